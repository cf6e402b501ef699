// W4A8 linears (layers/quant_linear.py, method "w4a8"): y[M, N] = x[M, K] W^T with int4 weights and int8
// activations, the dot products in integers -- what llama.cpp's Q4_0 x Q8_0 does, on our int4 layout.
//
// - W: the nibbles of lowbit_gemm.cpp's int4 rows (in each run of 16 columns byte i = column i | column i + 8 << 4,
//   each nibble q + 8 with q in [-8, 7]), Kp a multiple of 64, in blocks of 4 rows: qweight uint8
//   [ceil(N / 4) * 4, Kp / 2] holds per block, for each 64 columns, the 4 rows' 32 bytes in turn (rows past N zero:
//   nibble 8), so the whole matrix is one front-to-back stream (quant_linear.block_rows). ``group`` (input columns
//   per fp32 scale, [N, G]) is a multiple of 64, so every 32-byte load is 64 columns of one group.
// - x: fp32 [M, Kp] (zero-padded by the wrapper), quantised here per token like w8a8_gemm.cpp (s_m = amax / 127,
//   1 for an all-zero row, round half to even, [-127, 127]: quant_linear.quantize_activations' integers).
// - y[m, n] = s_m * sum_g s[n, g] * dot_g (+ bias[n]), dot_g = sum over group g of q_x * q_w, exact in int32.
//
// The products: _mm256_maddubs_epi16 multiplies unsigned by signed bytes, and the nibbles as stored (q + 8, 0..15)
// are the unsigned side with no sign trick: sum (q + 8) x = dot + 8 sum x, so each token's 8 sum x per group is
// worked out once, in the same lanes (``corr``), and subtracted in int32. Pairs sum to at most 2 * 15 * 127 = 3810,
// so the int16 sums of the two 32-byte halves of a 64-column step cannot saturate. The nibbles of one 32-byte load
// come out (and / shift) as 32 low and 32 high nibbles, i.e. columns {0-7, 16-23, 32-39, 48-55} and {8-15, 24-31,
// 40-47, 56-63} of the step; the quantised x is written once per call in that order, so no weight is shuffled.
// Per group the 8 int32 lanes are exact; they are widened to fp32 and multiplied by s[n, g] into 8 fp32 lane sums,
// summed horizontally at the end (the torch reference sums per group instead: the two differ in fp32 rounding only).
// Work is split over the blocks of 4 output rows (weights read from memory once, in L1 while the tokens pass over
// them 2 at a time, or 4 at a time in prefill-sized calls: w4a8_row), the first pass prefetching ahead in the
// stream. A plain loop without AVX2.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int kRows = 4;   // output rows per block
constexpr int kM = 2;      // tokens sharing each decoded weight vector (decode-sized calls)
constexpr int kWide = 4;   // tokens per pass of the prefill path (w4a8_row)
constexpr int kStep = 64;  // columns per 32-byte weight load
// The first token's pass prefetches this many bytes ahead in the weight stream (1 thread, batch 1, weights from
// memory, 5632 x 1024: none 12.0 GB/s, 512 B 13.7, 1 KB 14.4, 2 KB 14.6; 1024 x 2816 10.0 / 11.3 / 11.4 / 12.1).
constexpr int64_t kPrefetchAhead = 1024;
// Quantised activations per token tile (about L1d). 1 thread, 2048 tokens, ms for 5632 x 1024 / 1024 x 2816: no
// tiles 265 / 119, 512 KB 233 / 115, 128 KB 241 / 101, 32 KB 215 / 100.
constexpr int64_t kTileBytes = 32 << 10;

// Quantises each row of x (the arithmetic of w8a8_gemm.cpp: x / s rounded half to even) into ``q`` in step order,
// and per group writes corr[m][g][0..7] = the int32 lanes that maddubs / madd of 8 (every byte) by q would give, so
// the dot's lanes = the raw lanes - corr. Vectorised: this runs for every token of every linear, and at batch 1 a
// scalar loop here (a division per element) was a sizeable part of the call.
void quantize_rows(const float* x, int64_t M, int64_t Kp, int64_t G, int64_t group, int8_t* q, float* scales,
                   int32_t* corr) {
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * Kp;
    int8_t* out = q + m * Kp;
    int32_t* c = corr + m * G * 8;
    float amax = 0.f;
    int64_t k = 0;
#ifdef __AVX2__
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 vmax = _mm256_setzero_ps();
    for (; k + 8 <= Kp; k += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(row + k), absmask));
    float lanes[8];
    _mm256_storeu_ps(lanes, vmax);
    for (float v : lanes) amax = std::max(amax, v);
