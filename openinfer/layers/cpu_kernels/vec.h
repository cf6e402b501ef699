// Shared helpers of the CPU kernels: native-width float vectors, a fast exp, and rows of fp32 / bf16 / fp16 (and
// fp8 e4m3, read only) converted to fp32 and back. Header-only (inline, in an anonymous namespace): each kernel
// file gets its own copy.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {
// ---- native-width float vectors ------------------------------------------------------------------------
//
// GCC/Clang vector types of kW floats, one register each: 16 lanes (a zmm) on AVX-512 builds, 8 (a ymm) on
// every other build. Not 16 everywhere: without AVX-512, GCC 12 lowers the compares and selects of a 64-byte
// generic vector lane by lane through the stack (48 scalar vcmpss in the MLA kernel's online softmax alone,
// a 16-lane argmax 30x slower than an 8-lane one), so the lane count follows the register width. Kernels use
// kW, never a literal 16, for block loops, tails and score-row padding.
//
// A head_dim that is a multiple of kW runs on them; other head dims take plain loops. With head_dim and the
// cache type as template parameters (64 and 128 specialised, any other at run time) every loop over head_dim
// has a fixed trip count and unrolls; with runtime trip counts the loop set-up cost more than the arithmetic.

typedef float vfloat8 __attribute__((vector_size(32)));
typedef float vfloat4 __attribute__((vector_size(16)));
// OI_VEC_LANES: kW for the preprocessor (code that shuffles whole vectors is written per width)
#if defined(__AVX512F__)
#define OI_VEC_LANES 16
#else
#define OI_VEC_LANES 8
#endif
constexpr int64_t kW = OI_VEC_LANES;
typedef float vfloat __attribute__((vector_size(4 * kW)));
typedef int32_t vint __attribute__((vector_size(4 * kW)));
typedef uint32_t vuint __attribute__((vector_size(4 * kW)));
typedef uint16_t vushort __attribute__((vector_size(2 * kW)));  // kW bf16 bit patterns
typedef uint8_t vubyte __attribute__((vector_size(kW)));        // kW fp8 codes

inline vfloat loadv(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void storev(float* p, vfloat v) { std::memcpy(p, &v, sizeof(v)); }

// loadv into a register that GCC may not fold back into its uses: for a vector that several FMAs share (a
// tile's key or value vector), GCC otherwise re-reads it as a memory operand in every FMA, and the loads, not
// the FMAs, bound the loop (attn_tiles.h). No-op where a vector is no single register (plain x86-64 builds).
inline vfloat loadv_reg(const float* p) {
  vfloat v = loadv(p);
#if defined(__AVX2__) || defined(__AVX512F__)
  asm("" : "+v"(v));
#endif
  return v;
}

inline vfloat splat(float x) { return vfloat{} + x; }

#if defined(__AVX2__) && OI_VEC_LANES == 8
// max, lanewise: vmaxps(a, b) returns b unless a > b, i.e. exactly a > b ? a : b, NaN handling included.
inline vfloat vmax(vfloat a, vfloat b) { return (vfloat)_mm256_max_ps((__m256)a, (__m256)b); }
#else
inline vfloat vmax(vfloat a, vfloat b) { return a > b ? a : b; }
#endif

// to8 / max8: a vector folded to 8 lanes (the sum / max of its halves on 16-lane builds), the first step of the
// horizontal reductions.
#if OI_VEC_LANES == 16
inline vfloat8 lo_half(vfloat v) { return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7); }
inline vfloat8 hi_half(vfloat v) { return __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15); }
inline vfloat8 to8(vfloat v) { return lo_half(v) + hi_half(v); }
inline vfloat8 max8(vfloat v) {
  const vfloat8 x = lo_half(v), y = hi_half(v);
  return x > y ? x : y;
}
#else
inline vfloat8 to8(vfloat v) { return v; }
inline vfloat8 max8(vfloat v) { return v; }
#endif

