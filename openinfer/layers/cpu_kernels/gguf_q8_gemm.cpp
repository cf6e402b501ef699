// GGUF block-quantized weights times int8 activations (layers/gguf_quant.py, KernelSelection.gguf_int8): y[M, N] =
// x[M, K] W^T with W's rows in the file's block formats (gguf_blocks.h) and x quantised here, per row and 32-column
// block, to int8 -- the arithmetic llama.cpp's CPU backend runs (its q8_0 / q8_1 / q8_K activations, integer dot
// products), where gguf_gemm.cpp widens every weight to fp32 and multiplies fp32 activations.
//
// Activations, per row m and 32-column block b (column k in b = k / 32):
//   d_mb = max_k |x_mk| / 127, q_mk = round_half_even(x_mk * (1 / d_mb)) in [-127, 127] (0 for an all-zero block),
//   plus the block's sum of the rounded activations d_mb Σ_k q_mk (one fp32 product) for the formats with a min, and
//   per 4 columns the sum of the q (the formats with an offset); gguf_q8_act.h. layers/gguf_quant.py's
//   ``quantize_activations_q8`` does the same fp32 operations, so kernel and reference hold the same integers.
// Weights: each block's integers q_w as the file stores them (unsigned, offset not removed: Q4_0 0..15, Q5_0 0..31,
//   Q6_K 0..63; Q8_0 signed), a scale per 32 (Q6_K: per 16) and a min or an offset.
// Per activation block b of 32 columns, in int32, exactly:
//   I_b = Σ_g sc_g Σ_{k in g} (q_wk - z) q_mk          (g: Q6_K's two 16-column halves, sc_g their int8 scales;
//                                                        one g with sc = 1 elsewhere; z the offset 8 / 16 / 32 / 0)
//   y_mn = Σ_b s_b d_mb I_b + Σ_b mn_b d_mb Σ_{k in b} q_mk  (s_b the block's fp32 scale d or d * sc_j; mn_b its min
//                                                        m or -dmin * mn_j): the dequantised W times the rounded x
// The offset goes in without widening anything: Σ (q_w - z) q = Σ q_w q - z Σ q, and the per-4-column sums of q
// (negated, times z = a shift) are the dot product's starting accumulator.
//
// The integer products: q_w is the unsigned operand, q the signed one -- _mm256_dpbusd_epi32 (AVX512-VNNI with VL,
// or AVX-VNNI) sums 4 u8 x s8 products into each int32 lane; plain AVX2 does the same with _mm256_maddubs_epi16
// (pairs into int16: at most 2 * 63 * 127 = 16002 for the unsigned formats, no saturation) and _mm256_madd_epi16
// by ones. Q8_0's weights are signed: |w| times sign(w) * q (the w8a8 kernel's sign trick; |-128| = 128 read
// unsigned, q never -128), 2 * 128 * 127 = 32512 per pair at most. One 256-bit vector is one 32-column block, its
// 8 lanes are 4 columns each (so Q6_K's lanes 0-3 and 4-7 are its two 16-column halves). Each lane then goes to fp32
// and one FMA by s_b d_mb per block. A portable loop elsewhere, same integers.
//
// Work split as gguf_gemm.cpp: output rows over threads, each weight row read once per call with up to kMB = 4
// activation rows taking each decoded block while it is in registers.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "gguf_blocks.h"
#include "gguf_q8_act.h"
#include "kernels.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

// The build's integer dot product (reported by ``gguf_int_dot``): 3 AVX512-VNNI (256-bit), 2 AVX-VNNI, 1 AVX2
// maddubs, 0 the portable loop.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr int kIntDot = 3;
#elif defined(__AVXVNNI__)
constexpr int kIntDot = 2;
#elif defined(__AVX2__)
constexpr int kIntDot = 1;
#else
constexpr int kIntDot = 0;
#endif

template <int64_t T>
constexpr int small_bytes() {
  return T == Q8_0 ? 34 : T == Q4_0 ? 18 : T == Q4_1 ? 20 : T == Q5_0 ? 22 : 24;
}

#ifdef __AVX2__

// 16 bytes of nibbles -> 32 bytes: the low nibbles (elements 0..15), then the high ones (16..31)
inline __m256i nibbles16(const uint8_t* qs) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), f = _mm_set1_epi8(0xF);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), f), _mm_and_si128(v, f));
}

