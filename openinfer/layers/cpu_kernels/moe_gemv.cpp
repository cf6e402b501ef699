// Routed experts at decode-sized row counts (layers/moe.py): for rows [R, H] sorted by expert (counts[e] rows for
// expert e, in expert order), y = swiglu(rows W13[e]^T) W2[e]^T per expert, in one call, with W13 [E, 2I, H] (gate
// rows then up rows) and W2 [E, H, I] the plain row-major fp32 / bf16 stacks (the model's only copy of them).
//
// Why: at batch 1-8 each of the few experts with rows sees 1-3 rows, and each projection is a pass over that
// expert's weight bytes. Looping over experts in Python with one oneDNN matmul per projection plus a swiglu op
// pays dispatch and primitive overhead per call, and the packed layout is at its weakest at 1-3 rows. Here the
// dot-product blocks of gemv.cpp (gemv_block.h: each weight row read once per call, kM activation rows sharing each
// load, bf16 widened in registers) run over all experts at once:
// - phase 1, work items (expert, block of kRows gate rows and the kRows matching up rows): gate and up are rounded
//   to the weights' dtype, clamped by the limit (DeepSeek-V4; +inf: none), silu(gate) rounded, times up, rounded:
//   the roundings of the torch path (matmul in dtype, then moe.swiglu), into an fp32 buffer h [R, I] (already in
//   the de-interleaved order the bf16 dot blocks read, so phase 2 needs no conversion pass);
// - phase 2, work items (expert, block of kRows output rows of W2): out = h W2[e]^T, rounded once.
// Both phases are one at::parallel_for over a flat list of work items of the experts that have rows, so two
// threads stay busy when only four experts do; an expert without rows is never read (NaN there cannot reach the
// output). Every output element is one dot block whatever the thread split: 1 and N threads give the same bits.
//
// bf16 on a build with AVX512-BF16 (Zen 4, Cooper Lake, Sapphire Rapids and later; issue 38): the same two phases
// with the dot products on vdpbf16ps, which multiplies 32 bf16 pairs into 16 fp32 sums per instruction, in place of
// widening each weight to fp32 (shift / mask) and two FMAs per 32 weights per activation row. The activations stay
// bf16 (no widened copy of the rows), h is kept in bf16 (it is rounded to bf16 anyway: the torch path's
// roundings), up to 6 activation rows share each weight load (24 accumulators for 4 weight rows), and the sums of
// a row reduce in one transpose-add tree instead of 4 horizontal sums. The products of two bf16 are exact in
// fp32 as with the FMA path; only the summation order differs (and bf16 subnormals count as zero, as the
// instruction defines: far below the bf16 rounding of the result), and each output's sum is the same whatever
// rows share its chunk. Phase 1 streams each routed expert's gate / up rows once for all its rows (a 4-row block
// stays in L1 while every chunk of up to 6 tokens passes over it, the blocks ahead prefetched into L2 meanwhile),
// SiLU * up fused on the block's sums; phase 2 its down rows once. ``moe_bf16_dot()`` says whether the build has it
// (layers/dispatch.py reports it and decides it: the op's bf16_dot argument).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "gemv_block.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define OI_MOE_BF16_DOT 1
#endif

namespace {

inline float round_to(float v, float*) { return v; }
inline float round_to(float v, c10::BFloat16*) { return static_cast<float>(c10::BFloat16(v)); }

template <typename WT>
inline void dot_any(int R, int MB, const float* x, int64_t K, const WT* w, float acc[kM][kRows]) {
  switch (R) {
    case 4: dot_rows<4>(MB, x, K, w, acc); break;
    case 3: dot_rows<3>(MB, x, K, w, acc); break;
    case 2: dot_rows<2>(MB, x, K, w, acc); break;
    default: dot_rows<1>(MB, x, K, w, acc); break;
  }
}

// Where column c of a K-wide activation row sits in the order the dot blocks read: natural for fp32 weights; for
// bf16 ones each full run of kPair columns holds its even columns then its odd ones (bf16_pairs).
inline int64_t read_pos(int64_t c, int64_t K, bool pairs) {
  constexpr int64_t run = kPair > 0 ? kPair : 1;  // (no vector code: kPair 0, nothing de-interleaved)
  if (!pairs || kPair == 0 || c >= K / run * run) return c;
  const int64_t k = c / run * run, o = c - k;
  return k + (o % 2 ? run / 2 + o / 2 : o / 2);
}

// The work items of a phase: nb blocks per expert with rows, flattened; item i is block block[i] of expert expert[i].
struct Items {
  std::vector<int64_t> expert, block;
};

Items make_items(const std::vector<int64_t>& counts, int64_t nb) {
  Items it;
  for (int64_t e = 0; e < static_cast<int64_t>(counts.size()); ++e)
    if (counts[e] > 0)
      for (int64_t b = 0; b < nb; ++b) {
        it.expert.push_back(e);
        it.block.push_back(b);
      }
  return it;
}

template <typename WT>
void moe_impl(WT* out, const float* x, const std::vector<int64_t>& counts, const WT* w13, const WT* w2, int64_t H,
              int64_t I, float limit) {
  const int64_t E = static_cast<int64_t>(counts.size());
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) start[e + 1] = start[e] + counts[e];
  const int64_t R = start[E];
  constexpr bool pairs = std::is_same<WT, c10::BFloat16>::value;
  const bool clamp = std::isfinite(limit);
  std::vector<float> h(R * I);

