// GGUF block-quantized weights (layers/gguf_quant.py) executed as the file stores them: y[M, N] = x[M, K] W^T with
// W's rows in llama.cpp's block formats, decoded in registers, never dequantised into memory for small M.
//
// Formats (ggml-common.h; `d`, `m`, `dmin` fp16), per block of 32 (or super-block of 256) weights:
//   Q8_0 34 B   d, q int8[32]                                  w = d q
//   Q4_0 18 B   d, qs[16]: w_i = low nibble of qs[i], w_{16+i} high   w = d (q - 8)
//   Q4_1 20 B   d, m, qs[16] (as Q4_0)                          w = d q + m
//   Q5_0 22 B   d, qh u32 (bit i: 5th bit of w_i), qs[16]       w = d (q - 16)
//   Q5_1 24 B   d, m, qh, qs                                     w = d q + m
//   Q4_K 144 B  d, dmin, 12 B of 6-bit (scale, min) x 8, qs[128]: sub-block 2c = low nibbles of qs[32c..32c+32),
//               2c + 1 their high nibbles                        w = (d sc_j) q - dmin mn_j
//   Q5_K 176 B  as Q4_K with qh[32] before qs: bit j of qh[i] is the 5th bit of sub-block j's element i
//   Q6_K 210 B  ql[128], qh[64], sc int8[16] (one per 16 weights), d; w = (d sc_j) (q - 32), q 6 bits (below)
//
// The dot products run in fp32 on fp32 activations: each group's integers are widened to fp32, multiplied with x
// and summed per group, the sum scaled by the group's scale once (Σ_k x_k d q_k = d Σ_k x_k q_k). The formats
// with a min (Q4_1, Q5_1, Q4_K, Q5_K) add it through the algebra Σ_k x_k (d q_k + m) = d Σ x_k q_k + m Σ_k x_k,
// with Σ x over each 32-column group computed once per call (``xsum``), not once per weight row. So the result is
// dequantise-then-matmul up to fp32 summation order (tests/test_gguf_quant.py bounds it).
//
// Work split: output rows over threads (at::parallel_for); each weight row is read once per call, up to kMB = 4
// activation rows at a time passing over it while it sits in L1 (a row is K / 32 * 18..34 bytes: 324 B to 4.4 KB
// for K = 576..4096), so the rows are one front-to-back stream with a software prefetch ahead. Register
// accumulators per activation row, S = 4 / MB independent chains each so one row is not bound by the FMA latency.
// Each pass of 4 activation rows decodes the weights again: M = 4 costs ~1.7x M = 1, M = 8 twice M = 4 (1 thread,
// 1536 x 576 Q4_0 0.073 / 0.121 / 0.238 ms); with K = 4096 the 4 rows of x (64 KB) no longer fit L1 and come from
// L2 for every weight row (M = 8 ~3x M = 4). Splitting K into L1-sized column chunks measured 2x slower (the weight
// rows then became short strided segments), so it is not done. Larger M (prefill) decodes row chunks to fp32
// (``gguf_dequantize``: gguf.quants.dequantize's values to the bit) for torch's GEMM: the Python side decides
// (GGUF_DEQUANT_ROWS).
// AVX2 intrinsics (the same code compiles and runs on AVX-512 builds); a portable scalar loop elsewhere.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "gguf_blocks.h"
#include "vec.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

// ---- the row kernels: out[m] = x[m] . w for MB activation rows (stride K) ----------------------------------------
// xs: per activation row, Σ x over each 32-column group (stride K / 32), for the formats with a min.

#ifdef __AVX2__
// Software prefetch kPrefetch bytes ahead in the weight stream (rows are contiguous, so past a row's end it reaches
// into the next one): ``bytes`` of one block, one line per 64. Without it one thread streamed 3.7 GB/s at M = 1
// against 7.8 GB/s on the same matrix cache-resident (Q4_0 4096 x 4096): the decode work per line leaves the
// hardware prefetcher behind, as in lowbit_gemm.cpp.
constexpr int64_t kPrefetch = 1024;
template <int Bytes>
inline void prefetch_block(const uint8_t* blk) {
  for (int i = 0; i < Bytes; i += 64) __builtin_prefetch(blk + kPrefetch + i);
}

