// W8A8 int8 linears (layers/quant_linear.py, method "w8a8"): y[M, N] = x[M, K] W^T with both operands int8.
//
// - W: qweight int8 [N, K] (any K; values in [-128, 127], as compressed-tensors checkpoints hold them), one fp32
//   scale per output row.
// - x: fp32 [M, K], quantised here per token (row), symmetric and dynamic: s_m = amax(|x_m|) / 127 (1 for an
//   all-zero row), q = round_half_even(x / s_m) in [-127, 127] -- the arithmetic of quant_linear.quantize_activations,
//   so kernel and torch reference produce the same integers.
// - y[m, n] = float(sum_k q_mk w_nk) * s_m * s_n (+ bias[n]), the int32 sum exact; the same fp32 operations in the
//   same order as w8a8_reference, so the two agree bit for bit.
//
// The int8 x int8 products: x86 has only unsigned x signed byte multiplies, so the usual sign trick moves the sign
// of w onto x: |w| (unsigned, 0..128: -128 is 0x80, i.e. 128 read unsigned) times sign(w) * x (x is never -128, so
// negating it cannot overflow). AVX2: _mm256_maddubs_epi16 sums pairs into int16 (at most 2 * 128 * 127 = 32512,
// no saturation), _mm256_madd_epi16 by ones widens to int32. AVX512-VNNI (where the build targets it):
// _mm512_dpbusd_epi32 does both and accumulates in int32 (the sign moved with a masked subtract, AVX-512 has no
// sign_epi8). A plain loop elsewhere. Work is split over blocks of 4 output rows (each block's weights stay in L1
// while every quantised activation row passes over them); up to kSeqRows activation rows a block's rows are taken
// one at a time (one front-to-back stream through the matrix, which is what batch-1 decode is bound by).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels.h"

#if defined(__AVX2__) || defined(__AVX512VNNI__)
#include <immintrin.h>
#endif

namespace {

constexpr int kRows = 4;  // output rows per block
// Up to this many activation rows (decode at small batch) the rows of a block are taken one at a time, so the
// matrix is read front to back as one stream (row n + 1 follows row n in memory) instead of 4 streams K bytes apart;
// Llama bench w8a8 batch-1 decode step ~21 -> ~16 ms (scripts/profile_decode_step.py, alternating runs; the layers'
// weights ~11 -> ~14 GB/s). At 8 rows the 4-row block is ahead again (each x load and horizontal sum serves 4 rows).
constexpr int64_t kSeqRows = 4;
constexpr int64_t kSeqPrefetch = 1024;  // bytes ahead in that stream to prefetch (vs none: ~5 % on that step)

// dots[r] = sum_k x[k] * w[r][k] for R rows, exactly in int32 (|sum| <= 128 * 127 * K: fine for K < 130000).
// ``pf``: the next row block to prefetch (same offset, one line per row at a time), or nullptr; see lowbit_gemm.cpp
// (one block ahead measured 8.6 -> 13 GB/s at M = 1, +20-45 % at M = 4-8 on a 1024 x 2816 weight out of cache).
template <int R>
inline void dot_rows(const int8_t* x, const int8_t* w, const int8_t* pf, int64_t K, int32_t dots[kRows]) {
  int64_t k = 0;
  for (int r = 0; r < R; ++r) dots[r] = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  {
    __m512i acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
    const __m512i zero = _mm512_setzero_si512();
    for (; k + 64 <= K; k += 64) {
      if (pf)
        for (int r = 0; r < R; ++r) __builtin_prefetch(pf + r * K + k);
      const __m512i xv = _mm512_loadu_si512(x + k);
      for (int r = 0; r < R; ++r) {
        const __m512i wv = _mm512_loadu_si512(w + r * K + k);
        const __mmask64 neg = _mm512_movepi8_mask(wv);  // w < 0
        const __m512i sx = _mm512_mask_sub_epi8(xv, neg, zero, xv);
        acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_abs_epi8(wv), sx);
      }
    }
    for (int r = 0; r < R; ++r) dots[r] += _mm512_reduce_add_epi32(acc[r]);
  }
#endif
#ifdef __AVX2__
  {
    __m256i acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
    const __m256i ones = _mm256_set1_epi16(1);
    for (; k + 32 <= K; k += 32) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + k));
      if (pf && (k & 63) == 0)
        for (int r = 0; r < R; ++r) __builtin_prefetch(pf + r * K + k);
      for (int r = 0; r < R; ++r) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * K + k));
        const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv));
        acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(pairs, ones));
      }
    }
    for (int r = 0; r < R; ++r) {
      __m128i s = _mm_add_epi32(_mm256_castsi256_si128(acc[r]), _mm256_extracti128_si256(acc[r], 1));
      s = _mm_hadd_epi32(s, s);
      s = _mm_hadd_epi32(s, s);
      dots[r] += _mm_cvtsi128_si32(s);
    }
  }
