// MLA decode attention over the paged *latent* cache (DeepSeek-V2/V3, weight-absorbed form).
//
//   out[b, h, :Dv] = softmax_t(scale * q[b, h, :] . C[b, t, :]) @ C[b, t, :Dv]
//
// C[b, t] = cache[block_tables[b, t / bs], t % bs, :] is the token's latent [c_kv (Dv) | k_pe (D - Dv)], shared
// by every head: keys are whole rows, values their first Dv entries. q[b, h] = [W_UK_h^T q_nope | q_pe] (576
// wide for V3); the caller applies W_UV to out. This is MQA with one kv head, so every head reads the same rows.
//
// Why a kernel: the torch path gathers every sequence's blocks into a tensor padded to the longest sequence and
// runs SDPA's math fallback (no fused CPU kernel takes head dim 576 with a value dim of 512), copying and
// masking [B, H, max_len, 576] each step. Here each block is read once, in place, for all heads:
//   - one task per (sequence, chunk of heads); heads are split only when there are too few sequences to keep
//     the threads busy, because each chunk reads the sequence's rows again;
//   - per block: scores in register tiles of 2 heads x 4 keys (the 4 rows, 9 KB in fp32, stay in L1 while the
//     heads go by), an online softmax per head, then P V in tiles of 2 heads x 4 vectors of columns (the column
//     slice of the block's rows stays in L1);
//   - the next block is prefetched while this block's scores run, a few lines per tile (attn_tiles.h); the
//     tiles' shared key / value / query vectors are held in registers (vec.h's loadv_reg): GCC re-read them as
//     memory operands of every FMA, and loads bound the loop (50 -> 69 GFLOP/s with the rows in cache);
//   - fp32 caches are read in place; bf16 / fp16 / fp8 e4m3 blocks are widened to fp32 once and serve both
//     products (fp8: kv_cache_dtype fp8, converted in registers, vec.h).
// Rows at or past a sequence's length are never read (stale slots may hold anything, NaN included); an empty
// sequence gives zeros. fp32 accumulation throughout.
//
// Built at run time by openinfer/layers/cpu_ops.py and registered as torch.ops.openinfer_cpu.mla_decode_attention.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <type_traits>
#include <vector>

#include "attn_tiles.h"
#include "vec.h"