inline __m256i load8u(const uint8_t* p) {  // 8 bytes -> 8 x int32
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 widen_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 lo4(__m256i b) { return _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(0xF))); }
inline __m256i lo4i(__m256i b) { return _mm256_and_si256(b, _mm256_set1_epi32(0xF)); }
inline __m256i hi4i(__m256i b) { return _mm256_srli_epi32(b, 4); }

// Accumulators: S chains per activation row (4 in all at MB = 1 and 2; MB at 3 and 4), summed at the end.
template <int MB>
struct Acc {
  static constexpr int S = MB == 1 ? 4 : MB == 2 ? 2 : 1;
  __m256 a[MB][S];
  float off[MB];
  Acc() {
    for (int m = 0; m < MB; ++m) {
      off[m] = 0.f;
      for (int s = 0; s < S; ++s) a[m][s] = _mm256_setzero_ps();
    }
  }
  // a[m][s] += c * scale
  // a switch, not a[m][s % S]: an index unknown at compile time puts the accumulators on the stack
  inline void add(int m, int s, __m256 c, __m256 scale) {
    if constexpr (S == 1) {
      a[m][0] = _mm256_fmadd_ps(c, scale, a[m][0]);
    } else {
      switch (s & (S - 1)) {
        case 0: a[m][0] = _mm256_fmadd_ps(c, scale, a[m][0]); break;
        case 1: a[m][1] = _mm256_fmadd_ps(c, scale, a[m][1]); break;
        case 2: a[m][2 % S] = _mm256_fmadd_ps(c, scale, a[m][2 % S]); break;
        default: a[m][3 % S] = _mm256_fmadd_ps(c, scale, a[m][3 % S]); break;
      }
    }
  }
  void finish(float* out) const {
    for (int m = 0; m < MB; ++m) {
      __m256 t = a[m][0];
      for (int s = 1; s < S; ++s) t = _mm256_add_ps(t, a[m][s]);
      out[m] = hsum8(t) + off[m];
    }
  }
};

// One 32-weight group of a nibble format: lo / hi hold the integers of columns [0, 8) + [16, 24) (from bytes 0..7)
// and [8, 16) + [24, 32) (bytes 8..15) of the group, in x's order after the split below.
template <int MB>
inline void group32(Acc<MB>& acc, int s, const __m256 w[4], const float* x, int64_t K, __m256 scale) {
  // w[0]: columns 0..7, w[1]: 8..15, w[2]: 16..23, w[3]: 24..31
  for (int m = 0; m < MB; ++m) {
    const float* xm = x + m * K;
    __m256 c0 = _mm256_mul_ps(w[0], _mm256_loadu_ps(xm));
    __m256 c1 = _mm256_mul_ps(w[2], _mm256_loadu_ps(xm + 16));
    c0 = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xm + 8), c0);
    c1 = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xm + 24), c1);
    acc.add(m, s, _mm256_add_ps(c0, c1), scale);
  }
}

// Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0: blocks of 32 with one scale (and a min for _1).
template <int64_t T>
constexpr int small_bytes() {
  return T == Q8_0 ? 34 : T == Q4_0 ? 18 : T == Q4_1 ? 20 : T == Q5_0 ? 22 : 24;
}

