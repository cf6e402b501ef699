// Mixture-of-experts pieces around the expert matmuls (layers/moe.py, layers/deepseek_moe.py), each one pass
// over its rows instead of several torch ops:
//
//   moe_select:   per token, DeepSeek's noaux_tc selection: choice = scores + bias; group-limited (keep the
//                 topk_group groups with the largest sum of their top-2 choices); top-k experts; ties towards the
//                 lowest index (what a stable descending sort gives). The weights stay torch ops on [T, K]
//                 (deepseek_moe.route), so they are the torch path's bits.
//   swiglu:       out = dt(dt(silu(min(g, L))) * clamp(u, -L, L)) on a fused [T, 2I] gate|up row (L = +inf: plain
//                 SwiGLU), the roundings of the torch code (moe.swiglu).
//   moe_combine:  out[t] = dt(sum_k dt(dt(w[t, k]) * y[inv[t * K + k]])) (+ out[t] with accumulate: the shared
//                 expert's output), the products summed in fp32 in the order of the rows in y: the expert
//                 outputs (rows sorted by expert) weighted back into token order with the roundings of the
//                 scatter (index_add_, which sums reduced-precision rows in fp32) it replaces, as a gather per
//                 token, in one pass.
//
// Built at run time by openinfer/layers/cpu_ops.py and registered as torch.ops.openinfer_cpu.*.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "vec.h"
#include "kernels.h"

namespace {

int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(row_elems, 1)); }

// index of the largest x[i] over i in [0, n) with live[i], the lowest such index on ties; -1 if none is live
inline int64_t argmax_live(const float* x, const uint8_t* live, int64_t n) {
  int64_t best = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (live[i] && (best < 0 || x[i] > x[best])) best = i;
  }
  return best;
}

void moe_select(at::Tensor ids, const at::Tensor& scores, const c10::optional<at::Tensor>& bias, int64_t n_group,
                int64_t topk_group) {
  const char* fn = "moe_select: ";
  TORCH_CHECK(scores.dim() == 2 && scores.scalar_type() == at::kFloat && scores.is_contiguous(), fn,
              "scores must be a contiguous fp32 [T, E], got ", scores.sizes());
  const int64_t T = scores.size(0), E = scores.size(1), K = ids.size(1);
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == T && ids.scalar_type() == at::kLong && ids.is_contiguous(), fn,
              "ids must be a contiguous int64 [T, K]");
  TORCH_CHECK(n_group > 0 && E % n_group == 0 && topk_group > 0 && topk_group <= n_group, fn, "bad groups: E=", E,
              " n_group=", n_group, " topk_group=", topk_group);
  const int64_t per = E / n_group;
  TORCH_CHECK(K > 0 && K <= topk_group * per, fn, "top-k ", K, " exceeds the ", topk_group * per,
              " experts of the kept groups");
  TORCH_CHECK(topk_group == n_group || per >= 2, fn, "group-limited routing needs 2+ experts per group");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == E && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                fn, "bias must be a contiguous fp32 [E]");
    bp = bias->const_data_ptr<float>();
  }
  const float* sp = scores.const_data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  const float ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, T, grain(4 * E), [&](int64_t t0, int64_t t1) {
    std::vector<float> choice(E), gscore(n_group);
    std::vector<uint8_t> live(E), glive(n_group), keep(n_group);
    for (int64_t t = t0; t < t1; ++t) {
      const float* s = sp + t * E;
      for (int64_t e = 0; e < E; ++e) choice[e] = bp ? s[e] + bp[e] : s[e];
      std::fill(live.begin(), live.end(), 1);
      if (topk_group < n_group) {
        for (int64_t g = 0; g < n_group; ++g) {  // the sum of each group's two largest choices
          const float* c = choice.data() + g * per;
          int64_t a = 0;
          for (int64_t i = 1; i < per; ++i) a = c[i] > c[a] ? i : a;
          int64_t b = a == 0 ? 1 : 0;
          for (int64_t i = 0; i < per; ++i) b = (i != a && c[i] > c[b]) ? i : b;
          gscore[g] = c[a] + c[b];
        }
        std::fill(glive.begin(), glive.end(), 1);
        std::fill(keep.begin(), keep.end(), 0);
        for (int64_t j = 0; j < topk_group; ++j) {
          const int64_t g = argmax_live(gscore.data(), glive.data(), n_group);
          keep[g] = 1;
          glive[g] = 0;
        }
        for (int64_t e = 0; e < E; ++e) {
          if (!keep[e / per]) choice[e] = ninf;
        }
      }
      for (int64_t j = 0; j < K; ++j) {
        const int64_t e = argmax_live(choice.data(), live.data(), E);
        live[e] = 0;
        ip[t * K + j] = e;
      }
    }
  });
}

