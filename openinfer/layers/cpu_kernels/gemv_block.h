// The small-M dot-product blocks of gemv.cpp (see its header comment for the why), shared with moe_gemv.cpp:
// kRows weight rows x up to kM activation rows per block, AVX-512 / AVX2 + FMA / plain builds, fp32 and bf16
// weights (bf16 activations de-interleaved once by bf16_pairs). Header-only, in an anonymous namespace: each
// kernel file gets its own copy.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
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

}  // namespace