// One block of Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 -> its 32 integers as floats (the _0 types' offset subtracted),
// wv[0]: columns 0..7, wv[1]: 8..15, wv[2]: 16..23, wv[3]: 24..31.
template <int64_t T>
inline void decode_small(const uint8_t* blk, __m256 wv[4]) {
  constexpr bool kMin = T == Q4_1 || T == Q5_1, kFive = T == Q5_0 || T == Q5_1;
  if constexpr (T == Q8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
    for (int j = 0; j < 4; ++j) wv[j] = widen_i8(q + 8 * j);
  } else {
    const uint8_t* qs = blk + 2 + (kMin ? 2 : 0) + (kFive ? 4 : 0);
    const __m256i b0 = load8u(qs), b1 = load8u(qs + 8);
    __m256i q0 = lo4i(b0), q1 = lo4i(b1), q2 = hi4i(b0), q3 = hi4i(b1);  // columns 0-7, 8-15, 16-23, 24-31
    if constexpr (kFive) {
      const __m256i qh = _mm256_set1_epi32(static_cast<int32_t>(u32(blk + 2 + (kMin ? 2 : 0))));
      const __m256i sh = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), one = _mm256_set1_epi32(1);
      // bit c of qh -> 16 in lane (c mod 8) of the vector holding column c
      auto bit = [&](int c0) {
        return _mm256_slli_epi32(
            _mm256_and_si256(_mm256_srlv_epi32(qh, _mm256_add_epi32(sh, _mm256_set1_epi32(c0))), one), 4);
      };
      q0 = _mm256_or_si256(q0, bit(0));
      q1 = _mm256_or_si256(q1, bit(8));
      q2 = _mm256_or_si256(q2, bit(16));
      q3 = _mm256_or_si256(q3, bit(24));
    }
    const __m256i bias = _mm256_set1_epi32(kMin ? 0 : kFive ? 16 : 8);
    wv[0] = _mm256_cvtepi32_ps(_mm256_sub_epi32(q0, bias));
    wv[1] = _mm256_cvtepi32_ps(_mm256_sub_epi32(q1, bias));
    wv[2] = _mm256_cvtepi32_ps(_mm256_sub_epi32(q2, bias));
    wv[3] = _mm256_cvtepi32_ps(_mm256_sub_epi32(q3, bias));
  }
}

// Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0: blocks of 32 with one scale (and a min for _1).
template <int MB, int64_t T>
void row_small(const uint8_t* w, int64_t nb, const float* x, int64_t K, const float* xs, float* out) {
  constexpr bool kMin = T == Q4_1 || T == Q5_1;
  constexpr int kBytes = small_bytes<T>();
  Acc<MB> acc;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * kBytes;
    if (b % 2 == 0) prefetch_block<64>(blk);  // blocks of 18..34 bytes: one line per 2 blocks or so
    __m256 wv[4];
    decode_small<T>(blk, wv);
    group32<MB>(acc, static_cast<int>(b), wv, x + b * 32, K, _mm256_set1_ps(fp16(blk)));
    if constexpr (kMin) {
      const float mval = fp16(blk + 2);
      for (int m = 0; m < MB; ++m) acc.off[m] += mval * xs[m * (K / 32) + b];
    }
  }
  acc.finish(out);
}

// One row of those types as fp32: d q (+ m) per element, one fused multiply-add whose product d q is exact, so
// gguf's (d q) + m to the bit. The per-block portable decode took 7x as long on Q4_0 (0.96 against 0.13 ms for
// 512 x 4096, 1 thread; int4_dequantize 0.27; the GEMM the rows then feed at M = 32 2.1), Q6_K 5x (1.23 / 0.25).
template <int64_t T>
void dequant_small_row(const uint8_t* w, int64_t nb, float* o) {
  constexpr bool kMin = T == Q4_1 || T == Q5_1;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * small_bytes<T>();
    __m256 wv[4];
    decode_small<T>(blk, wv);
    const __m256 d = _mm256_set1_ps(fp16(blk));
    const __m256 m = _mm256_set1_ps(kMin ? fp16(blk + 2) : 0.f);
    for (int j = 0; j < 4; ++j)
      _mm256_storeu_ps(o + b * 32 + 8 * j, kMin ? _mm256_fmadd_ps(wv[j], d, m) : _mm256_mul_ps(wv[j], d));
  }
}

