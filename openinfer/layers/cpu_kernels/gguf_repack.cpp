// Q4_K / Q6_K weights repacked at load, 8 output rows interleaved (llama.cpp's REPACK idea, layers/gguf_quant.py's
// ``GGUFWeight.repacked``), times int8 activations: one pass over the weights serves every activation row, with each
// super-block's scales decoded once per 8 weight rows, where the small-M kernel (gguf_q8_gemm.cpp) re-decodes every
// block per 4 activation rows and reduces per row, and the tile kernel (gguf_q8_tiles.cpp) decodes the weights into
// 1-byte tiles on every call. The arithmetic is gguf_q8_gemm.cpp's (``matmul_q8_reference``): the same integers, the
// same fp32 scale products; only the fp32 order of the sums differs.
//
// Layout: rows padded to a multiple of 8 with zero rows (d = 0: they add nothing); group g = rows 8g .. 8g + 7 holds,
// per super-block b (256 columns), one chunk, the chunks of a group contiguous (so the tensor is [N8, nb * bytes / 8]
// with the group in its 8 rows):
//   Q4_K, 1184 bytes = 8 x 148 (the file's 144 + 4: scales and mins as bytes, not 6-bit packed):
//     [0, 16) d of rows 0-7 (fp16), [16, 32) dmin, [32, 96) scale of sub-block j for row r at 32 + 8 j + r,
//     [96, 160) min likewise, [160, 1184) sub-block j's 128 bytes at 160 + 128 j: 4 vectors of 32 bytes, vector v
//     byte 4 r + i = q[r][32 j + 4 v + i] | q[r][32 j + 16 + 4 v + i] << 4 (quads v and v + 4 of the sub-block).
//   Q6_K, 1680 bytes = 8 x 210 (the file's size):
//     [0, 16) d (fp16), [16, 144) scale of 16-column group k for row r at 16 + 8 k + r (int8),
//     [144, 1680) sub-block j's 192 bytes at 144 + 192 j: 4 vectors of low nibbles as Q4_K's (quads v, v + 4), then
//     2 vectors of high 2-bit pairs, vector h byte 4 r + i = Σ_t hi(q[r][32 j + 16 h + 4 t + i]) << 2 t.
// So one 256-bit load gives 8 weight rows x 4 columns of two quads, and an activation quad broadcast to the 8 lanes
// runs one integer dot product for 8 outputs (u8 weights 0..15 / 0..63 times s8 activations: Q6_K's offset 32 as the
// dot's start, -32 Σ q_x per 16 columns).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "gguf_blocks.h"
#include "gguf_q8_act.h"
#include "kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kR8Offset = 1000;  // a repacked type's code: 1000 + the file's GGML type (Q4_K 1012, Q6_K 1014)

inline bool is_r8(int64_t code) { return code == kR8Offset + Q4_K || code == kR8Offset + Q6_K; }
inline int chunk_bytes(int64_t base) { return base == Q4_K ? 1184 : 1680; }

// ---- repack / unpack (load time; scalar, exact byte moves) --------------------------------------------------------

