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
inline void store_cols(YT* y, const v8 lo, const v8 hi, int cols, const float* bias) {
  float out[kPanel];
  std::memcpy(out, &lo, sizeof(lo));
  std::memcpy(out + 8, &hi, sizeof(hi));
  for (int c = 0; c < cols; ++c) put(y + c, bias ? out[c] + bias[c] : out[c]);
}

// MR activation rows (fp32, stride ldx) x one panel, over all K; writes cols (<= 16) outputs per row (stride ldy)
template <int MR, typename WT, typename YT>
inline void row_tile(const float* __restrict x, int64_t ldx, const WT* __restrict wp, int64_t K,
                     YT* __restrict y, int64_t ldy, int cols, const float* bias) {
  v8 lo[MR], hi[MR];
  for (int i = 0; i < MR; ++i) lo[i] = hi[i] = v8{};
  for (int64_t k = 0; k < K; ++k) {
    v8 w0, w1;
    load_row(wp + k * kPanel, w0, w1);
    for (int i = 0; i < MR; ++i) {
      const float s = x[i * ldx + k];
      lo[i] += s * w0;
      hi[i] += s * w1;
    }
  }
  for (int i = 0; i < MR; ++i) store_cols(y + i * ldy, lo[i], hi[i], cols, bias);
}

// one activation row: even and odd k in separate chains
template <typename WT, typename YT>
inline void single_row(const float* __restrict x, const WT* __restrict wp, int64_t K, YT* __restrict y, int cols,
                       const float* bias) {
  v8 a0{}, a1{}, b0{}, b1{};
  int64_t k = 0;
  for (; k + 2 <= K; k += 2) {
    v8 w0, w1, w2, w3;
    load_row(wp + k * kPanel, w0, w1);
    load_row(wp + (k + 1) * kPanel, w2, w3);
    a0 += x[k] * w0;
    a1 += x[k] * w1;
    b0 += x[k + 1] * w2;
    b1 += x[k + 1] * w3;
  }
  if (k < K) {
    v8 w0, w1;
    load_row(wp + k * kPanel, w0, w1);
    a0 += x[k] * w0;
    a1 += x[k] * w1;
  }
  store_cols(y, a0 + b0, a1 + b1, cols, bias);
}

// M activation rows x one panel: row tiles of up to kMaxTile (see panel_gemm.cpp for the split)
template <typename WT, typename YT>
void panel_rows(const float* x, int64_t ldx, const WT* pw, int64_t K, YT* y, int64_t ldy, int64_t M, int cols,
                const float* bias) {
  if (M == 1) return single_row(x, pw, K, y, cols, bias);
  const int64_t tiles = (M + kMaxTile - 1) / kMaxTile;
  int64_t m = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int r = static_cast<int>(M >= 5 * tiles ? (M - m) / (tiles - t) : std::min<int64_t>(kMaxTile, M - m));
    const float* xr = x + m * ldx;
    YT* yr = y + m * ldy;
    switch (r) {
      case 6: row_tile<6>(xr, ldx, pw, K, yr, ldy, cols, bias); break;
      case 5: row_tile<5>(xr, ldx, pw, K, yr, ldy, cols, bias); break;
      case 4: row_tile<4>(xr, ldx, pw, K, yr, ldy, cols, bias); break;
      case 3: row_tile<3>(xr, ldx, pw, K, yr, ldy, cols, bias); break;
      case 2: row_tile<2>(xr, ldx, pw, K, yr, ldy, cols, bias); break;
      default: row_tile<1>(xr, ldx, pw, K, yr, ldy, cols, bias); break;
    }
    m += r;
  }
}

}  // namespace
