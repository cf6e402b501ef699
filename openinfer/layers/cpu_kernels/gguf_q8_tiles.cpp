// GGUF weights times int8 activations for many activation rows (prefill): y[M, N] = x[M, K] W^T with the arithmetic
// of gguf_q8_gemm.cpp (the small-M int8 kernel; layers/gguf_quant.py's ``matmul_q8_reference`` describes both), laid
// out so that the integer dot products do the work and each weight is decoded once per call, not once per 4 rows.
//
// Per chunk of kNC = 16 output columns (weight rows), over threads: the chunk's blocks are decoded once into an int8
// tile, column-interleaved: for 32-column block b and k-quad j (columns 32 b + 4 j .. + 3), 16 columns x 4 bytes
// (one 256-bit vector holds 8 columns' 4 bytes), the offset taken off (Q4_0 q - 8, Q6_K q - 32: signed), next to
// each scale group's fp32 scale (d, d sc_j; Q6_K two per block, one per 16 columns), each block's min (Q4_1 m,
// Q4_K -dmin mn_j) and each group's -128 Σ q_w. Then every activation row, kMR at a time (AVX-512 VNNI: kMRW,
// 512-bit, over packed panels: tile_rows512), runs over the tile:
// activations u = q + 128 (unsigned) broadcast 4 bytes at a time, weights signed, _mm256_dpbusd_epi32 (AVX512-VNNI
// with VL, or AVX-VNNI) or AVX2's _mm256_maddubs_epi16 + _mm256_madd_epi16 into 8 columns' int32 lanes, started at
// -128 Σ q_w so the group's sum is Σ q_x q_w exactly:
//   I_g = Σ_{k in g} (q_xk + 128) q_wk - 128 Σ_{k in g} q_wk = Σ_{k in g} q_xk q_wk
//   y_mn = Σ_g s_g d_mb(g) I_g + Σ_b mn_b Σ_{k in b} x_mk           (fp32, groups in order)
// the small-M kernel's integers and terms; only the fp32 order of the sum differs (the tests hold both to the same
// bound around the reference). maddubs sums pairs into int16: 2 * 255 * 32 = 16320 at most for Q4_0 / Q4_1 / Q4_K /
// Q6_K's integers, but Q8_0's 2 * 255 * 128 would saturate, so an AVX2-only build leaves Q8_0 (and a build without
// AVX2 every type) to the decode + fp32 GEMM path (``gguf_q8_tiled_supports``). Q5_0 / Q5_1 / Q5_K have no tile
// decoder yet and stay there too.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "gguf_blocks.h"
#include "gguf_q8_act.h"
#include "kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool kVnni = true;
constexpr int kMR = 6;  // activation rows per pass: 6 x 2 int32 + 6 x 2 fp32 accumulators, 2 weight vectors and a
                        // broadcast in 32 registers: 8 loads per 12 dot products (4 rows: 6 per 8); Q6_K's two
                        // scale groups per block hold more live, so it takes 4 (6 spilled: slower, measured)
#elif defined(__AVXVNNI__)
constexpr bool kVnni = true;
constexpr int kMR = 3;  // 16 registers
#else
constexpr bool kVnni = false;
constexpr int kMR = 3;
#endif

constexpr int kNC = 16;  // output columns per tile: two 8-lane vectors

bool tiled_supports(int64_t t) {
#ifdef __AVX2__
  if (t == Q8_0) return kVnni;
  return t == Q4_0 || t == Q4_1 || t == Q4_K || t == Q6_K;
#else
  (void)t;
  return false;
#endif
}

#ifdef __AVX2__
// One chunk's decoded weights: G = K / 32 blocks, S scale groups per block (2 for Q6_K).
struct Tile {
  std::vector<int32_t> q;     // [G][8 quads][kNC] four int8 each
  std::vector<float> s;       // [G][S][kNC]
  std::vector<float> mn;      // [G][kNC]
  std::vector<int32_t> comp;  // [G][S][kNC]: -128 Σ q_w over the group
  void size(int64_t G, int S) {
    if (static_cast<int64_t>(q.size()) < G * 8 * kNC) q.resize(G * 8 * kNC);
    if (static_cast<int64_t>(s.size()) < G * S * kNC) {
      s.resize(G * S * kNC);
      comp.resize(G * S * kNC);
    }
    if (static_cast<int64_t>(mn.size()) < G * kNC) mn.resize(G * kNC);
  }
  void zero(int64_t G, int S) {
    std::fill_n(q.begin(), G * 8 * kNC, 0);
    std::fill_n(s.begin(), G * S * kNC, 0.f);
    std::fill_n(comp.begin(), G * S * kNC, 0);
    std::fill_n(mn.begin(), G * kNC, 0.f);
  }
};


inline __m256i nibbles16(const uint8_t* qs) {  // low nibbles are elements 0..15, high ones 16..31
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), f = _mm_set1_epi8(0xF);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), f), _mm_and_si128(v, f));
}