// bit i of qh -> 0x10 in byte i (the 5th bit of Q5_0 / Q5_1 element i)
inline __m256i fifth_bits(uint32_t qh) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm256_maskz_mov_epi8(qh, _mm256_set1_epi8(0x10));
#else  // llama.cpp's bytes_from_bits_32: byte i gets byte i / 8 of qh, then every bit but i % 8 set, then == 0xFF
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(qh)), shuf);
  b = _mm256_or_si256(b, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_and_si256(_mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
#endif
}

constexpr int64_t kPrefetch = 1024;  // bytes ahead in the weight stream (gguf_gemm.cpp says why)

// Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1: blocks of 32 with one scale (and a min for _1, an offset for _0).
template <int MB, int64_t T>
void row_small(const uint8_t* w, int64_t nb, const XRows& x, float* out) {
  constexpr bool kMin = T == Q4_1 || T == Q5_1, kFive = T == Q5_0 || T == Q5_1;
  constexpr int kBytes = small_bytes<T>();
  constexpr int kShift = T == Q4_0 ? 3 : T == Q5_0 ? 4 : 0;  // offset 8 / 16 as a shift
  __m256 acc[MB];
  float off[MB];
  for (int m = 0; m < MB; ++m) {
    acc[m] = _mm256_setzero_ps();
    off[m] = 0.f;
  }
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * kBytes;
    if (b % 2 == 0) __builtin_prefetch(blk + kPrefetch);
    const __m256 dw = _mm256_set1_ps(fp16(blk));
    __m256i q;
    if constexpr (T == Q8_0) {
      q = load32(blk + 2);
    } else {
      q = nibbles16(blk + 2 + (kMin ? 2 : 0) + (kFive ? 4 : 0));
      if constexpr (kFive) q = _mm256_or_si256(q, fifth_bits(u32(blk + 2 + (kMin ? 2 : 0))));
    }
    const __m256i qa = T == Q8_0 ? _mm256_abs_epi8(q) : q;
    for (int m = 0; m < MB; ++m) {
      __m256i xv = load32(x.q + m * x.K + b * 32);
      if constexpr (T == Q8_0) xv = _mm256_sign_epi8(xv, q);
      __m256i init = _mm256_setzero_si256();
      if constexpr (kShift != 0) init = _mm256_slli_epi32(load32(x.nl + (m * x.G + b) * 8), kShift);
      const __m256i p = dot4(init, qa, xv);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(dw, _mm256_broadcast_ss(x.d + m * x.G + b)),
                               acc[m]);
      if constexpr (kMin) off[m] += fp16(blk + 2) * x.s[m * x.G + b];
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = hsum8(acc[m]) + off[m];
}

// Lane j of the result = the sum of p[j]'s 8 lanes (j < 8): one int32 per sub-block, so the K-quant kernels convert
// and scale once per super-block rather than once per sub-block (8 dependent FMAs per super-block held M = 1 at
// ~10 GB/s; the weights stream at ~20 with this).
inline __m256i reduce8(const __m256i p[8]) {
  // hadd pairs within 128-bit halves: e = [p0..p3 summed over lanes 0-3 | the same over lanes 4-7]
  const __m256i e = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
  const __m256i f = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(e, f, 0x20), _mm256_permute2x128_si256(e, f, 0x31));
}

// Q4_K / Q5_K: super-blocks of 256, 8 sub-blocks of 32 (each one activation block) with a 6-bit scale and min.
// Per super-block and activation row: the 8 sub-blocks' integer dots, summed per sub-block (reduce8), then one
// FMA by the vector of d sc_j d_x(j).
template <int MB, int64_t T>
void row_k45(const uint8_t* w, int64_t nb, const XRows& x, float* out) {
  constexpr int kBytes = T == Q4_K ? 144 : 176;
  const __m256i f = _mm256_set1_epi8(0xF), one = _mm256_set1_epi8(1);
  __m256 acc[MB], offv[MB];
  for (int m = 0; m < MB; ++m) acc[m] = offv[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * kBytes;
    for (int i = 0; i < kBytes; i += 64) __builtin_prefetch(blk + kPrefetch + i);
    uint64_t sc8, mn8;
    scale_min_k4_bytes(blk + 4, sc8, mn8);
    const __m256 scv = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(sc8))),
                                     _mm256_set1_ps(fp16(blk)));
    const __m256 mnv = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(mn8))),
                                     _mm256_set1_ps(fp16(blk + 2)));
    const uint8_t* qs = blk + 16 + (T == Q5_K ? 32 : 0);
    __m256i qh = _mm256_setzero_si256();
    if constexpr (T == Q5_K) qh = load32(blk + 16);
    __m256i q[8];
    for (int c = 0; c < 4; ++c) {  // sub-blocks 2c (low nibbles) and 2c + 1 (high) of the same 32 bytes
      const __m256i v = load32(qs + 32 * c);
      q[2 * c] = _mm256_and_si256(v, f);
      q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), f);
      if constexpr (T == Q5_K) {  // bit j of qh[i]: the 5th bit of sub-block j's element i
        q[2 * c] = _mm256_or_si256(q[2 * c], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one), 4));
        q[2 * c + 1] = _mm256_or_si256(
            q[2 * c + 1], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one), 4));
      }
    }
    for (int m = 0; m < MB; ++m) {
      const int8_t* xq = x.q + m * x.K + 256 * b;
      __m256i p[8];
      for (int j = 0; j < 8; ++j) p[j] = dot4(_mm256_setzero_si256(), q[j], load32(xq + 32 * j));
      const int64_t g = m * x.G + 8 * b;
      offv[m] = _mm256_fmadd_ps(mnv, _mm256_loadu_ps(x.s + g), offv[m]);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce8(p)), _mm256_mul_ps(scv, _mm256_loadu_ps(x.d + g)), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = hsum8(acc[m]) - hsum8(offv[m]);
}