// Q4_K / Q5_K: super-blocks of 256, 8 sub-blocks of 32 with a 6-bit scale and min each.
template <int MB, int64_t T>
void row_k45(const uint8_t* w, int64_t nb, const float* x, int64_t K, const float* xs, float* out) {
  constexpr int kBytes = T == Q4_K ? 144 : 176;
  Acc<MB> acc;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * kBytes;
    prefetch_block<kBytes>(blk);
    const float d = fp16(blk), dmin = fp16(blk + 2);
    int sc[8], mn[8];
    scale_min_k4(blk + 4, sc, mn);
    const uint8_t* qh = blk + 16;
    const uint8_t* qs = blk + 16 + (T == Q5_K ? 32 : 0);
    const float* xb = x + b * 256;
    for (int c = 0; c < 4; ++c) {  // sub-blocks 2c (low nibbles) and 2c + 1 (high) from the same 32 bytes
      __m256 lo[4], hi[4];
      for (int i = 0; i < 4; ++i) {
        const __m256i v = load8u(qs + 32 * c + 8 * i);
        __m256i l = lo4i(v), h = hi4i(v);
        if constexpr (T == Q5_K) {
          const __m256i hb = load8u(qh + 8 * i);
          const __m256i one = _mm256_set1_epi32(1);
          l = _mm256_or_si256(l, _mm256_slli_epi32(
                                     _mm256_and_si256(_mm256_srl_epi32(hb, _mm_cvtsi32_si128(2 * c)), one), 4));
          h = _mm256_or_si256(h, _mm256_slli_epi32(
                                     _mm256_and_si256(_mm256_srl_epi32(hb, _mm_cvtsi32_si128(2 * c + 1)), one), 4));
        }
        lo[i] = _mm256_cvtepi32_ps(l);
        hi[i] = _mm256_cvtepi32_ps(h);
      }
      group32<MB>(acc, 2 * c, lo, xb + 64 * c, K, _mm256_set1_ps(d * static_cast<float>(sc[2 * c])));
      group32<MB>(acc, 2 * c + 1, hi, xb + 64 * c + 32, K, _mm256_set1_ps(d * static_cast<float>(sc[2 * c + 1])));
    }
    for (int m = 0; m < MB; ++m) {
      const float* xm = xs + m * (K / 32) + b * 8;
      float o = 0.f;
      for (int j = 0; j < 8; ++j) o += dmin * static_cast<float>(mn[j]) * xm[j];
      acc.off[m] -= o;
    }
  }
  acc.finish(out);
}

// Q6_K: super-blocks of 256, 16 sub-blocks of 16 with an int8 scale; q = (4 low bits | 2 high bits << 4) - 32.
// decode_q6k: the integers of columns 128 h + 32 j + 16 half + [0, 16) for j = 0..3, as q[j][0] (the first 8) and
// q[j][1], with the sub-block scale index 8 h + 2 j + half.
inline void decode_q6k(const uint8_t* blk, int h, int half, __m256 q[4][2]) {
  const __m256i f = _mm256_set1_epi32(0xF), three = _mm256_set1_epi32(3), bias = _mm256_set1_epi32(32);
  for (int i = 0; i < 2; ++i) {
    const int off = 16 * half + 8 * i;
    const __m256i a = load8u(blk + 64 * h + off), c = load8u(blk + 64 * h + 32 + off);
    const __m256i hq = load8u(blk + 128 + 32 * h + off);
    auto hbits = [&](int sh) { return _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hq, sh), three), 4); };
    q[0][i] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_or_si256(_mm256_and_si256(a, f), hbits(0)), bias));
    q[1][i] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_or_si256(_mm256_and_si256(c, f), hbits(2)), bias));
    q[2][i] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_or_si256(_mm256_srli_epi32(a, 4), hbits(4)), bias));
    q[3][i] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_or_si256(_mm256_srli_epi32(c, 4), hbits(6)), bias));
  }
}

template <int MB>
void row_q6k(const uint8_t* w, int64_t nb, const float* x, int64_t K, const float*, float* out) {
  Acc<MB> acc;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 210;
    prefetch_block<210>(blk);
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = fp16(blk + 208);
    for (int h = 0; h < 2; ++h)
      for (int half = 0; half < 2; ++half) {  // columns [16 half, 16 half + 16) of each of the 4 runs of 32
        __m256 q[4][2];
        decode_q6k(blk, h, half, q);
        for (int j = 0; j < 4; ++j) {
          const int64_t col = 128 * h + 32 * j + 16 * half;
          const __m256 s = _mm256_set1_ps(d * static_cast<float>(sc[8 * h + 2 * j + half]));
          for (int m = 0; m < MB; ++m) {
            const float* xm = x + m * K + b * 256 + col;
            __m256 c0 = _mm256_mul_ps(q[j][0], _mm256_loadu_ps(xm));
            c0 = _mm256_fmadd_ps(q[j][1], _mm256_loadu_ps(xm + 8), c0);
            acc.add(m, j, c0, s);
          }
        }
      }
  }
  acc.finish(out);
}