// Column c's 32-column block b (signed integers q, in column order) into the tile, with its scales and min.
template <int S>
inline void put(Tile& t, int c, int64_t b, __m256i q, const float* s, float mn) {
  alignas(32) int32_t quads[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(quads), q);
  int32_t* dst = t.q.data() + b * 8 * kNC + c;
  for (int j = 0; j < 8; ++j) dst[j * kNC] = quads[j];
  // Σ q per 8 bytes: the sum of absolute differences of q + 128 from 0, less 8 * 128
  alignas(32) int64_t sad[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(sad),
                     _mm256_sad_epu8(_mm256_xor_si256(q, _mm256_set1_epi8(static_cast<char>(0x80))),
                                     _mm256_setzero_si256()));
  if constexpr (S == 1) {
    t.comp[b * kNC + c] = -128 * static_cast<int32_t>(sad[0] + sad[1] + sad[2] + sad[3] - 4 * 8 * 128);
  } else {
    t.comp[(b * 2) * kNC + c] = -128 * static_cast<int32_t>(sad[0] + sad[1] - 2 * 8 * 128);
    t.comp[(b * 2 + 1) * kNC + c] = -128 * static_cast<int32_t>(sad[2] + sad[3] - 2 * 8 * 128);
  }
  for (int i = 0; i < S; ++i) t.s[(b * S + i) * kNC + c] = s[i];
  t.mn[b * kNC + c] = mn;
}

// Q6_K's 32 signed quants 128 h + 32 j + i of a super-block, from its 32-byte rows qh = qh[32 h ..] and ql =
// ql[64 h + 32 (j & 1) ..]: low 4 bits in ql (high nibble for j >= 2), high 2 in bits 2j of qh; q - 32. The rows
// are loaded by the caller once per h (the tile stores between calls could alias them for the compiler).
inline __m256i q6k_quants(__m256i qh, __m256i ql, int j) {
  const __m256i f = _mm256_set1_epi8(0xF), three = _mm256_set1_epi8(3);
  const __m256i lo = j < 2 ? _mm256_and_si256(ql, f) : _mm256_and_si256(_mm256_srli_epi16(ql, 4), f);
  const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), three), 4);
  return _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
}

// Weight row w (nb blocks of type T) into column c of the tile.
template <int64_t T>
void decode_row(Tile& t, int c, const uint8_t* w, int64_t nb) {
  const __m256i f = _mm256_set1_epi8(0xF);
  for (int64_t b = 0; b < nb; ++b) {
    if constexpr (T == Q8_0) {
      const uint8_t* blk = w + b * 34;
      const float s = fp16(blk);
      put<1>(t, c, b, load32(blk + 2), &s, 0.f);
    } else if constexpr (T == Q4_0) {
      const uint8_t* blk = w + b * 18;
      const float s = fp16(blk);
      put<1>(t, c, b, _mm256_sub_epi8(nibbles16(blk + 2), _mm256_set1_epi8(8)), &s, 0.f);
    } else if constexpr (T == Q4_1) {
      const uint8_t* blk = w + b * 20;
      const float s = fp16(blk);
      put<1>(t, c, b, nibbles16(blk + 4), &s, fp16(blk + 2));
    } else if constexpr (T == Q4_K) {
      const uint8_t* blk = w + b * 144;
      const float d = fp16(blk), dmin = fp16(blk + 2);
      int sc[8], mn[8];
      scale_min_k4(blk + 4, sc, mn);
      for (int j = 0; j < 4; ++j) {  // sub-blocks 2j (low nibbles) and 2j + 1 (high) of the same 32 bytes
        const __m256i v = load32(blk + 16 + 32 * j);
        const float s0 = d * static_cast<float>(sc[2 * j]), s1 = d * static_cast<float>(sc[2 * j + 1]);
        put<1>(t, c, 8 * b + 2 * j, _mm256_and_si256(v, f), &s0, -(dmin * static_cast<float>(mn[2 * j])));
        put<1>(t, c, 8 * b + 2 * j + 1, _mm256_and_si256(_mm256_srli_epi16(v, 4), f), &s1,
               -(dmin * static_cast<float>(mn[2 * j + 1])));
      }
    } else {  // Q6_K: element 128 h + 32 j + i: low 4 bits in ql[64 h + 32 (j & 1) + i] (high nibble for j >= 2),
              // high 2 in bits 2j of qh[32 h + i], scale sc[8 h + 2 j + i / 16]; q - 32
      const uint8_t* blk = w + b * 210;
      const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
      const float d = fp16(blk + 208);
      for (int h = 0; h < 2; ++h) {
        const __m256i qh = load32(blk + 128 + 32 * h), ql0 = load32(blk + 64 * h), ql1 = load32(blk + 64 * h + 32);
        for (int j = 0; j < 4; ++j) {
          const float s[2] = {d * static_cast<float>(sc[8 * h + 2 * j]), d * static_cast<float>(sc[8 * h + 2 * j + 1])};
          put<2>(t, c, 8 * b + 4 * h + j, q6k_quants(qh, (j & 1) ? ql1 : ql0, j), s, 0.f);
        }
      }
    }
  }
}