void repack_chunk(int64_t t, const uint8_t* const rows[8], uint8_t* c) {
  if (t == Q4_K) {
    for (int r = 0; r < 8; ++r) {
      const uint8_t* b = rows[r];
      std::memcpy(c + 2 * r, b, 2);
      std::memcpy(c + 16 + 2 * r, b + 2, 2);
      int sc[8], mn[8];
      scale_min_k4(b + 4, sc, mn);
      for (int j = 0; j < 8; ++j) {
        c[32 + 8 * j + r] = static_cast<uint8_t>(sc[j]);
        c[96 + 8 * j + r] = static_cast<uint8_t>(mn[j]);
      }
      for (int j = 0; j < 8; ++j)
        for (int v = 0; v < 4; ++v)
          for (int i = 0; i < 4; ++i) {
            auto q = [&](int col) {  // element 32 j + col of the file's super-block
              const uint8_t byte = b[16 + 32 * (j / 2) + col];
              return (j & 1) ? byte >> 4 : byte & 0xF;
            };
            c[160 + 128 * j + 32 * v + 4 * r + i] = static_cast<uint8_t>(q(4 * v + i) | (q(16 + 4 * v + i) << 4));
          }
    }
  } else {
    for (int r = 0; r < 8; ++r) {
      const uint8_t* b = rows[r];
      std::memcpy(c + 2 * r, b + 208, 2);
      for (int k = 0; k < 16; ++k) c[16 + 8 * k + r] = b[192 + k];
      auto q = [&](int e) {  // element e of the file's super-block, 0..63
        const int h = e / 128, j = (e % 128) / 32, i = e % 32;
        const int lo = (b[64 * h + 32 * (j & 1) + i] >> (4 * (j / 2))) & 0xF;
        const int hi = (b[128 + 32 * h + i] >> (2 * j)) & 3;
        return lo | (hi << 4);
      };
      for (int j = 0; j < 8; ++j) {
        uint8_t* s = c + 144 + 192 * j;
        for (int v = 0; v < 4; ++v)
          for (int i = 0; i < 4; ++i)
            s[32 * v + 4 * r + i] =
                static_cast<uint8_t>((q(32 * j + 4 * v + i) & 0xF) | ((q(32 * j + 16 + 4 * v + i) & 0xF) << 4));
        for (int h = 0; h < 2; ++h)
          for (int i = 0; i < 4; ++i) {
            int bits = 0;
            for (int t4 = 0; t4 < 4; ++t4) bits |= (q(32 * j + 16 * h + 4 * t4 + i) >> 4) << (2 * t4);
            s[128 + 32 * h + 4 * r + i] = static_cast<uint8_t>(bits);
          }
      }
    }
  }
}

// The file's super-block of row r back from a chunk (unpack: the torch reference, dequantisation, fp32 fallbacks).
void unpack_row(int64_t t, const uint8_t* c, int r, uint8_t* b) {
  if (t == Q4_K) {
    std::memcpy(b, c + 2 * r, 2);
    std::memcpy(b + 2, c + 16 + 2 * r, 2);
    uint8_t sc[8], mn[8];
    for (int j = 0; j < 8; ++j) {
      sc[j] = c[32 + 8 * j + r];
      mn[j] = c[96 + 8 * j + r];
    }
    for (int j = 0; j < 4; ++j) {  // get_scale_min_k4's inverse
      b[4 + j] = static_cast<uint8_t>((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
      b[8 + j] = static_cast<uint8_t>((mn[j] & 63) | ((mn[j + 4] >> 4) << 6));
      b[12 + j] = static_cast<uint8_t>((sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4));
    }
    std::memset(b + 16, 0, 128);
    for (int j = 0; j < 8; ++j)
      for (int v = 0; v < 4; ++v)
        for (int i = 0; i < 4; ++i) {
          const uint8_t byte = c[160 + 128 * j + 32 * v + 4 * r + i];
          const int qs[2] = {byte & 0xF, byte >> 4};
          for (int half = 0; half < 2; ++half) {
            const int col = 16 * half + 4 * v + i;
            b[16 + 32 * (j / 2) + col] |= static_cast<uint8_t>((j & 1) ? qs[half] << 4 : qs[half]);
          }
        }
  } else {
    std::memcpy(b + 208, c + 2 * r, 2);
    for (int k = 0; k < 16; ++k) b[192 + k] = c[16 + 8 * k + r];
    std::memset(b, 0, 192);
    for (int j = 0; j < 8; ++j) {
      const uint8_t* s = c + 144 + 192 * j;
      for (int col = 0; col < 32; ++col) {
        const int v = (col % 16) / 4, i = col % 4, half = col / 16;
        const int lo = (s[32 * v + 4 * r + i] >> (4 * half)) & 0xF;
        const int hi = (s[128 + 32 * half + 4 * r + i] >> (2 * v)) & 3;
        const int e = 32 * j + col, h = e / 128, jj = (e % 128) / 32, ii = e % 32;
        b[64 * h + 32 * (jj & 1) + ii] |= static_cast<uint8_t>(lo << (4 * (jj / 2)));
        b[128 + 32 * h + ii] |= static_cast<uint8_t>(hi << (2 * jj));
      }
    }
  }
}

at::Tensor gguf_repack8(const at::Tensor& data, int64_t qtype) {
  TORCH_CHECK(qtype == Q4_K || qtype == Q6_K, "gguf_repack8: type ", qtype, " has no repacked layout (Q4_K, Q6_K)");
  TORCH_CHECK(data.dim() == 2 && data.is_contiguous() && data.scalar_type() == at::kByte,
              "gguf_repack8: data must be contiguous uint8 [N, row_bytes]");
  const Format f = format_of(qtype);
  const int64_t N = data.size(0), nb = data.size(1) / f.bytes, groups = (N + 7) / 8, cb = chunk_bytes(qtype);
  TORCH_CHECK(nb > 0 && data.size(1) == nb * f.bytes, "gguf_repack8: row bytes ", data.size(1), " are not whole blocks");
  at::Tensor out = at::empty({groups * 8, nb * cb / 8}, data.options());
  const uint8_t* src = data.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const std::vector<uint8_t> zero(f.bytes, 0);  // the padding rows: d = 0
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* rows[8];
        for (int r = 0; r < 8; ++r)
          rows[r] = 8 * g + r < N ? src + (8 * g + r) * data.size(1) + b * f.bytes : zero.data();
        repack_chunk(qtype, rows, dst + (g * nb + b) * cb);
      }
  });
  return out;
}

