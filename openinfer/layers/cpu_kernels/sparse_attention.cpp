// DeepSeek-V4 attention with a sink over a sliding window and selected compressed entries, read in place.
//
//   keys(t) = kv rows of positions max(0, p - W + 1) .. p of t's sequence (paged token store)
//             ++ entry rows entry_slots[t, :] (>= 0; -1 = none)                           (K == V, width d)
//   out[t, h] = sum_j softmax([scale * q[t, h] . k_j ..., sink_h])_j k_j       (the sink column dropped)
//
// Why: the torch path gathers every query's keys into a [T, W + E, d] tensor (a 128-key window per token in a
// prefill: T x 128 x 512 floats) before its einsums. Here each query reads its window straight from the paged
// store through the sequence's table and its entries by slot, 16 rows at a time widened into an L1 buffer,
// scores in register tiles (attn_tiles.h), an online softmax per head, the sink folded into the denominator at
// the end. Positions are never read past the query (causal by construction), entries with slot -1 are skipped,
// so stale slots are never read. One task per (query, chunk of heads), off a shared counter.
//
// kv_cache_dtype fp8 (DeepSeek's fp8_ds_mla, layers/kv_quant.py DsMlaLayout): kv and entries are uint8 rows of
// [nope e4m3 | rope bf16 | one power-of-two scale byte per 64 nope values], widened the same way per row (no
// bf16 copy of the store).
//
// Built at run time by openinfer/layers/cpu_ops.py and registered as torch.ops.openinfer_cpu.*.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <type_traits>
#include <vector>

#include "attn_tiles.h"
#include "vec.h"

namespace {

struct SparseProblem {
  int64_t T, H, d, bs, window, nb, E;
  int64_t heads_per_task, chunks;
  int64_t q_st, q_sh, out_st, out_sh;
  float scale;
  const int64_t* tables;     // [S, nb] token-store tables
  const int64_t* token_seq;  // [T]
  const int64_t* positions;  // [T]
  const int64_t* entry_slots;  // [T, E] or null
  const float* sinks;        // [H]
  at::ScalarType qtype;
  size_t qsize;
  int64_t row_bytes;             // bytes per store row: d * sizeof(element), or a packed fp8_ds_mla row
  int64_t ds_nope, ds_rope;      // fp8_ds_mla: the e4m3 and bf16 parts of a row (0: not packed)
};

// One fp8_ds_mla row -> d floats: e4m3 tiles of 64 times 2^(scale byte - 127), then the bf16 rope values.
inline void load_ds_mla_row(const uint8_t* row, float* __restrict__ dst, int64_t nope, int64_t rope) {
  const uint8_t* scales = row + nope + 2 * rope;
  load_row(reinterpret_cast<const c10::Float8_e4m3fn*>(row), dst, nope);
  for (int64_t t = 0; t * 64 < nope; ++t) {
    // 2^(e - 127) as the fp32 with exponent field e (e in 1..254; the writer's amax floor keeps e >= 105)
    const float s = __builtin_bit_cast(float, static_cast<uint32_t>(scales[t]) << 23);
    const int64_t end = std::min<int64_t>(nope, (t + 1) * 64);
    for (int64_t i = t * 64; i < end; ++i) dst[i] *= s;
  }
  load_row(reinterpret_cast<const c10::BFloat16*>(row + nope), dst + nope, rope);
}

// CT: the store's element type (uint8_t: fp8_ds_mla rows).
template <typename CT>
void run(const SparseProblem& pb, char* out, const char* q, const CT* kv_, const CT* ent_) {
  const char* kv = reinterpret_cast<const char*>(kv_);
  const char* ent = reinterpret_cast<const char*>(ent_);
  const int64_t rb = pb.row_bytes;
  const int64_t d = pb.d, bs = pb.bs, GC = pb.heads_per_task;
  constexpr int64_t kChunk = 16;  // keys per online-softmax step
  const int64_t ld = kChunk;
  const int64_t ntasks = pb.T * pb.chunks;
  std::atomic<int64_t> next{0};
  const int64_t nworkers = std::min<int64_t>(at::get_num_threads(), ntasks);
  at::parallel_for(0, nworkers, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> scratch(GC * d + GC * d + GC * ld + kChunk * d + 2 * GC);
    float* __restrict__ qf = scratch.data();  // [GC, d] query rows * scale
    float* __restrict__ acc = qf + GC * d;    // [GC, d]
    float* __restrict__ sc = acc + GC * d;    // [GC, ld]
    float* __restrict__ buf = sc + GC * ld;   // [kChunk, d] this chunk's key rows in fp32
    float* __restrict__ mx = buf + kChunk * d;
    float* __restrict__ sum = mx + GC;
    std::vector<const char*> rows(kChunk);
    for (int64_t w = w0; w < w1; ++w) {
      for (int64_t task = next.fetch_add(1); task < ntasks; task = next.fetch_add(1)) {
        const int64_t t = task / pb.chunks, h0 = (task % pb.chunks) * GC;
        const int64_t G = std::min(GC, pb.H - h0);
        const char* qbase = q + (t * pb.q_st + h0 * pb.q_sh) * pb.qsize;
        for (int64_t g = 0; g < G; ++g) {
          load_any(qbase + g * pb.q_sh * pb.qsize, pb.qtype, qf + g * d, d);
          scale_row(qf + g * d, pb.scale, d);
          mx[g] = -std::numeric_limits<float>::infinity();
          sum[g] = 0.0f;
        }
        std::fill(acc, acc + G * d, 0.0f);
        const int64_t p = pb.positions[t];
        const int64_t* table = pb.tables + pb.token_seq[t] * pb.nb;
        const int64_t first = std::max<int64_t>(0, p - pb.window + 1);
        const int64_t nwin = p - first + 1;
        const int64_t* eslots = pb.entry_slots ? pb.entry_slots + t * pb.E : nullptr;
        int64_t j = 0, e = 0;  // next window key, next entry
        while (true) {
          int64_t n = 0;
          for (; n < kChunk && j < nwin; ++n, ++j) {
            const int64_t pos = first + j;
            rows[n] = kv + (table[pos / bs] * bs + pos % bs) * rb;
          }
          for (; n < kChunk && eslots && e < pb.E; ++e) {
            if (eslots[e] >= 0) rows[n++] = ent + eslots[e] * rb;
          }
          if (n == 0) break;
          for (int64_t r = 0; r < n; ++r) {
            if constexpr (std::is_same_v<CT, uint8_t>) {
              load_ds_mla_row(reinterpret_cast<const uint8_t*>(rows[r]), buf + r * d, pb.ds_nope, pb.ds_rope);
            } else {
              load_row(reinterpret_cast<const CT*>(rows[r]), buf + r * d, d);
            }
          }
          chunk_scores(qf, G, buf, n, d, sc, ld);
          online_softmax_chunk(sc, ld, n, G, mx, sum, acc, d);
          chunk_values(acc, G, d, sc, ld, buf, n, d);
        }
        char* obase = out + (t * pb.out_st + h0 * pb.out_sh) * pb.qsize;
        for (int64_t g = 0; g < G; ++g) {
          // the sink: one more logit in the denominator, no value
          const float sink = pb.sinks[h0 + g];
          const float m = std::max(mx[g], sink);
          const float keep = std::exp(mx[g] - m);  // exp(-inf) = 0 when there were no keys
          const float denom = sum[g] * keep + std::exp(sink - m);
          scale_row(acc + g * d, keep / denom, d);
          store_any(acc + g * d, obase + g * pb.out_sh * pb.qsize, pb.qtype, d);
        }
      }
    }
  });
}