template <typename T>
void swiglu_impl(at::Tensor& out, const at::Tensor& x, float limit) {
  const int64_t rows = x.size(0), d = out.size(1);
  const T* xp = x.const_data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  const bool clamp = std::isfinite(limit);
  at::parallel_for(0, rows, grain(2 * d), [&](int64_t begin, int64_t end) {
    std::vector<float> g(d), u(d);
    for (int64_t t = begin; t < end; ++t) {
      load_row(xp + t * xs, g.data(), d);
      load_row(xp + t * xs + d, u.data(), d);
      if (clamp) {  // comparisons written so that NaN passes through, as torch.clamp does
        for (int64_t i = 0; i < d; ++i) {
          g[i] = g[i] > limit ? limit : g[i];
          u[i] = u[i] > limit ? limit : (u[i] < -limit ? -limit : u[i]);
        }
      }
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

void swiglu(at::Tensor out, const at::Tensor& x, double limit) {
  const char* fn = "swiglu: ";
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1, fn,
              "x and out must be [T, n] with contiguous rows");
  TORCH_CHECK(x.size(0) == out.size(0) && x.size(1) == 2 * out.size(1), fn, "x ", x.sizes(), " and out ",
              out.sizes(), " do not match");
  TORCH_CHECK(x.scalar_type() == out.scalar_type(), fn, "x and out dtypes differ");
  const float lim = static_cast<float>(limit);
  switch (x.scalar_type()) {
    case at::kFloat: return swiglu_impl<float>(out, x, lim);
    case at::kBFloat16: return swiglu_impl<c10::BFloat16>(out, x, lim);
    case at::kHalf: return swiglu_impl<c10::Half>(out, x, lim);
    default: TORCH_CHECK(false, fn, "unsupported dtype ", x.scalar_type());
  }
}

template <typename T>
void combine_impl(at::Tensor& out, const at::Tensor& y, const int64_t* inv, const float* w, int64_t K,
                  bool accumulate) {
  const int64_t rows = out.size(0), H = out.size(1);
  const T* yp = y.const_data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t ys = y.stride(0), os = out.stride(0);
  const T* tag = nullptr;
  at::parallel_for(0, rows, grain(K * H), [&](int64_t begin, int64_t end) {
    std::vector<float> acc(H), row(H);
    std::vector<int64_t> ks(K);
    for (int64_t t = begin; t < end; ++t) {
      // the token's pairs in the order their rows sit in y (ascending expert): the order index_add_ adds them
      for (int64_t k = 0; k < K; ++k) ks[k] = k;
      std::sort(ks.begin(), ks.end(), [&](int64_t a, int64_t b) { return inv[t * K + a] < inv[t * K + b]; });
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t k : ks) {
        load_row(yp + inv[t * K + k] * ys, row.data(), H);
        float wk = w[t * K + k];
        round_row(&wk, 1, const_cast<T*>(tag));  // the weight in the activation dtype
        int64_t i = 0;
        for (; i + kW <= H; i += kW) storev(row.data() + i, loadv(row.data() + i) * wk);
        for (; i < H; ++i) row[i] *= wk;
        round_row(row.data(), H, const_cast<T*>(tag));  // y * w, rounded
        i = 0;  // a separate pass: no fused multiply-add, so fp32 matches torch's mul then add
        for (; i + kW <= H; i += kW) storev(acc.data() + i, loadv(acc.data() + i) + loadv(row.data() + i));
        for (; i < H; ++i) acc[i] += row[i];
      }
      round_row(acc.data(), H, const_cast<T*>(tag));  // the routed sum, rounded once
      if (accumulate) {
        load_row(op + t * os, row.data(), H);
        int64_t i = 0;
        for (; i + kW <= H; i += kW) storev(acc.data() + i, loadv(acc.data() + i) + loadv(row.data() + i));
        for (; i < H; ++i) acc[i] += row[i];
      }
      store_row(acc.data(), op + t * os, H);
    }
  });
}

void moe_combine(at::Tensor out, const at::Tensor& y, const at::Tensor& inv, const at::Tensor& weights,
                 bool accumulate) {
  const char* fn = "moe_combine: ";
  TORCH_CHECK(out.dim() == 2 && y.dim() == 2 && out.stride(1) == 1 && y.stride(1) == 1, fn,
              "out and y must be 2-d with contiguous rows");
  TORCH_CHECK(out.size(1) == y.size(1) && out.scalar_type() == y.scalar_type(), fn, "out ", out.sizes(), " and y ",
              y.sizes(), " differ in width or dtype");
  TORCH_CHECK(weights.dim() == 2 && weights.size(0) == out.size(0) && weights.scalar_type() == at::kFloat &&
                  weights.is_contiguous(), fn, "weights must be a contiguous fp32 [T, K]");
  const int64_t K = weights.size(1), N = y.size(0);
  TORCH_CHECK(inv.dim() == 1 && inv.size(0) == out.size(0) * K && inv.scalar_type() == at::kLong &&
                  inv.is_contiguous(), fn, "inv must be a contiguous int64 [T * K]");
  const int64_t* ip = inv.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < inv.size(0); ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < N, fn, "inv[", i, "]=", ip[i], " is outside y's ", N, " rows");
  }
  const float* wp = weights.const_data_ptr<float>();
  switch (out.scalar_type()) {
    case at::kFloat: return combine_impl<float>(out, y, ip, wp, K, accumulate);
    case at::kBFloat16: return combine_impl<c10::BFloat16>(out, y, ip, wp, K, accumulate);
    case at::kHalf: return combine_impl<c10::Half>(out, y, ip, wp, K, accumulate);
    default: TORCH_CHECK(false, fn, "unsupported dtype ", out.scalar_type());
  }
}

}  // namespace

