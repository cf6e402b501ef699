// Weight-only low-bit linears (layers/quant_linear.py): y[M, N] = x[M, K] W^T with W kept packed and widened in
// registers, never dequantised into memory.
//
// - int8: qweight int8 [N, K] (any K), one fp32 scale per output row: y = (x . q_n) * s_n.
// - int4: qweight uint8 [N, Kp/2] (Kp = K rounded up to 16, the padding zero), one fp32 scale per row and group of
//   ``group`` (a multiple of 16) input columns; in each run of 16 columns byte i holds column i in its low nibble and
//   column i + 8 in its high nibble, as q + 8 (q in [-8, 7]). That layout (not the neighbouring-pair order of GGUF
//   or GPTQ) is what lets one 8-byte load widen into two 8-float vectors that line up with x without a shuffle.
//   x must have Kp columns (the wrapper pads it with zeros).
// Both: x fp32 (the wrapper widens bf16/fp16 rows once per call: M x K is small next to N x K), fp32 accumulation,
// work split over output rows in blocks of 4 (each block's weights are read from memory once, whatever M: the
// rows stay in L1 while every activation row passes over them), 2 activation rows at a time so each widened
// weight vector serves two FMAs; int8 with one activation row takes the rows one at a time instead (int8_row).
// (Widening a block once into an fp32 scratch for M >= 3 and running an fp32 4x3 tile over it measured slower here
// at M = 3 and 8, 1 thread: int8 17 vs 23 G multiply-adds/s.)
// AVX2 intrinsics (cvtepi8_epi32 -> cvtepi32_ps -> fmadd); a plain loop elsewhere. The AVX2 code also runs on
// AVX-512 hosts (no 512-bit variant yet).
// Software prefetch of the next row block (``pf``, same offset, one 64-byte line per row at a time, during the first
// activation row's pass): the widening makes each weight line cost several times an fp32 line's work, and the
// hardware prefetcher alone then kept the stream at ~6-7 GB/s here; one block ahead measured 11+ GB/s at M = 1
// (int8, 1 thread, weights out of cache; 8 rows ahead 9-11, 256 B ahead in the same rows no gain). The fp32 gemv
// (gemv.cpp) measured no gain from the same and keeps none.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "kernels.h"
#include "vec.h"

#include <algorithm>
#include <cstdint>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int kRows = 4;  // output rows per block
constexpr int kM = 2;     // activation rows sharing one widened weight vector
constexpr int64_t kRowPrefetch = 1024;  // int8_row: bytes ahead in the stream

#ifdef __AVX2__
inline __m256 widen_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

// acc[m][r] = x[m] . q[r] over all K, for R weight rows and MB activation rows. With one activation row, two
// accumulators per weight row (even / odd runs of 8): R chains alone are bound by the FMA latency, not its
// throughput (measured 2x slower per weight than two activation rows).
template <int R, int MB>
inline void int8_block(const float* x, int64_t K, const int8_t* w, const int8_t* pf, float acc[kM][kRows]) {
  int64_t k = 0;
#ifdef __AVX2__
  constexpr int S = MB == 1 ? 2 : 1;
  __m256 a[MB][R][S];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < S; ++j) a[m][r][j] = _mm256_setzero_ps();
  for (; k + 8 * S <= K; k += 8 * S) {
    if (pf && (k & 63) == 0)
      for (int r = 0; r < R; ++r) __builtin_prefetch(pf + r * K + k);
    for (int j = 0; j < S; ++j) {
      __m256 xv[MB];
      for (int m = 0; m < MB; ++m) xv[m] = _mm256_loadu_ps(x + m * K + k + 8 * j);
      for (int r = 0; r < R; ++r) {
        __m256 wv = widen_i8(w + r * K + k + 8 * j);
        for (int m = 0; m < MB; ++m) a[m][r][j] = _mm256_fmadd_ps(wv, xv[m], a[m][r][j]);
      }
    }
  }
  for (; k + 8 <= K; k += 8) {
    __m256 xv[MB];
    for (int m = 0; m < MB; ++m) xv[m] = _mm256_loadu_ps(x + m * K + k);
    for (int r = 0; r < R; ++r) {
      __m256 wv = widen_i8(w + r * K + k);
      for (int m = 0; m < MB; ++m) a[m][r][0] = _mm256_fmadd_ps(wv, xv[m], a[m][r][0]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) {
      __m256 t = a[m][r][0];
      for (int j = 1; j < S; ++j) t = _mm256_add_ps(t, a[m][r][j]);
      acc[m][r] = hsum8(t);
    }
#else
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = 0.f;
#endif
  for (; k < K; ++k)
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] += x[m * K + k] * static_cast<float>(w[r * K + k]);
}

