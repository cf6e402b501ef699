// The register tiles of the panel GEMM (panel_gemm.cpp, whose header comment says why this layout and loop), shared
// with the routed experts on panels (moe_panels.cpp). W [N, K] sits in panels [ceil(N / 16), K, 16]: panel p, row k
// holds W[16p .. 16p + 15, k], rows past N zero. Header-only, in an anonymous namespace: each kernel file gets its
// own copy.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include <c10/util/BFloat16.h>

namespace {

constexpr int64_t kPanel = 16;  // output columns per panel
constexpr int kMaxTile = 6;     // activation rows per register tile
// The first row tile of a panel streams it from memory; from kPrefetchMinRows rows it also prefetches
// kPrefetchRows rows ahead (1.5 KB of fp32). Measured (scripts/panel_gemm_speed.py shapes, weights cycled through
// 160 MB, 1 thread, Zen 3): 1.15-1.25x at M = 4-16, +3-5 % at M = 32; at M = 1-3 this one-per-k-step prefetch
// only cost load slots (their own follows). 16 and 64 rows ahead measured a little worse.
constexpr int64_t kPrefetchRows = 24;
constexpr int kPrefetchMinRows = 4;  // (row_tile's dispatch)
// Tiles of 1-3 rows prefetch too, every 64-byte line kPrefetchSmallBytes ahead (not per k step as above: their
// steps cover 2-4 rows), except fp32 at 1 row. A bf16 line costs twice fp32's instructions (a shift and a mask per
// row), and 2-3 rows are more FMAs per line, so the out-of-order window reaches fewer misses ahead than the 1-row
// fp32 loop, whose load ports the prefetches only crowd. Measured (one thread, Zen 3, 5632 x 1024 panels streamed
// from 160 MB, plain read 15-18 GB/s): bf16 1-3 rows 14.3-14.6 -> 16.4-16.8 GB/s; fp32 2 rows 12.3-13.2 -> 14.0-15.0,
// 3 rows 11.3-12.1 -> 13.1-14.3, 1 row 15.4-16.1 -> 13.7-14.0 (so not there).
constexpr int64_t kPrefetchSmallBytes = 1024;
// Calls with more than kRowBlockFrom activation rows (prefill) run in blocks of kRowBlock rows, every panel going by
// each block in turn: the block's rows (96 x K floats, 192 KB at K = 512) stay in L2 while the panels stream, where
// all M rows otherwise went through L2 once per panel. Measured (1 thread, Zen 3, weights cycled through 160 MB,
// fp32): M = 2048 84-91 -> 92-97 GFLOP/s (1536 x 384, 2048 x 512, 512 x 1024, 2816 x 512, 32000 x 512), M = 1024
// 2048 x 512 83 -> 90-91, M = 256 / 512 no change (so not blocked); blocks of 256 or 512 rows gained less.
constexpr int64_t kRowBlock = 96;
constexpr int64_t kRowBlockFrom = 512;
inline int64_t row_block(int64_t M) { return M > kRowBlockFrom ? kRowBlock : std::max<int64_t>(M, 1); }
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef uint32_t u32x8 __attribute__((vector_size(32), aligned(2)));

// Row k of a panel as two 8-float vectors (columns 0-7, 8-15): fp32 as stored. bf16 panels store each row's 16
// values interleaved, c0 c8 c1 c9 ... c7 c15 (cpu_ops.pack_panels), so as 8 32-bit lanes the low halves are columns
// 0-7 and the high halves columns 8-15, and widening is a shift and a mask on one load (bf16 is the top half of an
// fp32: exact). A plain zero-extension measured 13 GB/s at batch 1 where this streams like fp32: GCC splits each
// 8-value vpmovzxwd into two 128-bit ones, a shift and an insert.
inline void load_row(const float* p, v8& lo, v8& hi) {
  lo = *reinterpret_cast<const v8*>(p);
  hi = *reinterpret_cast<const v8*>(p + 8);
}
inline void load_row(const c10::BFloat16* p, v8& lo, v8& hi) {
  const u32x8 v = *reinterpret_cast<const u32x8*>(p);
  lo = reinterpret_cast<v8>(v << 16);
  hi = reinterpret_cast<v8>(v & 0xFFFF0000u);
}

inline void put(float* y, float v) { *y = v; }
inline void put(c10::BFloat16* y, float v) { *y = c10::BFloat16(v); }  // round to nearest even, as torch

// fp32 sums (+ fp32 bias) rounded once into y's type
template <typename YT>
inline void store_cols(YT* y, const float* out, int cols, const float* bias) {
  for (int c = 0; c < cols; ++c) put(y + c, bias ? out[c] + bias[c] : out[c]);
}

// MR activation rows (fp32, stride ldx) x one panel over all K, into acc (MR x 16 fp32 sums, row i at acc + 16 i).
// Tiles of under 4 rows split k over CH chains (even / odd k, or k mod 4 for one row) so that >= 8 independent
// accumulators cover the FMA latency (4 cycles, 2 ports): with the panel in cache, one chain ran 2-row tiles at
// 22 GFLOP/s and 1-row at 23 where these run 41 and 32.
template <int MR, bool PF, typename WT>
inline void row_tile(const float* __restrict x, int64_t ldx, const WT* __restrict wp, int64_t K,
                     float* __restrict acc) {
  constexpr int CH = MR == 1 ? 4 : MR <= 3 ? 2 : 1;
  v8 lo[CH][MR], hi[CH][MR];
  for (int c = 0; c < CH; ++c)
    for (int i = 0; i < MR; ++i) lo[c][i] = hi[c][i] = v8{};
  // the 64-byte lines of panel a k step of CH rows covers: what a small tile prefetches per step (1-2)
  constexpr int kLines = static_cast<int>(CH * kPanel * sizeof(WT) / 64);
  const char* wb = reinterpret_cast<const char*>(wp);
  int64_t k = 0;
  for (; k + CH <= K; k += CH) {
    if (PF && MR >= kPrefetchMinRows) {
      __builtin_prefetch(wp + (k + kPrefetchRows) * kPanel);
    } else if (PF) {
      for (int l = 0; l < kLines; ++l) __builtin_prefetch(wb + k * kPanel * sizeof(WT) + kPrefetchSmallBytes + 64 * l);
    }
    for (int c = 0; c < CH; ++c) {
      v8 w0, w1;
      load_row(wp + (k + c) * kPanel, w0, w1);
      for (int i = 0; i < MR; ++i) {
        const float s = x[i * ldx + k + c];
        lo[c][i] += s * w0;
        hi[c][i] += s * w1;
      }
    }
  }
  for (; k < K; ++k) {
    v8 w0, w1;
    load_row(wp + k * kPanel, w0, w1);
    for (int i = 0; i < MR; ++i) {
      const float s = x[i * ldx + k];
      lo[0][i] += s * w0;
      hi[0][i] += s * w1;
    }
  }
  for (int i = 0; i < MR; ++i) {
    v8 l = lo[0][i], h = hi[0][i];
    for (int c = 1; c < CH; ++c) {
      l += lo[c][i];
      h += hi[c][i];
    }
    float* a = acc + i * kPanel;
    *reinterpret_cast<v8*>(a) = l;
    *reinterpret_cast<v8*>(a + 8) = h;
  }
}

template <bool PF, typename WT>
inline void row_tile(int r, const float* x, int64_t ldx, const WT* wp, int64_t K, float* acc) {
  switch (r) {
    case 6: return row_tile<6, PF>(x, ldx, wp, K, acc);
    case 5: return row_tile<5, PF>(x, ldx, wp, K, acc);
    case 4: return row_tile<4, PF>(x, ldx, wp, K, acc);
    case 3: return row_tile<3, PF>(x, ldx, wp, K, acc);  // < kPrefetchMinRows: kPrefetchSmallBytes
    case 2: return row_tile<2, PF>(x, ldx, wp, K, acc);
    default: return row_tile<1, PF && sizeof(WT) == 2>(x, ldx, wp, K, acc);  // fp32: none
  }
}

// M activation rows x one panel: row tiles of up to kMaxTile rows, each over all of K, the first one streaming the
// panel from memory (and prefetching), the others reading it from L1 / L2. Tiles are balanced when each keeps
// >= 5 rows (M = 16: 6 + 5 + 5, measured 60 -> 65-68 GFLOP/s over 6 + 6 + 4); otherwise full tiles first (M = 8:
// 6 + 2, 53-57 GFLOP/s against 40 for 4 + 4; M = 13: 6 + 6 + 1, 68 against 51 for 5 + 4 + 4).
// Tiles taking turns over k blocks of 128 rows (every tile's FMAs inside the stream) measured no better than this
// at M = 8-24 without the prefetch and worse with it.
template <typename WT, typename YT>
void panel_rows(const float* x, int64_t ldx, const WT* pw, int64_t K, YT* y, int64_t ldy, int64_t M, int cols,
                const float* bias) {
  const int64_t tiles = (M + kMaxTile - 1) / kMaxTile;
  float acc[kMaxTile * kPanel];
  int64_t m = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int r = static_cast<int>(M >= 5 * tiles ? (M - m) / (tiles - t) : std::min<int64_t>(kMaxTile, M - m));
    if (t == 0)
      row_tile<true>(r, x, ldx, pw, K, acc);
    else
      row_tile<false>(r, x + m * ldx, ldx, pw, K, acc);
    for (int i = 0; i < r; ++i) store_cols(y + (m + i) * ldy, acc + i * kPanel, cols, bias);
    m += r;
  }
}

}  // namespace
