// Paged decode attention on CPU: one query token per sequence, keys and values read straight from the
// paged cache (no gather into a padded tensor, no mask).
//
//   out[b, hq, :] = softmax(scale * q[b, hq, :] . K[b, :, hq / G, :]) @ V[b, :, hq / G, :]
//
// with K/V of sequence b at cache[block_tables[b, p / block_size], p % block_size, hk, :] for p < seq_lens[b]
// and G = Hq / Hk query heads per kv head (GQA; G = 1 is MHA).
//
// One task per (sequence, kv head): its G query rows are loaded once as fp32 (pre-scaled), then each cache
// block is read once: the block's K rows are read in place (fp32 caches) or converted to fp32 into scratch (bf16,
// fp8), G x n scores computed, the running max / sum
// of an online softmax updated (accumulators rescaled when the max grows), and the block's V rows
// accumulated into G fp32 rows. Everything is fp32 internally; bf16 -> fp32 is a 16-bit shift, fp8 e4m3 -> fp32
// (kv_cache_dtype fp8) a few integer ops in registers (vec.h). The inner
// loops are plain loops over head_dim that the compiler vectorises (-O3 -march=native).
//
// Built at run time by openinfer/layers/cpu_ops.py and registered as torch.ops.openinfer_cpu.*.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <initializer_list>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "vec.h"

namespace {

// The rows of the next block, requested while this one computes: blocks sit anywhere in the cache, so the
// hardware prefetchers cannot guess the next one (-12% at B=64 x 200 tokens, where K/V outgrow L2).
template <typename T>
inline void prefetch_rows(const T* p, int64_t n, int64_t stride, int64_t D) {
  const int64_t bytes = D * static_cast<int64_t>(sizeof(T));
  for (int64_t t = 0; t < n; ++t) {
    const char* row = reinterpret_cast<const char*>(p + t * stride);
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(row + off);
  }
}

// ---- one block's arithmetic ----------------------------------------------------------------------------

// The four sums of a0..a3, as one 4-vector: a transposing tree of adds instead of four horizontal sums.
inline vfloat4 reduce4(vfloat a0, vfloat a1, vfloat a2, vfloat a3) {
  const vfloat8 b0 = to8(a0), b1 = to8(a1), b2 = to8(a2), b3 = to8(a3);  // 8 partial sums each
  // [4 partial sums of a0, 4 of a1] and [a2, a3]
  const vfloat8 c01 = __builtin_shufflevector(b0, b1, 0, 1, 2, 3, 8, 9, 10, 11) +
                      __builtin_shufflevector(b0, b1, 4, 5, 6, 7, 12, 13, 14, 15);
  const vfloat8 c23 = __builtin_shufflevector(b2, b3, 0, 1, 2, 3, 8, 9, 10, 11) +
                      __builtin_shufflevector(b2, b3, 4, 5, 6, 7, 12, 13, 14, 15);
  // [2 partial sums each of a0, a1, a2, a3]
  const vfloat8 d = __builtin_shufflevector(c01, c23, 0, 1, 4, 5, 8, 9, 12, 13) +
                    __builtin_shufflevector(c01, c23, 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(d, d, 0, 2, 4, 6) + __builtin_shufflevector(d, d, 1, 3, 5, 7);
}

// Dots of qg with the four rows at k0 (row stride rs): 16 floats of each row per step, in 16 / kW independent
// FMA chains per row (four 8-lane chains would leave AVX2's two FMA units waiting on latency).
inline vfloat4 dots4(const float* __restrict__ qg, const float* __restrict__ k0, int64_t D, int64_t rs) {
  constexpr int U = 16 / kW;
  vfloat a[4][U] = {};
  int64_t c = 0;
  for (; c + 16 <= D; c += 16) {
#pragma GCC unroll 2
    for (int u = 0; u < U; ++u) {
      const vfloat qv = loadv(qg + c + u * kW);
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) a[r][u] += qv * loadv(k0 + r * rs + c + u * kW);
    }
  }
  for (; c < D; c += kW) {  // D % 16 == 8 on 8-lane builds
    const vfloat qv = loadv(qg + c);
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) a[r][0] += qv * loadv(k0 + r * rs + c);
  }
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r) {
#pragma GCC unroll 2
    for (int u = 1; u < U; ++u) a[r][0] += a[r][u];
  }
  return reduce4(a[0][0], a[1][0], a[2][0], a[3][0]);
}

