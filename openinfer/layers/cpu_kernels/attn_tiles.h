// Register-tiled attention products shared by the latent-cache kernels (mla_decode.cpp, sparse_attention.cpp):
// scores of a few query heads against a few key rows, and probability-weighted sums of value rows, with the
// accumulators of a tile held in registers. Header-only (inline, anonymous namespace), after vec.h.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "vec.h"

namespace {

// vec.h's vectors are one register each (zmm with AVX-512, ymm otherwise), so a tile of accumulators is exactly
// what fits in the register file.

// sc[i * ld + j] = q[i] . k[j] for NH heads (rows of q, stride D) and NK keys (rows of k, stride D): NH x NK
// accumulators in registers, each key vector loaded once for all NH heads.
// Also prefetches npf 64-byte lines from pf, one per k step (chunk_scores says why).
template <int NH, int NK>
inline void tile_scores(const float* __restrict__ q, const float* __restrict__ k, int64_t D, float* __restrict__ sc,
                        int64_t ld, const char* pf = nullptr, int64_t npf = 0) {
  vfloat acc[NH][NK] = {};
  for (int64_t c = 0, it = 0; c < D; c += kW, ++it) {
    if (it < npf) __builtin_prefetch(pf + 64 * it);
    vfloat kv[NK];
#pragma GCC unroll 8
    for (int j = 0; j < NK; ++j) kv[j] = loadv_reg(k + j * D + c);
#pragma GCC unroll 8
    for (int i = 0; i < NH; ++i) {
      const vfloat qv = loadv_reg(q + i * D + c);
#pragma GCC unroll 8
      for (int j = 0; j < NK; ++j) acc[i][j] += qv * kv[j];
    }
  }
  for (int i = 0; i < NH; ++i) {
    for (int j = 0; j < NK; ++j) sc[i * ld + j] = hsum(acc[i][j]);
  }
}

inline float dot_scalar(const float* __restrict__ q, const float* __restrict__ k, int64_t D) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < D; ++d) s += q[d] * k[d];
  return s;
}

// sc[g * ld + t] = qf[g] . rows[t] for g < G, t < n: tiles of 2 heads x 4 keys; a group of 4 rows (9 KB in fp32)
// stays in L1 while every head pair goes by.
// pf / pf_bytes: memory the caller reads next (the next cache block, which sits anywhere, so the hardware
// prefetcher cannot guess it), prefetched a few lines per tile, one per k step. Prefetched all at once before
// the chunk, a 36 KB fp32 block's 576 lines measured no faster than no prefetch at all (most are dropped), and
// the kernel waited on every block: spread, the MLA decode over 4 layers' caches (more than L3) ran 1.2-1.4x
// faster (B = 32 / 128, DeepSeek-V3 shapes, Zen 3).
inline void chunk_scores(const float* __restrict__ qf, int64_t G, const float* __restrict__ rows, int64_t n,
                         int64_t D, float* __restrict__ sc, int64_t ld, const char* pf = nullptr,
                         int64_t pf_bytes = 0) {
  if (D % kW) {
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t g = 0; g < G; ++g) sc[g * ld + t] = dot_scalar(qf + g * D, rows + t * D, D);
    }
    return;
  }
  const int64_t tiles = n / 4 * ((G + 1) / 2), lines = pf ? (pf_bytes + 63) / 64 : 0;
  const int64_t per = tiles ? (lines + tiles - 1) / tiles : 0;  // lines per tile
  int64_t done = 0;                                              // lines handed to tiles so far
  auto share = [&]() { return std::max<int64_t>(0, std::min(per, lines - done)); };
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    int64_t g = 0;
    for (; g + 2 <= G; g += 2, done += per)
      tile_scores<2, 4>(qf + g * D, rows + t * D, D, sc + g * ld + t, ld, pf + 64 * done, share());
    if (g < G) {
      tile_scores<1, 4>(qf + g * D, rows + t * D, D, sc + g * ld + t, ld, pf + 64 * done, share());
      done += per;
    }
  }
  for (; t < n; ++t) {
    int64_t g = 0;
    for (; g + 2 <= G; g += 2) tile_scores<2, 1>(qf + g * D, rows + t * D, D, sc + g * ld + t, ld);
    if (g < G) tile_scores<1, 1>(qf + g * D, rows + t * D, D, sc + g * ld + t, ld);
  }
}

