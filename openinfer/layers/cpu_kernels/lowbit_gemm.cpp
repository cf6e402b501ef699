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
// work split over output rows in blocks of 4 (each block's weights are read from memory once, whatever M).
// M <= 2 (decode at batch 1-2): the weights are widened in registers right before their FMAs, 2 activation rows
// sharing each widened vector. M >= 3: the block's 4 rows are widened once into a per-thread fp32 scratch (L1/L2
// sized: 4 x K floats), then an fp32 4-rows x 3-activations register tile runs over it, so the widening cost is
// paid once per weight instead of once per activation pair and the FMAs dominate.
// AVX2 intrinsics (cvtepi8_epi32 -> cvtepi32_ps -> fmadd); a plain loop elsewhere. The AVX2 code also runs on
// AVX-512 hosts (no 512-bit variant yet).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int kRows = 4;  // output rows per block
constexpr int kM = 3;     // activation rows per register tile (2 on the in-register path)
constexpr int kDirectM = 2;  // M up to this: widen in registers; above it: widen into the scratch once

#ifdef __AVX2__
inline float hsum8(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

inline __m256 widen_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

// acc[m][r] = x[m] . q[r] over all K, for R weight rows and MB activation rows.
template <int R, int MB>
inline void int8_block(const float* x, int64_t K, const int8_t* w, float acc[kM][kRows]) {
  int64_t k = 0;
#ifdef __AVX2__
  __m256 a[MB][R];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) a[m][r] = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) {
    __m256 xv[MB];
    for (int m = 0; m < MB; ++m) xv[m] = _mm256_loadu_ps(x + m * K + k);
    for (int r = 0; r < R; ++r) {
      __m256 wv = widen_i8(w + r * K + k);
      for (int m = 0; m < MB; ++m) a[m][r] = _mm256_fmadd_ps(wv, xv[m], a[m][r]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = hsum8(a[m][r]);
#else
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = 0.f;
#endif
  for (; k < K; ++k)
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] += x[m * K + k] * static_cast<float>(w[r * K + k]);
}

// The same over int4 groups: acc[m][r] = sum_g s[r][g] * (x[m] . q[r] over group g).
template <int R, int MB>
inline void int4_block(const float* x, int64_t Kp, const uint8_t* w, const float* s, int64_t G, int64_t group,
                       float acc[kM][kRows]) {
  const int64_t row_bytes = Kp / 2;
#ifdef __AVX2__
  __m256 a[MB][R];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) a[m][r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi32(0xF), eight = _mm256_set1_epi32(8);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t k0 = g * group, k1 = std::min(Kp, k0 + group);
    __m256 ga[MB][R];
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < R; ++r) ga[m][r] = _mm256_setzero_ps();
    for (int64_t k = k0; k < k1; k += 16) {
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
          ga[m][r] = _mm256_fmadd_ps(lo, xl[m], ga[m][r]);
          ga[m][r] = _mm256_fmadd_ps(hi, xh[m], ga[m][r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      __m256 sv = _mm256_set1_ps(s[r * G + g]);
      for (int m = 0; m < MB; ++m) a[m][r] = _mm256_fmadd_ps(ga[m][r], sv, a[m][r]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = hsum8(a[m][r]);
#else
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) {
      float total = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t k0 = g * group, k1 = std::min(Kp, k0 + group);
        float part = 0.f;
        for (int64_t k = k0; k < k1; k += 16)
          for (int i = 0; i < 8; ++i) {
            uint8_t b = w[r * row_bytes + k / 2 + i];
            part += x[m * Kp + k + i] * static_cast<float>((b & 0xF) - 8);
            part += x[m * Kp + k + 8 + i] * static_cast<float>((b >> 4) - 8);
          }
        total += part * s[r * G + g];
      }
      acc[m][r] = total;
    }
#endif
}

// acc[m][r] = x[m] . w[r] on fp32 rows (the widened scratch), R rows of length K at stride K.
template <int R, int MB>
inline void fp32_block(const float* x, int64_t K, const float* w, float acc[kM][kRows]) {
  int64_t k = 0;
#ifdef __AVX2__
  __m256 a[MB][R];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) a[m][r] = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) {
    __m256 xv[MB];
    for (int m = 0; m < MB; ++m) xv[m] = _mm256_loadu_ps(x + m * K + k);
    for (int r = 0; r < R; ++r) {
      __m256 wv = _mm256_loadu_ps(w + r * K + k);
      for (int m = 0; m < MB; ++m) a[m][r] = _mm256_fmadd_ps(wv, xv[m], a[m][r]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = hsum8(a[m][r]);
#else
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = 0.f;
#endif
  for (; k < K; ++k)
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] += x[m * K + k] * w[r * K + k];
}

// Widen R int8 rows [R, K] into fp32 (unscaled: the row scale is applied to the sums).
inline void widen_int8_rows(const int8_t* w, int64_t K, int R, float* out) {
  for (int64_t i = 0; i < R * K; ++i) out[i] = static_cast<float>(w[i]);
}

// Widen R int4 rows into fp32 [R, Kp] with their group scales applied.
inline void widen_int4_rows(const uint8_t* w, int64_t Kp, const float* s, int64_t G, int64_t group, int R,
                            float* out) {
  const int64_t row_bytes = Kp / 2;
  for (int r = 0; r < R; ++r)
    for (int64_t k = 0; k < Kp; k += 16) {
      const float sc = s[r * G + k / group];
      for (int i = 0; i < 8; ++i) {
        const uint8_t b = w[r * row_bytes + k / 2 + i];
        out[r * Kp + k + i] = static_cast<float>((b & 0xF) - 8) * sc;
        out[r * Kp + k + 8 + i] = static_cast<float>((b >> 4) - 8) * sc;
      }
    }
}

// Runs ``block(R, MB, n, m, acc)`` over every (row block, activation pair), with the results scaled by
// ``row_scale`` (1 for int4, whose scales are inside the sum) plus bias, into y [M, N] fp32.
#define OI_DISPATCH_RM(FN, ...)                                      \
  do {                                                               \
    if (MB == 3) {                                                   \
      switch (R) {                                                   \
        case 4: FN<4, 3>(__VA_ARGS__); break;                        \
        case 3: FN<3, 3>(__VA_ARGS__); break;                        \
        case 2: FN<2, 3>(__VA_ARGS__); break;                        \
        default: FN<1, 3>(__VA_ARGS__); break;                       \
      }                                                              \
    } else if (MB == 2) {                                            \
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

template <typename Block, typename Widen>
void run_blocks(float* y, int64_t M, int64_t N, const float* row_scale, const float* bias, int64_t k_work,
                int64_t kx, const float* x, Block block, Widen widen) {
  const int64_t nblocks = (N + kRows - 1) / kRows;
  // ~64k weight bytes of work per task at least, so small layers do not wake every thread
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(kRows * k_work, 1));
  const bool direct = M <= kDirectM;
  at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) {
    std::vector<float> scratch(direct ? 0 : kRows * kx);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * kRows;
      const int R = static_cast<int>(std::min<int64_t>(kRows, N - n));
      if (!direct) widen(n, R, scratch.data());
      const int tile = direct ? kDirectM : kM;
      for (int64_t m = 0; m < M; m += tile) {
        const int MB = static_cast<int>(std::min<int64_t>(tile, M - m));
        float acc[kM][kRows];
        if (direct) {
          block(R, MB, n, m, acc);
        } else {
          const float* xm = x + m * kx;
          const float* ws = scratch.data();
          OI_DISPATCH_RM(fp32_block, xm, kx, ws, acc);
        }
        for (int i = 0; i < MB; ++i)
          for (int r = 0; r < R; ++r) {
            float v = acc[i][r] * (row_scale ? row_scale[n + r] : 1.f);
            y[(m + i) * N + n + r] = bias ? v + bias[n + r] : v;
          }
      }
    }
  });
}


