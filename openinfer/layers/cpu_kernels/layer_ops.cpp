// The small per-layer ops of a dense decoder, fused: residual add + RMSNorm, RMSNorm, SwiGLU, and rotary
// embedding of q and k together with the K/V cache write.
//
// Why: in PyTorch each of these is 3-8 separate passes over the activations (dtype casts, pow, mean, rsqrt,
// muls, cat), each a dispatcher round-trip and, for bf16, a convert in and out. At decode they cost ~8 ms of
// a 46 ms step (Llama 246M, batch 32, 2 threads); at prefill ~0.5 s per 4k tokens, as much as the GEMMs
// leave. Here each op is one pass over its rows, fp32 inside.
//
// Numerics follow the torch code they replace (openinfer/layers/norm.py, activation.py, rotary.py), rounding
// to the activation dtype where that code does:
//   add_rms_norm:  r = dt(x + r);  x = dt(w * dt(r * rsqrt(mean(r^2) + eps)))
//   rms_norm:      out = dt(w * dt(x * rsqrt(mean(x^2) + eps)))
//   silu_and_mul:  out = dt(dt(silu(g)) * u)
//   rotary:        [x1, x2] -> dt([x1 cos - x2 sin, x2 cos + x1 sin]) on the first rot_dim dims (NeoX layout)
// so the fused and torch paths agree to fp32 rounding (and, in bf16, to an occasional last-bit difference
// where fp32 rounding lands on a bf16 tie).
//
// Built at run time by openinfer/layers/cpu_ops.py and registered as torch.ops.openinfer_cpu.*.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "vec.h"
#include "kernels.h"

namespace {

// Rows of activations per parallel task: below ~32k elements a task is not worth waking a thread for
// (a decode step's [32, 1024] norm runs on one).
int64_t row_grain(int64_t row_elems) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(row_elems, 1)); }

// row <- dt(w * dt(row * inv_rms)), w already fp32.
template <typename T>
inline void normalise_row(float* __restrict__ row, const float* __restrict__ w, int64_t n, double eps) {
  const float inv = 1.0f / std::sqrt(sum_squares(row, n) / static_cast<float>(n) + static_cast<float>(eps));
  int64_t i = 0;
  for (; i + kW <= n; i += kW) storev(row + i, loadv(row + i) * inv);
  for (; i < n; ++i) row[i] *= inv;
  round_row(row, n, static_cast<T*>(nullptr));
  i = 0;
  for (; i + kW <= n; i += kW) storev(row + i, loadv(row + i) * loadv(w + i));
  for (; i < n; ++i) row[i] *= w[i];
}

template <typename T>
std::vector<float> weight_fp32(const at::Tensor& weight) {
  std::vector<float> w(weight.numel());
  load_row(weight.data_ptr<T>(), w.data(), weight.numel());
  return w;
}

template <typename T>
void add_rms_norm_impl(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  const std::vector<float> w = weight_fp32<T>(weight);
  T* xp = x.data_ptr<T>();
  T* rp = residual.data_ptr<T>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    std::vector<float> a(n), b(n);
    for (int64_t t = begin; t < end; ++t) {
      load_row(xp + t * xs, a.data(), n);
      load_row(rp + t * rs, b.data(), n);
      int64_t i = 0;
      for (; i + kW <= n; i += kW) storev(a.data() + i, loadv(a.data() + i) + loadv(b.data() + i));
      for (; i < n; ++i) a[i] += b[i];
      store_row(a.data(), rp + t * rs, n);  // the new residual, in its dtype
      round_row(a.data(), n, static_cast<T*>(nullptr));  // ... normalised from that rounded value, as torch does
      normalise_row<T>(a.data(), w.data(), n, eps);
      store_row(a.data(), xp + t * xs, n);
    }
  });
}

template <typename T>
void rms_norm_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  const std::vector<float> w = weight_fp32<T>(weight);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    std::vector<float> a(n);
    for (int64_t t = begin; t < end; ++t) {
      load_row(xp + t * xs, a.data(), n);
      normalise_row<T>(a.data(), w.data(), n, eps);
      store_row(a.data(), op + t * os, n);
    }
  });
}

