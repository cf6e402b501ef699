// DeepSeek's rotary on adjacent pairs (layers/rotary.py, apply_interleaved) as one op: for each row of x
// [T, N, D] (any strides, unit stride in D), the last rd = 2 * half dims are rotated pair by pair, (x0, x1),
// (x2, x3), ..., with fp32 cos / sin [T, half], and written into a new contiguous out [T, N, D], either
// interleaved as they came or de-interleaved as [a0 .. a_{half-1} | b0 .. b_{half-1}] (HF's DeepSeek-V3 layout);
// the first D - rd dims are copied through. inverse de-rotates (sin negated).
//
// Why: the torch path is ~10 small ops per call (widen, strided even / odd views, four products, two sums, a
// stack or cat, the cast back, a cat with the pass-through dims), and DeepSeek-V3 calls it for q_pe and k_pe in
// every layer: ~80 dispatches of a few microseconds each per decode step for a few thousand flops.
// The arithmetic is the torch path's, in its order, each product and sum rounded to fp32 (no FMA contraction
// in this file), then rounded once to x's dtype: the same bits.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include "kernels.h"

#pragma GCC optimize("fp-contract=off")

namespace {

template <typename T>
void run(at::Tensor& out, const at::Tensor& x, const float* cos, const float* sin, int64_t half, bool inverse,
         bool deinterleave) {
  const int64_t T_ = x.size(0), N = x.size(1), D = x.size(2), pass = D - 2 * half;
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1);
  const T* xp = x.const_data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, T_ * N, std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t t = r / N, n = r % N;
      const T* src = xp + t * xs0 + n * xs1;
      T* dst = op + r * D;
      std::copy(src, src + pass, dst);
      const float* c = cos + t * half;
      const float* s = sin + t * half;
      const T* xr = src + pass;
      T* yr = dst + pass;
      for (int64_t i = 0; i < half; ++i) {
        const float e = static_cast<float>(xr[2 * i]), o = static_cast<float>(xr[2 * i + 1]);
        const float si = inverse ? -s[i] : s[i];
        const float ec = e * c[i], os = o * si, oc = o * c[i], es = e * si;
        const float a = ec - os, b = oc + es;
        if (deinterleave) {
          yr[i] = static_cast<T>(a);
          yr[half + i] = static_cast<T>(b);
        } else {
          yr[2 * i] = static_cast<T>(a);
          yr[2 * i + 1] = static_cast<T>(b);
        }
      }
    }
  });
}

void rope_interleaved(at::Tensor out, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                      bool inverse, bool deinterleave) {
  TORCH_CHECK(x.dim() == 3 && (x.size(2) <= 1 || x.stride(2) == 1),
              "rope_interleaved: x must be [T, N, D] with unit stride in D");
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "rope_interleaved: x must be fp32, bf16 or fp16");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0),
              "rope_interleaved: cos and sin must be contiguous fp32 [T, half] with x's T");
  const int64_t half = cos.size(1);
  TORCH_CHECK(2 * half <= x.size(2), "rope_interleaved: 2 * half (", 2 * half, ") exceeds D (", x.size(2), ")");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == x.sizes() && out.scalar_type() == dt,
              "rope_interleaved: out must be contiguous, shaped and typed as x");
  if (x.numel() == 0) return;
  const float* c = cos.const_data_ptr<float>();
  const float* s = sin.const_data_ptr<float>();
  if (dt == at::kFloat) return run<float>(out, x, c, s, half, inverse, deinterleave);
  if (dt == at::kBFloat16) return run<c10::BFloat16>(out, x, c, s, half, inverse, deinterleave);
  run<c10::Half>(out, x, c, s, half, inverse, deinterleave);
}

}  // namespace

namespace oi {
void rope_interleaved(at::Tensor out, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool inverse,
                      bool deinterleave) {
  ::rope_interleaved(std::move(out), x, cos, sin, inverse, deinterleave);
}
}  // namespace oi

TORCH_LIBRARY_FRAGMENT(openinfer_cpu, m) {
  m.def("rope_interleaved(Tensor(a!) out, Tensor x, Tensor cos, Tensor sin, bool inverse, bool deinterleave) -> ()");
  m.impl("rope_interleaved", c10::DispatchKey::CPU, &rope_interleaved);
}