void check_common(const at::Tensor& y, const at::Tensor& x, int64_t N, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x must be contiguous fp32 [M, K]");
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && y.scalar_type() == at::kFloat && y.size(0) == x.size(0) &&
                  y.size(1) == N, "y must be contiguous fp32 [M, N]");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be contiguous fp32 [N]");
}

void int8_linear(at::Tensor y, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                 const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.scalar_type() == at::kChar,
              "qweight must be contiguous int8 [N, K]");
  const int64_t N = qweight.size(0), K = qweight.size(1), M = x.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [M, K] with K = qweight.size(1)");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N,
              "scales must be contiguous fp32 [N]");
  check_common(y, x, N, bias);
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = qweight.data_ptr<int8_t>();
  run_blocks(y.data_ptr<float>(), M, N, scales.data_ptr<float>(), bias ? bias->data_ptr<float>() : nullptr, K, K,
             xp,
             [&](int R, int MB, int64_t n, int64_t m, float acc[kM][kRows]) {
               OI_DISPATCH_RM(int8_block, xp + m * K, K, wp + n * K, acc);
             },
             [&](int64_t n, int R, float* out) { widen_int8_rows(wp + n * K, K, R, out); });
}

void int4_linear(at::Tensor y, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                 int64_t group, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.scalar_type() == at::kByte,
              "qweight must be contiguous uint8 [N, Kp / 2]");
  TORCH_CHECK(group > 0 && group % 16 == 0, "group must be a positive multiple of 16");
  const int64_t N = qweight.size(0), Kp = qweight.size(1) * 2, M = x.size(0);
  TORCH_CHECK(Kp % 16 == 0, "the packed row must cover a multiple of 16 columns");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == Kp, "x must be [M, Kp] (padded with zeros to qweight's columns)");
  const int64_t G = (Kp + group - 1) / group;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == N && scales.size(1) == G, "scales must be contiguous fp32 [N, ceil(Kp / group)]");
  check_common(y, x, N, bias);
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  run_blocks(y.data_ptr<float>(), M, N, nullptr, bias ? bias->data_ptr<float>() : nullptr, Kp / 2, Kp, xp,
             [&](int R, int MB, int64_t n, int64_t m, float acc[kM][kRows]) {
               OI_DISPATCH_RM(int4_block, xp + m * Kp, Kp, wp + n * (Kp / 2), sp + n * G, G, group, acc);
             },
             [&](int64_t n, int R, float* out) { widen_int4_rows(wp + n * (Kp / 2), Kp, sp + n * G, G, group, R, out); });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(openinfer_cpu, m) {
  m.def("int8_linear(Tensor(a!) y, Tensor x, Tensor qweight, Tensor scales, Tensor? bias) -> ()");
  m.impl("int8_linear", c10::DispatchKey::CPU, &int8_linear);
  m.def("int4_linear(Tensor(a!) y, Tensor x, Tensor qweight, Tensor scales, int group, Tensor? bias) -> ()");
  m.impl("int4_linear", c10::DispatchKey::CPU, &int4_linear);
}