inline float hsum(vfloat v) {
  const vfloat8 a = to8(v);
  vfloat4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

#ifdef __AVX2__
// The same sum, in the same order, of one __m256 (the kernels written in AVX2 intrinsics).
inline float hsum8(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}
#endif

inline float hmax(vfloat v) {
  const vfloat8 a = max8(v);
  vfloat4 c = __builtin_shufflevector(a, a, 0, 1, 2, 3), d = __builtin_shufflevector(a, a, 4, 5, 6, 7);
  vfloat4 b = c > d ? c : d;
  return std::max(std::max(b[0], b[1]), std::max(b[2], b[3]));
}

// exp(x) for x <= 0 (scores minus their running max): a Cephes-style polynomial on x = n ln2 + r, 2^n put
// into the exponent bits; relative error ~1e-7. Inputs below -87 (including -inf) give ~1e-38, which
// vanishes next to the running sum (>= 1).
inline vfloat vexp_neg(vfloat x) {
  const vfloat lo = splat(-87.0f), hi = splat(0.0f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  // 1.5 * 2^23: adding it rounds to an integer, held in the low mantissa bits
  const float magic = 12582912.0f;
  const vfloat t = x * 1.44269504088896341f + magic;
  const vfloat n = t - magic;
  vfloat r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  vfloat p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const vfloat y = p * r * r + r + 1.0f;
  const vint e = (((vint)t) - 0x4B400000 + 127) << 23;  // n in [-126, 0]: a normal power of two
  return y * (vfloat)e;
}

inline float exp_neg(float x) { return vexp_neg(splat(x))[0]; }

// silu(g) = g * sigmoid(g), sigmoid from exp(-|g|) so the exp never overflows.
inline vfloat vsilu(vfloat g) {
  const vfloat ag = g < 0.0f ? -g : g;
  const vfloat e = vexp_neg(-ag);
  const vfloat one = splat(1.0f);
  const vfloat r = one / (one + e);  // one division: a vector divide costs as much as the rest together
  const vfloat sig = g < 0.0f ? e * r : r;
  return g * sig;
}

// ---- rows of head_dim elements -> fp32 and back --------------------------------------------------------

inline void load_row(const float* __restrict__ src, float* __restrict__ dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

inline void load_row(const c10::BFloat16* __restrict__ src, float* __restrict__ dst, int64_t n) {
  const uint16_t* __restrict__ s = reinterpret_cast<const uint16_t*>(src);
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {  // bf16 is the top half of an fp32: widen and shift
    vushort h;
    std::memcpy(&h, s + i, sizeof(h));
    storev(dst + i, (vfloat)(__builtin_convertvector(h, vuint) << 16));
  }
  for (; i < n; ++i) dst[i] = __builtin_bit_cast(float, static_cast<uint32_t>(s[i]) << 16);
}

inline void load_row(const c10::Half* __restrict__ src, float* __restrict__ dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// kW float8_e4m3fn bytes -> fp32, in registers (x86 has no fp8 conversion before AVX10.2; these are integer
// shifts, adds and selects that map to AVX2 or AVX-512 alike). Byte s eeee mmm (bias 7):
//   - eeee > 0: the fp32 with exponent field eeee + 120 and mantissa mmm << 20, i.e. (em << 20) + (120 << 23);
//   - eeee = 0 (zero and subnormals): mmm * 2^-9, an exact int -> float conversion and a power-of-two scale;
//   - s 1111 111 is NaN (e4m3fn has no infinity): a quiet NaN;
// then the sign bit on top. Exact for every one of the 256 codes (tests compare with torch's cast).
// Signed int lanes throughout: AVX2 has no unsigned compare or unsigned int -> float conversion, and the compiler's
// emulation of them made the conversion the bottleneck (2x slower than reading bf16 at B=64).
inline vfloat fp8_e4m3_to_f32(vubyte b) {
  const vint u = __builtin_convertvector(b, vint);
  const vint em = u & 0x7F;
  const vint normal = (em << 20) + (120 << 23);
  const vint sub = (vint)(__builtin_convertvector(em, vfloat) * 0.001953125f);  // 2^-9
  vint r = em < 8 ? sub : normal;
  r = em == 0x7F ? vint{} + 0x7FC00000 : r;
  return (vfloat)(r | ((u & 0x80) << 24));
}

// The 256 e4m3 codes as floats, built once from the vector conversion above.
struct Fp8Lut {
  alignas(64) float v[256];
  Fp8Lut() {
    for (int c = 0; c < 256; c += kW) {
      vubyte b;
      for (int j = 0; j < kW; ++j) b[j] = static_cast<uint8_t>(c + j);
      storev(v + c, fp8_e4m3_to_f32(b));
    }
  }
};

inline const float* fp8_lut() {
  static const Fp8Lut lut;
  return lut.v;
}

// A table lookup per value (the 1 KB table stays in L1): measured faster than the in-register arithmetic on
// AVX2, where widening 16 bytes to 16 int lanes and back costs more than the loads.
inline void load_row(const c10::Float8_e4m3fn* __restrict__ src, float* __restrict__ dst, int64_t n) {
  const uint8_t* __restrict__ s = reinterpret_cast<const uint8_t*>(src);
  const float* __restrict__ lut = fp8_lut();
  for (int64_t i = 0; i < n; ++i) dst[i] = lut[s[i]];
}

inline void store_row(const float* __restrict__ src, float* __restrict__ dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

// fp32 -> the bf16 bit pattern in the high half: round to nearest even like torch (c10::round_to_nearest_even),
// NaN -> the canonical 0x7FC0 NaN
inline vuint bf16_round_bits(vfloat f) {
  const vuint u = (vuint)f;
  const vuint r = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  return f != f ? vuint{} + 0x7FC00000u : r;
}

inline void store_row(const float* __restrict__ src, c10::BFloat16* __restrict__ dst, int64_t n) {
  uint16_t* __restrict__ d = reinterpret_cast<uint16_t*>(dst);
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    const vushort h = __builtin_convertvector(bf16_round_bits(loadv(src + i)) >> 16, vushort);
    std::memcpy(d + i, &h, sizeof(h));
  }
  for (; i < n; ++i) dst[i] = c10::BFloat16(src[i]);
}

inline void store_row(const float* __restrict__ src, c10::Half* __restrict__ dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = c10::Half(src[i]);
}

// v := float(T(v)) for each element: the value a torch op computing in T holds (identity for fp32). The tag
// pointer only picks the overload.
inline void round_row(float*, int64_t, float*) {}

inline void round_row(float* __restrict__ v, int64_t n, c10::BFloat16*) {
  int64_t i = 0;
  for (; i + kW <= n; i += kW) storev(v + i, (vfloat)bf16_round_bits(loadv(v + i)));
  for (; i < n; ++i) v[i] = static_cast<float>(c10::BFloat16(v[i]));
}

inline void round_row(float* __restrict__ v, int64_t n, c10::Half*) {
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(c10::Half(v[i]));
}

// sum of x[i]^2 in 32 / kW vector partial sums, 32 floats per step (a plain loop would not vectorise without
// -ffast-math)
inline float sum_squares(const float* __restrict__ x, int64_t n) {
  constexpr int U = 32 / kW;
  vfloat a[U] = {};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) {
      const vfloat v = loadv(x + i + u * kW);
      a[u] += v * v;
    }
  }
  // pairwise, in the order the 16-lane code summed its halves
#pragma GCC unroll 2
  for (int u = 0; u < U / 2; ++u) a[u] += a[u + U / 2];
#pragma GCC unroll 1
  for (int u = 1; u < U / 2; ++u) a[0] += a[u];
  float s = hsum(a[0]);
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

// q and out rows: G per task, so a runtime dtype switch costs nothing and keeps q's dtype out of the
// template parameters (fewer instantiations, faster build).
inline void load_any(const void* src, at::ScalarType t, float* dst, int64_t n) {
  switch (t) {
    case at::kFloat: return load_row(static_cast<const float*>(src), dst, n);
    case at::kBFloat16: return load_row(static_cast<const c10::BFloat16*>(src), dst, n);
    default: return load_row(static_cast<const c10::Half*>(src), dst, n);
  }
}

inline void store_any(const float* src, void* dst, at::ScalarType t, int64_t n) {
  switch (t) {
    case at::kFloat: return store_row(src, static_cast<float*>(dst), n);
    case at::kBFloat16: return store_row(src, static_cast<c10::BFloat16*>(dst), n);
    default: return store_row(src, static_cast<c10::Half*>(dst), n);
  }
}

}  // namespace
