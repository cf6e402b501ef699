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
// converted once and scored for all of them; the top k is a radix select (select_top), then a sort of the k, not
// a sort of W; a restricted layer reads only its candidate blocks' keys. Sums in fp32, heads in order.
//
// Built at run time by openinfer/layers/cpu_ops.py and registered as torch.ops.openinfer_cpu.*.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "vec.h"

namespace {

constexpr int64_t kGroup = 8;  // queries of one sequence scored together (bounds the per-thread score rows)

// Top-k by a radix select on an order-preserving integer image of the scores: key(a) > key(b) iff a > b, -0 and
// +0 one key, NaN above +inf (torch's descending sort puts NaNs first, as select_topk does). A histogram of the top
// 11 bits finds the bin holding the k-th best; every entry above that bin is in, that bin's entries are the only
// candidates and go through the next 11 and then the last 10 bits the same way; what is still tied after all 32
// bits has equal scores, and the lowest indices of it are taken. Only the k chosen are sorted, as 64-bit
// (key, ~index) pairs, so the order is the stable sort's: descending, ties -> lowest index. Why: the copy of the
// scores, nth_element and a stable sort by indirect comparison took ~4x the tile arithmetic per (query, key);
// the histogram passes are branch-light and stream the scores twice.
struct Selector {
  std::vector<uint32_t> key, cand, next, hist;
  std::vector<uint64_t> sel;
};

inline uint32_t order_key(float x) {
  if (x != x) return 0xFFFFFFFFu;  // NaN: above +inf (0xFF800000)
  x += 0.0f;                       // -0 -> +0 (no -ffast-math in the kernel build)
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// (key, index) -> one integer whose descending order is key descending, then index ascending
inline uint64_t pack(uint32_t key, int64_t i) { return (static_cast<uint64_t>(key) << 32) | ~static_cast<uint32_t>(i); }

// The bin (of hist[0, nbins)) that holds the need-th largest key; need -= the count of the bins above it.
inline uint32_t bin_of_kth(const uint32_t* hist, int64_t nbins, int64_t& need) {
  int64_t b = nbins - 1;
  for (; b > 0 && hist[b] < need; --b) need -= hist[b];
  return static_cast<uint32_t>(b);
}

// out[0, K) = indices i of the `min(K, n)` largest sc[i], descending, ties -> lowest i; -1 pads. n < 2^32.
void select_top(const float* sc, int64_t n, int64_t K, int64_t* out, Selector& s) {
  const int64_t take = std::min(K, n);
  s.sel.clear();
  if (take == n) {
    for (int64_t i = 0; i < n; ++i) s.sel.push_back(pack(order_key(sc[i]), i));
  } else if (take > 0) {
    s.key.resize(n);
    uint32_t* key = s.key.data();
    for (int64_t i = 0; i < n; ++i) key[i] = order_key(sc[i]);
    s.hist.assign(2048, 0);
    uint32_t* hist = s.hist.data();
    for (int64_t i = 0; i < n; ++i) ++hist[key[i] >> 21];
    int64_t need = take;
    uint32_t b = bin_of_kth(hist, 2048, need);
    s.cand.clear();
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t top = key[i] >> 21;
      if (top > b) {
        s.sel.push_back(pack(key[i], i));
      } else if (top == b) {
        s.cand.push_back(static_cast<uint32_t>(i));
      }
    }
    // the bin's entries, in ascending index, by the next bits while more of them are left than are wanted
    constexpr int kShift[2] = {10, 0}, kBits[2] = {11, 10};
    for (int lvl = 0; lvl < 2 && need < static_cast<int64_t>(s.cand.size()); ++lvl) {
      const int sh = kShift[lvl];
      const uint32_t mask = (1u << kBits[lvl]) - 1;
      s.hist.assign(int64_t{1} << kBits[lvl], 0);
      for (uint32_t i : s.cand) ++hist[(key[i] >> sh) & mask];
      b = bin_of_kth(hist, int64_t{1} << kBits[lvl], need);
      s.next.clear();
      for (uint32_t i : s.cand) {
        const uint32_t v = (key[i] >> sh) & mask;
        if (v > b) {
          s.sel.push_back(pack(key[i], i));
        } else if (v == b) {
          s.next.push_back(i);
        }
      }
      s.cand.swap(s.next);
    }
    // what is left ties on every bit (or all of it is wanted): its lowest indices
    const int64_t m = std::min<int64_t>(need, static_cast<int64_t>(s.cand.size()));
    for (int64_t j = 0; j < m; ++j) s.sel.push_back(pack(key[s.cand[j]], s.cand[j]));
  }
  std::sort(s.sel.begin(), s.sel.end(), std::greater<uint64_t>());
  for (int64_t j = 0; j < K; ++j) out[j] = j < take ? static_cast<int64_t>(~static_cast<uint32_t>(s.sel[j])) : -1;
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
  int bs_shift = -1, ratio_shift = -1;  // log2 of bs and ratio when both are powers of two: no divisions per key

  int64_t slot(int64_t s, int64_t w) const {
    const int64_t e = (w + 1) * ratio - 1;
    if (bs_shift >= 0) return tables[s * t_st + (e >> bs_shift)] * cap + ((e & (bs - 1)) >> ratio_shift);
    return tables[s * t_st + e / bs] * cap + (e % bs) / ratio;
  }
  void load_q(int64_t t, float* dst) const {
    for (int64_t h = 0; h < nh; ++h) load_any(q + t * q_st + h * q_sh, qt, dst + h * d, d);
  }
};

// x in every lane as one broadcast: splat's 0 + x is an add first, to turn -0 into +0 (no score can tell: each
// chain starts at +0 and +0 + -0 is +0), and a lane-by-lane fill compiles to kW masked broadcasts
inline vfloat bcast(float x) {
#if defined(__AVX512F__) && OI_VEC_LANES == 16
  return (vfloat)_mm512_set1_ps(x);
#elif defined(__AVX2__) && OI_VEC_LANES == 8
  return (vfloat)_mm256_set1_ps(x);
#else
  return splat(x);
#endif
}

constexpr int64_t kChains = 8;  // (query, head) dot products in flight: FMA latency x throughput on one core

// Scores of the n (<= kW) entries ws[0, n) of sequence s for the G queries whose fp32 q rows are qf [G, nh, d]
// (zero rows after them up to a multiple of kChains) and head weights hw [G, nh]: sc[g * stride + pos[j]] for
// j < n (pos: where each lands in g's row); row_query[r] = r / nh. Each (query, head) dot is one FMA chain over
// i = 0..d-1 and each query's heads are added in order, as before; kChains of these chains run interleaved,
// since one alone waits on its FMA's latency every step (that serial chain was most of the kernel's time).
template <typename KT>
void score_tile(const Problem& p, const KT* keys, int64_t s, const int64_t* ws, int64_t n, const float* qf,
                const float* hw, int64_t G, float* sc, int64_t stride, const int64_t* pos, float* keyT,
                float* row, const int64_t* row_query) {
  const int64_t d = p.d, R = G * p.nh;
  for (int64_t j = 0; j < kW; ++j) {  // keyT [d, kW]: entry j's row in column j, zeros past n
    if (j < n) {
      load_row(keys + p.slot(s, ws[j]) * d, row, d);
      for (int64_t i = 0; i < d; ++i) keyT[i * kW + j] = row[i];
    } else {
      for (int64_t i = 0; i < d; ++i) keyT[i * kW + j] = 0.0f;
    }
  }
  const vfloat zero = splat(0.0f), sc_v = splat(p.scale);
  vfloat tot[kGroup];
  for (int64_t g = 0; g < G; ++g) tot[g] = zero;
  for (int64_t r0 = 0; r0 < R; r0 += kChains) {  // rows r = g * nh + h, in order
    vfloat acc[kChains];
    for (int64_t c = 0; c < kChains; ++c) acc[c] = zero;
    const float* q0 = qf + r0 * d;
    for (int64_t i = 0; i < d; ++i) {
      const vfloat kv = loadv_reg(keyT + i * kW);
      for (int64_t c = 0; c < kChains; ++c) acc[c] += bcast(q0[c * d + i]) * kv;
    }
    for (int64_t c = 0; c < kChains && r0 + c < R; ++c) {
      vfloat& t = tot[row_query[r0 + c]];
      t += splat(hw[r0 + c]) * (vmax(acc[c], zero) * sc_v);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float lanes[kW];
    storev(lanes, tot[g]);
    for (int64_t j = 0; j < n; ++j) sc[g * stride + pos[j]] = lanes[j];
  }
}

inline int64_t padded_rows(int64_t r) { return (r + kChains - 1) / kChains * kChains; }

// The next tile's key rows, asked for while this one is scored: the rows lie in paged blocks in whatever order the
// tables give, so the hardware prefetcher does not see them coming (the row loads were a quarter of the time).
template <typename KT>
inline void prefetch_rows(const Problem& p, const KT* keys, int64_t s, const int64_t* ws, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const char* r = reinterpret_cast<const char*>(keys + p.slot(s, ws[j]) * p.d);
    for (int64_t b = 0; b < p.d * static_cast<int64_t>(sizeof(KT)); b += 64) __builtin_prefetch(r + b);
  }
}

// Per-thread scratch kept from call to call: a score row of a 131k context is 0.5 MB per query, and a fresh one
// per call is a fresh mapping to fault in.
std::vector<float>& scratch_scores() {
  static thread_local std::vector<float> v;
  return v;
}
Selector& scratch_selector() {
  static thread_local Selector s;
  return s;
}

std::vector<int64_t> rows_to_queries(int64_t nh) {  // row r = g * nh + h of a group's q rows -> g
  std::vector<int64_t> out(padded_rows(kGroup * nh));
  for (int64_t r = 0; r < static_cast<int64_t>(out.size()); ++r) out[r] = r / nh;
  return out;
}

template <typename KT>
void run(const Problem& p, const KT* keys, int64_t T, int64_t K, int64_t* ids, int64_t NB, int64_t* blocks,
         const int64_t* allowed, int64_t B, int64_t cblock) {
  const int64_t nh = p.nh, d = p.d;
  const std::vector<int64_t> row_query = rows_to_queries(nh);
  if (B == 0) {
    // runs of up to kGroup consecutive queries of one sequence
    std::vector<int64_t> starts;
    for (int64_t t = 0; t < T; ++t) {
      if (t == 0 || p.token_seq[t] != p.token_seq[t - 1] || t - starts.back() == kGroup) starts.push_back(t);
    }
    starts.push_back(T);
    const int64_t ngroups = static_cast<int64_t>(starts.size()) - 1;
    at::parallel_for(0, ngroups, 1, [&](int64_t g0, int64_t g1) {
      std::vector<float> qf(padded_rows(kGroup * nh) * d, 0.0f), hw(kGroup * nh), keyT(d * kW), row(d), bmax;
      std::vector<int64_t> ws(kW), pos(kW), next(kW);
      std::vector<float>& sc = scratch_scores();
      Selector& sel = scratch_selector();
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
          const int64_t ahead = std::max<int64_t>(0, std::min(kW, nv - w0 - kW));
          for (int64_t j = 0; j < ahead; ++j) next[j] = w0 + kW + j;
          prefetch_rows(p, keys, s, next.data(), ahead);
          score_tile(p, keys, s, ws.data(), n, qf.data(), hw.data(), G, sc.data(), nv, pos.data(), keyT.data(),
                     row.data(), row_query.data());
        }
        for (int64_t g = 0; g < G; ++g) {
          const int64_t t = t0 + g, v = p.visible[t];
          const float* st = sc.data() + g * nv;
          select_top(st, v, K, ids + t * K, sel);
          if (NB == 0) continue;
          const int64_t nbv = (v + cblock - 1) / cblock;
          bmax.resize(nbv);
          for (int64_t b = 0; b < nbv; ++b) {  // a NaN score makes its block's max NaN (torch's amax)
            float m = -std::numeric_limits<float>::infinity();
            bool nan = false;
            for (int64_t w = b * cblock; w < std::min(v, (b + 1) * cblock); ++w) {
              nan |= st[w] != st[w];
              m = st[w] > m ? st[w] : m;
            }
            bmax[b] = nan ? std::numeric_limits<float>::quiet_NaN() : m;
          }
          if (nbv > 0) bmax[nbv - 1] = std::numeric_limits<float>::infinity();  // the newest block: always kept
          select_top(bmax.data(), nbv, NB, blocks + t * NB, sel);
        }
      }
    });
    return;
  }
  // candidate-restricted: each query reads only its allowed blocks' visible entries
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> qf(padded_rows(nh) * d, 0.0f), keyT(d * kW), row(d);
    std::vector<int64_t> blk, ws, pos(kW), top(K);
    std::vector<float>& sc = scratch_scores();
    Selector& sel = scratch_selector();
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
        prefetch_rows(p, keys, s, ws.data() + j0 + m, std::max<int64_t>(0, std::min(kW, n - j0 - m)));
        score_tile(p, keys, s, ws.data() + j0, m, qf.data(), p.head_w + t * nh, 1, sc.data(), 0, pos.data(),
                   keyT.data(), row.data(), row_query.data());
      }
      select_top(sc.data(), n, K, top.data(), sel);
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
    TORCH_CHECK(vis[t] >= 0 && vis[t] < (int64_t{1} << 32) && (vis[t] == 0 || (vis[t] * ratio - 1) / block_size < nblk), fn, "visible[", t, "]=",
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
  auto log2_exact = [](int64_t x) { return (x & (x - 1)) == 0 ? __builtin_ctzll(static_cast<uint64_t>(x)) : -1; };
  if (log2_exact(block_size) >= 0 && log2_exact(ratio) >= 0) {
    p.bs_shift = log2_exact(block_size);
    p.ratio_shift = log2_exact(ratio);
  }
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