#endif
    for (; k < Kp; ++k) amax = std::max(amax, std::fabs(row[k]));
    float s = amax / 127.f;
    if (!(s > 0.f)) s = 1.f;
    scales[m] = s;
    for (int64_t k0 = 0; k0 < Kp; k0 += kStep)
      for (int half = 0; half < 2; ++half)
        for (int run = 0; run < 4; ++run) {
          const float* src = row + k0 + run * 16 + half * 8;  // step positions 32 half + 8 run .. + 7
          int8_t* dst = out + k0 + half * 32 + run * 8;
#ifdef __AVX2__
          const __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(src), _mm256_set1_ps(s)),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          __m256i i = _mm256_cvtps_epi32(v);
          i = _mm256_max_epi32(_mm256_set1_epi32(-127), _mm256_min_epi32(_mm256_set1_epi32(127), i));
          const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
          _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm_packs_epi16(w16, w16));
#else
          for (int j = 0; j < 8; ++j)
            dst[j] = int8_t(std::min(127.f, std::max(-127.f, std::nearbyint(src[j] / s))));
#endif
        }
    // lane l of madd(maddubs(.)) holds bytes 4l..4l+3 of each 32-byte half, summed over both halves and the group
    for (int64_t g = 0; g < G; ++g) {
      const int64_t k0 = g * group, k1 = std::min(Kp, k0 + group);
#ifdef __AVX2__
      const __m256i eight = _mm256_set1_epi8(8), ones = _mm256_set1_epi16(1);
      __m256i acc = _mm256_setzero_si256();
      for (int64_t kk = k0; kk < k1; kk += kStep) {
        const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(out + kk));
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(out + kk + 32));
        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(eight, l), _mm256_maddubs_epi16(eight, h));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, ones));
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + g * 8), acc);
#else
      for (int l = 0; l < 8; ++l) c[g * 8 + l] = 0;
      for (int64_t kk = k0; kk < k1; ++kk) c[g * 8 + ((kk - k0) % 32) / 4] += 8 * int32_t(out[kk]);
#endif
    }
  }
}

// acc[m][r0 + r] = sum_g s_r[g] * dot(x_m, w_r over g), for rows r0 .. r0 + R - 1 of one block (``block``: its
// Kp / 64 steps of 4 x 32 bytes; ``s[r]``: row r's G scales) and MB tokens. ``pf_ahead``: bytes ahead of the stream
// to prefetch (0: none). Two tokens take a block as two passes of 2 rows: with 4 rows x 2 tokens the 8 int32 and 8
// fp32 accumulators outnumber AVX2's 16 registers, and the compiler kept 4 of the int32 ones on the stack, a store /
// reload per 64 columns (1 thread, 5632 x 1024 at 128 rows: 43 -> 55 G multiply-adds / s; the second pass finds
// the block's bytes in L1; summing two steps in int16 before widening spilled again: 47).
template <int MB, int R>
inline void w4a8_block(const int8_t* xq, const int32_t* corr, int64_t Kp, const uint8_t* block, int r0,
                       int64_t pf_ahead, const float* const* s, int64_t G, int64_t group, float acc[kWide][kRows]) {
  const uint8_t* w = block + r0 * 32;
#ifdef __AVX2__
  const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 fa[MB][R];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) fa[m][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const int64_t k0 = g * group, k1 = std::min(Kp, k0 + group);
    __m256i ia[MB][R];
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < R; ++r) ia[m][r] = _mm256_setzero_si256();
    for (int64_t k = k0; k < k1; k += kStep) {
      const uint8_t* ws = w + (k / kStep) * (kRows * 32);
      if (pf_ahead) {
        __builtin_prefetch(ws + pf_ahead);
        __builtin_prefetch(ws + pf_ahead + 64);
      }
      __m256i xl[MB], xh[MB];
      for (int m = 0; m < MB; ++m) {
        xl[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * Kp + k));
        xh[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * Kp + k + 32));
      }
      for (int r = 0; r < R; ++r) {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ws + r * 32));
        const __m256i lo = _mm256_and_si256(b, nib);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), nib);
        for (int m = 0; m < MB; ++m) {
          const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl[m]), _mm256_maddubs_epi16(hi, xh[m]));
          ia[m][r] = _mm256_add_epi32(ia[m][r], _mm256_madd_epi16(p, ones));
        }
      }
    }
    for (int m = 0; m < MB; ++m) {
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(corr + (m * G + g) * 8));
      for (int r = 0; r < R; ++r) {
        const __m256 d = _mm256_cvtepi32_ps(_mm256_sub_epi32(ia[m][r], c));
        fa[m][r] = _mm256_fmadd_ps(d, _mm256_set1_ps(s[r0 + r][g]), fa[m][r]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[m][r0 + r] = hsum8(fa[m][r]);
#else
  (void)pf_ahead;
  (void)corr;
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) {
      float a = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t k0 = g * group, k1 = std::min(Kp, k0 + group);
        int32_t dot = 0;
        for (int64_t k = k0; k < k1; k += kStep)
          for (int j = 0; j < kStep; ++j) {
            // xq is in step order: the nibble of step position j sits in byte j % 32 of this row's 32 bytes (the
            // low nibble for j < 32)
            const uint8_t byte = w[(k / kStep) * (kRows * 32) + r * 32 + j % 32];
            const int q = (j < 32 ? (byte & 0xF) : (byte >> 4)) - 8;
            dot += q * int32_t(xq[m * Kp + k + j]);
          }
        a += float(dot) * s[r0 + r][g];
      }
      acc[m][r0 + r] = a;
    }
