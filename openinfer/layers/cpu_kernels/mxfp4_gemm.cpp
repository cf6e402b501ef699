// MXFP4 weights (DeepSeek-V4's routed experts, layers/mxfp4.py): y[M, N] = x[M, Kp] W^T with W kept packed as
// loaded and decoded in registers (or one 4-row block at a time into an L1 scratch), never dequantised whole.
//
// Layout (``mxfp4.to_kernel_layout``, converted once at load): qweight uint8 [N, Kp / 2], Kp = K rounded up to 32
// (the padding nibbles are 0, i.e. +0.0). Each run of 32 columns (one scale block) is 16 bytes, byte i holding
// column i in its low nibble and column i + 16 in its high nibble (the checkpoint pairs neighbours instead): one
// 16-byte load splits into the block's two halves with an AND and a shift, each already in x's column order.
// scales uint8 [N, Kp / 32]: the raw UE8M0 bytes, 2^(e - 127), 255 = NaN (as torch's float8_e8m0fnu reads them).
//
// A nibble is sign | 3-bit magnitude index into E2M1 {0, .5, 1, 1.5, 2, 3, 4, 6}. The decode is one byte shuffle
// against a 16-entry table of 2 x E2M1 (integers -12..12, exact in int8), widened to fp32 and multiplied by the
// block's scale with the 1/2 folded in (a power of two: exact, so the weights are the reference's dequantised
// values bit for bit); products accumulate in fp32, one FMA chain per output, so the result differs from
// dequantise-then-matmul only in summation order. NaN scales propagate as in the reference.
//
// Work split as in lowbit_gemm.cpp: blocks of 4 output rows, each read from memory once whatever M (the rows stay
// in L1 while the activation rows pass over them), 2 activation rows per decoded weight vector. With more than 2
// activation rows the block's rows are decoded once into an fp32 scratch (16 KB at K = 1024, in L1) that a plain
// fp32 4 x 2 tile then reads for every pair: decoding in registers for each pair cost 2-3x at M = 12-32. Both
// paths do the same arithmetic in the same order (one chain per output over k in steps of 8), so a row's result
// does not depend on how many rows share its call (batch invariance).
// AVX2 intrinsics (SSSE3 pshufb + AVX2 widen/FMA; the same code runs on AVX-512 hosts); a plain loop elsewhere.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int kRows = 4;    // output rows per block
constexpr int kM = 2;       // activation rows sharing one decoded weight vector
constexpr int kBlock = 32;  // columns per UE8M0 scale

// 2 x E2M1 per nibble (nibble 8 is -0, read as 0: a product's sign of zero cannot change a sum of 32 terms
// unless all are zeros).
constexpr int8_t kTwiceE2M1[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// UE8M0 byte -> 2^(e - 127) / 2 (the table above is doubled). Subnormal at e <= 1, still exact.
struct ScaleTable {
  float v[256];
  ScaleTable() {
    for (int e = 0; e < 255; ++e) v[e] = std::ldexp(0.5f, e - 127);
    v[255] = std::numeric_limits<float>::quiet_NaN();
  }
};
const ScaleTable kScale;

#ifdef __AVX2__
// 32 codes of one block -> 4 x 8 floats in column order, times the block's scale (2 x E2M1 x 2^(e - 127) / 2:
// exact, a power of two; overflow to inf and NaN as the reference's value * scale).
inline void decode_block(const uint8_t* p, uint8_t e, __m128i lut, __m128i low, __m256 w[4]) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i qlo = _mm_shuffle_epi8(lut, _mm_and_si128(raw, low));                      // columns 0..15
  const __m128i qhi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(raw, 4), low));  // columns 16..31
  const __m256 sv = _mm256_set1_ps(kScale.v[e]);
  w[0] = _mm256_mul_ps(sv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(qlo)));
  w[1] = _mm256_mul_ps(sv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(qlo, qlo))));
  w[2] = _mm256_mul_ps(sv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(qhi)));
  w[3] = _mm256_mul_ps(sv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(qhi, qhi))));
}

// R rows -> fp32 scratch [R, Kp], scaled.
inline void decode_rows(int R, const uint8_t* w, const uint8_t* s, int64_t Kp, float* out) {
  const __m128i lut = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kTwiceE2M1));
  const __m128i low = _mm_set1_epi8(0x0F);
  const int64_t nb = Kp / kBlock;
  for (int r = 0; r < R; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      __m256 v[4];
      decode_block(w + r * (Kp / 2) + b * 16, s[r * nb + b], lut, low, v);
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + r * Kp + b * kBlock + 8 * j, v[j]);
    }
}