void sink_sparse_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& kv, const at::Tensor& tables,
                           const at::Tensor& token_seq, const at::Tensor& positions, int64_t block_size,
                           int64_t window, const c10::optional<at::Tensor>& entries,
                           const c10::optional<at::Tensor>& entry_slots, const at::Tensor& sinks, double scale,
                           int64_t ds_nope, int64_t ds_rope) {
  const char* fn = "sink_sparse_attention: ";
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, fn, "q must be [T, H, d] with a contiguous last dim");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() && out.stride(2) == 1, fn,
              "out must match q");
  const int64_t T = q.size(0), H = q.size(1), d = q.size(2);
  const bool packed = ds_nope > 0;
  // a packed row: nope e4m3 bytes, 2 * rope bf16 bytes, the scale bytes padded to a multiple of 8
  const int64_t row = packed ? ds_nope + 2 * ds_rope + ((ds_nope + 63) / 64 + 7) / 8 * 8 : d;
  TORCH_CHECK(!packed || (ds_rope > 0 && ds_nope + ds_rope == d && kv.scalar_type() == at::kByte), fn,
              "fp8_ds_mla rows need nope + rope == d and a uint8 store");
  TORCH_CHECK(kv.dim() == 2 && kv.size(1) == row && kv.is_contiguous(), fn, "kv must be a contiguous [slots, ",
              row, "]");
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kLong && tables.is_contiguous(), fn,
              "tables must be a contiguous int64 [S, blocks]");
  TORCH_CHECK(token_seq.dim() == 1 && token_seq.size(0) == T && token_seq.scalar_type() == at::kLong &&
                  token_seq.is_contiguous() && positions.dim() == 1 && positions.size(0) == T &&
                  positions.scalar_type() == at::kLong && positions.is_contiguous(), fn,
              "token_seq and positions must be contiguous int64 [T]");
  TORCH_CHECK(sinks.dim() == 1 && sinks.size(0) == H && sinks.scalar_type() == at::kFloat && sinks.is_contiguous(),
              fn, "sinks must be a contiguous fp32 [H]");
  TORCH_CHECK(block_size > 0 && window > 0, fn, "block_size and window must be positive");
  const bool has_entries = entries.has_value() && entries->defined() && entry_slots.has_value() &&
                           entry_slots->defined() && entry_slots->size(1) > 0;
  if (has_entries) {
    TORCH_CHECK(entries->dim() == 2 && entries->size(1) == row && entries->is_contiguous() &&
                    entries->scalar_type() == kv.scalar_type(), fn, "entries must be a contiguous [slots, d] like kv");
    TORCH_CHECK(entry_slots->dim() == 2 && entry_slots->size(0) == T && entry_slots->scalar_type() == at::kLong &&
                    entry_slots->is_contiguous(), fn, "entry_slots must be a contiguous int64 [T, E]");
  }
  const at::ScalarType qt = q.scalar_type();
  TORCH_CHECK(qt == at::kFloat || qt == at::kBFloat16 || qt == at::kHalf, fn, "unsupported q dtype ", qt);
  if (T == 0 || H == 0) return;
  SparseProblem pb;
  pb.T = T; pb.H = H; pb.d = d; pb.bs = block_size; pb.window = window; pb.nb = tables.size(1);
  pb.E = has_entries ? entry_slots->size(1) : 0;
  pb.heads_per_task = heads_per_task(T, H, at::get_num_threads());
  pb.chunks = (H + pb.heads_per_task - 1) / pb.heads_per_task;
  pb.q_st = q.stride(0); pb.q_sh = q.stride(1); pb.out_st = out.stride(0); pb.out_sh = out.stride(1);
  pb.scale = static_cast<float>(scale);
  pb.tables = tables.const_data_ptr<int64_t>();
  pb.token_seq = token_seq.const_data_ptr<int64_t>();
  pb.positions = positions.const_data_ptr<int64_t>();
  pb.entry_slots = has_entries ? entry_slots->const_data_ptr<int64_t>() : nullptr;
  pb.sinks = sinks.const_data_ptr<float>();
  pb.qtype = qt;
  pb.qsize = q.element_size();
  pb.row_bytes = packed ? row : d * static_cast<int64_t>(kv.element_size());
  pb.ds_nope = ds_nope;
  pb.ds_rope = ds_rope;
  // Every row the kernel will read is checked first: a bad table or slot is an error, never a wild read.
  const int64_t kv_blocks = kv.size(0) / block_size, S = tables.size(0);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = pb.token_seq[t], p = pb.positions[t];
    TORCH_CHECK(s >= 0 && s < S, fn, "token_seq[", t, "]=", s, " has no table (", S, " rows)");
    TORCH_CHECK(p >= 0 && p / block_size < pb.nb, fn, "positions[", t, "]=", p, " is past its table");
    for (int64_t i = std::max<int64_t>(0, p - window + 1) / block_size; i <= p / block_size; ++i) {
      const int64_t blk = pb.tables[s * pb.nb + i];
      TORCH_CHECK(blk >= 0 && blk < kv_blocks, fn, "tables[", s, ", ", i, "]=", blk, " is outside the store (",
                  kv_blocks, " blocks)");
    }
    for (int64_t e = 0; e < pb.E; ++e) {
      const int64_t slot = pb.entry_slots[t * pb.E + e];
      TORCH_CHECK(slot < entries->size(0), fn, "entry_slots[", t, ", ", e, "]=", slot, " is outside the store");
    }
  }
  char* o = static_cast<char*>(out.data_ptr());
  const char* qp = static_cast<const char*>(q.const_data_ptr());
  if (packed) {
    return run<uint8_t>(pb, o, qp, kv.const_data_ptr<uint8_t>(),
                        has_entries ? entries->const_data_ptr<uint8_t>() : nullptr);
  }
  switch (kv.scalar_type()) {
    case at::kFloat:
      return run<float>(pb, o, qp, kv.const_data_ptr<float>(), has_entries ? entries->const_data_ptr<float>() : nullptr);
    case at::kBFloat16:
      return run<c10::BFloat16>(pb, o, qp, kv.const_data_ptr<c10::BFloat16>(),
                                has_entries ? entries->const_data_ptr<c10::BFloat16>() : nullptr);
    case at::kHalf:
      return run<c10::Half>(pb, o, qp, kv.const_data_ptr<c10::Half>(),
                            has_entries ? entries->const_data_ptr<c10::Half>() : nullptr);
    default: TORCH_CHECK(false, fn, "unsupported store dtype ", kv.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(openinfer_cpu, m) {
  m.def(
      "sink_sparse_attention(Tensor(a!) out, Tensor q, Tensor kv, Tensor tables, Tensor token_seq, Tensor positions, "
      "int block_size, int window, Tensor? entries, Tensor? entry_slots, Tensor sinks, float scale, "
      "int ds_nope=0, int ds_rope=0) -> ()");
  m.impl("sink_sparse_attention", c10::DispatchKey::CPU, &sink_sparse_attention);
}