// One activation row against one weight row, 4 accumulator chains (the FMA latency): int8's M = 1 path, which takes
// the rows one after another so the matrix is read front to back as one stream (a 4-row block reads 4 streams K
// bytes apart): 1 thread, weights out of cache, 8.8 -> 12.1 GB/s; Llama bench int8 batch-1 step 24.0 -> ~18.5 ms.
// ``pf``: where in that stream to prefetch, one line per 64 columns, or nullptr.
inline float int8_row(const float* x, int64_t K, const int8_t* w, const int8_t* pf) {
  int64_t k = 0;
  float s = 0.f;
#ifdef __AVX2__
  __m256 a[4];
  for (int j = 0; j < 4; ++j) a[j] = _mm256_setzero_ps();
  for (; k + 32 <= K; k += 32) {
    if (pf && (k & 63) == 0) __builtin_prefetch(pf + k);
    for (int j = 0; j < 4; ++j) a[j] = _mm256_fmadd_ps(widen_i8(w + k + 8 * j), _mm256_loadu_ps(x + k + 8 * j), a[j]);
  }
  for (; k + 8 <= K; k += 8) a[0] = _mm256_fmadd_ps(widen_i8(w + k), _mm256_loadu_ps(x + k), a[0]);
  s = hsum8(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
#endif
  for (; k < K; ++k) s += x[k] * static_cast<float>(w[k]);
  return s;
}

// The same over int4 groups: acc[m][r] = sum_g s[r][g] * (x[m] . q[r] over group g). Each group's vector sum is
// reduced to a scalar and scaled (a few instructions per 128 weights) so the registers hold only the group
// accumulators; one activation row keeps the low- and high-nibble halves in separate chains (latency, as above).
template <int R, int MB>
inline void int4_block(const float* x, int64_t Kp, const uint8_t* w, const uint8_t* pf, const float* s, int64_t G,
                       int64_t group, float acc[kM][kRows]) {
  const int64_t row_bytes = Kp / 2;
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = 0.f;
#ifdef __AVX2__
  constexpr int S = MB == 1 ? 2 : 1;
  const __m256i low = _mm256_set1_epi32(0xF), eight = _mm256_set1_epi32(8);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t k0 = g * group, k1 = std::min(Kp, k0 + group);
    __m256 ga[MB][R][S];
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < S; ++j) ga[m][r][j] = _mm256_setzero_ps();
    for (int64_t k = k0; k < k1; k += 16) {
      if (pf && (k & 127) == 0)  // 64 bytes = 128 columns
        for (int r = 0; r < R; ++r) __builtin_prefetch(pf + r * row_bytes + k / 2);
      __m256 xl[MB], xh[MB];
      for (int m = 0; m < MB; ++m) {
        xl[m] = _mm256_loadu_ps(x + m * Kp + k);
        xh[m] = _mm256_loadu_ps(x + m * Kp + k + 8);
      }
      for (int r = 0; r < R; ++r) {
        __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + r * row_bytes + k / 2)));
        __m256 lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b, low), eight));
        __m256 hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b, 4), eight));
        for (int m = 0; m < MB; ++m) {
          ga[m][r][0] = _mm256_fmadd_ps(lo, xl[m], ga[m][r][0]);
          ga[m][r][S - 1] = _mm256_fmadd_ps(hi, xh[m], ga[m][r][S - 1]);
        }
      }
    }
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < R; ++r) {
        __m256 t = S == 2 ? _mm256_add_ps(ga[m][r][0], ga[m][r][S - 1]) : ga[m][r][0];
        acc[m][r] += hsum8(t) * s[r * G + g];
      }
  }
#else
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t k0 = g * group, k1 = std::min(Kp, k0 + group);
        float part = 0.f;
        for (int64_t k = k0; k < k1; k += 16)
          for (int i = 0; i < 8; ++i) {
            uint8_t b = w[r * row_bytes + k / 2 + i];
            part += x[m * Kp + k + i] * static_cast<float>((b & 0xF) - 8);
            part += x[m * Kp + k + 8 + i] * static_cast<float>((b >> 4) - 8);
          }
        acc[m][r] += part * s[r * G + g];
      }
#endif
}