template <typename T>
void silu_and_mul_impl(at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = x.size(0), d = out.size(1);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  at::parallel_for(0, rows, row_grain(2 * d), [&](int64_t begin, int64_t end) {
    std::vector<float> g(d), u(d);
    for (int64_t t = begin; t < end; ++t) {
      load_row(xp + t * xs, g.data(), d);
      load_row(xp + t * xs + d, u.data(), d);
      int64_t i = 0;
      for (; i + kW <= d; i += kW) storev(g.data() + i, vsilu(loadv(g.data() + i)));
      for (; i < d; ++i) g[i] = vsilu(splat(g[i]))[0];
      round_row(g.data(), d, static_cast<T*>(nullptr));
      i = 0;
      for (; i + kW <= d; i += kW) storev(g.data() + i, loadv(g.data() + i) * loadv(u.data() + i));
      for (; i < d; ++i) g[i] *= u[i];
      store_row(g.data(), op + t * os, d);
    }
  });
}

// One head's first rot_dim dims rotated in place (NeoX "rotate half": pairs (i, i + rot_dim / 2)).
template <typename T>
inline void rotate_head(T* __restrict__ h, const float* __restrict__ c, const float* __restrict__ s,
                        float* __restrict__ buf, int64_t rot_dim) {
  const int64_t half = rot_dim / 2;
  load_row(h, buf, rot_dim);
  float* x1 = buf;
  float* x2 = buf + half;
  float* y = buf + rot_dim;  // scratch: rot_dim more floats
  int64_t i = 0;
  for (; i + kW <= half; i += kW) {
    const vfloat a = loadv(x1 + i), b = loadv(x2 + i), cv = loadv(c + i), sv = loadv(s + i);
    storev(y + i, a * cv - b * sv);
    storev(y + half + i, b * cv + a * sv);
  }
  for (; i < half; ++i) {
    y[i] = x1[i] * c[i] - x2[i] * s[i];
    y[half + i] = x2[i] * c[i] + x1[i] * s[i];
  }
  store_row(y, h, rot_dim);
}

// A K or V row into an fp8 cache (kv_cache_dtype fp8): saturate at +-448 (a NaN stays NaN: both compares are
// false), then c10's round-to-nearest-even e4m3 conversion - what torch's cast does after kv_quant.to_cache's
// clamp, so the fused write and the torch write store the same bytes.
template <typename T>
inline void store_fp8_row(c10::Float8_e4m3fn* __restrict__ dst, const T* __restrict__ src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float f = static_cast<float>(src[i]);
    f = f > 448.0f ? 448.0f : (f < -448.0f ? -448.0f : f);
    dst[i] = c10::Float8_e4m3fn(f);
  }
}

// T: qkv's type; CT: the caches' (T, or float8_e4m3fn for kv_cache_dtype fp8).
template <typename T, typename CT = T>
void rotary_cache_write_impl(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                             const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                             const at::Tensor& slots, int64_t hq, int64_t hk, int64_t d, int64_t rot_dim) {
  const int64_t T_ = qkv.size(0), half = rot_dim / 2, max_pos = cos.size(0);
  T* base = qkv.data_ptr<T>();
  const int64_t qs = qkv.stride(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  CT* kc = k_cache.data_ptr<CT>();
  CT* vc = v_cache.data_ptr<CT>();
  const int64_t kv_row = hk * d, num_slots = k_cache.numel() / kv_row;
  for (int64_t t = 0; t < T_; ++t) {  // checked up front: an out-of-range index must not write anywhere
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "rotary_cache_write: position ", pos[t], " outside [0, ",
                max_pos, ")");
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "rotary_cache_write: slot ", slot[t], " outside [0, ",
                num_slots, ")");
  }
  at::parallel_for(0, T_, row_grain((hq + 2 * hk) * d), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(2 * rot_dim);
    for (int64_t t = begin; t < end; ++t) {
      T* row = base + t * qs;
      const float* c = cp + pos[t] * half;
      const float* s = sp + pos[t] * half;
      for (int64_t h = 0; h < hq + hk; ++h) rotate_head(row + h * d, c, s, buf.data(), rot_dim);
      if constexpr (std::is_same_v<CT, T>) {
        std::memcpy(kc + slot[t] * kv_row, row + hq * d, kv_row * sizeof(T));
        std::memcpy(vc + slot[t] * kv_row, row + (hq + hk) * d, kv_row * sizeof(T));
      } else {
        store_fp8_row(kc + slot[t] * kv_row, row + hq * d, kv_row);
        store_fp8_row(vc + slot[t] * kv_row, row + (hq + hk) * d, kv_row);
      }
    }
  });
}

