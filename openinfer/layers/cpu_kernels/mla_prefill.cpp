// Causal MLA prefill attention on decompressed K / V (DeepSeek-V2/V3 prefill chunks), fp32.
//
//   out[i, h] = sum_{j <= off + i} softmax_j(scale * q[i, h] . k[j, h]) v[j, h]
//   q[i, h] = [q_nope[i, h] | q_pe[i, h]],  k[j, h] = [kv[j, h, :Dn] | k_pe[j]],  v[j, h] = kv[j, h, Dn:]
//
// with off = ctx - n: the chunk's query i sits at absolute position off + i, after the keys of earlier chunks.
// kv [ctx, H * (Dn + Dv)] is the chunk's latents times kv_b (one GEMM in the caller); k_pe [ctx, R] is shared
// by every head and read in place.
//
// Why a kernel: SDPA's fused CPU kernel takes one head dim for q, k and v, so the torch path expands k_pe over
// the heads into a [ctx, H, 192] K, pads V from 128 to 192 columns and runs flash attention over the padding:
// ~29 GFLOP/s of useful work on Zen 3, ~9 % of a batch-32 DeepSeek-V3 bench prefill. Here, one task per head:
//   - the head's keys are transposed once into kT [Dn + R, ctx] so scores are a small GEMM vectorised along the
//     keys (tiles of 4 queries x 3 key vectors: 12 accumulators, no horizontal sums);
//   - a block of 4 queries keeps its whole score rows (4 x ctx floats) and takes an exact softmax over them
//     (max, exp, sum; no online rescaling); keys past a query's position get weight exactly 0;
//   - P V in tiles of 4 queries x 2 value vectors, V rows read in place from kv.
// fp32 accumulation; the sum of a row's weights is >= 1 (its max contributes exp(0)).
//
// Built at run time by openinfer/layers/cpu_ops.py and registered as torch.ops.openinfer_cpu.mla_prefill_attention.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <vector>

#include "vec.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int kQ = 4;   // queries per block
constexpr int kKV = 3;  // key vectors per score tile
constexpr int kVV = 2;  // value vectors per output tile

struct PrefillProblem {
  int64_t n, ctx, H, Dn, R, Dv;
  const float *q_nope, *q_pe, *kv, *k_pe;
  float* out;
  int64_t qn_s, qn_h, qp_s, qp_h, kv_s, pe_s, out_s, out_h;
  float scale;
};

// c[r, : NV kW] = sum_{t < T} a[r * lda + t] * b[t * ldb + (0 .. NV kW)] for r < NR: a GEMM micro-tile with NR x NV
// accumulators in registers, each vector of b loaded once for all NR rows and each a[r, t] broadcast. Scores are
// q (rows) times kT (key vectors), P V is p (rows) times V's rows.
template <int NR, int NV>
inline void outer_tile(const float* __restrict__ a, int64_t lda, const float* __restrict__ b, int64_t ldb, int64_t T,
                       float* __restrict__ c, int64_t ldc) {
  vfloat acc[NR][NV] = {};
  for (int64_t t = 0; t < T; ++t) {
    vfloat x[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) x[v] = loadv_reg(b + t * ldb + v * kW);
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const float at = a[r * lda + t];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] += at * x[v];
    }
  }
  for (int r = 0; r < NR; ++r) {
    for (int v = 0; v < NV; ++v) storev(c + r * ldc + v * kW, acc[r][v]);
  }
}