// Runs ``block(R, MB, n, m, prefetch, acc)`` over every (row block, activation pair), with the results scaled by
// ``row_scale`` (1 for int4, whose scales are inside the sum) plus bias, into y [M, N] fp32. ``prefetch``: whether
// the block should prefetch the next one (first activation pair, a next block exists).
template <typename Block>
void run_blocks(float* y, int64_t M, int64_t N, const float* row_scale, const float* bias, int64_t k_work,
                Block block) {
  const int64_t nblocks = (N + kRows - 1) / kRows;
  // ~64k weight bytes of work per task at least, so small layers do not wake every thread
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(kRows * k_work, 1));
  at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * kRows;
      const int R = static_cast<int>(std::min<int64_t>(kRows, N - n));
      for (int64_t m = 0; m < M; m += kM) {
        const int MB = static_cast<int>(std::min<int64_t>(kM, M - m));
        float acc[kM][kRows];
        block(R, MB, n, m, m == 0 && n + kRows < N, acc);
        for (int i = 0; i < MB; ++i)
          for (int r = 0; r < R; ++r) {
            float v = acc[i][r] * (row_scale ? row_scale[n + r] : 1.f);
            y[(m + i) * N + n + r] = bias ? v + bias[n + r] : v;
          }
      }
    }
  });
}

#define OI_DISPATCH_RM(FN, ...)                                      \
  do {                                                               \
    if (MB == 2) {                                                   \
      switch (R) {                                                   \
        case 4: FN<4, 2>(__VA_ARGS__); break;                        \
        case 3: FN<3, 2>(__VA_ARGS__); break;                        \
        case 2: FN<2, 2>(__VA_ARGS__); break;                        \
        default: FN<1, 2>(__VA_ARGS__); break;                       \
      }                                                              \
    } else {                                                         \
      switch (R) {                                                   \
        case 4: FN<4, 1>(__VA_ARGS__); break;                        \
        case 3: FN<3, 1>(__VA_ARGS__); break;                        \
        case 2: FN<2, 1>(__VA_ARGS__); break;                        \
        default: FN<1, 1>(__VA_ARGS__); break;                       \
      }                                                              \
    }                                                                \
  } while (0)

void check_common(const at::Tensor& y, const at::Tensor& x, int64_t N, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x must be contiguous fp32 [M, K]");
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && y.scalar_type() == at::kFloat && y.size(0) == x.size(0) &&
                  y.size(1) == N, "y must be contiguous fp32 [M, N]");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be contiguous fp32 [N]");
}

// The packed weight and its scales, for the linear and the dequantize op alike.
void check_int8(const at::Tensor& qweight, const at::Tensor& scales) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.scalar_type() == at::kChar,
              "qweight must be contiguous int8 [N, K]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == qweight.size(0),
              "scales must be contiguous fp32 [N]");
}

// Returns the number of groups, ceil(Kp / group).
int64_t check_int4(const at::Tensor& qweight, const at::Tensor& scales, int64_t group) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.scalar_type() == at::kByte,
              "qweight must be contiguous uint8 [N, Kp / 2]");
  TORCH_CHECK(group > 0 && group % 16 == 0, "group must be a positive multiple of 16");
  const int64_t Kp = qweight.size(1) * 2, G = (Kp + group - 1) / group;
  TORCH_CHECK(Kp % 16 == 0, "the packed row must cover a multiple of 16 columns");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == qweight.size(0) && scales.size(1) == G,
              "scales must be contiguous fp32 [N, ceil(Kp / group)]");
  return G;
}

void check_out(const at::Tensor& out, int64_t N, int64_t K) {
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == at::kFloat && out.size(0) == N &&
                  out.size(1) == K, "out must be contiguous fp32 [N, K] (K: qweight's unpacked columns)");
}

void int8_linear(at::Tensor y, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                 const c10::optional<at::Tensor>& bias) {
  check_int8(qweight, scales);
  const int64_t N = qweight.size(0), K = qweight.size(1), M = x.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [M, K] with K = qweight.size(1)");
  check_common(y, x, N, bias);
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = qweight.data_ptr<int8_t>();
  if (M == 1) {
    const float* sp = scales.data_ptr<float>();
    const float* bp = bias ? bias->data_ptr<float>() : nullptr;
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, N, std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1)), [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        const float v = int8_row(xp, K, wp + n * K, wp + n * K + kRowPrefetch) * sp[n];
        yp[n] = bp ? v + bp[n] : v;
      }
    });
    return;
  }
  run_blocks(y.data_ptr<float>(), M, N, scales.data_ptr<float>(), bias ? bias->data_ptr<float>() : nullptr, K,
             [&](int R, int MB, int64_t n, int64_t m, bool prefetch, float acc[kM][kRows]) {
               const int8_t* next = prefetch ? wp + (n + kRows) * K : nullptr;
               OI_DISPATCH_RM(int8_block, xp + m * K, K, wp + n * K, next, acc);
             });
}