// The same tile, 8 weight rows (columns c0 .. c0 + 7) at a time, for a full chunk: each row's weight block is
// decoded into a small buffer (one 256-bit vector per 32-column block), then per 32-column block the 8 rows' vectors
// are transposed in registers (8 x 8 int32: quad j of the 8 columns in one vector) and stored whole, and the
// columns' -128 Σ q_w come from integer dots of those vectors with ones. decode_row's per-column scalar stores and
// sums cost ~0.2 ms per MB of weights (the whole decode of the 200M Llama's Q4_K_M weights, ~24 ms per call, as
// much as 27 activation rows of tile work); the tails (a chunk of fewer than 16 columns) keep decode_row.
inline void transpose8(__m256i r[8]) {
  const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
  const __m256i t4 = _mm256_unpacklo_epi32(r[4], r[5]), t5 = _mm256_unpackhi_epi32(r[4], r[5]);
  const __m256i t6 = _mm256_unpacklo_epi32(r[6], r[7]), t7 = _mm256_unpackhi_epi32(r[6], r[7]);
  const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
  const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
  const __m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
  const __m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
  r[0] = _mm256_permute2x128_si256(u0, u4, 0x20);
  r[1] = _mm256_permute2x128_si256(u1, u5, 0x20);
  r[2] = _mm256_permute2x128_si256(u2, u6, 0x20);
  r[3] = _mm256_permute2x128_si256(u3, u7, 0x20);
  r[4] = _mm256_permute2x128_si256(u0, u4, 0x31);
  r[5] = _mm256_permute2x128_si256(u1, u5, 0x31);
  r[6] = _mm256_permute2x128_si256(u2, u6, 0x31);
  r[7] = _mm256_permute2x128_si256(u3, u7, 0x31);
}

// One weight block of type T (a super-block for the K-quants): its 32-column blocks' signed integers into q[],
// their scale groups' scales into s[] (S per 32 columns) and mins into mn[]; returns the number of 32-column blocks.
template <int64_t T, bool kScales = true>
inline int block_ints(const uint8_t* blk, __m256i* q, float* s, float* mn) {
  const __m256i f = _mm256_set1_epi8(0xF);
  if constexpr (T == Q8_0) {
    q[0] = load32(blk + 2);
    s[0] = fp16(blk);
    mn[0] = 0.f;
    return 1;
  } else if constexpr (T == Q4_0) {
    q[0] = _mm256_sub_epi8(nibbles16(blk + 2), _mm256_set1_epi8(8));
    s[0] = fp16(blk);
    mn[0] = 0.f;
    return 1;
  } else if constexpr (T == Q4_1) {
    q[0] = nibbles16(blk + 4);
    s[0] = fp16(blk);
    mn[0] = fp16(blk + 2);
    return 1;
  } else if constexpr (T == Q4_K) {
    for (int j = 0; j < 4; ++j) {
      const __m256i v = load32(blk + 16 + 32 * j);
      q[2 * j] = _mm256_and_si256(v, f);
      q[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), f);
    }
    if constexpr (!kScales) return 8;
    const float d = fp16(blk), dmin = fp16(blk + 2);
    int sc[8], m8[8];
    scale_min_k4(blk + 4, sc, m8);
    for (int j = 0; j < 8; ++j) {
      s[j] = d * static_cast<float>(sc[j]);
      mn[j] = -(dmin * static_cast<float>(m8[j]));
    }
    return 8;
  } else {  // Q6_K, as decode_row
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = fp16(blk + 208);
    for (int h = 0; h < 2; ++h) {
      const __m256i qh = load32(blk + 128 + 32 * h), ql0 = load32(blk + 64 * h), ql1 = load32(blk + 64 * h + 32);
      for (int j = 0; j < 4; ++j) {
        q[4 * h + j] = q6k_quants(qh, (j & 1) ? ql1 : ql0, j);
        if constexpr (!kScales) continue;
        s[2 * (4 * h + j)] = d * static_cast<float>(sc[8 * h + 2 * j]);
        s[2 * (4 * h + j) + 1] = d * static_cast<float>(sc[8 * h + 2 * j + 1]);
        mn[4 * h + j] = 0.f;
      }
    }
    return 8;
  }
}

