// DeepSeek-V4.1's lightning indexer over a step (models/deepseek_v41/indexer.py, attention.py Attention._choose):
// index scores of each query's visible compressed entries, read in place from the paged index-key store, their
// top-k, and - for the candidate source layer - the candidate blocks; a candidate-restricted layer scores only
// the entries of its query's candidate blocks.
//
//   I[t, w]  = sum_h head_w[t, h] * relu(q[t, h] . K[slot(seq(t), w)]) * scale      w < visible[t]
//   slot(s, w) = tables[s, e / bs] * cap + (e % bs) / ratio,  e = (w + 1) * ratio - 1  (StepIndex.entry_slots)
//   ids[t]    = the k best valid w, descending, ties -> lowest w, -1 pads      (select_topk)
//   blocks[t] = the newest visible block (scored +inf) and the best others by max score, ties -> lowest block,
//               -1 pads                                                          (candidate_blocks)
//   valid w   = w < visible[t], and w's block (w / cblock) in allowed[t] when ``allowed`` has columns
//
// Why: the torch path gathers [T, W, d] keys (each request's 1 + k verified tokens gather the same keys again),
// runs einsum / relu / weighting over [T, heads, W], a full stable sort of [T, W] and, for a restricted layer, a
// [T, W, blocks] comparison to build its mask: at 32k context and batch 64 that was ~4 s a step on the tiny
// model. Here the queries of one sequence (up to kGroup, contiguous in the step) share each tile of kW keys,
// converted once and scored for all of them; the top k is a selection (nth_element, then a sort of k), not a
// sort of W; a restricted layer reads only its candidate blocks' keys. Sums in fp32, heads in order.
//
// Built at run time by openinfer/layers/cpu_ops.py and registered as torch.ops.openinfer_cpu.*.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "vec.h"

namespace {

constexpr int64_t kGroup = 8;  // queries of one sequence scored together (bounds the per-thread score rows)

// out[0, K) = indices i of the `min(K, n)` largest sc[i], descending, ties -> lowest i; -1 pads.
void select_top(const float* sc, int64_t n, int64_t K, int64_t* out, std::vector<float>& tmp,
                std::vector<int64_t>& sel) {
  const int64_t take = std::min(K, n);
  sel.clear();
  if (take > 0 && take < n) {
    tmp.assign(sc, sc + n);
    std::nth_element(tmp.begin(), tmp.begin() + (take - 1), tmp.end(), std::greater<float>());
    const float v = tmp[take - 1];  // the take-th largest: all above it, then the lowest-index ties
    int64_t ties = take;
    for (int64_t i = 0; i < n; ++i) ties -= sc[i] > v;
    for (int64_t i = 0; i < n; ++i) {
      if (sc[i] > v) {
        sel.push_back(i);
      } else if (sc[i] == v && ties > 0) {
        sel.push_back(i);
        --ties;
      }
    }
  } else {
    for (int64_t i = 0; i < take; ++i) sel.push_back(i);
  }
  // sel ascends in i: a stable sort on the score alone breaks ties towards the lowest i
  std::stable_sort(sel.begin(), sel.end(), [&](int64_t a, int64_t b) { return sc[a] > sc[b]; });
  for (int64_t j = 0; j < K; ++j) out[j] = j < take ? sel[j] : -1;
}

struct Problem {
  const char* q;  // [T, nh, d] rows of q's dtype
  at::ScalarType qt;
  int64_t q_st, q_sh;  // byte strides
  const float* head_w;  // [T, nh]
  const int64_t* tables;
  int64_t t_st;  // row stride of tables
  const int64_t* token_seq;
  const int64_t* visible;
  int64_t nh, d, ratio, bs, cap;
  float scale;

