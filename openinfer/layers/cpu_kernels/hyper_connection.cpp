// DeepSeek-V4 manifold-constrained hyper-connections (mHC, openinfer/models/deepseek_v4/hc.py) on CPU.
//
// hc_activate: the per-token activation of one sub-layer (HyperConnection._activate). Given the (2+n)*n
// mixes of each token (n = hc_mult streams; the RMSNorm already applied),
//   pre  = sigmoid(m_pre * scale[0] + base_pre) + eps                       [T, n]
//   post = 2 * sigmoid(m_post * scale[1] + base_post)                       [T, n]
//   comb = Sinkhorn(softmax(m_comb * scale[2] + base_comb, -1) + eps)       [T, n, n]
//   x_in = sum_j pre_j * X[:, j, :]   (fp32 products and sum, rounded once to X's dtype)  [T, D]
// The torch path spends ~100 tiny ops per sub-layer on this (20 Sinkhorn iterations of 4 ops on
// [T, n, n]); here it is one pass per token.
//
// hc_post_pre: hc.fused_post_pre in one pass per token: the finished sub-layer's new streams
//   new[k] = post_k * y + sum_j comb[j, k] X[j]      (in X's dtype, like the torch path)
// then the next sub-layer's mixes (new.float() @ fn.T) * inv_rms(new) and hc_activate on them. The streams
// are read once and written once; the torch path makes ~8 full passes over [T, n, D] for this, which is
// what a long prefill spends its mHC time on.
//
// The activation follows the torch path op by op in fp32 (products rounded before the add, divisions kept
// as divisions, sums in index order), so hc_activate agrees with it to float rounding (exp and sigmoid are
// libm's, not torch's, ~1 ulp); that part is compiled without FMA contraction, since the extension's
// -ffp-contract=fast would fuse its mul-adds and drift by an ulp, which the bf16 rounding of x_in can turn
// into a visible difference. Only the mixes GEMV of hc_post_pre (whose torch counterpart is a BLAS call
// with its own summation order anyway) uses FMAs.
//
// Built at run time by openinfer/layers/cpu_ops.py and registered as torch.ops.openinfer_cpu.*.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <tuple>
#include <vector>

#include "vec.h"  // native-width float vectors, hsum, and the fp32 <-> fp32 / bf16 / fp16 row conversions

namespace {

// mixes[t] = (x[t] @ W.T) * inv[t] for W [m, K] and NT = 1 or 2 tokens: four outputs per pass, so each
// W row (streamed from L2: W is (2+n)n x nD fp32, 384 KB for V4's n = 4, D = 1024) is loaded once for both
// tokens, 16 floats per step in 16 / kW vectors, so 4 * NT (8 for a pair) 16-float FMA chains keep both FMA ports
// busy. The halves of a 16-float step are summed as the 16-lane code summed them, whatever the vector width.
template <int NT>
__attribute__((optimize("fp-contract=fast"))) void gemv(const float* const* x, const float* __restrict__ W,
                                                        int64_t m, int64_t K, const float* inv, float* const* out) {
  constexpr int U = 16 / kW;
  int64_t o = 0;
  for (; o + 4 <= m; o += 4) {
    vfloat a[NT][4][U] = {};
    int64_t i = 0;
    for (; i + 16 <= K; i += 16) {
#pragma GCC unroll 2
      for (int u = 0; u < U; ++u) {
        vfloat xv[NT];
        for (int t = 0; t < NT; ++t) xv[t] = loadv(x[t] + i + u * kW);
        for (int r = 0; r < 4; ++r) {
          const vfloat w = loadv(W + (o + r) * K + i + u * kW);
          for (int t = 0; t < NT; ++t) a[t][r][u] += xv[t] * w;
        }
      }
    }
    for (int t = 0; t < NT; ++t)
      for (int r = 0; r < 4; ++r) {
        for (int u = 1; u < U; ++u) a[t][r][0] += a[t][r][u];
        float v = hsum(a[t][r][0]);
        for (int64_t j = i; j < K; ++j) v += x[t][j] * W[(o + r) * K + j];
        out[t][o + r] = v * inv[t];
      }
  }
  for (; o < m; ++o)
    for (int t = 0; t < NT; ++t) {
      vfloat a[U] = {};
      int64_t i = 0;
      for (; i + 16 <= K; i += 16) {
        for (int u = 0; u < U; ++u) a[u] += loadv(x[t] + i + u * kW) * loadv(W + o * K + i + u * kW);
      }
      for (int u = 1; u < U; ++u) a[0] += a[u];
      float v = hsum(a[0]);
      for (; i < K; ++i) v += x[t][i] * W[o * K + i];
      out[t][o] = v * inv[t];
    }
}

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

// ---- rounding to the storage dtype (round_row is in vec.h) ------------------------------------------

template <typename T>
inline float round_to(float v) {
  round_row(&v, 1, static_cast<T*>(nullptr));
  return v;
}

// ---- the activation ----------------------------------------------------------------------------------

inline float sigmoidf(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// hc.sinkhorn on one n x n row-major matrix of logits; sums: scratch of n.
void sinkhorn(float* c, int64_t n, int64_t iters, float eps, float* sums) {
  for (int64_t i = 0; i < n; ++i) {
    float* r = c + i * n;
    float mx = r[0];
    for (int64_t k = 1; k < n; ++k) mx = r[k] > mx ? r[k] : mx;
    float s = 0.0f;
    for (int64_t k = 0; k < n; ++k) {
      r[k] = std::exp(r[k] - mx);
      s += r[k];
    }
    const float inv = 1.0f / s;  // torch's softmax multiplies by the reciprocal of the sum
    for (int64_t k = 0; k < n; ++k) r[k] = r[k] * inv + eps;
  }
  auto col_norm = [&] {
    for (int64_t k = 0; k < n; ++k) sums[k] = 0.0f;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t k = 0; k < n; ++k) sums[k] += c[i * n + k];
    for (int64_t k = 0; k < n; ++k) sums[k] += eps;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t k = 0; k < n; ++k) c[i * n + k] /= sums[k];
  };
  col_norm();
  for (int64_t it = 1; it < iters; ++it) {
    for (int64_t i = 0; i < n; ++i) {
      float* r = c + i * n;
      float s = 0.0f;
      for (int64_t k = 0; k < n; ++k) s += r[k];
      s += eps;
      for (int64_t k = 0; k < n; ++k) r[k] /= s;
    }
    col_norm();
  }
}

