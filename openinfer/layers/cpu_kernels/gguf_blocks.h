// GGUF block formats shared by the GGUF kernels (gguf_gemm.cpp: fp32 activations; gguf_q8_gemm.cpp: int8
// activations): the type codes and block sizes, the fp16 scale read, Q4_K / Q5_K's packed 6-bit scales, a portable
// one-block decoder and the data check. Header-only, in an anonymous namespace: each kernel file gets its own copy.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// GGMLQuantizationType values (gguf.GGMLQuantizationType).
enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

struct Format {
  int block;  // weights per block
  int bytes;  // bytes per block
};

inline Format format_of(int64_t t) {
  switch (t) {
    case Q8_0: return {32, 34};
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q5_0: return {32, 22};
    case Q5_1: return {32, 24};
    case Q4_K: return {256, 144};
    case Q5_K: return {256, 176};
    case Q6_K: return {256, 210};
    default: TORCH_CHECK(false, "gguf: unsupported quantization type ", t); return {0, 0};
  }
}

inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

inline uint32_t u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Q4_K / Q5_K: the 8 six-bit (scale, min) pairs of a super-block (llama.cpp's get_scale_min_k4).
inline void scale_min_k4(const uint8_t* s, int sc[8], int mn[8]) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0xF) | ((s[j] >> 6) << 4);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

// The same 16 six-bit values as bytes, in registers (llama.cpp's utmp masks): the 8 scales in sc8, the 8 mins in mn8,
// byte j = sub-block j. The SIMD kernels widen them with one cvtepu8 each; scale_min_k4's int arrays, stored and
// then loaded as a vector, stalled store-to-load forwarding on every super-block.
inline void scale_min_k4_bytes(const uint8_t* s, uint64_t& sc8, uint64_t& mn8) {
  uint32_t u[3];
  std::memcpy(u, s, 12);
  constexpr uint32_t k6 = 0x3f3f3f3f, k4 = 0x0f0f0f0f, k2 = 0x03030303;
  const uint32_t sc_lo = u[0] & k6, sc_hi = (u[2] & k4) | (((u[0] >> 6) & k2) << 4);
  const uint32_t mn_lo = u[1] & k6, mn_hi = ((u[2] >> 4) & k4) | (((u[1] >> 6) & k2) << 4);
  sc8 = sc_lo | (static_cast<uint64_t>(sc_hi) << 32);
  mn8 = mn_lo | (static_cast<uint64_t>(mn_hi) << 32);
}

// ---- portable decode: one block -> integers, and a scale and an offset per group -------------------------------
// w[k] = q[k] * s[k / group] + o[k / group], computed as one fused multiply-add: q * s is exact in every format
// (at most 11 + 8 + 6 bits, Q6_K's d sc q aside, which rounds once as gguf's (d sc) q does), so this is
// gguf.quants.dequantize's value to the bit.
struct Decoded {
  int8_t q[256];
  float s[16];
  float o[16];
  int group;
};

inline void decode_block(int64_t t, const uint8_t* b, Decoded& out) {
  switch (t) {
    case Q8_0:
      out.group = 32;
      out.s[0] = fp16(b);
      out.o[0] = 0.f;
      std::memcpy(out.q, b + 2, 32);
      return;
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: {
      const bool has_min = t == Q4_1 || t == Q5_1, five = t == Q5_0 || t == Q5_1;
      out.group = 32;
      out.s[0] = fp16(b);
      out.o[0] = has_min ? fp16(b + 2) : 0.f;
      const uint8_t* p = b + 2 + (has_min ? 2 : 0);
      const uint32_t qh = five ? u32(p) : 0;
      const uint8_t* qs = p + (five ? 4 : 0);
      const int bias = has_min ? 0 : (five ? 16 : 8);
      for (int i = 0; i < 16; ++i) {
        out.q[i] = static_cast<int8_t>(((qs[i] & 0xF) | (((qh >> i) & 1) << 4)) - bias);
        out.q[i + 16] = static_cast<int8_t>(((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) - bias);
      }
      return;
    }
    case Q4_K: case Q5_K: {
      const float d = fp16(b), dmin = fp16(b + 2);
      int sc[8], mn[8];
      scale_min_k4(b + 4, sc, mn);
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + 16 + (t == Q5_K ? 32 : 0);
      out.group = 32;
      for (int j = 0; j < 8; ++j) {
        out.s[j] = d * static_cast<float>(sc[j]);
        out.o[j] = -(dmin * static_cast<float>(mn[j]));
        for (int i = 0; i < 32; ++i) {
          const uint8_t byte = qs[32 * (j / 2) + i];
          int q = (j & 1) ? byte >> 4 : byte & 0xF;
          if (t == Q5_K) q |= ((qh[i] >> j) & 1) << 4;
          out.q[32 * j + i] = static_cast<int8_t>(q);
        }
      }
      return;
    }
    case Q6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = fp16(b + 208);
      out.group = 16;
      for (int j = 0; j < 16; ++j) {
        out.s[j] = d * static_cast<float>(sc[j]);
        out.o[j] = 0.f;
      }
      for (int h = 0; h < 2; ++h)
        for (int j = 0; j < 4; ++j)
          for (int i = 0; i < 32; ++i) {
            const int lo = (ql[64 * h + 32 * (j & 1) + i] >> (4 * (j / 2))) & 0xF;
            const int hi = (qh[32 * h + i] >> (2 * j)) & 3;
            out.q[128 * h + 32 * j + i] = static_cast<int8_t>((lo | (hi << 4)) - 32);
          }
      return;
    }
    default: TORCH_CHECK(false, "gguf: unsupported quantization type ", t);
  }
}

// Returns (N, K) after checking data against the format.
inline std::pair<int64_t, int64_t> check_data(const at::Tensor& data, int64_t qtype, int64_t K, const Format& f) {
  TORCH_CHECK(data.dim() == 2 && data.is_contiguous() && data.scalar_type() == at::kByte,
              "gguf: data must be contiguous uint8 [N, row_bytes]");
  TORCH_CHECK(K > 0 && K % f.block == 0 && data.size(1) == K / f.block * f.bytes, "gguf: type ", qtype, ", K = ", K,
              " needs K a multiple of ", f.block, " and ", K / f.block * f.bytes, " bytes per row, data has ",
              data.size(1));
  return {data.size(0), K};
}

}  // namespace
