// Small-M dense linear (layers/linear.py): y[M, N] = x[M, K] W^T (+ bias) for decode-sized M (1..~8), with W
// the plain row-major [N, K] weight in fp32 or bf16 (the model's only copy of it).
//
// Why: at batch 1 a linear is a pass over its weight bytes; everything else is noise. torch's paths do not get
// near the memory bandwidth on this project's AVX2 hosts (oneDNN on a prepacked fp32 weight streamed ~55 % of the
// copy bandwidth; bf16 runs an emulated GEMM there that is slower than fp32 although it reads half the bytes).
// Here:
// - each weight row is read from memory exactly once per call, whatever M: rows go in blocks of kRows, and every
//   activation row passes over a block while it sits in L1 (kRows x K x 4 bytes <= 45 KB for K = 2816 fp32; L2
//   holds it when L1 does not);
// - independent accumulators: kRows rows side by side, and with one activation row two chains per weight row
//   (even / odd vectors), so the loop is bound by loads, not by the FMA latency;
// - bf16 weights are widened in registers by a 16-bit shift / a mask (bf16 is the top half of an fp32: exact),
//   never converted into memory;
// - output rows are split over at::parallel_for in whole blocks, so the threads split the bytes.
// - no software prefetch: prefetching the same rows 256 B, 1 KB or 4 KB ahead measured within the noise of the
//   hardware prefetcher alone (1 thread, the bench model's shapes), so the loop stays plain.
// x is widened to fp32 once per call (M x K is tiny next to N x K); accumulation is fp32, rounded to y's dtype
// once (as torch's CPU bf16 GEMM does), so the result differs from F.linear only by summation order. NaN / inf in
// x propagate as in any dot product (no padding, no masking: the K tail runs scalar).
// Vector code: AVX-512 (16 floats) under __AVX512F__, else AVX2 + FMA (8 floats), else a plain loop. One set of
// templates serves both widths through the small V traits below (vec.h is not used: its 16-float vectors are
// compiler vector extensions, and this kernel wants the explicit bf16 even/odd split below).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kRows = 4;  // weight rows per block
constexpr int kM = 2;     // activation rows sharing each weight vector load

#if defined(__AVX512F__)
struct V {
  using T = __m512;
  static constexpr int W = 16;
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  // 32 bf16 -> the even-indexed 16 and the odd-indexed 16 as fp32 (see bf16_pairs)
  static void load_pairs(const c10::BFloat16* p, T& even, T& odd) {
    const __m512i v = _mm512_loadu_si512(p);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static float sum(T v) { return _mm512_reduce_add_ps(v); }
};
#define OI_GEMV_VEC 1
#elif defined(__AVX2__) && defined(__FMA__)
struct V {
  using T = __m256;
  static constexpr int W = 8;
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static void load_pairs(const c10::BFloat16* p, T& even, T& odd) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static float sum(T v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
  }
};
#define OI_GEMV_VEC 1
#endif

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }  // the bias

// acc[m][r] = x[m] . w[r] over all K, for R weight rows (row stride K) and MB activation rows (fp32, stride K).
// fp32 weights: acc[m][r] = x[m] . w[r] over all K, for R weight rows (row stride K) and MB activation rows (stride
// K). With one activation row, two chains per weight row (even / odd vectors): R chains alone are bound by the FMA
// latency, not by the loads.
template <int R, int MB>
inline void dot_block(const float* __restrict__ x, int64_t K, const float* __restrict__ w, float acc[kM][kRows]) {
  int64_t k = 0;
#ifdef OI_GEMV_VEC
  constexpr int W = V::W;
  constexpr int S = MB == 1 ? 2 : 1;
  typename V::T a[MB][R][S];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < S; ++j) a[m][r][j] = V::zero();
  for (; k + W * S <= K; k += W * S)
    for (int j = 0; j < S; ++j) {
      typename V::T xv[MB];
      for (int m = 0; m < MB; ++m) xv[m] = V::load(x + m * K + k + W * j);
      for (int r = 0; r < R; ++r) {
        const typename V::T wv = V::load(w + r * K + k + W * j);
        for (int m = 0; m < MB; ++m) a[m][r][j] = V::fma(wv, xv[m], a[m][r][j]);
      }
    }
  for (; k + W <= K; k += W) {
    typename V::T xv[MB];
    for (int m = 0; m < MB; ++m) xv[m] = V::load(x + m * K + k);
    for (int r = 0; r < R; ++r) {
      const typename V::T wv = V::load(w + r * K + k);
      for (int m = 0; m < MB; ++m) a[m][r][0] = V::fma(wv, xv[m], a[m][r][0]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) {
      typename V::T t = a[m][r][0];
      for (int j = 1; j < S; ++j) t = V::add(t, a[m][r][j]);
      acc[m][r] = V::sum(t);
    }
#else
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = 0.f;
#endif
  for (; k < K; ++k)
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] += x[m * K + k] * w[r * K + k];
}

#ifdef OI_GEMV_VEC
constexpr int kPair = 2 * V::W;  // bf16 weights per vector load
#else
constexpr int kPair = 0;
#endif