  // ~64 KB of weight bytes per task at least (as gemv.cpp), so a small call does not wake every thread for nothing
  const Items p1 = make_items(counts, (I + kRows - 1) / kRows);
  const int64_t grain1 = std::max<int64_t>(1, 65536 / std::max<int64_t>(2 * kRows * H * sizeof(WT), 1));
  at::parallel_for(0, static_cast<int64_t>(p1.expert.size()), grain1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = p1.expert[i], j0 = p1.block[i] * kRows;
      const int nr = static_cast<int>(std::min<int64_t>(kRows, I - j0));
      const WT* wg = w13 + (e * 2 * I + j0) * H;
      const WT* wu = w13 + (e * 2 * I + I + j0) * H;
      for (int64_t m = start[e]; m < start[e + 1]; m += kM) {
        const int MB = static_cast<int>(std::min<int64_t>(kM, start[e + 1] - m));
        float g[kM][kRows], u[kM][kRows];
        dot_any(nr, MB, x + m * H, H, wg, g);
        dot_any(nr, MB, x + m * H, H, wu, u);
        for (int a = 0; a < MB; ++a)
          for (int r = 0; r < nr; ++r) {
            float gv = round_to(g[a][r], static_cast<WT*>(nullptr));
            float uv = round_to(u[a][r], static_cast<WT*>(nullptr));
            if (clamp) {  // written so that NaN passes through, as torch.clamp does
              gv = gv > limit ? limit : gv;
              uv = uv > limit ? limit : (uv < -limit ? -limit : uv);
            }
            const float s = round_to(gv / (1.f + std::exp(-gv)), static_cast<WT*>(nullptr));
            h[(m + a) * I + read_pos(j0 + r, I, pairs)] = round_to(s * uv, static_cast<WT*>(nullptr));
          }
      }
    }
  });

  const Items p2 = make_items(counts, (H + kRows - 1) / kRows);
  const int64_t grain2 = std::max<int64_t>(1, 65536 / std::max<int64_t>(kRows * I * sizeof(WT), 1));
  at::parallel_for(0, static_cast<int64_t>(p2.expert.size()), grain2, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = p2.expert[i], n = p2.block[i] * kRows;
      const int nr = static_cast<int>(std::min<int64_t>(kRows, H - n));
      const WT* wd = w2 + (e * H + n) * I;
      for (int64_t m = start[e]; m < start[e + 1]; m += kM) {
        const int MB = static_cast<int>(std::min<int64_t>(kM, start[e + 1] - m));
        float acc[kM][kRows];
        dot_any(nr, MB, h.data() + m * I, I, wd, acc);
        for (int a = 0; a < MB; ++a)
          for (int r = 0; r < nr; ++r) store(out + (m + a) * H + n + r, acc[a][r]);
      }
    }
  });
}

