// The register tiles of the panel GEMM (panel_gemm.cpp, whose header comment says why this layout and loop), shared
// with the routed experts on panels (moe_panels.cpp). W [N, K] sits in panels [ceil(N / 16), K, 16]: panel p, row k
// holds W[16p .. 16p + 15, k], rows past N zero. Header-only, in an anonymous namespace: each kernel file gets its
// own copy.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kPanel = 16;  // output columns per panel
constexpr int kMaxTile = 6;     // activation rows per register tile
typedef float v8 __attribute__((vector_size(32), aligned(4)));

inline v8 load8(const float* p) { return *reinterpret_cast<const v8*>(p); }

inline void store_cols(float* y, const v8 lo, const v8 hi, int cols, const float* bias) {
  float out[kPanel];
  std::memcpy(out, &lo, sizeof(lo));
  std::memcpy(out + 8, &hi, sizeof(hi));
  if (bias)
    for (int c = 0; c < cols; ++c) y[c] = out[c] + bias[c];
  else
    std::memcpy(y, out, cols * sizeof(float));
}

// MR activation rows (stride ldx) x one panel, over all K; writes cols (<= 16) outputs per row (stride ldy)
template <int MR>
inline void row_tile(const float* __restrict x, int64_t ldx, const float* __restrict wp, int64_t K,
                     float* __restrict y, int64_t ldy, int cols, const float* bias) {
  v8 lo[MR], hi[MR];
  for (int i = 0; i < MR; ++i) lo[i] = hi[i] = v8{};
  for (int64_t k = 0; k < K; ++k) {
    const v8 w0 = load8(wp + k * kPanel), w1 = load8(wp + k * kPanel + 8);
    for (int i = 0; i < MR; ++i) {
      const float s = x[i * ldx + k];
      lo[i] += s * w0;
      hi[i] += s * w1;
    }
  }
  for (int i = 0; i < MR; ++i) store_cols(y + i * ldy, lo[i], hi[i], cols, bias);
}

// one activation row: even and odd k in separate chains
inline void single_row(const float* __restrict x, const float* __restrict wp, int64_t K, float* __restrict y,
                       int cols, const float* bias) {
  v8 a0{}, a1{}, b0{}, b1{};
  int64_t k = 0;
  for (; k + 2 <= K; k += 2) {
    const float* w = wp + k * kPanel;
    a0 += x[k] * load8(w);
    a1 += x[k] * load8(w + 8);
    b0 += x[k + 1] * load8(w + 16);
    b1 += x[k + 1] * load8(w + 24);
  }
  if (k < K) {
    a0 += x[k] * load8(wp + k * kPanel);
    a1 += x[k] * load8(wp + k * kPanel + 8);
  }
  store_cols(y, a0 + b0, a1 + b1, cols, bias);
}

void panel_rows(const float* x, int64_t ldx, const float* pw, int64_t K, float* y, int64_t ldy, int64_t M, int cols,
                const float* bias) {
  if (M == 1) return single_row(x, pw, K, y, cols, bias);
  const int64_t tiles = (M + kMaxTile - 1) / kMaxTile;
  int64_t m = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int r = static_cast<int>(M >= 5 * tiles ? (M - m) / (tiles - t) : std::min<int64_t>(kMaxTile, M - m));
    const float* xr = x + m * ldx;
    float* yr = y + m * ldy;
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