// One block of NQ queries (i0 ..) of head h: scores, softmax, P V, normalised into out.
template <int NQ>
void query_block(const PrefillProblem& pb, int64_t h, int64_t i0, const float* kT, int64_t ldk, float* qb,
                 float* s, float* ob) {
  const int64_t D = pb.Dn + pb.R, off = pb.ctx - pb.n;
  for (int r = 0; r < NQ; ++r) {
    const float* qn = pb.q_nope + (i0 + r) * pb.qn_s + h * pb.qn_h;
    const float* qp = pb.q_pe + (i0 + r) * pb.qp_s + h * pb.qp_h;
    for (int64_t d = 0; d < pb.Dn; ++d) qb[r * D + d] = qn[d] * pb.scale;
    for (int64_t d = 0; d < pb.R; ++d) qb[r * D + pb.Dn + d] = qp[d] * pb.scale;
  }
  const int64_t m = off + i0 + NQ;                 // keys any row of the block sees
  const int64_t mt = (m + kW - 1) / kW * kW;       // <= ldk: kT's columns are zero padded
  int64_t j0 = 0;
  for (; j0 + kKV * kW <= mt; j0 += kKV * kW) outer_tile<NQ, kKV>(qb, D, kT + j0, ldk, D, s + j0, ldk);
  for (; j0 < mt; j0 += kW) outer_tile<NQ, 1>(qb, D, kT + j0, ldk, D, s + j0, ldk);
  const float ninf = -std::numeric_limits<float>::infinity();
  float inv[NQ];
  for (int r = 0; r < NQ; ++r) {
    float* __restrict__ sr = s + r * ldk;
    const int64_t len = off + i0 + r + 1;  // keys 0 .. off + i0 + r
    for (int64_t j = len; j < mt; ++j) sr[j] = ninf;
    vfloat mx = loadv(sr);
    for (int64_t j = kW; j < mt; j += kW) mx = vmax(mx, loadv(sr + j));
    const float rmax = hmax(mx);
    for (int64_t j = 0; j < mt; j += kW) storev(sr + j, vexp_neg(loadv(sr + j) - rmax));
    for (int64_t j = len; j < mt; ++j) sr[j] = 0.0f;  // exp(-inf) comes out ~1e-38: masked keys get exactly 0
    vfloat sum = {};
    for (int64_t j = 0; j < mt; j += kW) sum += loadv(sr + j);
    inv[r] = 1.0f / hsum(sum);
  }
  const float* v = pb.kv + h * (pb.Dn + pb.Dv) + pb.Dn;
  for (int64_t c = 0; c < pb.Dv; c += kVV * kW) outer_tile<NQ, kVV>(s, ldk, v + c, pb.kv_s, m, ob + c, pb.Dv);
  for (int r = 0; r < NQ; ++r) {
    float* o = pb.out + (i0 + r) * pb.out_s + h * pb.out_h;
    const float a = inv[r];
#pragma omp simd
    for (int64_t c = 0; c < pb.Dv; ++c) o[c] = ob[r * pb.Dv + c] * a;
  }
}

// dst[d * ldd + j] = src[j * lds + d] for j < rows, d < cols, in 8 x 8 blocks: key rows sit H * (Dn + Dv) floats
// apart (8 KB for V3), so reading one column of them walks a single L1 set and evicts itself; a block keeps 8 rows'
// lines live and writes 8 runs of 8 floats.
void transpose(const float* __restrict__ src, int64_t lds, int64_t rows, int64_t cols, float* __restrict__ dst,
               int64_t ldd) {
  int64_t j0 = 0;
#if defined(__AVX2__)
  for (; j0 + 8 <= rows; j0 += 8) {
    int64_t d0 = 0;
    for (; d0 + 8 <= cols; d0 += 8) {
      __m256 r[8], t[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + (j0 + i) * lds + d0);
      for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
      }
      for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
      }
      // r[i] (i < 4): column d0 + i of rows 0-3 in its low lane, column d0 + i + 4 in its high lane; r[i + 4]:
      // the same for rows 4-7
      for (int i = 0; i < 4; ++i) {
        _mm256_storeu_ps(dst + (d0 + i) * ldd + j0, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(dst + (d0 + i + 4) * ldd + j0, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
      }
    }
    for (; d0 < cols; ++d0) {
      for (int64_t j = j0; j < j0 + 8; ++j) dst[d0 * ldd + j] = src[j * lds + d0];
    }
  }
#endif
  for (int64_t d0 = 0; d0 < cols; d0 += 8) {
    const int64_t d1 = std::min(cols, d0 + 8);
    for (int64_t j = j0; j < rows; ++j) {
      for (int64_t d = d0; d < d1; ++d) dst[d * ldd + j] = src[j * lds + d];
    }
  }
}