// One Q6_K row as fp32: (d sc) q, the product rounded once as gguf's.
void dequant_q6k_row(const uint8_t* w, int64_t nb, float* o) {
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 210;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = fp16(blk + 208);
    for (int h = 0; h < 2; ++h)
      for (int half = 0; half < 2; ++half) {
        __m256 q[4][2];
        decode_q6k(blk, h, half, q);
        for (int j = 0; j < 4; ++j) {
          const __m256 s = _mm256_set1_ps(d * static_cast<float>(sc[8 * h + 2 * j + half]));
          float* oj = o + b * 256 + 128 * h + 32 * j + 16 * half;
          _mm256_storeu_ps(oj, _mm256_mul_ps(q[j][0], s));
          _mm256_storeu_ps(oj + 8, _mm256_mul_ps(q[j][1], s));
        }
      }
  }
}
#endif

// The portable path (no AVX2): decode a block, dot per group.
template <int MB>
void row_generic(int64_t t, const uint8_t* w, int64_t nb, int bytes, int block, const float* x, int64_t K,
                 float* out) {
  Decoded dec;
  for (int m = 0; m < MB; ++m) out[m] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    decode_block(t, w + b * bytes, dec);
    for (int m = 0; m < MB; ++m) {
      const float* xm = x + m * K + b * block;
      for (int g = 0; g < block / dec.group; ++g) {
        float qx = 0.f, sx = 0.f;
        for (int i = 0; i < dec.group; ++i) {
          qx += static_cast<float>(dec.q[g * dec.group + i]) * xm[g * dec.group + i];
          sx += xm[g * dec.group + i];
        }
        out[m] += qx * dec.s[g] + dec.o[g] * sx;
      }
    }
  }
}

template <int MB>
void row_dot(int64_t t, const uint8_t* w, int64_t nb, const Format& f, const float* x, int64_t K, const float* xs,
             float* out) {
#ifdef __AVX2__
  switch (t) {
    case Q8_0: return row_small<MB, Q8_0>(w, nb, x, K, xs, out);
    case Q4_0: return row_small<MB, Q4_0>(w, nb, x, K, xs, out);
    case Q4_1: return row_small<MB, Q4_1>(w, nb, x, K, xs, out);
    case Q5_0: return row_small<MB, Q5_0>(w, nb, x, K, xs, out);
    case Q5_1: return row_small<MB, Q5_1>(w, nb, x, K, xs, out);
    case Q4_K: return row_k45<MB, Q4_K>(w, nb, x, K, xs, out);
    case Q5_K: return row_k45<MB, Q5_K>(w, nb, x, K, xs, out);
    case Q6_K: return row_q6k<MB>(w, nb, x, K, xs, out);
    default: break;
  }
#endif
  (void)xs;
  row_generic<MB>(t, w, nb, f.bytes, f.block, x, K, out);
}

constexpr int kMB = 4;  // activation rows per pass over a weight row