// The scores of the kW rows at k0 (row stride rs), as one vector.
inline vfloat dots_w(const float* __restrict__ qg, const float* __restrict__ k0, int64_t D, int64_t rs) {
  const vfloat4 s0 = dots4(qg, k0, D, rs), s1 = dots4(qg, k0 + 4 * rs, D, rs);
  const vfloat8 s01 = __builtin_shufflevector(s0, s1, 0, 1, 2, 3, 4, 5, 6, 7);
#if OI_VEC_LANES == 16
  const vfloat4 s2 = dots4(qg, k0 + 8 * rs, D, rs), s3 = dots4(qg, k0 + 12 * rs, D, rs);
  const vfloat8 s23 = __builtin_shufflevector(s2, s3, 0, 1, 2, 3, 4, 5, 6, 7);
  return __builtin_shufflevector(s01, s23, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  return s01;
#endif
}

// sg[t] = qg . keys[t] for t < n; keys are n rows of D floats, rs apart. kW keys at a time are one vector store
// (the softmax reads them back as a vector: no store-forwarding stall from scalar stores).
inline void block_scores(const float* __restrict__ qg, const float* __restrict__ keys, float* __restrict__ sg,
                         int64_t n, int64_t D, int64_t rs) {
  int64_t t = 0;
  if (D % kW == 0) {
    for (; t + kW <= n; t += kW) storev(sg + t, dots_w(qg, keys + t * rs, D, rs));
    for (; t + 4 <= n; t += 4) {
      const vfloat4 s4 = dots4(qg, keys + t * rs, D, rs);
      std::memcpy(sg + t, &s4, sizeof(s4));
    }
    for (; t < n; ++t) {
      vfloat a = {};
      for (int64_t c = 0; c < D; c += kW) a += loadv(qg + c) * loadv(keys + t * rs + c);
      sg[t] = hsum(a);
    }
    return;
  }
  for (; t < n; ++t) {
    const float* __restrict__ kt = keys + t * rs;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < D; ++d) dot += qg[d] * kt[d];
    sg[t] = dot;
  }
}

// row *= a
inline void scale_row(float* __restrict__ row, float a, int64_t D) {
  if (D % kW == 0) {
    for (int64_t c = 0; c < D; c += kW) storev(row + c, loadv(row + c) * a);
    return;
  }
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) row[d] *= a;
}

// ag += sum_t pg[t] * vals[t] for t < n; vals are n rows of D floats, rs apart. 64 floats of ag at a time stay in
// registers across the block, 64 / kW vectors, so that four (AVX-512) or eight (AVX2) FMA chains run side by side.
inline void block_values(float* __restrict__ ag, const float* __restrict__ pg, const float* __restrict__ vals,
                         int64_t n, int64_t D, int64_t rs) {
  constexpr int U = 64 / kW;
  if (D % 64 == 0) {
    for (int64_t c = 0; c < D; c += 64) {
      vfloat a[U];
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) a[u] = loadv(ag + c + u * kW);
      for (int64_t t = 0; t < n; ++t) {
        const float* vt = vals + t * rs + c;
        const float p = pg[t];
#pragma GCC unroll 8
        for (int u = 0; u < U; ++u) a[u] += p * loadv(vt + u * kW);
      }
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) storev(ag + c + u * kW, a[u]);
    }
    return;
  }
  if (D % kW == 0) {
    for (int64_t c = 0; c < D; c += kW) {
      vfloat a = loadv(ag + c);
      for (int64_t t = 0; t < n; ++t) a += pg[t] * loadv(vals + t * rs + c);
      storev(ag + c, a);
    }
    return;
  }
  for (int64_t t = 0; t < n; ++t) {
    const float p = pg[t];
    const float* __restrict__ vt = vals + t * rs;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) ag[d] += p * vt[d];
  }
}