void run(const PrefillProblem& pb) {
  const int64_t D = pb.Dn + pb.R;
  const int64_t ldk = (pb.ctx + kW - 1) / kW * kW;
  at::parallel_for(0, pb.H, 1, [&](int64_t h0, int64_t h1) {
    // kT[d, j] = k[j, h, d]: rows Dn.. (k_pe) are every head's, written once; rows ..Dn per head. The padding
    // columns past ctx are never written and stay 0 (finite scores, masked).
    std::vector<float> scratch(D * ldk + kQ * D + kQ * ldk + kQ * pb.Dv);
    float* kT = scratch.data();
    float* qb = kT + D * ldk;
    float* s = qb + kQ * D;
    float* ob = s + kQ * ldk;
    transpose(pb.k_pe, pb.pe_s, pb.ctx, pb.R, kT + pb.Dn * ldk, ldk);
    for (int64_t h = h0; h < h1; ++h) {
      transpose(pb.kv + h * (pb.Dn + pb.Dv), pb.kv_s, pb.ctx, pb.Dn, kT, ldk);
      int64_t i = 0;
      for (; i + kQ <= pb.n; i += kQ) query_block<kQ>(pb, h, i, kT, ldk, qb, s, ob);
      for (; i < pb.n; ++i) query_block<1>(pb, h, i, kT, ldk, qb, s, ob);
    }
  });
}

bool rows_ok(const at::Tensor& t, int64_t dims) { return t.dim() == dims && t.stride(-1) == 1 && t.is_cpu(); }

// out [n, H, Dv], q_nope [n, H, Dn], q_pe [n, H, R], kv [ctx, H * (Dn + Dv)], k_pe [ctx, R]: all fp32 with a
// contiguous last dim (other strides free). Returns false, writing nothing, for a call it does not take (another
// dtype, Dv not a multiple of 2 vectors); bad shapes are errors.
bool mla_prefill_attention(at::Tensor out, const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& kv,
                           const at::Tensor& k_pe, double scale) {
  const char* fn = "mla_prefill_attention: ";
  TORCH_CHECK(rows_ok(out, 3) && rows_ok(q_nope, 3) && rows_ok(q_pe, 3) && rows_ok(kv, 2) && rows_ok(k_pe, 2), fn,
              "CPU tensors out/q_nope/q_pe [n, H, .] and kv/k_pe [ctx, .] with a contiguous last dim expected");
  const int64_t n = q_nope.size(0), H = q_nope.size(1), Dn = q_nope.size(2), R = q_pe.size(2), ctx = kv.size(0);
  TORCH_CHECK(q_pe.size(0) == n && q_pe.size(1) == H && out.size(0) == n && out.size(1) == H, fn, "q_nope ",
              q_nope.sizes(), ", q_pe ", q_pe.sizes(), " and out ", out.sizes(), " disagree on [n, H]");
  const int64_t Dv = out.size(2);
  TORCH_CHECK(kv.size(1) == H * (Dn + Dv), fn, "kv's width ", kv.size(1), " != H * (Dn + Dv) = ", H * (Dn + Dv));
  TORCH_CHECK(k_pe.size(0) == ctx && k_pe.size(1) == R, fn, "k_pe ", k_pe.sizes(), " != [ctx, R] = [", ctx, ", ",
              R, "]");
  TORCH_CHECK(ctx >= n, fn, "ctx (", ctx, ") must cover the chunk's ", n, " queries");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&out, &q_nope, &q_pe, &kv, &k_pe}) {
    if (t->scalar_type() != at::kFloat) return false;
  }
  if (Dv % (kVV * kW) != 0) return false;
  if (n == 0 || H == 0) return true;
  PrefillProblem pb{n, ctx, H, Dn, R, Dv,
                    q_nope.const_data_ptr<float>(), q_pe.const_data_ptr<float>(), kv.const_data_ptr<float>(),
                    k_pe.const_data_ptr<float>(), out.data_ptr<float>(),
                    q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), kv.stride(0),
                    k_pe.stride(0), out.stride(0), out.stride(1), static_cast<float>(scale)};
  run(pb);
  return true;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(openinfer_cpu, m) {
  m.def(
      "mla_prefill_attention(Tensor(a!) out, Tensor q_nope, Tensor q_pe, Tensor kv, Tensor k_pe, float scale) -> "
      "bool");
  m.impl("mla_prefill_attention", c10::DispatchKey::CPU, &mla_prefill_attention);
}