#ifdef OI_MOE_BF16_DOT
// -- the AVX512-BF16 path -------------------------------------------------------------------------------------------
namespace dp {

using BF = c10::BFloat16;
constexpr int kR = 4;      // weight rows per block
constexpr int kMB = 6;     // activation rows sharing each weight load (24 accumulators + 4 weight rows + 1 of 32)
constexpr int kAhead = 4;  // blocks of weight rows prefetched ahead, into L2 (see Prefetch)

inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

// 32 bf16 from p, zeros past the first n (n < 32: the K tail, a masked load that reads nothing past it)
inline __m512i load_tail(const BF* p, int64_t n) {
  return _mm512_maskz_loadu_epi16(static_cast<__mmask32>((1u << n) - 1u), p);
}

// the horizontal sums of a, b, c, d as 4 floats, in one fixed order (so the bits do not depend on the caller)
inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // a02 b02 a13 b13 per lane
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512d t0d = _mm512_castps_pd(t0), t1d = _mm512_castps_pd(t1);
  const __m512 u = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(t0d, t1d)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(t0d, t1d)));  // a b c d per 128-bit lane
  const __m512 v = _mm512_add_ps(u, _mm512_shuffle_f32x4(u, u, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m512 w = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_castps512_ps128(w);
}

// What one call prefetches: the lines of columns [k0, k1) of R rows at pf (row stride as the weights'), one line
// per row per 32 columns, issued as the call reads the same columns of its own rows, into L2 (T1). The caller
// splits a block's columns over all the chunks of rows that pass over it, so the blocks ahead arrive while the
// arithmetic of every chunk runs. Measured on a Zen 4 (issue 38's DeepSeek-V3 shape, 5 layers of 32 experts, one
// process, each variant interleaved with the one before, bits equal): prefetching into L1 (T0) two blocks ahead
// from the first chunk only, as this kernel first did, left compute and streaming adding up (batch 32: 23.4 ms =
// ~11 ms of arithmetic + ~12 ms of weights at 24 GB/s), likely because the blocks ahead, the block in use and the
// rows (~45 KB at 6 rows) overflow a 32 KB L1 and the lines are gone again before use. Into L2, 4 blocks ahead,
// against T0 2 ahead spread over the chunks: batch 8 16.3 -> 10.2 ms, batch 32 20.3 -> 13.4 ms, batch 64 26.7 ->
// 20.3 ms (2, 3, 4 and 6 blocks ahead within the host's noise of each other, 8 worse; no software prefetch at all
// ~20 % slower than T0).
struct Prefetch {
  const BF* pf = nullptr;
  int64_t k0 = 0, k1 = 0;
};

// acc[m][r] = x[m] . w[r] over K, for R <= kR weight rows (row stride ws) and M <= kMB activation rows (row stride
// xs), all bf16; each output is the same sum whatever R and M (an accumulator per output, one reduction order).
template <int R, int M>
inline void dot(const BF* __restrict__ x, int64_t xs, const BF* __restrict__ w, int64_t ws, int64_t K,
                float acc[kMB][kR], Prefetch p) {
  __m512 a[M][kR];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < kR; ++r) a[m][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) wv[r] = as_bh(_mm512_loadu_si512(w + r * ws + k));
    if (k >= p.k0 && k < p.k1)
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(p.pf + r * ws + k), _MM_HINT_T1);
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = as_bh(_mm512_loadu_si512(x + m * xs + k));
      for (int r = 0; r < R; ++r) a[m][r] = _mm512_dpbf16_ps(a[m][r], wv[r], xv);
    }
  }
  if (k < K) {  // zeros past K on both sides: their products add nothing
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) wv[r] = as_bh(load_tail(w + r * ws + k, K - k));
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = as_bh(load_tail(x + m * xs + k, K - k));
      for (int r = 0; r < R; ++r) a[m][r] = _mm512_dpbf16_ps(a[m][r], wv[r], xv);
    }
  }
  for (int m = 0; m < M; ++m) _mm_storeu_ps(acc[m], hsum4(a[m][0], a[m][1], a[m][2], a[m][3]));
}

template <int R>
inline void dot_m(int M, const BF* x, int64_t xs, const BF* w, int64_t ws, int64_t K, float acc[kMB][kR],
                  Prefetch p) {
  switch (M) {
    case 6: dot<R, 6>(x, xs, w, ws, K, acc, p); break;
    case 5: dot<R, 5>(x, xs, w, ws, K, acc, p); break;
    case 4: dot<R, 4>(x, xs, w, ws, K, acc, p); break;
    case 3: dot<R, 3>(x, xs, w, ws, K, acc, p); break;
    case 2: dot<R, 2>(x, xs, w, ws, K, acc, p); break;
    default: dot<R, 1>(x, xs, w, ws, K, acc, p); break;
  }
}