  int64_t slot(int64_t s, int64_t w) const {
    const int64_t e = (w + 1) * ratio - 1;
    return tables[s * t_st + e / bs] * cap + (e % bs) / ratio;
  }
  void load_q(int64_t t, float* dst) const {
    for (int64_t h = 0; h < nh; ++h) load_any(q + t * q_st + h * q_sh, qt, dst + h * d, d);
  }
};

// Scores of the n (<= kW) entries ws[0, n) of sequence s for the G queries whose fp32 q rows are qf [G, nh, d]
// and head weights hw [G, nh]: sc[g * stride + ws_pos[j]] for j < n (ws_pos: where each lands in g's row).
template <typename KT>
void score_tile(const Problem& p, const KT* keys, int64_t s, const int64_t* ws, int64_t n, const float* qf,
                const float* hw, int64_t G, float* sc, int64_t stride, const int64_t* pos, float* keyT,
                float* row) {
  const int64_t d = p.d, nh = p.nh;
  for (int64_t j = 0; j < kW; ++j) {  // keyT [d, kW]: entry j's row in column j, zeros past n
    if (j < n) {
      load_row(keys + p.slot(s, ws[j]) * d, row, d);
      for (int64_t i = 0; i < d; ++i) keyT[i * kW + j] = row[i];
    } else {
      for (int64_t i = 0; i < d; ++i) keyT[i * kW + j] = 0.0f;
    }
  }
  const vfloat zero = splat(0.0f), sc_v = splat(p.scale);
  for (int64_t g = 0; g < G; ++g) {
    vfloat tot = zero;
    for (int64_t h = 0; h < nh; ++h) {
      const float* qh = qf + (g * nh + h) * d;
      vfloat acc = zero;
      for (int64_t i = 0; i < d; ++i) acc += splat(qh[i]) * loadv(keyT + i * kW);
      tot += splat(hw[g * nh + h]) * (vmax(acc, zero) * sc_v);
    }
    float lanes[kW];
    storev(lanes, tot);
    for (int64_t j = 0; j < n; ++j) sc[g * stride + pos[j]] = lanes[j];
  }
}

template <typename KT>
void run(const Problem& p, const KT* keys, int64_t T, int64_t K, int64_t* ids, int64_t NB, int64_t* blocks,
         const int64_t* allowed, int64_t B, int64_t cblock) {
  const int64_t nh = p.nh, d = p.d;
  if (B == 0) {
    // runs of up to kGroup consecutive queries of one sequence
    std::vector<int64_t> starts;
    for (int64_t t = 0; t < T; ++t) {
      if (t == 0 || p.token_seq[t] != p.token_seq[t - 1] || t - starts.back() == kGroup) starts.push_back(t);
    }
    starts.push_back(T);
    const int64_t ngroups = static_cast<int64_t>(starts.size()) - 1;
    at::parallel_for(0, ngroups, 1, [&](int64_t g0, int64_t g1) {
      std::vector<float> qf(kGroup * nh * d), hw(kGroup * nh), keyT(d * kW), row(d), sc, tmp, bmax;
      std::vector<int64_t> sel, ws(kW), pos(kW);
      for (int64_t gi = g0; gi < g1; ++gi) {
        const int64_t t0 = starts[gi], G = starts[gi + 1] - t0, s = p.token_seq[t0];
        int64_t nv = 0;
        for (int64_t g = 0; g < G; ++g) {
          p.load_q(t0 + g, qf.data() + g * nh * d);
          std::copy(p.head_w + (t0 + g) * nh, p.head_w + (t0 + g + 1) * nh, hw.data() + g * nh);
          nv = std::max(nv, p.visible[t0 + g]);
        }
        sc.resize(G * std::max<int64_t>(nv, 1));
        for (int64_t w0 = 0; w0 < nv; w0 += kW) {
          const int64_t n = std::min(kW, nv - w0);
          for (int64_t j = 0; j < n; ++j) ws[j] = pos[j] = w0 + j;
          score_tile(p, keys, s, ws.data(), n, qf.data(), hw.data(), G, sc.data(), nv, pos.data(), keyT.data(),
                     row.data());
        }
        for (int64_t g = 0; g < G; ++g) {
          const int64_t t = t0 + g, v = p.visible[t];
          const float* st = sc.data() + g * nv;
          select_top(st, v, K, ids + t * K, tmp, sel);
          if (NB == 0) continue;
          const int64_t nbv = (v + cblock - 1) / cblock;
          bmax.assign(nbv, -std::numeric_limits<float>::infinity());
          for (int64_t w = 0; w < v; ++w) bmax[w / cblock] = std::max(bmax[w / cblock], st[w]);
          if (nbv > 0) bmax[nbv - 1] = std::numeric_limits<float>::infinity();  // the newest block: always kept
          select_top(bmax.data(), nbv, NB, blocks + t * NB, tmp, sel);
        }
      }
    });
    return;
  }
  // candidate-restricted: each query reads only its allowed blocks' visible entries
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> qf(nh * d), keyT(d * kW), row(d), sc, tmp;
    std::vector<int64_t> blk, ws, sel, pos(kW), top(K);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t s = p.token_seq[t], v = p.visible[t];
      p.load_q(t, qf.data());
      blk.clear();
      for (int64_t b = 0; b < B; ++b) {
        const int64_t id = allowed[t * B + b];
        if (id >= 0 && id * cblock < v) blk.push_back(id);
      }
      std::sort(blk.begin(), blk.end());
      blk.erase(std::unique(blk.begin(), blk.end()), blk.end());
      ws.clear();  // ascending: the selection's lowest-index ties are the lowest entries
      for (int64_t b : blk) {
        for (int64_t w = b * cblock; w < std::min(v, (b + 1) * cblock); ++w) ws.push_back(w);
      }
      const int64_t n = static_cast<int64_t>(ws.size());
      sc.resize(std::max<int64_t>(n, 1));
      for (int64_t j0 = 0; j0 < n; j0 += kW) {
        const int64_t m = std::min(kW, n - j0);
        for (int64_t j = 0; j < m; ++j) pos[j] = j0 + j;
        score_tile(p, keys, s, ws.data() + j0, m, qf.data(), p.head_w + t * nh, 1, sc.data(), 0, pos.data(),
                   keyT.data(), row.data());
      }
      select_top(sc.data(), n, K, top.data(), tmp, sel);
      for (int64_t j = 0; j < K; ++j) ids[t * K + j] = top[j] < 0 ? -1 : ws[top[j]];
    }
  });
}