at::Tensor gguf_unpack8(const at::Tensor& data, int64_t code, int64_t N) {
  TORCH_CHECK(is_r8(code), "gguf_unpack8: code ", code, " is not a repacked type");
  const int64_t t = code - kR8Offset, cb = chunk_bytes(t);
  const Format f = format_of(t);
  TORCH_CHECK(data.dim() == 2 && data.is_contiguous() && data.scalar_type() == at::kByte && data.size(0) % 8 == 0 &&
                  data.size(0) >= N && N > 0 && data.size(1) % (cb / 8) == 0,
              "gguf_unpack8: data must be contiguous uint8 [N rounded up to 8, super-blocks * ", cb / 8, "]");
  const int64_t nb = data.size(1) / (cb / 8);
  at::Tensor out = at::empty({N, nb * f.bytes}, data.options());
  const uint8_t* src = data.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t b = 0; b < nb; ++b) unpack_row(t, src + ((n / 8) * nb + b) * cb, n % 8, dst + (n * nb + b) * f.bytes);
  });
  return out;
}

// ---- the kernel ---------------------------------------------------------------------------------------------------

// Bytes ahead in the weight stream that the kernel prefetches. At batch 1 two threads stream ~30 GB/s, so ~100 ns of
// memory latency is ~1.5 KB in flight a thread; 1 KB ahead left the loads waiting. 4 KB: the Q4_K_M bench file's
// fused decode layers (scripts/gguf_layers_replay.py, 2 threads, 2-core EPYC, 23 pairs of alternating processes)
// had the lower median in 18 pairs (by up to 15 %) and the lower min in most (by 5-10 %); 8 KB was no better.
constexpr int64_t kPrefetch = 4096;

// Per activation row and 16-column group of Q6_K: 32 x the negated sum of q (the offset's share of the dot).
struct Q6Offsets {
  std::vector<int32_t> v;
};

#ifdef __AVX2__
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr int kMR4 = 8, kMR6 = 6;  // activation rows per pass (32 registers)
#else
constexpr int kMR4 = 4, kMR6 = 3;  // 16 registers: 2 x rows accumulators + the weights, constants and a broadcast
#endif

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}