inline void dot_any(int R, int M, const BF* x, int64_t xs, const BF* w, int64_t ws, int64_t K,
                    float acc[kMB][kR], Prefetch p) {
  switch (R) {
    case 4: dot_m<4>(M, x, xs, w, ws, K, acc, p); break;
    case 3: dot_m<3>(M, x, xs, w, ws, K, acc, p); break;
    case 2: dot_m<2>(M, x, xs, w, ws, K, acc, p); break;
    default: dot_m<1>(M, x, xs, w, ws, K, acc, p); break;
  }
}

inline float rnd(float v) { return static_cast<float>(BF(v)); }

// An expert's n rows in nc = ceil(n / kMB) chunks of near-equal size (7 rows: 4 + 3, not 6 + 1, whose one-row
// chunk would load 4 weight vectors per 4 products); chunk c starts at row chunk_start(c) of the expert.
struct Chunks {
  int64_t n, nc;
  explicit Chunks(int64_t rows) : n(rows), nc((rows + kMB - 1) / kMB) {}
  int64_t start(int64_t c) const { return c * n / nc; }
};

// The columns of a K-wide block that chunk c of nc prefetches (whole 32-column steps, the last chunk to the end)
inline Prefetch share(const BF* pf, int64_t K, int64_t c, int64_t nc) {
  const int64_t steps = (K + 31) / 32;
  return {pf, c * steps / nc * 32, c + 1 == nc ? K : (c + 1) * steps / nc * 32};
}

void moe(BF* out, const BF* x, const std::vector<int64_t>& counts, const BF* w13, const BF* w2, int64_t H, int64_t I,
         float limit) {
  const int64_t E = static_cast<int64_t>(counts.size());
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) start[e + 1] = start[e] + counts[e];
  const int64_t R = start[E];
  const bool clamp = std::isfinite(limit);
  std::vector<BF> h(R * I);  // silu(gate) * up per row, bf16 (the torch path rounds it there too)

  // phase 1: (expert, block of kR gate rows + the kR matching up rows); every chunk of the expert's rows passes
  // over the block while it is in L1, so the expert's gate / up bytes come from memory once
  const Items p1 = make_items(counts, (I + kR - 1) / kR);
  const int64_t grain1 = std::max<int64_t>(1, 65536 / std::max<int64_t>(2 * kR * H * sizeof(BF), 1));
  at::parallel_for(0, static_cast<int64_t>(p1.expert.size()), grain1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = p1.expert[i], j0 = p1.block[i] * kR;
      const int nr = static_cast<int>(std::min<int64_t>(kR, I - j0));
      const BF* wg = w13 + (e * 2 * I + j0) * H;
      const BF* wu = w13 + (e * 2 * I + I + j0) * H;
      const Chunks ch(counts[e]);
      for (int64_t c = 0; c < ch.nc; ++c) {
        const int64_t m = start[e] + ch.start(c);
        const int MB = static_cast<int>(ch.start(c + 1) - ch.start(c));
        float g[kMB][kR], u[kMB][kR];
        dot_any(nr, MB, x + m * H, H, wg, H, H, g, share(wg + kAhead * kR * H, H, c, ch.nc));
        dot_any(nr, MB, x + m * H, H, wu, H, H, u, share(wu + kAhead * kR * H, H, c, ch.nc));
        for (int a = 0; a < MB; ++a)
          for (int r = 0; r < nr; ++r) {
            float gv = rnd(g[a][r]), uv = rnd(u[a][r]);
            if (clamp) {  // written so that NaN passes through, as torch.clamp does
              gv = gv > limit ? limit : gv;
              uv = uv > limit ? limit : (uv < -limit ? -limit : uv);
            }
            h[(m + a) * I + j0 + r] = BF(rnd(gv / (1.f + std::exp(-gv))) * uv);
          }
      }
    }
  });

  // phase 2: (expert, block of kR rows of W2): out = h W2[e]^T, rounded once
  const Items p2 = make_items(counts, (H + kR - 1) / kR);
  const int64_t grain2 = std::max<int64_t>(1, 65536 / std::max<int64_t>(kR * I * sizeof(BF), 1));
  at::parallel_for(0, static_cast<int64_t>(p2.expert.size()), grain2, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = p2.expert[i], n = p2.block[i] * kR;
      const int nr = static_cast<int>(std::min<int64_t>(kR, H - n));
      const BF* wd = w2 + (e * H + n) * I;
      const Chunks ch(counts[e]);
      for (int64_t c = 0; c < ch.nc; ++c) {
        const int64_t m = start[e] + ch.start(c);
        const int MB = static_cast<int>(ch.start(c + 1) - ch.start(c));
        float acc[kMB][kR];
        dot_any(nr, MB, h.data() + m * I, I, wd, I, I, acc, share(wd + kAhead * kR * I, I, c, ch.nc));
        for (int a = 0; a < MB; ++a)
          for (int r = 0; r < nr; ++r) out[(m + a) * H + n + r] = BF(acc[a][r]);
      }
    }
  });
}

}  // namespace dp
constexpr bool kBf16Dot = true;
#else
constexpr bool kBf16Dot = false;
#endif