void indexer_select(at::Tensor ids, at::Tensor blocks, const at::Tensor& q, const at::Tensor& head_w,
                    const at::Tensor& keys, const at::Tensor& tables, const at::Tensor& token_seq,
                    const at::Tensor& visible, const at::Tensor& allowed, int64_t ratio, int64_t block_size,
                    int64_t cap, int64_t cblock, double scale) {
  const char* fn = "indexer_select: ";
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, fn, "q must be [T, heads, d] with a contiguous last dim");
  const int64_t T = q.size(0), nh = q.size(1), d = q.size(2);
  const at::ScalarType qt = q.scalar_type();
  TORCH_CHECK(qt == at::kFloat || qt == at::kBFloat16 || qt == at::kHalf, fn, "unsupported q dtype ", qt);
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == T && ids.scalar_type() == at::kLong && ids.is_contiguous(), fn,
              "ids must be a contiguous int64 [T, k]");
  TORCH_CHECK(blocks.dim() == 2 && blocks.size(0) == T && blocks.scalar_type() == at::kLong && blocks.is_contiguous(),
              fn, "blocks must be a contiguous int64 [T, num_blocks] (0 columns: none wanted)");
  TORCH_CHECK(allowed.dim() == 2 && allowed.size(0) == T && allowed.scalar_type() == at::kLong &&
                  allowed.is_contiguous(), fn, "allowed must be a contiguous int64 [T, blocks] (0 columns: all)");
  TORCH_CHECK(!(blocks.size(1) && allowed.size(1)), fn, "a layer either emits candidate blocks or reads them");
  TORCH_CHECK(head_w.dim() == 2 && head_w.size(0) == T && head_w.size(1) == nh && head_w.scalar_type() == at::kFloat &&
                  head_w.is_contiguous(), fn, "head_w must be a contiguous fp32 [T, heads]");
  TORCH_CHECK(keys.dim() == 2 && keys.size(1) == d && keys.is_contiguous(), fn, "keys must be a contiguous [slots, d]");
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kLong && tables.stride(1) == 1, fn,
              "tables must be int64 [S, blocks] with contiguous rows");
  TORCH_CHECK(token_seq.dim() == 1 && token_seq.size(0) == T && token_seq.scalar_type() == at::kLong &&
                  token_seq.is_contiguous() && visible.dim() == 1 && visible.size(0) == T &&
                  visible.scalar_type() == at::kLong && visible.is_contiguous(), fn,
              "token_seq and visible must be contiguous int64 [T]");
  TORCH_CHECK(ratio > 0 && block_size > 0 && cap >= (block_size + ratio - 1) / ratio, fn, "ratio ", ratio,
              ", block_size ", block_size, ", cap ", cap, ": a block's entries need cap >= ceil(block_size / ratio)");
  TORCH_CHECK(cblock > 0 || (blocks.size(1) == 0 && allowed.size(1) == 0), fn, "candidate blocks need cblock > 0");
  const int64_t S = tables.size(0), nblk = tables.size(1), nstore = keys.size(0) / cap;
  const int64_t* tb = tables.const_data_ptr<int64_t>();
  const int64_t* ts = token_seq.const_data_ptr<int64_t>();
  const int64_t* vis = visible.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {  // every block read is checked first: a bad table is an error, not a wild read
    TORCH_CHECK(ts[t] >= 0 && ts[t] < S, fn, "token_seq[", t, "]=", ts[t], " has no tables row");
    TORCH_CHECK(vis[t] >= 0 && (vis[t] == 0 || (vis[t] * ratio - 1) / block_size < nblk), fn, "visible[", t, "]=",
                vis[t], " reaches past the tables' ", nblk, " blocks");
    const int64_t used = vis[t] == 0 ? 0 : (vis[t] * ratio - 1) / block_size + 1;
    for (int64_t b = 0; b < used; ++b) {
      const int64_t blk = tb[ts[t] * tables.stride(0) + b];
      TORCH_CHECK(blk >= 0 && blk < nstore, fn, "tables[", ts[t], ", ", b, "]=", blk, " is outside the store");
    }
  }
  const int64_t K = ids.size(1);
  if (T == 0 || K == 0) return;
  Problem p{static_cast<const char*>(q.const_data_ptr()), qt, q.stride(0) * q.element_size(),
            q.stride(1) * q.element_size(), head_w.const_data_ptr<float>(), tb, tables.stride(0), ts, vis, nh, d,
            ratio, block_size, cap, static_cast<float>(scale)};
  int64_t* ip = ids.data_ptr<int64_t>();
  int64_t* bp = blocks.data_ptr<int64_t>();
  const int64_t* ap = allowed.const_data_ptr<int64_t>();
  const int64_t NB = blocks.size(1), B = allowed.size(1);
  switch (keys.scalar_type()) {
    case at::kFloat: return run(p, keys.const_data_ptr<float>(), T, K, ip, NB, bp, ap, B, cblock);
    case at::kBFloat16: return run(p, keys.const_data_ptr<c10::BFloat16>(), T, K, ip, NB, bp, ap, B, cblock);
    case at::kHalf: return run(p, keys.const_data_ptr<c10::Half>(), T, K, ip, NB, bp, ap, B, cblock);
    default: TORCH_CHECK(false, fn, "unsupported key dtype ", keys.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(openinfer_cpu, m) {
  m.def(
      "indexer_select(Tensor(a!) ids, Tensor(b!) blocks, Tensor q, Tensor head_w, Tensor keys, Tensor tables, "
      "Tensor token_seq, Tensor visible, Tensor allowed, int ratio, int block_size, int cap, int cblock, "
      "float scale) -> ()");
  m.impl("indexer_select", c10::DispatchKey::CPU, &indexer_select);
}
