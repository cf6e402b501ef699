// DeepSeek-V4 manifold-constrained hyper-connections (mHC) on CPU: the per-token activation of one sub-layer.
//
// Given the 24-wide mixes of each token (n = hc_mult streams; the RMSNorm already applied), computes
//   pre  = sigmoid(m_pre * scale[0] + base_pre) + eps                       [T, n]
//   post = 2 * sigmoid(m_post * scale[1] + base_post)                       [T, n]
//   comb = Sinkhorn(softmax(m_comb * scale[2] + base_comb, -1) + eps)       [T, n, n]
//   x_in = sum_j pre_j * X[:, j, :]   (fp32 products and sum, rounded once to X's dtype)  [T, D]
// i.e. HyperConnection._activate in openinfer/models/deepseek_v4/hc.py. The torch path spends ~100 tiny ops
// per sub-layer on this (20 Sinkhorn iterations of 4 ops on [T, n, n]); here it is one pass per token.
//
// The arithmetic follows the torch path op by op in fp32 (products rounded before the add, divisions not
// turned into reciprocal multiplies, sums in index order), so the results agree to float rounding: the
// file is compiled without FMA contraction for that reason (the extension's -ffp-contract=fast would fuse
// the mul-adds and drift by an ulp, which a bf16 rounding of x_in can turn into a visible difference).
//
// Built at run time by openinfer/layers/cpu_ops.py and registered as torch.ops.openinfer_cpu.hc_activate.

#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

inline float sigmoidf(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// Row softmax + eps, then the column normalisation and iters-1 row/column rounds (hc.sinkhorn); c is n x n
// row-major, sums scratch of n.
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

template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }

// x_in[d] = sum_j pre[j] * X[j, d]; fp32 accumulation in j order, one rounding to T at the end.
template <typename T>
void weighted_sum(const T* X, int64_t n, int64_t D, const float* pre, T* out, float* acc) {
  for (int64_t d = 0; d < D; ++d) acc[d] = pre[0] * to_f(X[d]);
  for (int64_t j = 1; j < n; ++j) {
    const T* x = X + j * D;
    const float p = pre[j];
    for (int64_t d = 0; d < D; ++d) acc[d] = acc[d] + p * to_f(x[d]);
  }
  for (int64_t d = 0; d < D; ++d) out[d] = static_cast<T>(acc[d]);
}

template <typename T>
void run(const float* mixes, const float* base, const float* scale, const T* X, T* x_in, float* post,
         float* comb, int64_t Tn, int64_t n, int64_t D, float eps, int64_t iters) {
  const int64_t m = (2 + n) * n;
  // A task costs ~n*D for the weighted sum plus ~iters*n*n for Sinkhorn; aim for ~32k of work per chunk so a
  // decode step (T = batch) splits across threads only when it is big enough to pay for it.
  const int64_t per_token = n * D + iters * n * n * 4;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, per_token));
  at::parallel_for(0, Tn, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(D), pre(n), sums(n);
    for (int64_t t = begin; t < end; ++t) {
      const float* mt = mixes + t * m;
      float* pt = post + t * n;
      float* ct = comb + t * n * n;
      for (int64_t j = 0; j < n; ++j) {
        pre[j] = sigmoidf(mt[j] * scale[0] + base[j]) + eps;
        pt[j] = 2.0f * sigmoidf(mt[n + j] * scale[1] + base[n + j]);
      }
      for (int64_t q = 0; q < n * n; ++q) ct[q] = mt[2 * n + q] * scale[2] + base[2 * n + q];
      sinkhorn(ct, n, iters, eps, sums.data());
      weighted_sum<T>(X + t * n * D, n, D, pre.data(), x_in + t * D, acc.data());
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> hc_activate(const at::Tensor& mixes, const at::Tensor& base,
                                                           const at::Tensor& scale, const at::Tensor& X,
                                                           double eps, int64_t iters) {
  const char* fn = "hc_activate: ";
  TORCH_CHECK(X.dim() == 3 && X.is_contiguous(), fn, "X must be a contiguous [T, n, D] tensor, got ",
              X.sizes());
  const int64_t Tn = X.size(0), n = X.size(1), D = X.size(2), m = (2 + n) * n;
  TORCH_CHECK(mixes.scalar_type() == at::kFloat && base.scalar_type() == at::kFloat &&
                  scale.scalar_type() == at::kFloat,
              fn, "mixes, base and scale must be float32");
  TORCH_CHECK(mixes.dim() == 2 && mixes.size(0) == Tn && mixes.size(1) == m && mixes.is_contiguous(), fn,
              "mixes must be a contiguous [", Tn, ", ", m, "] tensor, got ", mixes.sizes());
  TORCH_CHECK(base.numel() == m && base.is_contiguous(), fn, "base must hold ", m, " contiguous values");
  TORCH_CHECK(scale.numel() == 3 && scale.is_contiguous(), fn, "scale must hold 3 contiguous values");
  TORCH_CHECK(iters >= 0, fn, "iters must be >= 0");
  auto f32 = mixes.options();
  at::Tensor x_in = at::empty({Tn, D}, X.options());
  at::Tensor post = at::empty({Tn, n}, f32);
  at::Tensor comb = at::empty({Tn, n, n}, f32);
  if (Tn == 0) return {x_in, post, comb};
  const float* mp = mixes.const_data_ptr<float>();
  const float* bp = base.const_data_ptr<float>();
  const float* sp = scale.const_data_ptr<float>();
  float* pp = post.data_ptr<float>();
  float* cp = comb.data_ptr<float>();
  const float e = static_cast<float>(eps);
  switch (X.scalar_type()) {
    case at::kFloat:
      run<float>(mp, bp, sp, X.const_data_ptr<float>(), x_in.data_ptr<float>(), pp, cp, Tn, n, D, e, iters);
      break;
    case at::kBFloat16:
      run<c10::BFloat16>(mp, bp, sp, X.const_data_ptr<c10::BFloat16>(), x_in.data_ptr<c10::BFloat16>(), pp,
                         cp, Tn, n, D, e, iters);
      break;
    case at::kHalf:
      run<c10::Half>(mp, bp, sp, X.const_data_ptr<c10::Half>(), x_in.data_ptr<c10::Half>(), pp, cp, Tn, n,
                     D, e, iters);
      break;
    default:
      TORCH_CHECK(false, fn, "unsupported X dtype ", X.scalar_type(), " (float32, bfloat16 or float16)");
  }
  return {x_in, post, comb};
}

}  // namespace

// paged_decode_attention.cpp owns TORCH_LIBRARY(openinfer_cpu); this file adds to the namespace.
TORCH_LIBRARY_FRAGMENT(openinfer_cpu, m) {
  m.def("hc_activate(Tensor mixes, Tensor base, Tensor scale, Tensor X, float eps, int iters) "
        "-> (Tensor, Tensor, Tensor)");
  m.impl("hc_activate", c10::DispatchKey::CPU, &hc_activate);
}