// The K-quants' scales (and Q4_K's mins) of 8 weight rows' super-block b in the tile, as vectors: per row the
// 8 (Q6_K 16) scale-group scales widened and multiplied in one go (the same fp32 products as block_ints), then
// transposed so that one store writes a scale group's 8 columns.
template <int64_t T>
inline void k_scales8(Tile& t, int c0, const uint8_t* w0, int64_t row_bytes, int64_t b) {
  constexpr int kBytes = T == Q4_K ? 144 : 210;
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256i sv[8], hv[8];  // Q4_K: scales, mins; Q6_K: scales 0-7, 8-15 (fp32 bits)
  for (int r = 0; r < 8; ++r) {
    const uint8_t* blk = w0 + r * row_bytes + b * kBytes;
    if constexpr (T == Q4_K) {
      uint64_t sc8, mn8;
      scale_min_k4_bytes(blk + 4, sc8, mn8);
      const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(sc8))));
      const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(mn8))));
      sv[r] = _mm256_castps_si256(_mm256_mul_ps(_mm256_set1_ps(fp16(blk)), sc));
      hv[r] = _mm256_castps_si256(_mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(fp16(blk + 2)), mn), sign));
    } else {
      const __m256 d = _mm256_set1_ps(fp16(blk + 208));
      const __m128i lo = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 192));
      const __m128i hi = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 200));
      sv[r] = _mm256_castps_si256(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo))));
      hv[r] = _mm256_castps_si256(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi))));
    }
  }
  transpose8(sv);  // sv[j]: group j's scale for the 8 rows
  transpose8(hv);
  if constexpr (T == Q4_K) {
    for (int j = 0; j < 8; ++j) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(t.s.data() + (8 * b + j) * kNC + c0), sv[j]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(t.mn.data() + (8 * b + j) * kNC + c0), hv[j]);
    }
  } else {  // group k of the super-block is t.s's row 16 b + k (32-column block 8 b + k / 2, half k % 2)
    for (int j = 0; j < 8; ++j) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(t.s.data() + (16 * b + j) * kNC + c0), sv[j]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(t.s.data() + (16 * b + 8 + j) * kNC + c0), hv[j]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(t.mn.data() + (8 * b + j) * kNC + c0), _mm256_setzero_si256());
    }
  }
}

// Weight rows w0, w0 + row_bytes, ... (8 of them, nb blocks of type T each) into columns c0 .. c0 + 7 of the tile.
template <int64_t T>
void decode_rows8(Tile& t, int c0, const uint8_t* w0, int64_t row_bytes, int64_t nb) {
  constexpr int S = T == Q6_K ? 2 : 1;
  constexpr int kBytes = T == Q8_0 ? 34 : T == Q4_0 ? 18 : T == Q4_1 ? 20 : T == Q4_K ? 144 : 210;
  constexpr bool kK = T == Q4_K || T == Q6_K;
  constexpr int kSub = kK ? 8 : 1;  // 32-column blocks per weight block
  const __m256i ones = _mm256_set1_epi8(1);
  alignas(32) __m256i q[8][kSub];
  float s[8][kSub * S], mn[8][kSub];
  for (int64_t b = 0; b < nb; ++b) {
    for (int r = 0; r < 8; ++r) block_ints<T, !kK>(w0 + r * row_bytes + b * kBytes, q[r], s[r], mn[r]);
    if constexpr (kK) k_scales8<T>(t, c0, w0, row_bytes, b);
    for (int sub = 0; sub < kSub; ++sub) {
      const int64_t g = b * kSub + sub;  // the 32-column block
      __m256i v[8];
      for (int r = 0; r < 8; ++r) v[r] = q[r][sub];
      transpose8(v);  // v[j]: quad j (columns 4j .. 4j + 3 of the block) of the 8 weight rows
      int32_t* dst = t.q.data() + g * 8 * kNC + c0;
      __m256i sum[S];
      for (int i = 0; i < S; ++i) sum[i] = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j * kNC), v[j]);
        sum[j * S / 8] = dot4(sum[j * S / 8], ones, v[j]);  // Σ q_w per column over the scale group
      }
      for (int i = 0; i < S; ++i) {
        const __m256i comp = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(sum[i], 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(t.comp.data() + (g * S + i) * kNC + c0), comp);
      }
      if constexpr (!kK) {
        for (int r = 0; r < 8; ++r) t.s[g * kNC + c0 + r] = s[r][0];
        for (int r = 0; r < 8; ++r) t.mn[g * kNC + c0 + r] = mn[r][0];
      }
    }
  }
}