void int4_linear(at::Tensor y, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                 int64_t group, const c10::optional<at::Tensor>& bias) {
  const int64_t G = check_int4(qweight, scales, group);
  const int64_t N = qweight.size(0), Kp = qweight.size(1) * 2, M = x.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == Kp, "x must be [M, Kp] (padded with zeros to qweight's columns)");
  check_common(y, x, N, bias);
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  run_blocks(y.data_ptr<float>(), M, N, nullptr, bias ? bias->data_ptr<float>() : nullptr, Kp / 2,
             [&](int R, int MB, int64_t n, int64_t m, bool prefetch, float acc[kM][kRows]) {
               const uint8_t* next = prefetch ? wp + (n + kRows) * (Kp / 2) : nullptr;
               OI_DISPATCH_RM(int4_block, xp + m * Kp, Kp, wp + n * (Kp / 2), next, sp + n * G, G, group, acc);
             });
}

// Prefill (quant_linear.LOWBIT_DEQUANT_ROWS rows and more): the weight decoded into an fp32 [N, Kp] matrix for one
// call, which torch's blocked GEMM then multiplies (the register tile above re-widens every weight for each pair of
// activation rows, so from a few dozen rows it trails a GEMM). The values are QuantizedWeight.dequantize's to the
// bit: int8 float(q) * s_n, int4 float(q - 8) * s_{n, g} (one fp32 product each). Parallel over rows.
void int8_dequantize(at::Tensor out, const at::Tensor& qweight, const at::Tensor& scales) {
  check_int8(qweight, scales);
  const int64_t N = qweight.size(0), K = qweight.size(1);
  check_out(out, N, K);
  const int8_t* wp = qweight.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1)), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* q = wp + n * K;
      float* o = op + n * K;
      int64_t k = 0;
#ifdef __AVX2__
      const __m256 sv = _mm256_set1_ps(sp[n]);
      for (; k + 8 <= K; k += 8) _mm256_storeu_ps(o + k, _mm256_mul_ps(widen_i8(q + k), sv));
#endif
      for (; k < K; ++k) o[k] = static_cast<float>(q[k]) * sp[n];
    }
  });
}

void int4_dequantize(at::Tensor out, const at::Tensor& qweight, const at::Tensor& scales, int64_t group) {
  const int64_t G = check_int4(qweight, scales, group);
  const int64_t N = qweight.size(0), Kp = qweight.size(1) * 2;
  check_out(out, N, Kp);
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, std::max<int64_t>(1, 65536 / std::max<int64_t>(Kp, 1)), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* q = wp + n * (Kp / 2);
      float* o = op + n * Kp;
      for (int64_t k = 0; k < Kp; k += 16) {  // a run of 16 never straddles a group (group % 16 == 0)
        const float s = sp[n * G + k / group];
#ifdef __AVX2__
        const __m256 sv = _mm256_set1_ps(s);
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k / 2)));
        const __m256i low = _mm256_set1_epi32(0xF), eight = _mm256_set1_epi32(8);
        _mm256_storeu_ps(o + k, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b, low), eight)), sv));
        _mm256_storeu_ps(o + k + 8,
                         _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b, 4), eight)), sv));
#else
        for (int i = 0; i < 8; ++i) {
          o[k + i] = static_cast<float>((q[k / 2 + i] & 0xF) - 8) * s;
          o[k + 8 + i] = static_cast<float>((q[k / 2 + i] >> 4) - 8) * s;
        }
#endif
      }
    }
  });
}

}  // namespace

namespace oi {
void int8_linear(at::Tensor y, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                 const c10::optional<at::Tensor>& bias) {
  ::int8_linear(std::move(y), x, qweight, scales, bias);
}
void int4_linear(at::Tensor y, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                 int64_t group, const c10::optional<at::Tensor>& bias) {
  ::int4_linear(std::move(y), x, qweight, scales, group, bias);
}
}  // namespace oi

TORCH_LIBRARY_FRAGMENT(openinfer_cpu, m) {
  m.def("int8_linear(Tensor(a!) y, Tensor x, Tensor qweight, Tensor scales, Tensor? bias) -> ()");
  m.impl("int8_linear", c10::DispatchKey::CPU, &int8_linear);
  m.def("int4_linear(Tensor(a!) y, Tensor x, Tensor qweight, Tensor scales, int group, Tensor? bias) -> ()");
  m.impl("int4_linear", c10::DispatchKey::CPU, &int4_linear);
  m.def("int8_dequantize(Tensor(a!) out, Tensor qweight, Tensor scales) -> ()");
  m.impl("int8_dequantize", c10::DispatchKey::CPU, &int8_dequantize);
  m.def("int4_dequantize(Tensor(a!) out, Tensor qweight, Tensor scales, int group) -> ()");
  m.impl("int4_dequantize", c10::DispatchKey::CPU, &int4_dequantize);
}