struct Params {
  const float* base;
  const float* scale;
  int64_t n, D, iters;
  float eps;
};

struct Scratch {  // per thread: fp32 rows of X / of the new streams, one row, and per-token smalls
  std::vector<float> xf, rows, acc, pre, sums, combT, mixes;
  Scratch(int64_t n, int64_t D)
      : xf(n * D), rows(n * D), acc(D), pre(n), sums(n), combT(n * n), mixes((2 + n) * n) {}
};

// One token: mixes mt -> post pt [n], comb ct [n, n], and x_in from the fp32 streams xf [n, D] into out.
template <typename T>
void activate_token(const Params& p, const float* mt, const float* xf, float* pt, float* ct, T* out,
                    Scratch& s) {
  const int64_t n = p.n, D = p.D;
  const float* b = p.base;
  for (int64_t j = 0; j < n; ++j) {
    s.pre[j] = sigmoidf(mt[j] * p.scale[0] + b[j]) + p.eps;
    pt[j] = 2.0f * sigmoidf(mt[n + j] * p.scale[1] + b[n + j]);
  }
  for (int64_t q = 0; q < n * n; ++q) ct[q] = mt[2 * n + q] * p.scale[2] + b[2 * n + q];
  sinkhorn(ct, n, p.iters, p.eps, s.sums.data());
  float* __restrict__ acc = s.acc.data();
  const float p0 = s.pre[0];
  for (int64_t d = 0; d < D; ++d) acc[d] = p0 * xf[d];
  for (int64_t j = 1; j < n; ++j) {
    const float* __restrict__ x = xf + j * D;
    const float pj = s.pre[j];
    for (int64_t d = 0; d < D; ++d) acc[d] = acc[d] + pj * x[d];
  }
  store_row(acc, out, D);
}

// post_token's rows for V4's n = 4 in one pass over d per row (the generic loop makes n + 3 passes).
template <typename T>
void post_rows4(const float* post, const float* c, const float* __restrict__ yf, const float* __restrict__ xf,
                T* newX, int64_t D, float* __restrict__ rows) {
  const float* __restrict__ x0 = xf;
  const float* __restrict__ x1 = xf + D;
  const float* __restrict__ x2 = xf + 2 * D;
  const float* __restrict__ x3 = xf + 3 * D;
  for (int64_t k = 0; k < 4; ++k) {
    float* __restrict__ r = rows + k * D;
    const float pk = round_to<T>(post[k]);
    const float c0 = c[k], c1 = c[4 + k], c2 = c[8 + k], c3 = c[12 + k];
    for (int64_t d = 0; d < D; ++d) {
      float v = round_to<T>(pk * yf[d]);
      v = v + c0 * x0[d];
      v = v + c1 * x1[d];
      v = v + c2 * x2[d];
      v = v + c3 * x3[d];
      r[d] = round_to<T>(v);
    }
  }
  store_row(rows, newX, 4 * D);
}