// MR activation rows (xq [MR][K] int8, their scales dx and rounded sums xs [MR][G]) times one group's 8 rows: out
// [MR][8] (no bias).
template <int MR>
void group_q4k(const uint8_t* w, int64_t nb, const int8_t* xq, const float* dx, const float* xs, int64_t K, int64_t G,
               float* out) {
  const __m256i f = _mm256_set1_epi8(0xF);
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* c = w + b * 1184;
    const __m256 d = fp16x8(c), dmin = fp16x8(c + 16);
    for (int j = 0; j < 8; ++j) {
      const uint8_t* qs = c + 160 + 128 * j;
      __builtin_prefetch(qs + kPrefetch);
      __builtin_prefetch(qs + kPrefetch + 64);
      __m256i I[MR];
      for (int r = 0; r < MR; ++r) I[r] = _mm256_setzero_si256();
      const int8_t* xb = xq + 256 * b + 32 * j;
      for (int v = 0; v < 4; ++v) {
        const __m256i L = load32(qs + 32 * v);
        const __m256i lo = _mm256_and_si256(L, f), hi = _mm256_and_si256(_mm256_srli_epi16(L, 4), f);
        for (int r = 0; r < MR; ++r) {
          I[r] = dot4(I[r], lo, bcast4(xb + r * K + 4 * v));
          I[r] = dot4(I[r], hi, bcast4(xb + r * K + 16 + 4 * v));
        }
      }
      const __m256 s = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 32 + 8 * j)))));
      const __m256 mn = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                                _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 96 + 8 * j)))));
      const int64_t g = 8 * b + j;
      for (int r = 0; r < MR; ++r) {
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I[r]), _mm256_mul_ps(s, _mm256_broadcast_ss(dx + r * G + g)),
                                 acc[r]);
        acc[r] = _mm256_fnmadd_ps(mn, _mm256_broadcast_ss(xs + r * G + g), acc[r]);
      }
    }
  }
  for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

template <int MR>
void group_q6k(const uint8_t* w, int64_t nb, const int8_t* xq, const float* dx, const int32_t* off, int64_t K,
               int64_t G, float* out) {
  const __m256i f = _mm256_set1_epi8(0xF), three = _mm256_set1_epi8(3);
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* c = w + b * 1680;
    const __m256 d = fp16x8(c);
    for (int j = 0; j < 8; ++j) {
      const uint8_t* qs = c + 144 + 192 * j;
      __builtin_prefetch(qs + kPrefetch);
      __builtin_prefetch(qs + kPrefetch + 64);
      __builtin_prefetch(qs + kPrefetch + 128);
      const int64_t g = 8 * b + j;
      __m256i IA[MR], IB[MR];
      for (int r = 0; r < MR; ++r) {
        IA[r] = _mm256_set1_epi32(off[r * 2 * G + 2 * g]);
        IB[r] = _mm256_set1_epi32(off[r * 2 * G + 2 * g + 1]);
      }
      const int8_t* xb = xq + 32 * g;
      for (int v = 0; v < 4; ++v) {
        const __m256i L = load32(qs + 32 * v);
        const __m256i qa = _mm256_or_si256(
            _mm256_and_si256(L, f), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(load32(qs + 128), 2 * v), three), 4));
        const __m256i qb = _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16(L, 4), f),
            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(load32(qs + 160), 2 * v), three), 4));
        for (int r = 0; r < MR; ++r) {
          IA[r] = dot4(IA[r], qa, bcast4(xb + r * K + 4 * v));
          IB[r] = dot4(IB[r], qb, bcast4(xb + r * K + 16 + 4 * v));
        }
      }
      const __m256 sa = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                             _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 16 + 16 * j)))));
      const __m256 sb = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                             _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 24 + 16 * j)))));
      for (int r = 0; r < MR; ++r) {
        const __m256 dxr = _mm256_broadcast_ss(dx + r * G + g);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(IA[r]), _mm256_mul_ps(sa, dxr), acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(IB[r]), _mm256_mul_ps(sb, dxr), acc[r]);
      }
    }
  }
  for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out + 8 * r, acc[r]);
}
#endif

