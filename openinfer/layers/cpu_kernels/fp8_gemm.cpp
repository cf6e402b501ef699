// FP8 e4m3 block-quantised weights (DeepSeek-V3 / V4 linears, layers/fp8.py): y[M, N] = x[M, Kp] W^T with W kept
// as the checkpoint's fp8 codes and decoded in registers (or one 4-row block at a time into an L1 scratch), never
// dequantised whole.
//
// Layout (``fp8.Fp8Weight``, converted once at load): qweight uint8 [N, Kp], the float8_e4m3fn bytes as shipped,
// Kp = K rounded up to 8 (padding codes 0 = +0.0); scales fp32 [N, ceil(Kp / bk)]: the checkpoint's per-[bn, bk]
// block multiplier repeated for each of the block's rows (3 % of the codes' bytes for bk = 128; it lets fused and
// tensor-parallel slices cut rows anywhere). bk is a multiple of 8.
//
// Decode, exact: an e4m3 byte s.eeee.mmm moved into an fp16's bit pattern as s.0eeee.mmm0000000 is the same number
// times 2^-8 (fp16's exponent bias is 15, e4m3's 7; e4m3 subnormals land on fp16 subnormals), which F16C widens to
// fp32 exactly; times 256 * scale it is the reference's ``fp8.float() * scale`` rounded once, bit for bit (256 is a
// power of two). Products accumulate in fp32, one FMA chain per output over k in steps of 8, so the result differs
// from dequantise-then-matmul only in summation order, and a row's result does not depend on how many rows share
// its call. e4m3fn's NaN codes (0x7f / 0xff) decode as +-480 here: Fp8Weight refuses them at load.
//
// Work split as in mxfp4_gemm.cpp: blocks of 4 output rows read from memory once whatever M (interleaved in the
// inner loop: 4 independent FMA chains; one row at a time left each chain latency-bound, 2.1x slower at 1 row),
// 2 activation rows per decoded weight vector; with more than 2 activation rows the block's rows are decoded once
// into an fp32 scratch.
// AVX2 + F16C intrinsics (the same code runs on AVX-512 hosts); a plain loop with a 256-entry table elsewhere.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define FP8_SIMD 1
#endif

namespace {

constexpr int kRows = 4;  // output rows per block
constexpr int kM = 2;     // activation rows sharing one decoded weight vector

// e4m3fn byte -> its value (the plain path's decode; NaN codes as the SIMD path reads them, +-480).
struct E4m3Table {
  float v[256];
  E4m3Table() {
    for (int c = 0; c < 256; ++c) {
      const int e = (c >> 3) & 0xF, m = c & 7;
      const float mag = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(1.f + m / 8.f, e - 7);
      v[c] = (c & 0x80) ? -mag : mag;
    }
  }
};
const E4m3Table kE4m3;

// One block's multiplier with the decode's 2^8 folded in, unless that overflows (a scale >= 2^120): then the
// caller multiplies twice, still exact.
inline bool folded(float s, float* s256) {
  *s256 = s * 256.f;
  return std::isfinite(*s256) || !std::isfinite(s);
}

#ifdef FP8_SIMD
// 8 codes -> 8 floats times the block's scale.
inline __m256 decode8(const uint8_t* p, __m256 s256, bool twice, __m256 s) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                 _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7));
  const __m256 f = _mm256_cvtph_ps(h);
  if (!twice) return _mm256_mul_ps(f, s256);
  return _mm256_mul_ps(_mm256_mul_ps(f, _mm256_set1_ps(256.f)), s);
}

// R rows -> fp32 scratch [R, Kp], scaled.
inline void decode_rows(int R, const uint8_t* w, const float* s, int64_t Kp, int64_t bk, float* out) {
  const int64_t nb = (Kp + bk - 1) / bk;
  for (int r = 0; r < R; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      float s256;
      const float sc = s[r * nb + b];
      const bool twice = !folded(sc, &s256);
      const __m256 sv = _mm256_set1_ps(s256), sp = _mm256_set1_ps(sc);
      for (int64_t k = b * bk; k < std::min(Kp, (b + 1) * bk); k += 8)
        _mm256_storeu_ps(out + r * Kp + k, decode8(w + r * Kp + k, sv, twice, sp));
    }
}

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