// Q6_K: super-blocks of 256; element 128 h + 32 j + i has the low 4 bits in ql[64 h + 32 (j & 1) + i] (high nibble
// for j >= 2), the high 2 in bits 2j of qh[32 h + i], scale sc[8 h + 2 j + i / 16]; q - 32. Per half h and
// activation row: the 4 sub-blocks' dots summed per 16-column group (lanes 0-3 of a dot are the first 16 columns,
// 4-7 the second), then one FMA by the groups' d sc d_x.
template <int MB>
void row_q6k(const uint8_t* w, int64_t nb, const XRows& x, float* out) {
  const __m256i f = _mm256_set1_epi8(0xF), three = _mm256_set1_epi8(3);
  const __m256i evens_odds = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 210;
    for (int i = 0; i < 210; i += 64) __builtin_prefetch(blk + kPrefetch + i);
    const __m256 d = _mm256_set1_ps(fp16(blk + 208));
    for (int h = 0; h < 2; ++h) {
      // scales of groups 8h + 2j (first 16 columns of sub-block j) in lanes 0-3, 8h + 2j + 1 in lanes 4-7
      const __m128i sc8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 192 + 8 * h));
      const __m256 scv = _mm256_mul_ps(
          _mm256_cvtepi32_ps(_mm256_permutevar8x32_epi32(_mm256_cvtepi8_epi32(sc8), evens_odds)), d);
      const __m256i qh = load32(blk + 128 + 32 * h), ql0 = load32(blk + 64 * h), ql1 = load32(blk + 64 * h + 32);
      __m256i q[4];
      for (int j = 0; j < 4; ++j) {
        const __m256i ql = (j & 1) ? ql1 : ql0;
        const __m256i lo = j < 2 ? _mm256_and_si256(ql, f) : _mm256_and_si256(_mm256_srli_epi16(ql, 4), f);
        const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), three), 4);
        q[j] = _mm256_or_si256(lo, hi);
      }
      const int64_t g0 = 8 * b + 4 * h;
      for (int m = 0; m < MB; ++m) {
        __m256i p[4];
        for (int j = 0; j < 4; ++j) {
          const int64_t g = m * x.G + g0 + j;
          const __m256i init = _mm256_slli_epi32(load32(x.nl + g * 8), 5);  // - 32 Σ q per lane
          p[j] = dot4(init, q[j], load32(x.q + m * x.K + 32 * (g0 + j)));
        }
        const __m256i e = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
        const __m256 dx = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(x.d + m * x.G + g0));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(e), _mm256_mul_ps(scv, dx), acc[m]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = hsum8(acc[m]);
}
#endif

// The portable path: decode a block (its integers with the offset taken off, fp32 scale and min per group), then
// int32 dots per group.
template <int MB>
void row_generic(int64_t t, const uint8_t* w, int64_t nb, const Format& f, const XRows& x, float* out) {
  Decoded dec;
  for (int m = 0; m < MB; ++m) out[m] = 0.f;
  const int per = f.block / 32;  // activation blocks per weight block
  for (int64_t b = 0; b < nb; ++b) {
    decode_block(t, w + b * f.bytes, dec);
    const int sub = 32 / dec.group;  // scale groups per activation block (2 for Q6_K)
    for (int m = 0; m < MB; ++m)
      for (int a = 0; a < per; ++a) {
        const int64_t g = b * per + a;
        const int8_t* xq = x.q + m * x.K + 32 * g;
        float blk = 0.f;
        for (int s = 0; s < sub; ++s) {
          int32_t isum = 0;
          for (int i = 0; i < dec.group; ++i) isum += dec.q[32 * a + s * dec.group + i] * xq[s * dec.group + i];
          blk += dec.s[a * sub + s] * static_cast<float>(isum);
        }
        out[m] += blk * x.d[m * x.G + g] + dec.o[a * sub] * x.s[m * x.G + g];
      }
  }
}