// 8 weight rows repacked at load (gguf_repack.cpp: group gp, nb super-blocks) into columns c0 .. c0 + 7 of the
// tile. The repacked vectors already hold quad j of 8 rows in one vector, so no transpose: a mask or shift per
// vector (Q6_K: the high bits or-ed in, the offset 32 taken off), the scales widened 8 rows at a time, the same fp32
// products as block_ints.
template <int64_t T>
void decode_r8(Tile& t, int c0, const uint8_t* gp, int64_t nb) {
  constexpr int kChunk = T == Q4_K ? 1184 : 1680;
  const __m256i f = _mm256_set1_epi8(0xF), three = _mm256_set1_epi8(3), ones = _mm256_set1_epi8(1);
  const __m256 sign = _mm256_set1_ps(-0.f);
  auto u8s = [](const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); };
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* c = gp + b * kChunk;
    const __m256 d = fp16x8(c);
    if constexpr (T == Q4_K) {
      const __m256 dmin = fp16x8(c + 16);
      for (int j = 0; j < 8; ++j) {
        const int64_t g = 8 * b + j;
        _mm256_storeu_ps(t.s.data() + g * kNC + c0, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(u8s(c + 32 + 8 * j)))));
        _mm256_storeu_ps(t.mn.data() + g * kNC + c0,
                         _mm256_xor_ps(_mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(u8s(c + 96 + 8 * j)))), sign));
        int32_t* dst = t.q.data() + g * 8 * kNC + c0;
        __m256i sum = _mm256_setzero_si256();
        for (int v = 0; v < 4; ++v) {
          const __m256i L = load32(c + 160 + 128 * j + 32 * v);
          const __m256i lo = _mm256_and_si256(L, f), hi = _mm256_and_si256(_mm256_srli_epi16(L, 4), f);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + v * kNC), lo);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (v + 4) * kNC), hi);
          sum = dot4(dot4(sum, ones, lo), ones, hi);
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(t.comp.data() + g * kNC + c0),
                            _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(sum, 7)));
      }
    } else {
      for (int k = 0; k < 16; ++k)
        _mm256_storeu_ps(t.s.data() + (16 * b + k) * kNC + c0,
                         _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(u8s(c + 16 + 8 * k)))));
      const __m256i off = _mm256_set1_epi8(32);
      for (int j = 0; j < 8; ++j) {
        const int64_t g = 8 * b + j;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(t.mn.data() + g * kNC + c0), _mm256_setzero_si256());
        const uint8_t* qs = c + 144 + 192 * j;
        const __m256i H0 = load32(qs + 128), H1 = load32(qs + 160);
        int32_t* dst = t.q.data() + g * 8 * kNC + c0;
        __m256i sa = _mm256_setzero_si256(), sb = _mm256_setzero_si256();
        for (int v = 0; v < 4; ++v) {
          const __m256i L = load32(qs + 32 * v);
          const __m256i qa = _mm256_sub_epi8(
              _mm256_or_si256(_mm256_and_si256(L, f),
                              _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H0, 2 * v), three), 4)), off);
          const __m256i qb = _mm256_sub_epi8(
              _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L, 4), f),
                              _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H1, 2 * v), three), 4)), off);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + v * kNC), qa);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (v + 4) * kNC), qb);
          sa = dot4(sa, ones, qa);
          sb = dot4(sb, ones, qb);
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(t.comp.data() + (2 * g) * kNC + c0),
                            _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(sa, 7)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(t.comp.data() + (2 * g + 1) * kNC + c0),
                            _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(sb, 7)));
      }
    }
  }
}

// MR activation rows (u: q + 128, [MR][K]; their scales dx and sums xs, [MR][G]) times the tile: out [MR][kNC].
template <int MR, int S, bool kMin>
void tile_rows(const Tile& t, const uint8_t* u, const float* dx, const float* xs, int64_t K, int64_t G, float* out) {
  constexpr int kQuads = 8 / S;  // k-quads per scale group
  __m256 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < G; ++b) {
    const int32_t* wq = t.q.data() + b * 8 * kNC;
    for (int g = 0; g < S; ++g) {
      const int32_t* cp = t.comp.data() + (b * S + g) * kNC;
      const __m256i c0 = load32(cp), c1 = load32(cp + 8);
      __m256i ia[MR][2];
      for (int r = 0; r < MR; ++r) {
        ia[r][0] = c0;
        ia[r][1] = c1;
      }
      for (int j = g * kQuads; j < (g + 1) * kQuads; ++j) {
        const __m256i w0 = load32(wq + j * kNC), w1 = load32(wq + j * kNC + 8);
        for (int r = 0; r < MR; ++r) {
          int32_t quad;
          std::memcpy(&quad, u + r * K + 32 * b + 4 * j, 4);
          const __m256i xv = _mm256_set1_epi32(quad);
          ia[r][0] = dot4(ia[r][0], xv, w0);
          ia[r][1] = dot4(ia[r][1], xv, w1);
        }
      }
      const float* sp = t.s.data() + (b * S + g) * kNC;
      const __m256 s0 = _mm256_loadu_ps(sp), s1 = _mm256_loadu_ps(sp + 8);
      for (int r = 0; r < MR; ++r) {
        const __m256 d = _mm256_broadcast_ss(dx + r * G + b);
        acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[r][0]), _mm256_mul_ps(s0, d), acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[r][1]), _mm256_mul_ps(s1, d), acc[r][1]);
      }
    }
    if constexpr (kMin) {
      const __m256 m0 = _mm256_loadu_ps(t.mn.data() + b * kNC), m1 = _mm256_loadu_ps(t.mn.data() + b * kNC + 8);
      for (int r = 0; r < MR; ++r) {
        const __m256 sx = _mm256_broadcast_ss(xs + r * G + b);
        acc[r][0] = _mm256_fmadd_ps(m0, sx, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(m1, sx, acc[r][1]);
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(out + r * kNC, acc[r][0]);
    _mm256_storeu_ps(out + r * kNC + 8, acc[r][1]);
  }
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define OI_WIDE_TILES 1
#else
#define OI_WIDE_TILES 0
#endif

#if OI_WIDE_TILES
// tile_rows with 512-bit vectors over packed activations. A 16-column tile row (64 bytes of quads, 16 scales, 16
// comps, 16 mins) is one register, so a row needs one int32 and one fp32 accumulator instead of two of each: 12
// rows in 24 registers. The activations come packed in panels of kMRW rows (pack_panels: quad k of the panel's rows
// side by side, their scales and sums likewise), so every broadcast is one base pointer plus a constant: with rows
// K bytes apart the 256-bit kernel spilled its accumulators at every scale group and spent about as many cycles on
// the epilogue and addressing as on the dots (perf, Zen 4). Per lane the same operations in the same order as
// tile_rows: the same bits.
constexpr int kMRW = 12;

template <int MR, int S, bool kMin>
void tile_rows512(const Tile& t, const int32_t* a, const float* dx, const float* xs, int64_t G, float* out) {
  constexpr int kQuads = 8 / S;
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < G; ++b, a += 8 * kMRW, dx += kMRW, xs += kMRW) {
    const int32_t* wq = t.q.data() + b * 8 * kNC;
    for (int g = 0; g < S; ++g) {
      const __m512i c = _mm512_loadu_si512(t.comp.data() + (b * S + g) * kNC);
      __m512i ia[MR];
      for (int r = 0; r < MR; ++r) ia[r] = c;
#pragma GCC unroll 8
      for (int j = g * kQuads; j < (g + 1) * kQuads; ++j) {
        const __m512i w = _mm512_loadu_si512(wq + j * kNC);
        for (int r = 0; r < MR; ++r) ia[r] = _mm512_dpbusd_epi32(ia[r], _mm512_set1_epi32(a[j * kMRW + r]), w);
      }
      const __m512 s = _mm512_loadu_ps(t.s.data() + (b * S + g) * kNC);
      for (int r = 0; r < MR; ++r)
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[r]), _mm512_mul_ps(s, _mm512_set1_ps(dx[r])), acc[r]);
    }
    if constexpr (kMin) {
      const __m512 m = _mm512_loadu_ps(t.mn.data() + b * kNC);
      for (int r = 0; r < MR; ++r) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r]), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(out + r * kNC, acc[r]);
}