// First index of each row's maximum; a NaN wins (first NaN), as torch's max(dim) reports it. One pass keeps the
// row's largest value per block of 512 (four independent kW-lane accumulators) and the first block that reached
// it (strictly greater replaces); that block alone is then scanned for the first index holding the value.
// vec.h's native-width vectors (8 lanes on AVX2): with 16-lane generic vectors on an AVX2 build, GCC 12 lowered the
// compares and selects lane by lane through the stack, and an earlier one-pass kernel (a per-lane index carried
// with 16-lane selects) ran a [32, 32000] fp32 argmax in ~13 ms on the project's AVX2 host, where this one takes
// ~0.4 ms (a plain scalar loop: ~1.4 ms).
constexpr int64_t kArgmaxBlock = 512;

template <typename T>
void argmax_rows_impl(at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / std::max<int64_t>(n, 1)), [&](int64_t begin, int64_t end) {
    std::vector<float> wide(std::is_same_v<T, float> ? 0 : kArgmaxBlock);  // a block widened to fp32
    const float ninf = -std::numeric_limits<float>::infinity();
    for (int64_t r = begin; r < end; ++r) {
      const T* row = xp + r * xs;
      float bv = ninf;
      int64_t bblk = 0, i = 0;
      vint nans = {};
      for (; i + kArgmaxBlock <= n; i += kArgmaxBlock) {
        const float* src;
        if constexpr (std::is_same_v<T, float>) {
          src = row + i;
        } else {
          load_row(row + i, wide.data(), kArgmaxBlock);
          src = wide.data();
        }
        vfloat acc[4];
        for (auto& a : acc) a = splat(ninf);
        for (int64_t k = 0; k < kArgmaxBlock; k += 4 * kW) {
          for (int u = 0; u < 4; ++u) {
            const vfloat v = loadv(src + k + kW * u);
            nans |= v != v;
            acc[u] = v > acc[u] ? v : acc[u];
          }
        }
        vfloat m = acc[0] > acc[1] ? acc[0] : acc[1];
        const vfloat m2 = acc[2] > acc[3] ? acc[2] : acc[3];
        m = m > m2 ? m : m2;
        float bm = m[0];
        for (int l = 1; l < kW; ++l) bm = m[l] > bm ? m[l] : bm;
        if (bm > bv) {
          bv = bm;
          bblk = i;
        }
      }
      bool nan = false;
      for (int l = 0; l < kW; ++l) nan |= nans[l] != 0;
      int64_t bi = -1;
      for (; i < n; ++i) {  // the tail after the last whole block
        const float v = static_cast<float>(row[i]);
        nan |= v != v;
        if (v > bv) {
          bv = v;
          bi = i;
        }
      }
      if (nan) {  // rare: the first NaN is the answer
        for (int64_t j = 0; j < n; ++j) {
          const float v = static_cast<float>(row[j]);
          if (v != v) {
            bi = j;
            break;
          }
        }
      } else if (bi < 0) {  // the maximum sits in block bblk (every value -inf: index 0, like torch)
        bi = 0;
        for (int64_t j = bblk; j < n; ++j) {
          if (static_cast<float>(row[j]) == bv) {
            bi = j;
            break;
          }
        }
      }
      op[r] = bi;
    }
  });
}

// ---- entry points: checks, then a dtype dispatch --------------------------------------------------------

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows, got sizes ",
              t.sizes(), " strides ", t.strides());
}

#define OI_DISPATCH(dtype, NAME, ...)                                                        \
  switch (dtype) {                                                                          \
    case at::kFloat: { using scalar_t = float; __VA_ARGS__; break; }                        \
    case at::kBFloat16: { using scalar_t = c10::BFloat16; __VA_ARGS__; break; }             \
    case at::kHalf: { using scalar_t = c10::Half; __VA_ARGS__; break; }                     \
    default: TORCH_CHECK(false, NAME ": unsupported dtype ", dtype);                        \
  }

void add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type() &&
                  weight.scalar_type() == x.scalar_type() && weight.is_contiguous() &&
                  weight.numel() == x.size(1),
              "add_rms_norm: x, residual [T, D] and weight [D] must share one dtype");
  OI_DISPATCH(x.scalar_type(), "add_rms_norm", add_rms_norm_impl<scalar_t>(x, residual, weight, eps));
}

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(x.sizes() == out.sizes() && x.scalar_type() == out.scalar_type() &&
                  weight.scalar_type() == x.scalar_type() && weight.is_contiguous() &&
                  weight.numel() == x.size(1),
              "rms_norm: out, x [T, D] and weight [D] must share one dtype");
  OI_DISPATCH(x.scalar_type(), "rms_norm", rms_norm_impl<scalar_t>(out, x, weight, eps));
}