// The portable path: the group's rows back in the file's layout, then gguf_q8_gemm.cpp's integer dots per block.
void group_generic(int64_t t, const uint8_t* w, int64_t nb, const int8_t* xq, const float* dx, const float* xs,
                   int64_t M, int64_t K, int64_t G, float* out) {
  const Format f = format_of(t);
  const int cb = chunk_bytes(t);
  uint8_t blk[210];
  Decoded dec;
  for (int64_t i = 0; i < M * 8; ++i) out[i] = 0.f;
  for (int r = 0; r < 8; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      unpack_row(t, w + b * cb, r, blk);
      decode_block(t, blk, dec);
      const int sub = 32 / dec.group;
      for (int64_t m = 0; m < M; ++m)
        for (int a = 0; a < 8; ++a) {
          const int64_t g = b * 8 + a;
          const int8_t* xb = xq + m * K + 32 * g;
          float acc = 0.f;
          for (int s = 0; s < sub; ++s) {
            int32_t isum = 0;
            for (int i = 0; i < dec.group; ++i) isum += dec.q[32 * a + s * dec.group + i] * xb[s * dec.group + i];
            acc += dec.s[a * sub + s] * static_cast<float>(isum);
          }
          out[m * 8 + r] += acc * dx[m * G + g] + dec.o[a * sub] * xs[m * G + g];
        }
    }
  (void)f;
}

// From this many activation rows on, the tile kernel takes the repacked weights (gguf_q8_tiles.cpp's decode_r8:
// 16 columns decoded once into an int8 tile, one broadcast per two dots where this kernel has one per dot).
// gguf_r8_tile_from reports it; the op gguf_linear_q8_r8 is this kernel alone at any M (the per-M measurements).
constexpr int64_t kR8TileFrom = 32;

// Groups per block of the outer loop: their weights (8 x 8 rows) stay in L2 while every activation pass runs over
// them, so each pass's rows are read from L1 once per block, not once per 8 output columns.
constexpr int64_t kBlockGroups = 8;