// mr (1 .. MR) packed rows over the tile.
template <int MR, int S, bool kMin>
inline void rows_over_tile(int mr, const Tile& t, const int32_t* a, const float* dx, const float* xs, int64_t G,
                           float* out) {
  if constexpr (MR > 1) {
    if (mr < MR) return rows_over_tile<MR - 1, S, kMin>(mr, t, a, dx, xs, G, out);
  }
  tile_rows512<MR, S, kMin>(t, a, dx, xs, G, out);
}

// Panel p of the activations (rows kMRW p .. + kMRW), straight from the quantised rows: quad k of row r at
// a[p][k][r] as u = q + 128 (four bytes, the unsigned operand), block b's scale and sum at dx[p][b][r], xs[p][b][r];
// rows past M are zeros (u 128, scale 0).
void pack_panels(const QX& qx, int64_t M, int64_t K, int64_t G, int64_t p0, int64_t p1, int32_t* a, float* dx,
                 float* xs) {
  const int64_t Q = K / 4;
  const int32_t flip = static_cast<int32_t>(0x80808080u);
  for (int64_t p = p0; p < p1; ++p) {
    int32_t* ap = a + p * Q * kMRW;
    float *dp = dx + p * G * kMRW, *sp = xs + p * G * kMRW;
    for (int r = 0; r < kMRW; ++r) {
      const int64_t m = p * kMRW + r;
      if (m < M) {
        const int8_t* qm = qx.q.data() + m * K;
        for (int64_t k = 0; k < Q; ++k) {
          int32_t quad;
          std::memcpy(&quad, qm + 4 * k, 4);
          ap[k * kMRW + r] = quad ^ flip;
        }
        for (int64_t b = 0; b < G; ++b) {
          dp[b * kMRW + r] = qx.d[m * G + b];
          sp[b * kMRW + r] = qx.sum[m * G + b];
        }
      } else {
        for (int64_t k = 0; k < Q; ++k) ap[k * kMRW + r] = flip;
        for (int64_t b = 0; b < G; ++b) dp[b * kMRW + r] = sp[b * kMRW + r] = 0.f;
      }
    }
  }
}
#else
constexpr int kMRW = 1;
#endif

// The packed activations of the 512-bit kernel (empty otherwise; the 256-bit kernel reads u and qx).
struct Panels {
  const int32_t* a = nullptr;
  const float* dx = nullptr;
  const float* xs = nullptr;
};

// A thread's chunks, kGroup at a time: the group's tiles are decoded first (K x 16 bytes each: 8 of them for
// K = 2816 are 360 KB, in L2), then each kMR activation rows run over all of them, so a row's K bytes are read
// from L1 once per group rather than from L3 once per 16 columns: with one tile per pass, prefill of 1,024 rows
// ran at half the tokens per second of 128 rows (the activations re-streamed once per chunk).
constexpr int kGroup = 8;