namespace {

struct MlaProblem {
  int64_t B, H, D, Dv, bs, max_blocks;
  int64_t heads_per_task, chunks;  // heads split into `chunks` tasks of at most heads_per_task
  int64_t q_sb, q_sh, out_sb, out_sh;
  int64_t c_sblk;  // cache stride between blocks (a slot is D contiguous elements)
  float scale;
  const int64_t* tables;
  const int64_t* lens;
  at::ScalarType qtype;
  size_t qsize;
};

// CT: the cache's element type; DC / DVC: D and Dv when fixed at compile time (0: any).
template <typename CT, int64_t DC, int64_t DVC>
void run(const MlaProblem& pb, char* out, const char* q, const CT* cache) {
  const int64_t D = DC ? DC : pb.D, Dv = DVC ? DVC : pb.Dv, bs = pb.bs, GC = pb.heads_per_task;
  const int64_t ld = (bs + kW - 1) / kW * kW;  // score rows padded to whole vectors
  const int64_t ntasks = pb.B * pb.chunks;
  // Tasks off a shared counter inside torch's pool: sequences differ in length and parallel_for would hand
  // each thread one fixed range.
  std::atomic<int64_t> next{0};
  const int64_t nworkers = std::min<int64_t>(at::get_num_threads(), ntasks);
  at::parallel_for(0, nworkers, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> scratch(GC * D + GC * Dv + GC * ld + (std::is_same_v<CT, float> ? 0 : bs * D) + 2 * GC);
    float* __restrict__ qf = scratch.data();  // [GC, D] query rows * scale
    float* __restrict__ acc = qf + GC * D;    // [GC, Dv] unnormalised outputs
    float* __restrict__ sc = acc + GC * Dv;   // [GC, ld] one block's scores, then probabilities
    float* __restrict__ buf = sc + GC * ld;   // [bs, D] one block widened to fp32 (not for fp32 caches)
    float* __restrict__ mx = buf + (std::is_same_v<CT, float> ? 0 : bs * D);
    float* __restrict__ sum = mx + GC;
    const float ninf = -std::numeric_limits<float>::infinity();
    for (int64_t w = w0; w < w1; ++w) {
      for (int64_t task = next.fetch_add(1); task < ntasks; task = next.fetch_add(1)) {
        const int64_t b = task / pb.chunks, h0 = (task % pb.chunks) * GC;
        const int64_t G = std::min(GC, pb.H - h0);
        if (G <= 0) continue;
        const int64_t len = pb.lens[b];
        char* obase = out + (b * pb.out_sb + h0 * pb.out_sh) * pb.qsize;
        if (len <= 0) {  // no keys: zeros rather than 0 / 0
          std::fill(acc, acc + Dv, 0.0f);
          for (int64_t g = 0; g < G; ++g) store_any(acc, obase + g * pb.out_sh * pb.qsize, pb.qtype, Dv);
          continue;
        }
        const char* qbase = q + (b * pb.q_sb + h0 * pb.q_sh) * pb.qsize;
        for (int64_t g = 0; g < G; ++g) {
          load_any(qbase + g * pb.q_sh * pb.qsize, pb.qtype, qf + g * D, D);
          scale_row(qf + g * D, pb.scale, D);
          mx[g] = ninf;
          sum[g] = 0.0f;
        }
        std::fill(acc, acc + G * Dv, 0.0f);
        const int64_t* table = pb.tables + b * pb.max_blocks;
        const int64_t nblocks = (len + bs - 1) / bs;
        for (int64_t i = 0; i < nblocks; ++i) {
          const int64_t n = std::min(bs, len - i * bs);
          const CT* blk = cache + table[i] * pb.c_sblk;
          // the next block, prefetched while this one's scores run (chunk_scores)
          const char* next =
              i + 1 < nblocks ? reinterpret_cast<const char*>(cache + table[i + 1] * pb.c_sblk) : nullptr;
          const int64_t next_bytes = next ? std::min(bs, len - (i + 1) * bs) * D * int64_t(sizeof(CT)) : 0;
          const float* rows;
          if constexpr (std::is_same_v<CT, float>) {
            rows = blk;
          } else {
            for (int64_t t = 0; t < n; ++t) load_row(blk + t * D, buf + t * D, D);
            rows = buf;
          }
          chunk_scores(qf, G, rows, n, D, sc, ld, next, next_bytes);
          online_softmax_chunk(sc, ld, n, G, mx, sum, acc, Dv);
          chunk_values(acc, G, Dv, sc, ld, rows, n, D);
        }
        for (int64_t g = 0; g < G; ++g) {
          scale_row(acc + g * Dv, 1.0f / sum[g], Dv);  // sum >= 1: the max score contributes exp(0)
          store_any(acc + g * Dv, obase + g * pb.out_sh * pb.qsize, pb.qtype, Dv);
        }
      }
    }
  });
}

template <typename CT>
void dispatch(const MlaProblem& pb, char* out, const char* q, const at::Tensor& cache) {
  const CT* c = cache.const_data_ptr<CT>();
  if (pb.D == 576 && pb.Dv == 512) return run<CT, 576, 512>(pb, out, q, c);  // DeepSeek-V2/V3
  return run<CT, 0, 0>(pb, out, q, c);
}

}  // namespace

#include "amx_mla_decode.h"
#include "kernels.h"