template <int MB>
void row_dot(int64_t t, const uint8_t* w, int64_t nb, const Format& f, const XRows& x, float* out) {
#ifdef __AVX2__
  switch (t) {
    case Q8_0: return row_small<MB, Q8_0>(w, nb, x, out);
    case Q4_0: return row_small<MB, Q4_0>(w, nb, x, out);
    case Q4_1: return row_small<MB, Q4_1>(w, nb, x, out);
    case Q5_0: return row_small<MB, Q5_0>(w, nb, x, out);
    case Q5_1: return row_small<MB, Q5_1>(w, nb, x, out);
    case Q4_K: return row_k45<MB, Q4_K>(w, nb, x, out);
    case Q5_K: return row_k45<MB, Q5_K>(w, nb, x, out);
    case Q6_K: return row_q6k<MB>(w, nb, x, out);
    default: break;
  }
#endif
  row_generic<MB>(t, w, nb, f, x, out);
}

constexpr int kMB = 4;  // activation rows per pass over a weight row

// From this many activation rows on, the types the tile kernel takes go to it (oi::gguf_gemm_q8_tiled): the same
// integers, summed in another fp32 order. This kernel's cost grows by a full pass of integer dots, per-sub-block
// reductions and scale FMAs per activation row (~2.6 ms per row on the 200M Llama's 135 MB of Q4_K_M weights, 2
// threads), the tiles' by ~0.9 ms per row after a fixed decode of the weights into int8 tiles (~19 ms there): the
// tiles win from ~11 rows (docs/gguf_kernels.md, "Small-M hand-over"). gguf_q8_tile_from reports it (tests).
constexpr int64_t kTileFrom = 12;

void gguf_linear_q8(at::Tensor y, const at::Tensor& x, const at::Tensor& data, int64_t qtype,
                    const c10::optional<at::Tensor>& bias) {
  // a load-time repacked Q4_K / Q6_K weight (gguf_repack.cpp): its own kernel at every M (the decode block and the
  // Python path reach it through this entry)
  if (oi::gguf_is_r8(qtype)) return oi::gguf_gemm_q8_r8(y, x, data, qtype, bias);
  const Format f = format_of(qtype);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x must be contiguous fp32 [M, K]");
  const auto [N, K] = check_data(data, qtype, x.size(1), f);
  const int64_t M = x.size(0), G = K / 32;
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && y.scalar_type() == at::kFloat && y.size(0) == M && y.size(1) == N,
              "y must be contiguous fp32 [M, N]");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be contiguous fp32 [N]");
  if (M >= kTileFrom && oi::gguf_q8_tiled_has(qtype)) return oi::gguf_gemm_q8_tiled(y, x, data, qtype, bias);
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = data.data_ptr<uint8_t>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // the quantised activations, in buffers kept per calling thread (no allocation per call at steady state)
  thread_local QX qx;
  qx.reserve(M, K, G);
  QX& qr = qx;
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t m0, int64_t m1) {
    quantize_rows(xp, K, qr, m0, m1);
  });
  const int64_t nb = K / f.block, row_bytes = nb * f.bytes;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(row_bytes, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* w = wp + n * row_bytes;
      for (int64_t m = 0; m < M; m += kMB) {
        float out[kMB];
        const XRows xr{qr.q.data() + m * K, qr.d.data() + m * G, qr.sum.data() + m * G, qr.nls.data() + m * G * 8,
                       K, G};
        switch (std::min<int64_t>(kMB, M - m)) {
          case 4: row_dot<4>(qtype, w, nb, f, xr, out); break;
          case 3: row_dot<3>(qtype, w, nb, f, xr, out); break;
          case 2: row_dot<2>(qtype, w, nb, f, xr, out); break;
          default: row_dot<1>(qtype, w, nb, f, xr, out); break;
        }
        for (int i = 0; i < kMB && m + i < M; ++i) yp[(m + i) * N + n] = bp ? out[i] + bp[n] : out[i];
      }
    }
  });
}

int64_t gguf_int_dot() { return kIntDot; }

}  // namespace

namespace oi {
// for decode_blocks.cpp's fused Llama layer (kernels.h)
void gguf_gemm_q8(at::Tensor y, const at::Tensor& x, const at::Tensor& data, int64_t qtype) {
  gguf_linear_q8(std::move(y), x, data, qtype, c10::nullopt);
}
}  // namespace oi

TORCH_LIBRARY_FRAGMENT(openinfer_cpu, m) {
  m.def("gguf_linear_q8(Tensor(a!) y, Tensor x, Tensor data, int qtype, Tensor? bias) -> ()");
  m.impl("gguf_linear_q8", c10::DispatchKey::CPU, &gguf_linear_q8);
  m.def("gguf_int_dot() -> int", &gguf_int_dot);
  m.def("gguf_q8_tile_from() -> int", +[]() -> int64_t { return kTileFrom; });
}
