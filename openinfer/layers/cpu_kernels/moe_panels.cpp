// Routed experts on panel-packed fp32 / bf16 weights (layers/deepseek_moe.py, DeepseekExperts.prepack_cpu): for rows
// [R, H] sorted by expert (counts[e] rows for expert e, in expert order), y = swiglu(rows W13[e]^T) W2[e]^T per
// expert, in one call, with W13 [E, 2I, H] (gate rows then up rows) as panels [E, 2I / 16, H, 16] and W2 [E, H, I]
// as panels [E, ceil(H / 16), I, 16] (the model's only copy of them; I a multiple of 16, so gate panel p and up
// panel I / 16 + p cover the same 16 intermediate columns).
//
// Why: the row-major experts kernel (moe_gemv.cpp) shares each weight load between 2 rows and reads a row-major
// weight at ~10-12 GB/s; on panels every expert's matrices are contiguous streams and the register tiles of
// panel_tile.h take up to 6 rows per load, at any row count (1-3 rows per expert at batch 1-8 decode, hundreds in
// prefill), so one kernel serves every batch and replaces torch._grouped_mm as well.
// - phase 1, work items (expert, gate panel p): gate and up for the expert's rows, 16 columns each, then
//   silu(min(gate, limit)) * clamp(up, -limit, limit) (DeepSeek-V4's clamp; +inf: none) into an fp32 buffer h [R, I];
//   bf16 weights: gate, up, silu and the product rounded to bf16 as the torch path rounds them (moe_gemv.cpp too);
// - phase 2, work items (expert, panel q of W2): out = h W2[e]^T, 16 output columns at a time, rounded once.
// Both phases are one at::parallel_for over the work items of the experts that have rows (an expert's rows in row
// blocks when it has many, panel_tile.h); an expert without rows is never read (NaN there cannot reach the
// output). Every output element is one fixed k-order sum whatever the thread split: 1 and N threads give the same
// bits.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "panel_tile.h"
#include "vec.h"
#include "kernels.h"

namespace {

inline float round_to(float v, const float*) { return v; }
inline float round_to(float v, const c10::BFloat16*) { return static_cast<float>(c10::BFloat16(v)); }

template <typename WT>
void run(at::Tensor& out, const at::Tensor& x32, const std::vector<int64_t>& start, const at::Tensor& p13,
         const at::Tensor& p2, float lim) {
  const int64_t E = p13.size(0), H = p13.size(2), I = p2.size(2), IP = I / kPanel, HP = p2.size(1);
  const int64_t R = x32.size(0);
  // Row blocks: each expert's rows, cut into panel_tile.h's row blocks when there are many (prefill), so a block
  // stays in L2 while the expert's panels go by. Experts without rows get none (never read).
  struct Block { int64_t e, r0, n; };
  std::vector<Block> blocks;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = start[e + 1] - start[e], mb = row_block(n);
    for (int64_t r = 0; r < n; r += mb) blocks.push_back({e, start[e] + r, std::min(mb, n - r)});
  }
  const int64_t A = static_cast<int64_t>(blocks.size());
  const float* x = x32.data_ptr<float>();
  const WT* w13 = p13.data_ptr<WT>();
  const WT* w2 = p2.data_ptr<WT>();
  WT* y = out.data_ptr<WT>();
  const WT* tag = nullptr;  // selects round_to's overload
  std::vector<float> h(static_cast<size_t>(R * I));