// An fp32 tile over the scratch: acc[m][r] = x[m] . wf[r], one FMA chain per (m, r) over k in steps of 8, the
// order mxfp4_block uses too.
template <int R, int MB>
inline void scratch_block(const float* x, int64_t Kp, const float* wf, float acc[kM][kRows]) {
  __m256 a[MB][R];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) a[m][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < Kp; k += 8) {
    __m256 xv[MB];
    for (int m = 0; m < MB; ++m) xv[m] = _mm256_loadu_ps(x + m * Kp + k);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = _mm256_loadu_ps(wf + r * Kp + k);
      for (int m = 0; m < MB; ++m) a[m][r] = _mm256_fmadd_ps(wv, xv[m], a[m][r]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = hsum8(a[m][r]);
}
#endif

// acc[m][r] = x[m] . (q[r] * its block scales), for R weight rows, MB activation rows, decoded in registers.
// ``pf``: the next row block, prefetched one line per row at a time (or nullptr); see lowbit_gemm.cpp.
template <int R, int MB>
inline void mxfp4_block(const float* x, int64_t Kp, const uint8_t* w, const uint8_t* pf, const uint8_t* s,
                        float acc[kM][kRows]) {
  const int64_t row_bytes = Kp / 2, nb = Kp / kBlock;
#ifdef __AVX2__
  const __m128i lut = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kTwiceE2M1));
  const __m128i low = _mm_set1_epi8(0x0F);
  __m256 a[MB][R];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) a[m][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * kBlock;
    if (pf && (b & 3) == 0)  // 4 blocks of 16 bytes = one line per row
      for (int r = 0; r < R; ++r) __builtin_prefetch(pf + r * row_bytes + b * 16);
    for (int r = 0; r < R; ++r) {
      __m256 wv[4];
      decode_block(w + r * row_bytes + b * 16, s[r * nb + b], lut, low, wv);
      for (int m = 0; m < MB; ++m)
        for (int j = 0; j < 4; ++j) a[m][r] = _mm256_fmadd_ps(wv[j], _mm256_loadu_ps(xb + m * Kp + 8 * j), a[m][r]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = hsum8(a[m][r]);
#else
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) {
      float total = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* q = w + r * row_bytes + b * 16;
        const float* xm = x + m * Kp + b * kBlock;
        const float sc = kScale.v[s[r * nb + b]];
        for (int i = 0; i < 16; ++i) total += xm[i] * (static_cast<float>(kTwiceE2M1[q[i] & 0xF]) * sc);
        for (int i = 0; i < 16; ++i) total += xm[i + 16] * (static_cast<float>(kTwiceE2M1[q[i] >> 4]) * sc);
      }
      acc[m][r] = total;
    }
#endif
}

template <int R>
inline void dispatch_m(int MB, const float* x, int64_t Kp, const uint8_t* w, const uint8_t* pf, const float* wf,
                       const uint8_t* s, float acc[kM][kRows]) {
#ifdef __AVX2__
  if (wf != nullptr) {
    if (MB == 2)
      scratch_block<R, 2>(x, Kp, wf, acc);
    else
      scratch_block<R, 1>(x, Kp, wf, acc);
    return;
  }
#endif
  if (MB == 2)
    mxfp4_block<R, 2>(x, Kp, w, pf, s, acc);
  else
    mxfp4_block<R, 1>(x, Kp, w, pf, s, acc);
}

void mxfp4_linear(at::Tensor y, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.scalar_type() == at::kByte,
              "qweight must be contiguous uint8 [N, Kp / 2]");
  const int64_t N = qweight.size(0), Kp = qweight.size(1) * 2;
  TORCH_CHECK(Kp % kBlock == 0, "the packed row must cover a multiple of 32 columns");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) == Kp,
              "x must be contiguous fp32 [M, Kp] (padded with zeros to qweight's columns)");
  const int64_t M = x.size(0), nb = Kp / kBlock;
  TORCH_CHECK(scales.scalar_type() == at::kByte && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == N && scales.size(1) == nb, "scales must be contiguous uint8 [N, Kp / 32]");
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && y.scalar_type() == at::kFloat && y.size(0) == M &&
                  y.size(1) == N, "y must be contiguous fp32 [M, N]");
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  const uint8_t* sp = scales.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t nblocks = (N + kRows - 1) / kRows;
  // ~64k weight bytes of work per task at least, so small matrices do not wake every thread
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(kRows * Kp / 2, 1));
#ifdef __AVX2__
  const bool scratch = M > kM;
#else
  const bool scratch = false;
#endif
  at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) {
    std::vector<float> buf(scratch ? kRows * Kp : 0);
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n = blk * kRows;
      const int R = static_cast<int>(std::min<int64_t>(kRows, N - n));
      const uint8_t* w = wp + n * (Kp / 2);
      const uint8_t* s = sp + n * nb;
      const float* wf = nullptr;
#ifdef __AVX2__
      if (scratch) {
        decode_rows(R, w, s, Kp, buf.data());
        wf = buf.data();
      }
#endif
      for (int64_t m = 0; m < M; m += kM) {
        const int MB = static_cast<int>(std::min<int64_t>(kM, M - m));
        float acc[kM][kRows];
        const float* xm = xp + m * Kp;
        const uint8_t* pf = m == 0 && n + kRows < N ? w + kRows * (Kp / 2) : nullptr;
        switch (R) {
          case 4: dispatch_m<4>(MB, xm, Kp, w, pf, wf, s, acc); break;
          case 3: dispatch_m<3>(MB, xm, Kp, w, pf, wf, s, acc); break;
          case 2: dispatch_m<2>(MB, xm, Kp, w, pf, wf, s, acc); break;
          default: dispatch_m<1>(MB, xm, Kp, w, pf, wf, s, acc); break;
        }
        for (int i = 0; i < MB; ++i)
          for (int r = 0; r < R; ++r) yp[(m + i) * N + n + r] = acc[i][r];
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(openinfer_cpu, m) {
  m.def("mxfp4_linear(Tensor(a!) y, Tensor x, Tensor qweight, Tensor scales) -> ()");
  m.impl("mxfp4_linear", c10::DispatchKey::CPU, &mxfp4_linear);
}
