// DeepSeek-V4's lightning indexer (models/deepseek_v4/indexer.py) in one pass per query token: index scores over
// the query's visible compressed entries, read in place from the entry store, and their top-k.
//
//   I[t, w] = sum_h head_w[t, h] * relu(q[t, h] . K[slot(seq(t), w)]) * scale      for w < visible[t]
//   ids[t, :] = the k largest I[t, w], descending, ties towards the lowest w; -1 past visible[t]
//
// Why: the torch path gathers every query's visible keys into [T, W, d] and runs einsum / relu / weighting / a
// full stable sort over [T, W]; here each key row is read once per query, the score reduced over heads at once,
// and only k entries are selected (a partial selection, not a sort). Sums run in fp32, heads in order.
//
// Built at run time by openinfer/layers/cpu_ops.py and registered as torch.ops.openinfer_cpu.*.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <cstring>
#include <vector>

#include "vec.h"

namespace {

// KT: the key store's element type; uint8_t: kv_cache_dtype fp8 rows of d e4m3 values then their fp32 scale
// (layers/kv_quant.py Fp8RowLayout, vLLM's 132 B per 128-d indexer key).
template <typename KT>
void run(int64_t* ids, const at::Tensor& q, const float* head_w, const KT* keys, const int64_t* seq_slots,
         int64_t W, const int64_t* token_seq, const int64_t* visible, int64_t K, float scale) {
  constexpr bool kRowScaled = std::is_same_v<KT, uint8_t>;
  const int64_t T = q.size(0), nh = q.size(1), d = q.size(2);
  const at::ScalarType qt = q.scalar_type();
  const char* qp = static_cast<const char*>(q.const_data_ptr());
  const int64_t q_st = q.stride(0) * q.element_size(), q_sh = q.stride(1) * q.element_size();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> qf(nh * d), key(d), score(W);
    std::vector<int64_t> order(W);
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t h = 0; h < nh; ++h) load_any(qp + t * q_st + h * q_sh, qt, qf.data() + h * d, d);
      const int64_t nv = std::min<int64_t>(visible[t], W);
      const int64_t* slots = seq_slots + token_seq[t] * W;
      for (int64_t w = 0; w < nv; ++w) {
        if constexpr (kRowScaled) {
          const uint8_t* row = keys + slots[w] * (d + 4);
          load_row(reinterpret_cast<const c10::Float8_e4m3fn*>(row), key.data(), d);
          float rs;
          std::memcpy(&rs, row + d, sizeof(rs));
          for (int64_t i = 0; i < d; ++i) key[i] *= rs;
        } else {
          load_row(keys + slots[w] * d, key.data(), d);
        }
        float s = 0.0f;
        for (int64_t h = 0; h < nh; ++h) {
          const float* qh = qf.data() + h * d;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t i = 0; i < d; ++i) dot += qh[i] * key[i];
          s += head_w[t * nh + h] * (std::max(dot, 0.0f) * scale);
        }
        score[w] = s;
      }
      const int64_t take = std::min(K, nv);
      for (int64_t w = 0; w < nv; ++w) order[w] = w;
      // descending, ties towards the lowest index (w breaks them): the stable sort's first `take`
      std::partial_sort(order.begin(), order.begin() + take, order.begin() + nv, [&](int64_t a, int64_t b) {
        return score[a] > score[b] || (score[a] == score[b] && a < b);
      });
      for (int64_t j = 0; j < K; ++j) ids[t * K + j] = j < take ? order[j] : -1;
    }
  });
}

void indexer_topk(at::Tensor ids, const at::Tensor& q, const at::Tensor& head_w, const at::Tensor& keys,
                  const at::Tensor& seq_slots, const at::Tensor& token_seq, const at::Tensor& visible, double scale) {
  const char* fn = "indexer_topk: ";
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, fn, "q must be [T, heads, d] with a contiguous last dim");
  const int64_t T = q.size(0), nh = q.size(1), d = q.size(2);
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == T && ids.scalar_type() == at::kLong && ids.is_contiguous(), fn,
              "ids must be a contiguous int64 [T, k]");
  TORCH_CHECK(head_w.dim() == 2 && head_w.size(0) == T && head_w.size(1) == nh && head_w.scalar_type() == at::kFloat &&
                  head_w.is_contiguous(), fn, "head_w must be a contiguous fp32 [T, heads]");
  const bool row_scaled = keys.scalar_type() == at::kByte;  // fp8 keys + an fp32 scale per row
  TORCH_CHECK(keys.dim() == 2 && keys.size(1) == d + (row_scaled ? 4 : 0) && keys.is_contiguous(), fn,
              "keys must be a contiguous [slots, d] (uint8 fp8 rows: [slots, d + 4])");
  TORCH_CHECK(seq_slots.dim() == 2 && seq_slots.scalar_type() == at::kLong && seq_slots.is_contiguous(), fn,
              "seq_slots must be a contiguous int64 [S, W]");
  TORCH_CHECK(token_seq.dim() == 1 && token_seq.size(0) == T && token_seq.scalar_type() == at::kLong &&
                  token_seq.is_contiguous() && visible.dim() == 1 && visible.size(0) == T &&
                  visible.scalar_type() == at::kLong && visible.is_contiguous(), fn,
              "token_seq and visible must be contiguous int64 [T]");
  const at::ScalarType qt = q.scalar_type();
  TORCH_CHECK(qt == at::kFloat || qt == at::kBFloat16 || qt == at::kHalf, fn, "unsupported q dtype ", qt);
  const int64_t S = seq_slots.size(0), W = seq_slots.size(1), K = ids.size(1), nslots = keys.size(0);
  const int64_t* ss = seq_slots.const_data_ptr<int64_t>();
  const int64_t* ts = token_seq.const_data_ptr<int64_t>();
  const int64_t* vis = visible.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {  // every row read is checked first: a bad slot is an error, not a wild read
    TORCH_CHECK(ts[t] >= 0 && ts[t] < S, fn, "token_seq[", t, "]=", ts[t], " has no slots row");
    for (int64_t w = 0; w < std::min<int64_t>(vis[t], W); ++w) {
      const int64_t slot = ss[ts[t] * W + w];
      TORCH_CHECK(slot >= 0 && slot < nslots, fn, "seq_slots[", ts[t], ", ", w, "]=", slot, " is outside the store");
    }
  }
  if (T == 0 || K == 0) return;
  const float* hw = head_w.const_data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);
  switch (keys.scalar_type()) {
    case at::kFloat: return run<float>(ip, q, hw, keys.const_data_ptr<float>(), ss, W, ts, vis, K, sc);
    case at::kBFloat16: return run<c10::BFloat16>(ip, q, hw, keys.const_data_ptr<c10::BFloat16>(), ss, W, ts, vis, K, sc);
    case at::kHalf: return run<c10::Half>(ip, q, hw, keys.const_data_ptr<c10::Half>(), ss, W, ts, vis, K, sc);
    case at::kByte: return run<uint8_t>(ip, q, hw, keys.const_data_ptr<uint8_t>(), ss, W, ts, vis, K, sc);
    default: TORCH_CHECK(false, fn, "unsupported key dtype ", keys.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(openinfer_cpu, m) {
  m.def(
      "indexer_topk(Tensor(a!) ids, Tensor q, Tensor head_w, Tensor keys, Tensor seq_slots, Tensor token_seq, "
      "Tensor visible, float scale) -> ()");
  m.impl("indexer_topk", c10::DispatchKey::CPU, &indexer_topk);
}