void gguf_linear_q8_r8(at::Tensor y, const at::Tensor& x, const at::Tensor& data, int64_t code,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(is_r8(code), "gguf_linear_q8_r8: code ", code, " is not a repacked type");
  const int64_t t = code - kR8Offset, cb = chunk_bytes(t);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x must be contiguous fp32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), G = K / 32, nb = K / 256;
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && y.scalar_type() == at::kFloat && y.size(0) == M,
              "y must be contiguous fp32 [M, N]");
  const int64_t N = y.size(1), groups = (N + 7) / 8;
  TORCH_CHECK(K > 0 && K % 256 == 0 && data.dim() == 2 && data.is_contiguous() && data.scalar_type() == at::kByte &&
                  data.size(0) == groups * 8 && data.size(1) == nb * cb / 8,
              "gguf (repacked type ", code, "): K = ", K, " needs K a multiple of 256 and data uint8 [", groups * 8,
              ", ", nb * cb / 8, "], data has ", data.sizes());
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be contiguous fp32 [N]");
  if (M == 0 || N == 0) return;
  const float* xp = x.data_ptr<float>();
  thread_local QX qx;
  thread_local Q6Offsets q6;
  qx.reserve(M, K, G);
  if (t == Q6_K && static_cast<int64_t>(q6.v.size()) < M * 2 * G) q6.v.resize(M * 2 * G);
  QX& qr = qx;
  int32_t* offp = q6.v.data();
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t m0, int64_t m1) {
    quantize_rows(xp, K, qr, m0, m1);
    if (t == Q6_K)
      for (int64_t i = m0 * G; i < m1 * G; ++i) {
        const int32_t* nl = qr.nls.data() + 8 * i;
        offp[2 * i] = 32 * (nl[0] + nl[1] + nl[2] + nl[3]);
        offp[2 * i + 1] = 32 * (nl[4] + nl[5] + nl[6] + nl[7]);
      }
  });
  const uint8_t* wp = data.data_ptr<uint8_t>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t group_bytes = nb * cb;
  const int64_t grain = std::max<int64_t>(1, 32768 / group_bytes);
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    std::vector<float> outbuf;
    for (int64_t gb = g0; gb < g1; gb += kBlockGroups) {
      const int64_t ge = std::min(g1, gb + kBlockGroups);
#ifdef __AVX2__
      const int MR = t == Q4_K ? kMR4 : kMR6;
#else
      const int MR = static_cast<int>(std::min<int64_t>(M, 8));
      if (static_cast<int64_t>(outbuf.size()) < MR * 8) outbuf.resize(MR * 8);
#endif
      for (int64_t m = 0; m < M; m += MR) {
        const int mr = static_cast<int>(std::min<int64_t>(MR, M - m));
        const int8_t* xq = qr.q.data() + m * K;
        const float* dx = qr.d.data() + m * G;
        const float* xs = qr.sum.data() + m * G;
        for (int64_t g = gb; g < ge; ++g) {
          const uint8_t* w = wp + g * group_bytes;
#ifdef __AVX2__
          alignas(32) float out[8 * 8];
          if (t == Q4_K) {
            switch (mr) {
              case 8: group_q4k<(kMR4 >= 8 ? 8 : 1)>(w, nb, xq, dx, xs, K, G, out); break;
              case 7: group_q4k<(kMR4 >= 7 ? 7 : 1)>(w, nb, xq, dx, xs, K, G, out); break;
              case 6: group_q4k<(kMR4 >= 6 ? 6 : 1)>(w, nb, xq, dx, xs, K, G, out); break;
              case 5: group_q4k<(kMR4 >= 5 ? 5 : 1)>(w, nb, xq, dx, xs, K, G, out); break;
              case 4: group_q4k<4>(w, nb, xq, dx, xs, K, G, out); break;
              case 3: group_q4k<3>(w, nb, xq, dx, xs, K, G, out); break;
              case 2: group_q4k<2>(w, nb, xq, dx, xs, K, G, out); break;
              default: group_q4k<1>(w, nb, xq, dx, xs, K, G, out); break;
            }
          } else {
            const int32_t* off = offp + m * 2 * G;
            switch (mr) {
              case 6: group_q6k<(kMR6 >= 6 ? 6 : 1)>(w, nb, xq, dx, off, K, G, out); break;
              case 5: group_q6k<(kMR6 >= 5 ? 5 : 1)>(w, nb, xq, dx, off, K, G, out); break;
              case 4: group_q6k<(kMR6 >= 4 ? 4 : 1)>(w, nb, xq, dx, off, K, G, out); break;
              case 3: group_q6k<3>(w, nb, xq, dx, off, K, G, out); break;
              case 2: group_q6k<2>(w, nb, xq, dx, off, K, G, out); break;
              default: group_q6k<1>(w, nb, xq, dx, off, K, G, out); break;
            }
          }
#else
          float* out = outbuf.data();
          group_generic(t, w, nb, xq, dx, xs, mr, K, G, out);
#endif
          const int nc = static_cast<int>(std::min<int64_t>(8, N - 8 * g));
          for (int r = 0; r < mr; ++r) {
            float* yr = yp + (m + r) * N + 8 * g;
            for (int c = 0; c < nc; ++c) yr[c] = bp ? out[8 * r + c] + bp[8 * g + c] : out[8 * r + c];
          }
        }
      }
    }
  });
}

}  // namespace

namespace oi {
// for gguf_q8_gemm.cpp's entry (kernels.h): a repacked type's code goes here whatever M
bool gguf_is_r8(int64_t code) { return is_r8(code); }
void gguf_gemm_q8_r8(at::Tensor y, const at::Tensor& x, const at::Tensor& data, int64_t code,
                     const c10::optional<at::Tensor>& bias) {
  if (x.dim() == 2 && x.size(0) >= kR8TileFrom && is_r8(code) && gguf_q8_tiled_has(code - kR8Offset))
    return gguf_gemm_q8_tiled(std::move(y), x, data, code, bias);
  gguf_linear_q8_r8(std::move(y), x, data, code, bias);
}
}  // namespace oi

TORCH_LIBRARY_FRAGMENT(openinfer_cpu, m) {
  m.def("gguf_repack8(Tensor data, int qtype) -> Tensor", &gguf_repack8);
  m.def("gguf_unpack8(Tensor data, int code, int n) -> Tensor", &gguf_unpack8);
  m.def("gguf_r8_tile_from() -> int", +[]() -> int64_t { return kR8TileFrom; });
  m.def("gguf_linear_q8_r8(Tensor(a!) y, Tensor x, Tensor data, int code, Tensor? bias) -> ()");
  m.impl("gguf_linear_q8_r8", c10::DispatchKey::CPU, &gguf_linear_q8_r8);
}