namespace {

void mla_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& cache,
                          const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  const char* fn = "mla_decode_attention: ";
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&out, &q, &cache, &block_tables, &seq_lens}) {
    TORCH_CHECK(t->device().is_cpu(), fn, "all tensors must be on the CPU");
  }
  TORCH_CHECK(q.dim() == 3, fn, "q must be [B, H, D], got ", q.sizes());
  TORCH_CHECK(cache.dim() == 3 && cache.is_contiguous(), fn,
              "cache must be a contiguous [num_blocks, block_size, D], got ", cache.sizes());
  TORCH_CHECK(out.dim() == 3 && out.size(0) == q.size(0) && out.size(1) == q.size(1), fn, "out ",
              out.sizes(), " must be [B, H, Dv] for q ", q.sizes());
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), fn, "out dtype ", out.scalar_type(), " != q dtype ",
              q.scalar_type());
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, fn, "q and out need a contiguous last dim");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Dv = out.size(2);
  TORCH_CHECK(cache.size(2) == D, fn, "q's last dim (", D, ") != the cache's (", cache.size(2), ")");
  TORCH_CHECK(Dv > 0 && Dv <= D, fn, "value dim ", Dv, " must be in [1, ", D, "]");
  const int64_t nblk = cache.size(0), bs = cache.size(1);
  TORCH_CHECK(bs > 0, fn, "block_size must be positive");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, fn,
              "block_tables and seq_lens must be int64");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B && block_tables.is_contiguous(), fn,
              "block_tables must be a contiguous [B, max_blocks] tensor, got ", block_tables.sizes());
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == B && seq_lens.is_contiguous(), fn,
              "seq_lens must be a contiguous [B] tensor, got ", seq_lens.sizes());
  const at::ScalarType qt = q.scalar_type();
  TORCH_CHECK(qt == at::kFloat || qt == at::kBFloat16 || qt == at::kHalf, fn, "unsupported q dtype ", qt);
  if (B == 0 || H == 0) return;

  MlaProblem pb;
  pb.B = B; pb.H = H; pb.D = D; pb.Dv = Dv; pb.bs = bs; pb.max_blocks = block_tables.size(1);
  pb.heads_per_task = heads_per_task(B, H, at::get_num_threads());
  pb.chunks = (H + pb.heads_per_task - 1) / pb.heads_per_task;
  pb.q_sb = q.stride(0); pb.q_sh = q.stride(1); pb.out_sb = out.stride(0); pb.out_sh = out.stride(1);
  pb.c_sblk = cache.stride(0);
  pb.scale = static_cast<float>(scale);
  pb.tables = block_tables.const_data_ptr<int64_t>();
  pb.lens = seq_lens.const_data_ptr<int64_t>();
  pb.qtype = qt;
  pb.qsize = q.element_size();
  // Every block the kernel will read is checked here: a bad table is an error, never a wild read.
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = pb.lens[b];
    const int64_t need = len > 0 ? (len + bs - 1) / bs : 0;
    TORCH_CHECK(need <= pb.max_blocks, fn, "seq_lens[", b, "]=", len, " needs ", need,
                " blocks; block_tables has ", pb.max_blocks);
    for (int64_t i = 0; i < need; ++i) {
      const int64_t blk = pb.tables[b * pb.max_blocks + i];
      TORCH_CHECK(blk >= 0 && blk < nblk, fn, "block_tables[", b, ", ", i, "]=", blk,
                  " is outside the cache (", nblk, " blocks)");
    }
  }
  char* o = static_cast<char*>(out.data_ptr());
  const char* qp = static_cast<const char*>(q.const_data_ptr());
  if (amx_mla_decode(pb, o, qp, cache)) return;
  switch (cache.scalar_type()) {
    case at::kFloat: return dispatch<float>(pb, o, qp, cache);
    case at::kBFloat16: return dispatch<c10::BFloat16>(pb, o, qp, cache);
    case at::kHalf: return dispatch<c10::Half>(pb, o, qp, cache);
    case at::kFloat8_e4m3fn: return dispatch<c10::Float8_e4m3fn>(pb, o, qp, cache);  // kv_cache_dtype fp8
    default: TORCH_CHECK(false, fn, "unsupported cache dtype ", cache.scalar_type());
  }
}

}  // namespace

namespace oi {
void mla_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_tables,
                          const at::Tensor& seq_lens, double scale) {
  ::mla_decode_attention(std::move(out), q, cache, block_tables, seq_lens, scale);
}
}  // namespace oi

TORCH_LIBRARY_FRAGMENT(openinfer_cpu, m) {
  m.def(
      "mla_decode_attention(Tensor(a!) out, Tensor q, Tensor cache, Tensor block_tables, Tensor seq_lens, "
      "float scale) -> ()");
  m.impl("mla_decode_attention", c10::DispatchKey::CPU, &mla_decode_attention);
  // The MLA kernel's AMX path on or off (OPENINFER_CPU_AMX=0, and tests comparing the two); returns whether
  // this build and machine can run it.
  m.def("mla_decode_use_amx(bool enable) -> bool", [](bool enable) {
    g_mla_amx_enabled.store(enable);
    return mla_amx_available();
  });
}