template <int64_t T, bool kR8 = false>
void run_chunks(int64_t n0, int64_t n1, const uint8_t* wp, int64_t row_bytes, int64_t nb, const uint8_t* u,
                const QX& qx, const Panels& pn, int64_t M, int64_t N, int64_t K, const float* bias, float* y) {
  constexpr int S = T == Q6_K ? 2 : 1;
  constexpr bool kMin = T == Q4_1 || T == Q4_K;
  constexpr int kR = OI_WIDE_TILES ? kMRW : S == 2 && kMR > 4 ? 4 : kMR;  // rows per pass for this type
  const int64_t G = K / 32;
  thread_local Tile tiles[kGroup];
  alignas(64) float out[(kMR > kMRW ? kMR : kMRW) * kNC];
  for (int64_t g0 = n0; g0 < n1; g0 += kGroup) {
    const int64_t g1 = std::min(n1, g0 + kGroup);
    for (int64_t ch = g0; ch < g1; ++ch) {
      Tile& tile = tiles[ch - g0];
      tile.size(G, S);
      const int64_t c0 = ch * kNC;
      const int nc = static_cast<int>(std::min<int64_t>(kNC, N - c0));
      if (nc < kNC) tile.zero(G, S);  // the missing columns contribute zeros
      if constexpr (kR8) {  // row_bytes: one 8-row group's bytes; the rows are padded to whole groups
        decode_r8<T>(tile, 0, wp + (2 * ch) * row_bytes, nb);
        if (nc > 8) decode_r8<T>(tile, 8, wp + (2 * ch + 1) * row_bytes, nb);
      } else if (nc == kNC) {
        decode_rows8<T>(tile, 0, wp + c0 * row_bytes, row_bytes, nb);
        decode_rows8<T>(tile, 8, wp + (c0 + 8) * row_bytes, row_bytes, nb);
      } else {
        for (int c = 0; c < nc; ++c) decode_row<T>(tile, c, wp + (c0 + c) * row_bytes, nb);
      }
    }
    for (int64_t m = 0; m < M; m += kR) {
      const int mr = static_cast<int>(std::min<int64_t>(kR, M - m));
#if OI_WIDE_TILES
      const int64_t p = m / kMRW;
      const int32_t* pa = pn.a + p * (K / 4) * kMRW;
      const float *dx = pn.dx + p * G * kMRW, *xs = pn.xs + p * G * kMRW;
      (void)u, (void)qx;
#else
      const uint8_t* um = u + m * K;
      const float* dx = qx.d.data() + m * G;
      const float* xs = qx.sum.data() + m * G;
      (void)pn;
#endif
      for (int64_t ch = g0; ch < g1; ++ch) {
        const Tile& tile = tiles[ch - g0];
#if OI_WIDE_TILES
        rows_over_tile<kMRW, S, kMin>(mr, tile, pa, dx, xs, G, out);
#else
        switch (mr) {
          case 6: tile_rows<(kMR >= 6 ? 6 : 1), S, kMin>(tile, um, dx, xs, K, G, out); break;
          case 5: tile_rows<(kMR >= 5 ? 5 : 1), S, kMin>(tile, um, dx, xs, K, G, out); break;
          case 4: tile_rows<(kMR >= 4 ? 4 : 1), S, kMin>(tile, um, dx, xs, K, G, out); break;
          case 3: tile_rows<3, S, kMin>(tile, um, dx, xs, K, G, out); break;
          case 2: tile_rows<2, S, kMin>(tile, um, dx, xs, K, G, out); break;
          default: tile_rows<1, S, kMin>(tile, um, dx, xs, K, G, out); break;
        }
#endif
        const int64_t c0 = ch * kNC;
        const int nc = static_cast<int>(std::min<int64_t>(kNC, N - c0));
        for (int r = 0; r < mr; ++r) {
          float* yr = y + (m + r) * N + c0;
          for (int c = 0; c < nc; ++c) yr[c] = bias ? out[r * kNC + c] + bias[c0 + c] : out[r * kNC + c];
        }
      }
    }
  }
}
#endif

// A repacked weight's code (gguf_repack.cpp: 1000 + Q4_K / Q6_K); its data [N rounded up to 8, nb * chunk / 8].
constexpr int64_t kR8 = 1000;

void gguf_linear_q8_tiled(at::Tensor y, const at::Tensor& x, const at::Tensor& data, int64_t code,
                          const c10::optional<at::Tensor>& bias) {
  const bool r8 = code == kR8 + Q4_K || code == kR8 + Q6_K;
  const int64_t qtype = r8 ? code - kR8 : code;
  const Format f = format_of(qtype);
  TORCH_CHECK(tiled_supports(qtype), "gguf_linear_q8_tiled: type ", code,
              " has no tile kernel in this build (gguf_q8_tiled_supports)");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x must be contiguous fp32 [M, K]");
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && y.scalar_type() == at::kFloat && y.size(0) == x.size(0),
              "y must be contiguous fp32 [M, N]");
  int64_t N, K;
  if (r8) {
    N = y.size(1), K = x.size(1);
    const int64_t cb = qtype == Q4_K ? 1184 : 1680;
    TORCH_CHECK(K > 0 && K % 256 == 0 && data.dim() == 2 && data.is_contiguous() && data.scalar_type() == at::kByte &&
                    data.size(0) == (N + 7) / 8 * 8 && data.size(1) == K / 256 * cb / 8,
                "gguf_linear_q8_tiled: repacked type ", code, " needs data uint8 [", (N + 7) / 8 * 8, ", ",
                K / 256 * cb / 8, "], has ", data.sizes());
  } else {
    std::tie(N, K) = check_data(data, qtype, x.size(1), f);
  }
  const int64_t M = x.size(0), G = K / 32;
  TORCH_CHECK(y.size(1) == N, "y must be contiguous fp32 [M, N]");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be contiguous fp32 [N]");