namespace oi {
void moe_select(at::Tensor ids, const at::Tensor& scores, const c10::optional<at::Tensor>& bias, int64_t n_group,
                int64_t topk_group) {
  ::moe_select(std::move(ids), scores, bias, n_group, topk_group);
}
void swiglu(at::Tensor out, const at::Tensor& x, double limit) { ::swiglu(std::move(out), x, limit); }
void moe_combine(at::Tensor out, const at::Tensor& y, const at::Tensor& inv, const at::Tensor& weights,
                 bool accumulate) {
  ::moe_combine(std::move(out), y, inv, weights, accumulate);
}
}  // namespace oi

TORCH_LIBRARY_FRAGMENT(openinfer_cpu, m) {
  m.def("moe_select(Tensor(a!) ids, Tensor scores, Tensor? bias, int n_group, int topk_group) -> ()");
  m.impl("moe_select", c10::DispatchKey::CPU, &moe_select);
  m.def("swiglu(Tensor(a!) out, Tensor x, float limit) -> ()");
  m.impl("swiglu", c10::DispatchKey::CPU, &swiglu);
  m.def("moe_combine(Tensor(a!) out, Tensor y, Tensor inv, Tensor weights, bool accumulate) -> ()");
  m.impl("moe_combine", c10::DispatchKey::CPU, &moe_combine);
}