// new[k] = post_k * y + sum_j comb[j, k] X[j] as the torch path computes it in T: post and comb cast to T,
// post_k * y rounded to T, the matmul accumulated in fp32 onto it and rounded once. Writes new to newX and
// float(new) to s.rows.
template <typename T>
void post_token(const float* post, const float* comb, const T* y, const T* X, T* newX, int64_t n, int64_t D,
                Scratch& s) {
  T* tag = nullptr;
  float* __restrict__ yf = s.acc.data();
  float* __restrict__ xf = s.xf.data();
  load_row(y, yf, D);
  load_row(X, xf, n * D);
  for (int64_t q = 0; q < n * n; ++q) s.combT[q] = round_to<T>(comb[q]);
  if (n == 4) return post_rows4<T>(post, s.combT.data(), yf, xf, newX, D, s.rows.data());
  for (int64_t k = 0; k < n; ++k) {
    float* __restrict__ r = s.rows.data() + k * D;
    const float pk = round_to<T>(post[k]);
    for (int64_t d = 0; d < D; ++d) r[d] = pk * yf[d];
    round_row(r, D, tag);
    for (int64_t j = 0; j < n; ++j) {
      const float c = s.combT[j * n + k];
      const float* __restrict__ x = xf + j * D;
      for (int64_t d = 0; d < D; ++d) r[d] = r[d] + c * x[d];
    }
    round_row(r, D, tag);
  }
  store_row(s.rows.data(), newX, n * D);
}

#pragma GCC pop_options

inline int64_t grain_for(int64_t per_token) {
  // ~64k flops per chunk: a small decode batch stays on one thread, a prefill splits across all of them
  return std::max<int64_t>(1, 65536 / std::max<int64_t>(1, per_token));
}

template <typename T>
void run_activate(const Params& p, const float* mixes, const T* X, T* x_in, float* post, float* comb,
                  int64_t Tn) {
  const int64_t n = p.n, D = p.D, m = (2 + n) * n;
  at::parallel_for(0, Tn, grain_for(n * D + p.iters * n * n * 4), [&](int64_t begin, int64_t end) {
    Scratch s(n, D);
    for (int64_t t = begin; t < end; ++t) {
      load_row(X + t * n * D, s.xf.data(), n * D);
      activate_token<T>(p, mixes + t * m, s.xf.data(), post + t * n, comb + t * n * n, x_in + t * D, s);
    }
  });
}

template <typename T>
void run_post_pre(const Params& p, const T* y, const T* X, const float* post, const float* comb,
                  const float* fn, float norm_eps, T* newX, T* x_in, float* post2, float* comb2, int64_t Tn) {
  const int64_t n = p.n, D = p.D, m = (2 + n) * n, K = n * D;
  at::parallel_for(0, Tn, grain_for(K * (n + 2 + m)), [&](int64_t begin, int64_t end) {
    Scratch s[2] = {Scratch(n, D), Scratch(n, D)};
    for (int64_t t0 = begin; t0 < end; t0 += 2) {
      const int nt = end - t0 >= 2 ? 2 : 1;  // token pairs share the GEMV's loads of fn
      const float* xs[2];
      float* mixes[2];
      float inv[2];
      for (int i = 0; i < nt; ++i) {
        const int64_t t = t0 + i;
        post_token<T>(post + t * n, comb + t * n * n, y + t * D, X + t * K, newX + t * K, n, D, s[i]);
        xs[i] = s[i].rows.data();
        mixes[i] = s[i].mixes.data();
        inv[i] = 1.0f / std::sqrt(sum_squares(xs[i], K) / static_cast<float>(K) + norm_eps);
      }
      if (nt == 2) gemv<2>(xs, fn, m, K, inv, mixes);
      else gemv<1>(xs, fn, m, K, inv, mixes);
      for (int i = 0; i < nt; ++i) {
        const int64_t t = t0 + i;
        activate_token<T>(p, mixes[i], xs[i], post2 + t * n, comb2 + t * n * n, x_in + t * D, s[i]);
      }
    }
  });
}

void check_float(const at::Tensor& t, const char* name, std::initializer_list<int64_t> shape) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.sizes().vec() == std::vector<int64_t>(shape),
              name, " must be a contiguous float32 ", at::IntArrayRef(shape), " tensor, got ", t.scalar_type(),
              " ", t.sizes(), t.is_contiguous() ? "" : " (not contiguous)");
}