#endif
}

#ifdef __AVX2__
// The prefill path: w4a8_block's results (the same bits) for MB = 4 tokens and one row r of a block, with fewer
// instructions per multiply-add. The row's nibbles are unpacked once per 64 columns for 4 tokens instead of two, x
// comes straight from memory as maddubs' second operand, and the int16 pair sums of the steps of a group add up in
// int16 before one widening madd per group (w4a8_block widens every step: a multiply-port op per step, where
// maddubs already fills those ports). Exact: a step adds at most 2 x 3810 per lane, so up to 4 steps (256 columns)
// stay within int16; the caller takes this path only for groups of at most 256. Integer sums are order-free and
// the fp32 work (per group: widen, subtract corr, fma with the scale; hsum at the end) is w4a8_block's, in its order.
// One row per pass keeps the int16 accumulators in registers: with 2 rows x 4 tokens, or 1 row x 8 tokens, gcc kept
// 4-5 of the 8 on the stack and the pass was slower. 1 thread, one Llama bench layer's four linears
// (scripts/quant_speed.py --microbench --modes w4a8): 128 tokens 27.0-27.3 -> 23.7-25.1 ms (~60 G multiply-adds / s),
// 16 tokens 3.36-3.56 -> 3.10-3.37 ms.
template <int MB>
inline void w4a8_row(const int8_t* xq, const int32_t* corr, int64_t Kp, const uint8_t* block, int r,
                     int64_t pf_ahead, const float* const* s, int64_t G, int64_t group, float acc[kWide][kRows]) {
  const uint8_t* w = block + r * 32;
  const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 fa[MB];
  for (int m = 0; m < MB; ++m) fa[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const int64_t k0 = g * group, k1 = std::min(Kp, k0 + group);
    __m256i ia[MB];
    for (int m = 0; m < MB; ++m) ia[m] = _mm256_setzero_si256();
    const uint8_t* ws = w + (k0 / kStep) * (kRows * 32);
    for (int64_t k = k0; k < k1; k += kStep, ws += kRows * 32) {
      if (pf_ahead) {
        __builtin_prefetch(ws + pf_ahead);
        __builtin_prefetch(ws + pf_ahead + 64);
      }
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ws));
      const __m256i lo = _mm256_and_si256(b, nib), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), nib);
      for (int m = 0; m < MB; ++m) {
        const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * Kp + k));
        const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * Kp + k + 32));
        ia[m] = _mm256_add_epi16(ia[m], _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh)));
      }
    }
    const __m256 sg = _mm256_set1_ps(s[r][g]);
    for (int m = 0; m < MB; ++m) {
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(corr + (m * G + g) * 8));
      fa[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_madd_epi16(ia[m], ones), c)), sg, fa[m]);
    }
  }
  for (int m = 0; m < MB; ++m) acc[m][r] = hsum8(fa[m]);
}
#endif