// acc[m][r] = x[m] . (code[r] * its block scales), R weight rows, MB activation rows, decoded in registers.
// ``pf``: the next row block, prefetched one line per row at a time (or nullptr); see lowbit_gemm.cpp (here 4.6 ->
// 6.5 GB/s at M = 1 on a 32000 x 1024 weight out of cache, 1 thread).
template <int R, int MB>
inline void fp8_block(const float* x, int64_t Kp, int64_t bk, const uint8_t* w, const uint8_t* pf, const float* s,
                      float acc[kM][kRows]) {
  const int64_t nb = (Kp + bk - 1) / bk;
#ifdef FP8_SIMD
  __m256 a[MB][R];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) a[m][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t k1 = std::min(Kp, (b + 1) * bk);
    __m256 sv[R], sp[R];
    bool twice = false;
    for (int r = 0; r < R; ++r) {
      float s256;
      const float sc = s[r * nb + b];
      twice |= !folded(sc, &s256);
      sv[r] = _mm256_set1_ps(s256);
      sp[r] = _mm256_set1_ps(sc);
    }
    // the R rows interleaved in the inner loop: R independent FMA chains in flight, not one
    for (int64_t k = b * bk; k < k1; k += 8) {
      if (pf && (k & 63) == 0)
        for (int r = 0; r < R; ++r) __builtin_prefetch(pf + r * Kp + k);
      __m256 xv[MB];
      for (int m = 0; m < MB; ++m) xv[m] = _mm256_loadu_ps(x + m * Kp + k);
      for (int r = 0; r < R; ++r) {
        const __m256 wv = decode8(w + r * Kp + k, sv[r], twice, sp[r]);
        for (int m = 0; m < MB; ++m) a[m][r] = _mm256_fmadd_ps(wv, xv[m], a[m][r]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = hsum8(a[m][r]);
#else
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) {
      float total = 0.f;
      for (int64_t k = 0; k < Kp; ++k) total += x[m * Kp + k] * (kE4m3.v[w[r * Kp + k]] * s[r * nb + k / bk]);
      acc[m][r] = total;
    }
#endif
}

template <int R>
inline void dispatch_m(int MB, const float* x, int64_t Kp, int64_t bk, const uint8_t* w, const uint8_t* pf,
                       const float* wf, const float* s, float acc[kM][kRows]) {
#ifdef FP8_SIMD
  if (wf != nullptr) {
    if (MB == 2)
      scratch_block<R, 2>(x, Kp, wf, acc);
    else
      scratch_block<R, 1>(x, Kp, wf, acc);
    return;
  }
#endif
  if (MB == 2)
    fp8_block<R, 2>(x, Kp, bk, w, pf, s, acc);
  else
    fp8_block<R, 1>(x, Kp, bk, w, pf, s, acc);
}

void fp8_linear(at::Tensor y, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                int64_t bk) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.scalar_type() == at::kByte,
              "qweight must be contiguous uint8 [N, Kp]");
  const int64_t N = qweight.size(0), Kp = qweight.size(1);
  TORCH_CHECK(Kp % 8 == 0 && bk > 0 && bk % 8 == 0, "Kp and the block width must be multiples of 8");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) == Kp,
              "x must be contiguous fp32 [M, Kp] (padded with zeros to qweight's columns)");
  const int64_t M = x.size(0), nb = (Kp + bk - 1) / bk;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == N && scales.size(1) == nb, "scales must be contiguous fp32 [N, ceil(Kp / bk)]");
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && y.scalar_type() == at::kFloat && y.size(0) == M &&
                  y.size(1) == N, "y must be contiguous fp32 [M, N]");
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t nblocks = (N + kRows - 1) / kRows;
  // ~64k weight bytes of work per task at least, so small matrices do not wake every thread
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(kRows * Kp, 1));
#ifdef FP8_SIMD
  const bool scratch = M > kM;
#else
  const bool scratch = false;
#endif
  at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) {
    std::vector<float> buf(scratch ? kRows * Kp : 0);
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n = blk * kRows;
      const int R = static_cast<int>(std::min<int64_t>(kRows, N - n));
      const uint8_t* w = wp + n * Kp;
      const float* s = sp + n * nb;
      const float* wf = nullptr;
#ifdef FP8_SIMD
      if (scratch) {
        decode_rows(R, w, s, Kp, bk, buf.data());
        wf = buf.data();
      }
#endif
      for (int64_t m = 0; m < M; m += kM) {
        const int MB = static_cast<int>(std::min<int64_t>(kM, M - m));
        float acc[kM][kRows];
        const float* xm = xp + m * Kp;
        const uint8_t* pf = m == 0 && n + kRows < N ? w + kRows * Kp : nullptr;
        switch (R) {
          case 4: dispatch_m<4>(MB, xm, Kp, bk, w, pf, wf, s, acc); break;
          case 3: dispatch_m<3>(MB, xm, Kp, bk, w, pf, wf, s, acc); break;
          case 2: dispatch_m<2>(MB, xm, Kp, bk, w, pf, wf, s, acc); break;
          default: dispatch_m<1>(MB, xm, Kp, bk, w, pf, wf, s, acc); break;
        }
        for (int i = 0; i < MB; ++i)
          for (int r = 0; r < R; ++r) yp[(m + i) * N + n + r] = acc[i][r];
      }
    }
  });
}

// The whole matrix decoded into fp32 out [N, Kp] (the same values the matmul uses): for many activation rows,
// where a blocked fp32 GEMM over the decoded copy beats the 4 x 2 tile above (prefill).
void fp8_dequantize(at::Tensor out, const at::Tensor& qweight, const at::Tensor& scales, int64_t bk) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.scalar_type() == at::kByte,
              "qweight must be contiguous uint8 [N, Kp]");
  const int64_t N = qweight.size(0), Kp = qweight.size(1);
  TORCH_CHECK(Kp % 8 == 0 && bk > 0 && bk % 8 == 0, "Kp and the block width must be multiples of 8");
  const int64_t nb = (Kp + bk - 1) / bk;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == N && scales.size(1) == nb, "scales must be contiguous fp32 [N, ceil(Kp / bk)]");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == at::kFloat && out.size(0) == N &&
                  out.size(1) == Kp, "out must be contiguous fp32 [N, Kp]");
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, std::max<int64_t>(1, 65536 / std::max<int64_t>(Kp, 1)), [&](int64_t n0, int64_t n1) {
#ifdef FP8_SIMD
    decode_rows(static_cast<int>(n1 - n0), wp + n0 * Kp, sp + n0 * nb, Kp, bk, op + n0 * Kp);
#else
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t k = 0; k < Kp; ++k) op[n * Kp + k] = kE4m3.v[wp[n * Kp + k]] * sp[n * nb + k / bk];
#endif
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(openinfer_cpu, m) {
  m.def("fp8_linear(Tensor(a!) y, Tensor x, Tensor qweight, Tensor scales, int bk) -> ()");
  m.impl("fp8_linear", c10::DispatchKey::CPU, &fp8_linear);
  m.def("fp8_dequantize(Tensor(a!) out, Tensor qweight, Tensor scales, int bk) -> ()");
  m.impl("fp8_dequantize", c10::DispatchKey::CPU, &fp8_dequantize);
}