void gguf_linear(at::Tensor y, const at::Tensor& x, const at::Tensor& data, int64_t qtype,
                 const c10::optional<at::Tensor>& bias) {
  const Format f = format_of(qtype);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x must be contiguous fp32 [M, K]");
  const auto [N, K] = check_data(data, qtype, x.size(1), f);
  const int64_t M = x.size(0);
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && y.scalar_type() == at::kFloat && y.size(0) == M && y.size(1) == N,
              "y must be contiguous fp32 [M, N]");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be contiguous fp32 [N]");
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = data.data_ptr<uint8_t>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t G = K / 32, nb = K / f.block, row_bytes = nb * f.bytes;
  std::vector<float> xs(M * G);  // Σ x per 32-column group, for the min terms
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.f;
      for (int i = 0; i < 32; ++i) s += xp[m * K + g * 32 + i];
      xs[m * G + g] = s;
    }
  // ~64 KB of weight bytes per task at least, so small layers do not wake every thread
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(row_bytes, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* w = wp + n * row_bytes;
      for (int64_t m = 0; m < M; m += kMB) {
        float out[kMB];
        const float* xm = xp + m * K;
        const float* xsm = xs.data() + m * G;
        switch (std::min<int64_t>(kMB, M - m)) {
          case 4: row_dot<4>(qtype, w, nb, f, xm, K, xsm, out); break;
          case 3: row_dot<3>(qtype, w, nb, f, xm, K, xsm, out); break;
          case 2: row_dot<2>(qtype, w, nb, f, xm, K, xsm, out); break;
          default: row_dot<1>(qtype, w, nb, f, xm, K, xsm, out); break;
        }
        for (int i = 0; i < kMB && m + i < M; ++i) yp[(m + i) * N + n] = bp ? out[i] + bp[n] : out[i];
      }
    }
  });
}

// Rows of W as fp32 [N, K]: gguf.quants.dequantize's values to the bit (see Decoded). For prefill (the Python
// side's GGUF_DEQUANT_ROWS) and for embedding lookups on a quantized token table.
void gguf_dequantize(at::Tensor out, const at::Tensor& data, int64_t qtype) {
  const Format f = format_of(qtype);
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == at::kFloat,
              "out must be contiguous fp32 [N, K]");
  const auto [N, K] = check_data(data, qtype, out.size(1), f);
  TORCH_CHECK(out.size(0) == N, "out must have data's rows");
  const uint8_t* wp = data.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t nb = K / f.block, row_bytes = nb * f.bytes;
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t n0, int64_t n1) {
    Decoded dec;
    for (int64_t n = n0; n < n1; ++n) {
#ifdef __AVX2__
      const uint8_t* w = wp + n * row_bytes;
      float* o = op + n * K;
      switch (qtype) {
        case Q8_0: dequant_small_row<Q8_0>(w, nb, o); continue;
        case Q4_0: dequant_small_row<Q4_0>(w, nb, o); continue;
        case Q4_1: dequant_small_row<Q4_1>(w, nb, o); continue;
        case Q5_0: dequant_small_row<Q5_0>(w, nb, o); continue;
        case Q5_1: dequant_small_row<Q5_1>(w, nb, o); continue;
        case Q6_K: dequant_q6k_row(w, nb, o); continue;
        default: break;  // Q4_K / Q5_K: the portable decode's 32-wide loops vectorise (0.38 / 0.44 ms, 512 x 4096)
      }
#endif
      for (int64_t b = 0; b < nb; ++b) {
        decode_block(qtype, wp + n * row_bytes + b * f.bytes, dec);
        float* ob = op + n * K + b * f.block;
        for (int g = 0; g < f.block / dec.group; ++g) {
          const float s = dec.s[g], z = dec.o[g];
          const int8_t* q = dec.q + g * dec.group;
          for (int i = 0; i < dec.group; ++i) ob[g * dec.group + i] = static_cast<float>(q[i]) * s + z;
        }
      }
    }
  });
}

}  // namespace

namespace oi {
// for decode_blocks.cpp's fused Llama layer (kernels.h)
void gguf_gemm(at::Tensor y, const at::Tensor& x, const at::Tensor& data, int64_t qtype) {
  gguf_linear(std::move(y), x, data, qtype, c10::nullopt);
}
}  // namespace oi

TORCH_LIBRARY_FRAGMENT(openinfer_cpu, m) {
  m.def("gguf_linear(Tensor(a!) y, Tensor x, Tensor data, int qtype, Tensor? bias) -> ()");
  m.impl("gguf_linear", c10::DispatchKey::CPU, &gguf_linear);
  m.def("gguf_dequantize(Tensor(a!) out, Tensor data, int qtype) -> ()");
  m.impl("gguf_dequantize", c10::DispatchKey::CPU, &gguf_dequantize);
}