void w4a8_linear(at::Tensor y, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                 int64_t group, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.scalar_type() == at::kByte &&
                  qweight.size(0) % kRows == 0,
              "qweight must be contiguous uint8 [ceil(N / 4) * 4, Kp / 2] (blocks of 4 rows)");
  TORCH_CHECK(group > 0 && group % kStep == 0, "group must be a positive multiple of 64");
  const int64_t Kp = qweight.size(1) * 2, G = (Kp + group - 1) / group;
  TORCH_CHECK(Kp % kStep == 0, "the packed row must cover a multiple of 64 columns");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(1) == G && (scales.size(0) + kRows - 1) / kRows * kRows == qweight.size(0),
              "scales must be contiguous fp32 [N, ceil(Kp / group)], N within qweight's last block of rows");
  const int64_t N = scales.size(0);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) == Kp,
              "x must be contiguous fp32 [M, Kp] (padded with zeros to qweight's columns)");
  const int64_t M = x.size(0);
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && y.scalar_type() == at::kFloat && y.size(0) == M && y.size(1) == N,
              "y must be contiguous fp32 [M, N]");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be contiguous fp32 [N]");
  if (M == 0 || N == 0) return;
  std::vector<int8_t> xq(static_cast<size_t>(M * Kp));
  std::vector<float> xs(static_cast<size_t>(M));
  std::vector<int32_t> corr(static_cast<size_t>(M * G * 8));
  quantize_rows(x.data_ptr<float>(), M, Kp, G, group, xq.data(), xs.data(), corr.data());
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t block_bytes = kRows * Kp / 2, blocks = qweight.size(0) / kRows;
  // ~64k weight bytes of work per task at least, so small layers do not wake every thread
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, block_bytes));
  // Tokens in tiles of ~kTileBytes of quantised x: each block of rows passes over one tile while it stays in cache,
  // and the weights are read once per tile. Without tiles a 2048-token prefill chunk re-read all of x (2 MB at K = 1024)
  // from L3 for every block of 4 rows.
  const int64_t fit = kTileBytes / Kp;  // whole passes of the wide path where it fits, else pairs
  const int64_t tile = fit >= kWide ? fit / kWide * kWide : std::max<int64_t>(kM, fit / kM * kM);
#ifdef __AVX2__
  const bool wide = group <= 4 * kStep;  // w4a8_row's int16 sums hold up to 4 steps
#else
  const bool wide = false;
#endif
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    float acc[kWide][kRows];
    for (int64_t m0 = 0; m0 < M; m0 += tile) {
      const int64_t m1 = std::min(M, m0 + tile);
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n = b * kRows;
        const int R = int(std::min<int64_t>(kRows, N - n));
        const float* srows[kRows];
        for (int r = 0; r < kRows; ++r) srows[r] = sp + (n + std::min(r, R - 1)) * G;  // rows past N: zero weights
        const uint8_t* wb = wp + b * block_bytes;
        for (int64_t m = m0; m < m1;) {
          const int64_t pf = m == m0 ? kPrefetchAhead : 0;
          const int8_t* xm = xq.data() + m * Kp;
          const int32_t* cm = corr.data() + m * G * 8;
          int MB;
          if (wide && m1 - m >= kWide) {
#ifdef __AVX2__
            for (int r = 0; r < kRows; ++r) w4a8_row<kWide>(xm, cm, Kp, wb, r, r == 0 ? pf : 0, srows, G, group, acc);
#endif
            MB = kWide;
          } else if (m1 - m >= 2) {
            w4a8_block<2, 2>(xm, cm, Kp, wb, 0, pf, srows, G, group, acc);
            w4a8_block<2, 2>(xm, cm, Kp, wb, 2, 0, srows, G, group, acc);
            MB = 2;
          } else {
            w4a8_block<1, 4>(xm, cm, Kp, wb, 0, pf, srows, G, group, acc);
            MB = 1;
          }
          for (int i = 0; i < MB; ++i)
            for (int r = 0; r < R; ++r) {
              const float v = acc[i][r] * xs[m + i];
              yp[(m + i) * N + n + r] = bp ? v + bp[n + r] : v;
            }
          m += MB;
        }
      }
    }
  });
}

}  // namespace

namespace oi {
void w4a8_linear(at::Tensor y, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                 int64_t group, const c10::optional<at::Tensor>& bias) {
  ::w4a8_linear(std::move(y), x, qweight, scales, group, bias);
}
}  // namespace oi

TORCH_LIBRARY_FRAGMENT(openinfer_cpu, m) {
  m.def("w4a8_linear(Tensor(a!) y, Tensor x, Tensor qweight, Tensor scales, int group, Tensor? bias) -> ()");
  m.impl("w4a8_linear", c10::DispatchKey::CPU, &w4a8_linear);
}