#ifdef __AVX2__
  const float* xp = x.data_ptr<float>();
  thread_local QX qx;
  qx.reserve(M, K, G);
  QX& qr = qx;
  Panels pn;
#if OI_WIDE_TILES
  const uint8_t* up = nullptr;  // the 512-bit kernel reads the panels: each panel's rows quantised, then packed
  thread_local std::vector<int32_t> pa;
  thread_local std::vector<float> pd, ps;
  const int64_t panels = (M + kMRW - 1) / kMRW;
  if (static_cast<int64_t>(pa.size()) < panels * kMRW * K / 4) pa.resize(panels * kMRW * K / 4);
  if (static_cast<int64_t>(pd.size()) < panels * kMRW * G) pd.resize(panels * kMRW * G), ps.resize(panels * kMRW * G);
  int32_t* pap = pa.data();
  float *pdp = pd.data(), *psp = ps.data();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    quantize_rows(xp, K, qr, p0 * kMRW, std::min(M, p1 * kMRW));
    pack_panels(qr, M, K, G, p0, p1, pap, pdp, psp);
  });
  pn = Panels{pap, pdp, psp};
#else
  thread_local std::vector<uint8_t> u;
  if (static_cast<int64_t>(u.size()) < M * K) u.resize(M * K);
  uint8_t* uw = u.data();
  const uint8_t* up = uw;
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t m0, int64_t m1) {
    quantize_rows(xp, K, qr, m0, m1);
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int64_t i = m0 * K; i < m1 * K; i += 32)  // q + 128: the unsigned operand
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(uw + i), _mm256_xor_si256(load32(qr.q.data() + i), flip));
  });
#endif
  const uint8_t* wp = data.data_ptr<uint8_t>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t nb = K / f.block, row_bytes = nb * f.bytes, chunks = (N + kNC - 1) / kNC;
  at::parallel_for(0, chunks, 1, [&](int64_t n0, int64_t n1) {
    if (r8) {  // row_bytes * 8 / 8: a group of 8 rows holds 8 rows' bytes (+ Q4_K's 4 per super-block and row)
      const int64_t gb = nb * (qtype == Q4_K ? 1184 : 1680);
      if (qtype == Q4_K) return run_chunks<Q4_K, true>(n0, n1, wp, gb, nb, up, qr, pn, M, N, K, bp, yp);
      return run_chunks<Q6_K, true>(n0, n1, wp, gb, nb, up, qr, pn, M, N, K, bp, yp);
    }
    switch (qtype) {
      case Q8_0: return run_chunks<Q8_0>(n0, n1, wp, row_bytes, nb, up, qr, pn, M, N, K, bp, yp);
      case Q4_0: return run_chunks<Q4_0>(n0, n1, wp, row_bytes, nb, up, qr, pn, M, N, K, bp, yp);
      case Q4_1: return run_chunks<Q4_1>(n0, n1, wp, row_bytes, nb, up, qr, pn, M, N, K, bp, yp);
      case Q4_K: return run_chunks<Q4_K>(n0, n1, wp, row_bytes, nb, up, qr, pn, M, N, K, bp, yp);
      default: return run_chunks<Q6_K>(n0, n1, wp, row_bytes, nb, up, qr, pn, M, N, K, bp, yp);
    }
  });
#endif
}

bool gguf_q8_tiled_supports(int64_t qtype) { return tiled_supports(qtype); }

}  // namespace

namespace oi {
// for gguf_q8_gemm.cpp's small-M entry (kernels.h): from kTileFrom rows it hands over to the tiles
void gguf_gemm_q8_tiled(at::Tensor y, const at::Tensor& x, const at::Tensor& data, int64_t qtype,
                        const c10::optional<at::Tensor>& bias) {
  gguf_linear_q8_tiled(std::move(y), x, data, qtype, bias);
}
bool gguf_q8_tiled_has(int64_t qtype) { return tiled_supports(qtype); }
}  // namespace oi

TORCH_LIBRARY_FRAGMENT(openinfer_cpu, m) {
  m.def("gguf_linear_q8_tiled(Tensor(a!) y, Tensor x, Tensor data, int qtype, Tensor? bias) -> ()");
  m.impl("gguf_linear_q8_tiled", c10::DispatchKey::CPU, &gguf_linear_q8_tiled);
  m.def("gguf_q8_tiled_supports(int qtype) -> bool", &gguf_q8_tiled_supports);
}