void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(x.size(0) == out.size(0) && x.size(1) == 2 * out.size(1) && x.scalar_type() == out.scalar_type(),
              "silu_and_mul: x [T, 2d] and out [T, d] must share one dtype");
  OI_DISPATCH(x.scalar_type(), "silu_and_mul", silu_and_mul_impl<scalar_t>(out, x));
}

void rotary_cache_write(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                        at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, int64_t rot_dim) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim, "rotary_cache_write: qkv width ",
              qkv.size(1), " != (num_heads + 2 num_kv_heads) head_dim");
  TORCH_CHECK(rot_dim > 0 && rot_dim % 2 == 0 && rot_dim <= head_dim, "rotary_cache_write: bad rot_dim ", rot_dim);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == rot_dim / 2 && sin.sizes() == cos.sizes(),
              "rotary_cache_write: cos/sin must be contiguous fp32 [max_pos, rot_dim / 2]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
                  positions.is_contiguous() && slot_mapping.is_contiguous() && positions.numel() == qkv.size(0) &&
                  slot_mapping.numel() == qkv.size(0),
              "rotary_cache_write: positions and slot_mapping must be contiguous int64 [T]");
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  (k_cache.scalar_type() == qkv.scalar_type() || fp8) &&
                  v_cache.scalar_type() == k_cache.scalar_type() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.size(-1) == head_dim && k_cache.size(-2) == num_kv_heads,
              "rotary_cache_write: caches must be contiguous [..., num_kv_heads, head_dim] in qkv's dtype or "
              "float8_e4m3fn");
  if (fp8) {
    OI_DISPATCH(qkv.scalar_type(), "rotary_cache_write",
                (rotary_cache_write_impl<scalar_t, c10::Float8_e4m3fn>(qkv, positions, cos, sin, k_cache, v_cache,
                                                                        slot_mapping, num_heads, num_kv_heads,
                                                                        head_dim, rot_dim)));
    return;
  }
  OI_DISPATCH(qkv.scalar_type(), "rotary_cache_write",
              rotary_cache_write_impl<scalar_t>(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads,
                                                num_kv_heads, head_dim, rot_dim));
}

void argmax_rows(at::Tensor out, const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(out.dim() == 1 && out.size(0) == x.size(0) && out.scalar_type() == at::kLong && out.is_contiguous(),
              "argmax_rows: out must be a contiguous int64 [rows]");
  TORCH_CHECK(x.size(1) > 0, "argmax_rows: empty rows");
  OI_DISPATCH(x.scalar_type(), "argmax_rows", argmax_rows_impl<scalar_t>(out, x));
}

#undef OI_DISPATCH

}  // namespace

namespace oi {
void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  ::rms_norm(std::move(out), x, weight, eps);
}
void add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  ::add_rms_norm(std::move(x), std::move(residual), weight, eps);
}
void silu_and_mul(at::Tensor out, const at::Tensor& x) { ::silu_and_mul(std::move(out), x); }
void rotary_cache_write(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                        at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, int64_t rot_dim) {
  ::rotary_cache_write(std::move(qkv), positions, cos, sin, std::move(k_cache), std::move(v_cache), slot_mapping,
                       num_heads, num_kv_heads, head_dim, rot_dim);
}
}  // namespace oi

TORCH_LIBRARY_FRAGMENT(openinfer_cpu, m) {
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.impl("add_rms_norm", c10::DispatchKey::CPU, &add_rms_norm);
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &silu_and_mul);
  m.def(
      "rotary_cache_write(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, Tensor(b!) k_cache, "
      "Tensor(c!) v_cache, Tensor slot_mapping, int num_heads, int num_kv_heads, int head_dim, int rot_dim) -> ()");
  m.impl("rotary_cache_write", c10::DispatchKey::CPU, &rotary_cache_write);
  m.def("argmax_rows(Tensor(a!) out, Tensor x) -> ()");
  m.impl("argmax_rows", c10::DispatchKey::CPU, &argmax_rows);
  // the lanes of vec.h's vectors in this build (16 with AVX-512, else 8): what tests and benchmarks check it was
  // built for
  m.def("vector_lanes() -> int", []() -> int64_t { return kW; });
}