#endif
  for (; k < K; ++k)
    for (int r = 0; r < R; ++r) dots[r] += int32_t(x[k]) * int32_t(w[r * K + k]);
}

// Per-row symmetric int8 quantisation of fp32 activations (see the header comment for the exact arithmetic).
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* scales) {
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(row[k]));
    float s = amax / 127.f;
    if (!(s > 0.f)) s = 1.f;
    scales[m] = s;
    int8_t* out = q + m * K;
    for (int64_t k = 0; k < K; ++k) {
      const float v = std::nearbyint(row[k] / s);  // the default rounding mode: half to even, like torch.round
      out[k] = int8_t(std::min(127.f, std::max(-127.f, v)));
    }
  }
}

void w8a8_linear(at::Tensor y, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                 const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.scalar_type() == at::kChar,
              "qweight must be contiguous int8 [N, K]");
  const int64_t N = qweight.size(0), K = qweight.size(1);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) == K,
              "x must be contiguous fp32 [M, K] with K = qweight.size(1)");
  const int64_t M = x.size(0);
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && y.scalar_type() == at::kFloat && y.size(0) == M && y.size(1) == N,
              "y must be contiguous fp32 [M, N]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N,
              "scales must be contiguous fp32 [N]");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be contiguous fp32 [N]");
  if (M == 0 || N == 0) return;
  std::vector<int8_t> xq(static_cast<size_t>(M * K));
  std::vector<float> xs(static_cast<size_t>(M));
  quantize_rows(x.data_ptr<float>(), M, K, xq.data(), xs.data());
  const int8_t* wp = qweight.data_ptr<int8_t>();
  const float* ws = scales.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t blocks = (N + kRows - 1) / kRows;
  // A grain of ~64k weight bytes per task keeps small layers on one thread.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, kRows * K));
  // y[m, n .. n + R) from the exact dots: the reference's fp32 operations in its order
  auto store = [&](int64_t m, int64_t n, int R, const int32_t* d) {
    for (int r = 0; r < R; ++r) {
      float v = float(d[r]) * xs[m] * ws[n + r];
      if (bp) v += bp[n + r];
      yp[m * N + n + r] = v;
    }
  };
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    int32_t dots[kRows];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * kRows;
      const int R = int(std::min<int64_t>(kRows, N - n));
      if (M <= kSeqRows) {
        for (int r = 0; r < R; ++r)
          for (int64_t m = 0; m < M; ++m) {
            const int8_t* w = wp + (n + r) * K;
            dot_rows<1>(xq.data() + m * K, w, m == 0 ? w + kSeqPrefetch : nullptr, K, dots);
            store(m, n + r, 1, dots);
          }
        continue;
      }
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* xr = xq.data() + m * K;
        const int8_t* next = m == 0 && n + kRows < N ? wp + (n + kRows) * K : nullptr;
        switch (R) {
          case 4: dot_rows<4>(xr, wp + n * K, next, K, dots); break;
          case 3: dot_rows<3>(xr, wp + n * K, next, K, dots); break;
          case 2: dot_rows<2>(xr, wp + n * K, next, K, dots); break;
          default: dot_rows<1>(xr, wp + n * K, next, K, dots); break;
        }
        store(m, n, R, dots);
      }
    }
  });
}

}  // namespace

namespace oi {
void w8a8_linear(at::Tensor y, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                 const c10::optional<at::Tensor>& bias) {
  ::w8a8_linear(std::move(y), x, qweight, scales, bias);
}
}  // namespace oi

TORCH_LIBRARY_FRAGMENT(openinfer_cpu, m) {
  m.def("w8a8_linear(Tensor(a!) y, Tensor x, Tensor qweight, Tensor scales, Tensor? bias) -> ()");
  m.impl("w8a8_linear", c10::DispatchKey::CPU, &w8a8_linear);
}