Params params_of(const at::Tensor& X, const at::Tensor& base, const at::Tensor& scale, double eps,
                 int64_t iters) {
  TORCH_CHECK(X.dim() == 3 && X.is_contiguous(), "X must be a contiguous [T, n, D] tensor, got ", X.sizes());
  TORCH_CHECK(X.scalar_type() == at::kFloat || X.scalar_type() == at::kBFloat16 ||
                  X.scalar_type() == at::kHalf,
              "unsupported X dtype ", X.scalar_type(), " (float32, bfloat16 or float16)");
  const int64_t n = X.size(1);
  check_float(base, "base", {(2 + n) * n});
  check_float(scale, "scale", {3});
  TORCH_CHECK(iters >= 0, "iters must be >= 0, got ", iters);
  return Params{base.const_data_ptr<float>(), scale.const_data_ptr<float>(), n, X.size(2), iters,
                static_cast<float>(eps)};
}

#define HC_DISPATCH(dtype, ...)                                                          \
  switch (dtype) {                                                                       \
    case at::kFloat: { using T = float; __VA_ARGS__; break; }                            \
    case at::kBFloat16: { using T = c10::BFloat16; __VA_ARGS__; break; }                 \
    default: { using T = c10::Half; __VA_ARGS__; break; }                                \
  }

std::tuple<at::Tensor, at::Tensor, at::Tensor> hc_activate(const at::Tensor& mixes, const at::Tensor& base,
                                                           const at::Tensor& scale, const at::Tensor& X,
                                                           double eps, int64_t iters) {
  const Params p = params_of(X, base, scale, eps, iters);
  const int64_t Tn = X.size(0), n = p.n;
  check_float(mixes, "mixes", {Tn, (2 + n) * n});
  at::Tensor x_in = at::empty({Tn, p.D}, X.options());
  at::Tensor post = at::empty({Tn, n}, mixes.options());
  at::Tensor comb = at::empty({Tn, n, n}, mixes.options());
  if (Tn > 0) {
    HC_DISPATCH(X.scalar_type(),
                run_activate<T>(p, mixes.const_data_ptr<float>(), X.const_data_ptr<T>(), x_in.data_ptr<T>(),
                                post.data_ptr<float>(), comb.data_ptr<float>(), Tn));
  }
  return {x_in, post, comb};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> hc_post_pre(
    const at::Tensor& y, const at::Tensor& X, const at::Tensor& post, const at::Tensor& comb,
    const at::Tensor& fn, const at::Tensor& base, const at::Tensor& scale, double norm_eps, double eps,
    int64_t iters) {
  const Params p = params_of(X, base, scale, eps, iters);
  const int64_t Tn = X.size(0), n = p.n, D = p.D;
  TORCH_CHECK(y.scalar_type() == X.scalar_type() && y.is_contiguous() && y.sizes() == at::IntArrayRef({Tn, D}),
              "y must be a contiguous [", Tn, ", ", D, "] tensor of X's dtype, got ", y.scalar_type(), " ",
              y.sizes());
  check_float(post, "post", {Tn, n});
  check_float(comb, "comb", {Tn, n, n});
  check_float(fn, "fn", {(2 + n) * n, n * D});
  at::Tensor newX = at::empty_like(X);
  at::Tensor x_in = at::empty({Tn, D}, X.options());
  at::Tensor post2 = at::empty({Tn, n}, post.options());
  at::Tensor comb2 = at::empty({Tn, n, n}, post.options());
  if (Tn > 0) {
    HC_DISPATCH(X.scalar_type(),
                run_post_pre<T>(p, y.const_data_ptr<T>(), X.const_data_ptr<T>(), post.const_data_ptr<float>(),
                                comb.const_data_ptr<float>(), fn.const_data_ptr<float>(),
                                static_cast<float>(norm_eps), newX.data_ptr<T>(), x_in.data_ptr<T>(),
                                post2.data_ptr<float>(), comb2.data_ptr<float>(), Tn));
  }
  return {newX, x_in, post2, comb2};
}

}  // namespace

// paged_decode_attention.cpp owns TORCH_LIBRARY(openinfer_cpu); this file adds to the namespace.
TORCH_LIBRARY_FRAGMENT(openinfer_cpu, m) {
  m.def("hc_activate(Tensor mixes, Tensor base, Tensor scale, Tensor X, float eps, int iters) "
        "-> (Tensor, Tensor, Tensor)");
  m.impl("hc_activate", c10::DispatchKey::CPU, &hc_activate);
  m.def("hc_post_pre(Tensor y, Tensor X, Tensor post, Tensor comb, Tensor fn, Tensor base, Tensor scale, "
        "float norm_eps, float eps, int iters) -> (Tensor, Tensor, Tensor, Tensor)");
  m.impl("hc_post_pre", c10::DispatchKey::CPU, &hc_post_pre);
}