// ---- the kernel ----------------------------------------------------------------------------------------

struct Problem {
  int64_t B, Hq, Hk, D, G, block_size, max_blocks;
  int64_t q_sb, q_sh;      // q strides (elements) over sequence and head; the last dim is contiguous
  int64_t out_sb, out_sh;  // same for out
  int64_t c_sblk, c_st;    // cache strides over block and slot (a slot is Hk x D, contiguous)
  float scale;
  const int64_t* tables;   // [B, max_blocks]
  const int64_t* lens;     // [B]
  at::ScalarType qtype;    // q and out
  size_t qsize;            // bytes per q element
};

// CT: the cache's element type. DC: head_dim when fixed at compile time, 0 for any.
template <typename CT, int64_t DC>
void run(const Problem& pb, char* out, const char* q, const CT* kc, const CT* vc) {
  const int64_t D = DC ? DC : pb.D;
  const int64_t G = pb.G, bs = pb.block_size;
  const int64_t bsp = (bs + kW - 1) / kW * kW;  // score rows padded to whole vectors
  const int64_t ntasks = pb.B * pb.Hk;
  // Dynamic scheduling inside torch's thread pool: sequences differ in length, and at::parallel_for hands
  // each thread one contiguous range. Each worker takes (sequence, kv head) tasks off a shared counter.
  std::atomic<int64_t> next{0};
  const int64_t nworkers = std::min<int64_t>(at::get_num_threads(), ntasks);
  at::parallel_for(0, nworkers, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> scratch(2 * G * D + G * bsp + bs * D + 2 * G);
    float* __restrict__ qf = scratch.data();   // [G, D] query rows * scale
    float* __restrict__ acc = qf + G * D;      // [G, D] unnormalised output rows
    float* __restrict__ sc = acc + G * D;      // [G, bsp] scores, then probabilities, of one block
    float* __restrict__ buf = sc + G * bsp;    // [bs, D] one block's K (then V) rows in fp32
    float* __restrict__ mx = buf + bs * D;     // [G] running max
    float* __restrict__ sum = mx + G;          // [G] running sum of exp(score - max)
    const float ninf = -std::numeric_limits<float>::infinity();
    for (int64_t w = w0; w < w1; ++w) {
      for (int64_t task = next.fetch_add(1); task < ntasks; task = next.fetch_add(1)) {
        const int64_t b = task / pb.Hk, h = task % pb.Hk;
        const int64_t len = pb.lens[b];
        char* orow = out + (b * pb.out_sb + h * G * pb.out_sh) * pb.qsize;
        if (len <= 0) {  // no keys: define the output as zeros rather than 0/0
          std::fill(acc, acc + D, 0.0f);
          for (int64_t g = 0; g < G; ++g) store_any(acc, orow + g * pb.out_sh * pb.qsize, pb.qtype, D);
          continue;
        }
        const char* qrow = q + (b * pb.q_sb + h * G * pb.q_sh) * pb.qsize;
        for (int64_t g = 0; g < G; ++g) {
          load_any(qrow + g * pb.q_sh * pb.qsize, pb.qtype, qf + g * D, D);
          scale_row(qf + g * D, pb.scale, D);
          mx[g] = ninf;
          sum[g] = 0.0f;
        }
        std::fill(acc, acc + G * D, 0.0f);
        const int64_t* table = pb.tables + b * pb.max_blocks;
        const int64_t nblocks = (len + bs - 1) / bs;
        for (int64_t i = 0; i < nblocks; ++i) {
          const int64_t n = std::min(bs, len - i * bs);
          const int64_t base = table[i] * pb.c_sblk + h * D;
          if (i + 1 < nblocks) {
            const int64_t nb = table[i + 1] * pb.c_sblk + h * D;
            const int64_t nn = std::min(bs, len - (i + 1) * bs);
            prefetch_rows(kc + nb, nn, pb.c_st, D);
            prefetch_rows(vc + nb, nn, pb.c_st, D);
          }
          // scores, then the online softmax: new max, rescale what was accumulated under the old one
          // fp32 rows are read where they are in the cache (a slot's stride apart); other dtypes as fp32 in buf
          const float* keys = buf;
          int64_t rs = D;
          if constexpr (std::is_same_v<CT, float>) {
            keys = kc + base;
            rs = pb.c_st;
          } else {
            for (int64_t t = 0; t < n; ++t) load_row(kc + base + t * pb.c_st, buf + t * D, D);
          }
          for (int64_t g = 0; g < G; ++g) {
            float* __restrict__ sg = sc + g * bsp;
            block_scores(qf + g * D, keys, sg, n, D, rs);
            for (int64_t t = n; t < bsp; ++t) sg[t] = ninf;  // padding: exp() -> ~0, never used for V
            vfloat m = loadv(sg);
            for (int64_t c = kW; c < bsp; c += kW) m = vmax(m, loadv(sg + c));
            const float bmax = std::max(mx[g], hmax(m));
            if (bmax > mx[g]) {
              const float alpha = exp_neg(mx[g] - bmax);
              sum[g] *= alpha;
              scale_row(acc + g * D, alpha, D);
              mx[g] = bmax;
            }
            vfloat s = {};
            for (int64_t c = 0; c < bsp; c += kW) {
              const vfloat p = vexp_neg(loadv(sg + c) - bmax);
              storev(sg + c, p);
              s += p;
            }
            sum[g] += hsum(s);
          }
          // values
          const float* vals = buf;
          if constexpr (std::is_same_v<CT, float>)
            vals = vc + base;
          else
            for (int64_t t = 0; t < n; ++t) load_row(vc + base + t * pb.c_st, buf + t * D, D);
          for (int64_t g = 0; g < G; ++g) block_values(acc + g * D, sc + g * bsp, vals, n, D, rs);
        }
        for (int64_t g = 0; g < G; ++g) {
          scale_row(acc + g * D, 1.0f / sum[g], D);  // sum >= 1: the max score contributes exp(0)
          store_any(acc + g * D, orow + g * pb.out_sh * pb.qsize, pb.qtype, D);
        }
      }
    }
  });
}

}  // namespace

