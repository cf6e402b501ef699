// The int8 activations of the GGUF int8 kernels (gguf_q8_gemm.cpp: up to GGUF_DEQUANT_ROWS rows; gguf_q8_tiles.cpp:
// prefill), so both quantise x the same way: per row m and 32-column block, d = max |x| / 127,
// q = round_half_even(x * (1 / d)) in [-127, 127] (0 for an all-zero block), the rounded block's sum d Σ q, and per 4
// columns the negated sum of q. layers/gguf_quant.py's ``quantize_activations_q8`` is the same fp32 arithmetic.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "gguf_blocks.h"  // fp16

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

#ifdef __AVX2__
// 8 consecutive fp16 scales (the repacked layout's 8 rows' d / dmin, gguf_repack.cpp) as fp32
inline __m256 fp16x8(const uint8_t* p) {
#ifdef __F16C__
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float v[8];
  for (int i = 0; i < 8; ++i) v[i] = fp16(p + 2 * i);
  return _mm256_load_ps(v);
#endif
}

// lane l of acc += Σ_{i < 4} u[4 l + i] (unsigned) * s[4 l + i] (signed): VNNI's dpbusd, or AVX2's maddubs (pairs
// into int16; each kernel keeps its operands below saturation) and madd by ones.
inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

inline __m256i load32(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
#endif

// x quantised: rows [M, K] int8, and per row and 32-column block the scale, the rounded sum d Σ q, and 8 lane sums (the
// negated sum of q over columns 4l..4l+3 of the block).
struct QX {
  std::vector<int8_t> q;
  std::vector<float> d, sum;
  std::vector<int32_t> nls;

  // room for M rows of K columns (G = K / 32 blocks); kept per calling thread, so it only grows
  void reserve(int64_t M, int64_t K, int64_t G) {
    if (static_cast<int64_t>(q.size()) < M * K) q.resize(M * K);
    if (static_cast<int64_t>(d.size()) < M * G) {
      d.resize(M * G);
      sum.resize(M * G);
      nls.resize(M * G * 8);
    }
  }
};

// A view of kMB (or fewer) consecutive quantised rows.
struct XRows {
  const int8_t* q;
  const float* d;
  const float* s;
  const int32_t* nl;
  int64_t K, G;
};

void quantize_rows(const float* x, int64_t K, QX& qx, int64_t m0, int64_t m1) {
  const int64_t G = K / 32;
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const float* xb = x + m * K + g * 32;
      float amax = 0.f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
      int8_t* q = qx.q.data() + m * K + g * 32;
      for (int i = 0; i < 32; ++i)
        q[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(xb[i] * id))));
      int32_t* nl = qx.nls.data() + (m * G + g) * 8;
      int32_t qsum = 0;
      for (int l = 0; l < 8; ++l) {
        nl[l] = -(q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3]);
        qsum -= nl[l];
      }
      qx.d[m * G + g] = d;
      // The min term's sum is that of the rounded activations, d Σ q (llama.cpp's q8_1 s / q8_K bsums), not the
      // exact Σ x: with Σ x the rounding error meets only d q_w, the weight less its min (all >= 0, not centred),
      // and SmolLM2's Q4_1 perplexity lost ~3x what llama.cpp loses to int8 activations; with d Σ q the product is
      // the dequantised W times the rounded x, whose error w (x - d q) has the centred weights' smaller size.
      qx.sum[m * G + g] = d * static_cast<float>(qsum);
    }
}

}  // namespace