  at::parallel_for(0, A * IP, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> gate, up;
    for (int64_t t = t0; t < t1; ++t) {
      const Block& bk = blocks[t / IP];
      const int64_t e = bk.e, p = t % IP, r0 = bk.r0, n = bk.n;
      gate.resize(n * kPanel);
      up.resize(n * kPanel);
      const WT* we = w13 + e * 2 * IP * H * kPanel;
      panel_rows(x + r0 * H, H, we + p * H * kPanel, H, gate.data(), kPanel, n, kPanel, nullptr);
      panel_rows(x + r0 * H, H, we + (IP + p) * H * kPanel, H, up.data(), kPanel, n, kPanel, nullptr);
      for (int64_t r = 0; r < n; ++r) {
        float* hr = h.data() + (r0 + r) * I + p * kPanel;
        // the torch path's roundings for bf16 (matmul output, silu, product in the weights' dtype); silu in vectors
        // (vec.h, relative error ~1e-7): a scalar expf per element was ~8 % of this phase
        alignas(64) float g[kPanel], u[kPanel];
        for (int c = 0; c < kPanel; ++c) {
          g[c] = std::min(round_to(gate[r * kPanel + c], tag), lim);
          u[c] = std::min(std::max(round_to(up[r * kPanel + c], tag), -lim), lim);
        }
        for (int c = 0; c < kPanel; c += kW) storev(g + c, vsilu(loadv(g + c)));
        for (int c = 0; c < kPanel; ++c) hr[c] = round_to(round_to(g[c], tag) * u[c], tag);
      }
    }
  });
  at::parallel_for(0, A * HP, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const Block& bk = blocks[t / HP];
      const int64_t e = bk.e, q = t % HP, r0 = bk.r0, n = bk.n;
      const int cols = static_cast<int>(std::min<int64_t>(kPanel, H - q * kPanel));
      panel_rows(h.data() + r0 * I, I, w2 + (e * HP + q) * I * kPanel, I, y + r0 * H + q * kPanel, H, n, cols,
                 nullptr);
    }
  });
}

void moe_experts_panels(at::Tensor out, const at::Tensor& rows, const at::Tensor& counts, const at::Tensor& p13,
                        const at::Tensor& p2, double limit) {
  const auto dt = p13.scalar_type();
  TORCH_CHECK(p13.dim() == 4 && p2.dim() == 4 && p13.size(3) == kPanel && p2.size(3) == kPanel &&
                  (dt == at::kFloat || dt == at::kBFloat16) && p2.scalar_type() == dt && p13.is_contiguous() &&
                  p2.is_contiguous(),
              "moe_experts_panels: p13 / p2 must be contiguous fp32 or bf16 [E, NP, K, 16], one dtype");
  const int64_t E = p13.size(0), H = p13.size(2), I = p2.size(2), IP = I / kPanel, HP = p2.size(1);
  TORCH_CHECK(I % kPanel == 0 && p13.size(1) == 2 * IP && p2.size(0) == E && HP == (H + kPanel - 1) / kPanel,
              "moe_experts_panels: p13 must be [E, 2I / 16, H, 16] and p2 [E, ceil(H / 16), I, 16], I a multiple of 16");
  TORCH_CHECK(rows.dim() == 2 && rows.is_contiguous() && rows.scalar_type() == dt && rows.size(1) == H,
              "moe_experts_panels: rows must be contiguous [R, H] in the weights' dtype");
  const int64_t R = rows.size(0);
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == dt && out.size(0) == R &&
                  out.size(1) == H,
              "moe_experts_panels: out must be contiguous [R, H] in the weights' dtype");
  TORCH_CHECK(counts.dim() == 1 && counts.size(0) == E && counts.scalar_type() == at::kLong,
              "moe_experts_panels: counts must be int64 [E]");
  std::vector<int64_t> start(E + 1, 0);
  const int64_t* cnt = counts.data_ptr<int64_t>();
  for (int64_t e = 0; e < E; ++e) {
    TORCH_CHECK(cnt[e] >= 0, "moe_experts_panels: negative count");
    start[e + 1] = start[e] + cnt[e];
  }
  TORCH_CHECK(start[E] == R, "moe_experts_panels: counts must sum to the number of rows");
  if (R == 0) return;
  const float lim = static_cast<float>(limit);
  if (dt == at::kFloat) return run<float>(out, rows, start, p13, p2, lim);
  run<c10::BFloat16>(out, rows.to(at::kFloat), start, p13, p2, lim);  // rows widened once
}

}  // namespace

namespace oi {
void moe_experts_panels(at::Tensor out, const at::Tensor& rows, const at::Tensor& counts, const at::Tensor& p13,
                        const at::Tensor& p2, double limit) {
  ::moe_experts_panels(std::move(out), rows, counts, p13, p2, limit);
}
}  // namespace oi

TORCH_LIBRARY_FRAGMENT(openinfer_cpu, m) {
  m.def("moe_experts_panels(Tensor(a!) out, Tensor rows, Tensor counts, Tensor p13, Tensor p2, float limit) -> ()");
  m.impl("moe_experts_panels", c10::DispatchKey::CPU, &moe_experts_panels);
}