#include "amx_decode_attention.h"

namespace {

template <typename CT>
void dispatch_dim(const Problem& pb, char* out, const char* q, const at::Tensor& kc, const at::Tensor& vc) {
  const CT* k = kc.const_data_ptr<CT>();
  const CT* v = vc.const_data_ptr<CT>();
  switch (pb.D) {
    case 64: return run<CT, 64>(pb, out, q, k, v);
    case 128: return run<CT, 128>(pb, out, q, k, v);
    default: return run<CT, 0>(pb, out, q, k, v);
  }
}

void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale) {
  const char* fn = "paged_decode_attention: ";
  const std::initializer_list<const at::Tensor*> all = {&out,     &q,           &k_cache,
                                                        &v_cache, &block_tables, &seq_lens};
  for (const at::Tensor* t : all) {
    TORCH_CHECK(t->device().is_cpu(), fn, "all tensors must be on the CPU");
  }
  TORCH_CHECK(q.dim() == 3, fn, "q must be [B, Hq, D], got ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 4, fn, "k_cache must be [num_blocks, block_size, Hk, D], got ",
              k_cache.sizes());
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), fn, "v_cache ", v_cache.sizes(), " != k_cache ",
              k_cache.sizes());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), fn, "caches must be contiguous");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), fn, "k_cache and v_cache dtypes differ");
  TORCH_CHECK(out.sizes() == q.sizes(), fn, "out ", out.sizes(), " must have q's shape ", q.sizes());
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), fn, "out dtype ", out.scalar_type(), " != q dtype ",
              q.scalar_type());
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, fn, "q and out need a contiguous last dim");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t nblk = k_cache.size(0), bs = k_cache.size(1), Hk = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D, fn, "head_dim of q (", D, ") and cache (", k_cache.size(3), ") differ");
  TORCH_CHECK(Hk > 0 && Hq % Hk == 0, fn, "Hq=", Hq, " is not a multiple of Hk=", Hk);
  TORCH_CHECK(bs > 0, fn, "block_size must be positive");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, fn,
              "block_tables and seq_lens must be int64");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B && block_tables.is_contiguous(), fn,
              "block_tables must be a contiguous [B, max_blocks] tensor, got ", block_tables.sizes());
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == B && seq_lens.is_contiguous(), fn,
              "seq_lens must be a contiguous [B] tensor, got ", seq_lens.sizes());
  if (B == 0 || Hq == 0) return;

  Problem pb;
  pb.B = B; pb.Hq = Hq; pb.Hk = Hk; pb.D = D; pb.G = Hq / Hk; pb.block_size = bs;
  pb.max_blocks = block_tables.size(1);
  pb.q_sb = q.stride(0); pb.q_sh = q.stride(1);
  pb.out_sb = out.stride(0); pb.out_sh = out.stride(1);
  pb.c_sblk = k_cache.stride(0); pb.c_st = k_cache.stride(1);
  pb.scale = static_cast<float>(scale);
  pb.tables = block_tables.const_data_ptr<int64_t>();
  pb.lens = seq_lens.const_data_ptr<int64_t>();
  // Validate every block the kernel will read, so a bad table is an error here and never an
  // out-of-bounds read in the loop (B x blocks integer compares).
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = pb.lens[b];
    const int64_t need = len > 0 ? (len + bs - 1) / bs : 0;
    TORCH_CHECK(need <= pb.max_blocks, fn, "seq_lens[", b, "]=", len, " needs ", need,
                " blocks; block_tables has ", pb.max_blocks);
    for (int64_t i = 0; i < need; ++i) {
      const int64_t blk = pb.tables[b * pb.max_blocks + i];
      TORCH_CHECK(blk >= 0 && blk < nblk, fn, "block_tables[", b, ", ", i, "]=", blk,
                  " is outside the cache (", nblk, " blocks)");
    }
  }
  const at::ScalarType qt = q.scalar_type();
  TORCH_CHECK(qt == at::kFloat || qt == at::kBFloat16 || qt == at::kHalf, fn, "unsupported q dtype ", qt,
              " (float32, bfloat16 or float16)");
  pb.qtype = qt;
  pb.qsize = q.element_size();
  char* o = static_cast<char*>(out.data_ptr());
  const char* qp = static_cast<const char*>(q.const_data_ptr());
  if (amx_decode_attention(pb, o, qp, k_cache, v_cache)) return;
  switch (k_cache.scalar_type()) {
    case at::kFloat: return dispatch_dim<float>(pb, o, qp, k_cache, v_cache);
    case at::kBFloat16: return dispatch_dim<c10::BFloat16>(pb, o, qp, k_cache, v_cache);
    case at::kHalf: return dispatch_dim<c10::Half>(pb, o, qp, k_cache, v_cache);
    // kv_cache_dtype fp8: rows widened in registers block by block (vec.h), never a bf16 copy of the cache
    case at::kFloat8_e4m3fn: return dispatch_dim<c10::Float8_e4m3fn>(pb, o, qp, k_cache, v_cache);
    default:
      TORCH_CHECK(false, fn, "unsupported cache dtype ", k_cache.scalar_type(),
                  " (float32, bfloat16, float16 or float8_e4m3fn)");
  }
}

}  // namespace

namespace oi {
void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  ::paged_decode_attention(std::move(out), q, k_cache, v_cache, block_tables, seq_lens, scale);
}
}  // namespace oi

TORCH_LIBRARY(openinfer_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &paged_decode_attention);
  // Turns the AMX path on or off (OPENINFER_CPU_AMX=0, and tests comparing the two); returns whether this
  // build and machine can run it.
  m.def("decode_attention_use_amx(bool enable) -> bool", [](bool enable) {
    g_amx_enabled.store(enable);
    return amx_available();
  });
}