// bf16 weights: one integer load of kPair weights gives two fp32 vectors with a shift (even-indexed weights) and a
// mask (odd-indexed ones), 2 ALU ops per kPair weights instead of a widening load per W. The activations are
// de-interleaved to match once per call (bf16_pairs): per full run of kPair columns, the even columns then the
// odd ones; the K tail (K % kPair columns) stays in order and runs scalar. Even and odd products go into separate
// chains, which also hides the FMA latency with one activation row.
template <int R, int MB>
inline void dot_block(const float* __restrict__ x, int64_t K, const c10::BFloat16* __restrict__ w,
                      float acc[kM][kRows]) {
  int64_t k = 0;
#ifdef OI_GEMV_VEC
  constexpr int W = V::W;
  typename V::T a[MB][R][2];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) a[m][r][0] = a[m][r][1] = V::zero();
  for (; k + kPair <= K; k += kPair) {
    typename V::T xe[MB], xo[MB];
    for (int m = 0; m < MB; ++m) {
      xe[m] = V::load(x + m * K + k);
      xo[m] = V::load(x + m * K + k + W);
    }
    for (int r = 0; r < R; ++r) {
      typename V::T we, wo;
      V::load_pairs(w + r * K + k, we, wo);
      for (int m = 0; m < MB; ++m) {
        a[m][r][0] = V::fma(we, xe[m], a[m][r][0]);
        a[m][r][1] = V::fma(wo, xo[m], a[m][r][1]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = V::sum(V::add(a[m][r][0], a[m][r][1]));
#else
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = 0.f;
#endif
  for (; k < K; ++k)
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] += x[m * K + k] * static_cast<float>(w[r * K + k]);
}

// x [M, K] bf16 -> fp32 in the order the bf16 dot_block reads: each full run of kPair columns as its even columns
// then its odd ones, the tail in order.
std::vector<float> bf16_pairs(const c10::BFloat16* x, int64_t M, int64_t K) {
  std::vector<float> out(M * K);
  constexpr int64_t run = kPair > 0 ? kPair : 1;  // (no vector code: kPair 0, nothing de-interleaved)
  const int64_t full = kPair > 0 ? K / run * run : 0;
  for (int64_t m = 0; m < M; ++m) {
    const c10::BFloat16* src = x + m * K;
    float* dst = out.data() + m * K;
    for (int64_t k = 0; k < full; k += kPair)
      for (int i = 0; i < kPair / 2; ++i) {
        dst[k + i] = static_cast<float>(src[k + 2 * i]);
        dst[k + kPair / 2 + i] = static_cast<float>(src[k + 2 * i + 1]);
      }
    for (int64_t k = full; k < K; ++k) dst[k] = static_cast<float>(src[k]);
  }
  return out;
}

template <int R, typename WT>
inline void dot_rows(int MB, const float* x, int64_t K, const WT* w, float acc[kM][kRows]) {
  if (MB == 2)
    dot_block<R, 2>(x, K, w, acc);
  else
    dot_block<R, 1>(x, K, w, acc);
}

inline void store(float* p, float v) { *p = v; }
inline void store(c10::BFloat16* p, float v) { *p = c10::BFloat16(v); }  // round to nearest even, as torch

template <typename WT, typename YT>
void gemv_impl(YT* y, const float* x, const WT* w, const WT* bias, int64_t M, int64_t N, int64_t K) {
  const int64_t nblocks = (N + kRows - 1) / kRows;
  // ~64 KB of weight bytes per task at least, so a small layer does not wake every thread for nothing
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(kRows * K * sizeof(WT), 1));
  at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * kRows;
      const int R = static_cast<int>(std::min<int64_t>(kRows, N - n));
      const WT* wb = w + n * K;
      for (int64_t m = 0; m < M; m += kM) {
        const int MB = static_cast<int>(std::min<int64_t>(kM, M - m));
        float acc[kM][kRows];
        switch (R) {
          case 4: dot_rows<4>(MB, x + m * K, K, wb, acc); break;
          case 3: dot_rows<3>(MB, x + m * K, K, wb, acc); break;
          case 2: dot_rows<2>(MB, x + m * K, K, wb, acc); break;
          default: dot_rows<1>(MB, x + m * K, K, wb, acc); break;
        }
        for (int i = 0; i < MB; ++i)
          for (int r = 0; r < R; ++r) {
            const float v = acc[i][r];
            store(y + (m + i) * N + n + r, bias ? v + widen(bias[n + r]) : v);
          }
      }
    }
  });
}

// y = x W^T + bias. y [M, N] and x [M, K] in the weight's dtype (fp32 or bf16), all contiguous; bias [N] or None.
void dense_gemv(at::Tensor y, const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const auto dt = weight.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "dense_gemv: weight must be fp32 or bf16");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "dense_gemv: weight must be contiguous [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == dt && x.size(1) == K,
              "dense_gemv: x must be contiguous [M, K] in the weight's dtype");
  const int64_t M = x.size(0);
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && y.scalar_type() == dt && y.size(0) == M && y.size(1) == N,
              "dense_gemv: y must be contiguous [M, N] in the weight's dtype");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == dt && bias->is_contiguous() && bias->numel() == N,
                "dense_gemv: bias must be contiguous [N] in the weight's dtype");
  if (M == 0 || N == 0) return;
  if (dt == at::kFloat) {
    gemv_impl(y.data_ptr<float>(), x.data_ptr<float>(), weight.data_ptr<float>(),
              bias ? bias->data_ptr<float>() : nullptr, M, N, K);
    return;
  }
  const std::vector<float> xf = bf16_pairs(x.data_ptr<c10::BFloat16>(), M, K);  // x widened once
  gemv_impl(y.data_ptr<c10::BFloat16>(), xf.data(), weight.data_ptr<c10::BFloat16>(),
            bias ? bias->data_ptr<c10::BFloat16>() : nullptr, M, N, K);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(openinfer_cpu, m) {
  m.def("dense_gemv(Tensor(a!) y, Tensor x, Tensor weight, Tensor? bias) -> ()");
  m.impl("dense_gemv", c10::DispatchKey::CPU, &dense_gemv);
}