// out [R, H] = the experts on rows [R, H] (sorted by expert, counts [E] int64 summing to R); w13 [E, 2I, H], w2
// [E, H, I]; all contiguous, in one dtype (fp32 or bf16); limit: the swiglu clamp, +inf for none; bf16_dot: bf16
// on vdpbf16ps where the build has it (moe_bf16_dot), else the widening FMA blocks.
void moe_experts_gemv(at::Tensor out, const at::Tensor& rows, const at::Tensor& counts, const at::Tensor& w13,
                      const at::Tensor& w2, double limit, bool bf16_dot) {
  const auto dt = w13.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "moe_experts_gemv: weights must be fp32 or bf16");
  TORCH_CHECK(w13.dim() == 3 && w13.is_contiguous() && w13.size(1) % 2 == 0,
              "moe_experts_gemv: w13 must be contiguous [E, 2I, H]");
  const int64_t E = w13.size(0), I = w13.size(1) / 2, H = w13.size(2);
  TORCH_CHECK(w2.dim() == 3 && w2.is_contiguous() && w2.scalar_type() == dt && w2.size(0) == E && w2.size(1) == H &&
                  w2.size(2) == I,
              "moe_experts_gemv: w2 must be contiguous [E, H, I] in w13's dtype");
  TORCH_CHECK(rows.dim() == 2 && rows.is_contiguous() && rows.scalar_type() == dt && rows.size(1) == H,
              "moe_experts_gemv: rows must be contiguous [R, H] in the weights' dtype");
  const int64_t R = rows.size(0);
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == dt && out.size(0) == R &&
                  out.size(1) == H,
              "moe_experts_gemv: out must be contiguous [R, H] in the weights' dtype");
  TORCH_CHECK(counts.dim() == 1 && counts.scalar_type() == at::kLong && counts.is_contiguous() && counts.size(0) == E,
              "moe_experts_gemv: counts must be contiguous int64 [E]");
  const int64_t* cp = counts.data_ptr<int64_t>();
  std::vector<int64_t> cnt(cp, cp + E);
  int64_t total = 0;
  for (int64_t c : cnt) {
    TORCH_CHECK(c >= 0, "moe_experts_gemv: counts must be >= 0");
    total += c;
  }
  TORCH_CHECK(total == R, "moe_experts_gemv: counts sum to ", total, ", rows has ", R);
  if (R == 0 || H == 0) return;
  const float lim = static_cast<float>(limit);
  if (dt == at::kFloat) {
    moe_impl(out.data_ptr<float>(), rows.data_ptr<float>(), cnt, w13.data_ptr<float>(), w2.data_ptr<float>(), H, I,
             lim);
    return;
  }
#ifdef OI_MOE_BF16_DOT
  if (bf16_dot) {
    dp::moe(out.data_ptr<c10::BFloat16>(), rows.data_ptr<c10::BFloat16>(), cnt, w13.data_ptr<c10::BFloat16>(),
            w2.data_ptr<c10::BFloat16>(), H, I, lim);
    return;
  }
#else
  (void)bf16_dot;  // not in this build (moe_bf16_dot() is false): the FMA blocks below
#endif
  const std::vector<float> xf = bf16_pairs(rows.data_ptr<c10::BFloat16>(), R, H);  // rows widened once
  moe_impl(out.data_ptr<c10::BFloat16>(), xf.data(), cnt, w13.data_ptr<c10::BFloat16>(),
           w2.data_ptr<c10::BFloat16>(), H, I, lim);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(openinfer_cpu, m) {
  m.def("moe_experts_gemv(Tensor(a!) out, Tensor rows, Tensor counts, Tensor w13, Tensor w2, float limit, "
        "bool bf16_dot) -> ()");
  m.impl("moe_experts_gemv", c10::DispatchKey::CPU, &moe_experts_gemv);
  m.def("moe_bf16_dot() -> bool", []() -> bool { return kBf16Dot; });
}