// acc[i, c : c + 4 kW] += sum_{t < n} p[i, t] * rows[t, c : c + 4 kW] for NH heads: NH x 4 accumulators in
// registers, each value vector loaded once for all NH heads.
template <int NH>
inline void tile_values(float* __restrict__ acc, int64_t Dv, const float* __restrict__ p, int64_t ld,
                        const float* __restrict__ v, int64_t n, int64_t D) {
  vfloat a[NH][4];
  for (int i = 0; i < NH; ++i) {
    for (int j = 0; j < 4; ++j) a[i][j] = loadv(acc + i * Dv + j * kW);
  }
  for (int64_t t = 0; t < n; ++t) {
    vfloat vv[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) vv[j] = loadv_reg(v + t * D + j * kW);
#pragma GCC unroll 8
    for (int i = 0; i < NH; ++i) {
      const float pt = p[i * ld + t];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) a[i][j] += pt * vv[j];
    }
  }
  for (int i = 0; i < NH; ++i) {
    for (int j = 0; j < 4; ++j) storev(acc + i * Dv + j * kW, a[i][j]);
  }
}

// acc[g, :Dv] += sum_{t < n} p[g, t] * rows[t, :Dv] (rows of stride D). Column slices outer, heads inner: a
// 4-vector-wide slice of the n rows stays in L1 for every head pair.
inline void chunk_values(float* __restrict__ acc, int64_t G, int64_t Dv, const float* __restrict__ p,
                         int64_t ld, const float* __restrict__ rows, int64_t n, int64_t D) {
  if (Dv % (4 * kW) == 0) {
    for (int64_t c = 0; c < Dv; c += 4 * kW) {
      int64_t g = 0;
      for (; g + 2 <= G; g += 2) tile_values<2>(acc + g * Dv + c, Dv, p + g * ld, ld, rows + c, n, D);
      if (g < G) tile_values<1>(acc + g * Dv + c, Dv, p + g * ld, ld, rows + c, n, D);
    }
    return;
  }
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t t = 0; t < n; ++t) {
      const float pt = p[g * ld + t];
      const float* __restrict__ v = rows + t * D;
      float* __restrict__ a = acc + g * Dv;
#pragma omp simd
      for (int64_t d = 0; d < Dv; ++d) a[d] += pt * v[d];
    }
  }
}

inline void scale_row(float* __restrict__ row, float a, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) row[d] *= a;
}


// Online softmax over one chunk of n keys for G heads: sc[g * ld + t] holds scores (t < n), becomes exp(score -
// new max); mx / sum / acc rows [g, :Dv] are rescaled when a head's max grows. Padding t in [n, ld) is set to
// -inf so that a whole-vector sweep over ld is safe; it is never used for values.
inline void online_softmax_chunk(float* __restrict__ sc, int64_t ld, int64_t n, int64_t G, float* __restrict__ mx,
                                 float* __restrict__ sum, float* __restrict__ acc, int64_t Dv) {
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t g = 0; g < G; ++g) {
    float* __restrict__ sg = sc + g * ld;
    for (int64_t t = n; t < ld; ++t) sg[t] = ninf;
    vfloat m = loadv(sg);
    for (int64_t c = kW; c < ld; c += kW) m = vmax(m, loadv(sg + c));
    const float bmax = std::max(mx[g], hmax(m));
    if (bmax > mx[g]) {
      const float alpha = exp_neg(mx[g] - bmax);
      sum[g] *= alpha;
      scale_row(acc + g * Dv, alpha, Dv);
      mx[g] = bmax;
    }
    vfloat s = {};
    for (int64_t c = 0; c < ld; c += kW) {
      const vfloat e = vexp_neg(loadv(sg + c) - bmax);
      storev(sg + c, e);
      s += e;
    }
    sum[g] += hsum(s);
  }
}

// Heads per task: all of them when there are enough sequences for the threads (each chunk re-reads the
// sequence's rows), else fewer, at least 4 so a group of rows is still shared by several heads.
inline int64_t heads_per_task(int64_t B, int64_t H, int64_t threads) {
  const int64_t want_chunks = std::max<int64_t>(1, (2 * threads + B - 1) / B);
  const int64_t chunks = std::min<int64_t>(want_chunks, std::max<int64_t>(1, H / 4));
  return std::min<int64_t>((H + chunks - 1) / chunks, 32);
}

}  // namespace
