// Routed experts at decode-sized row counts (layers/moe.py): for rows [R, H] sorted by expert (counts[e] rows for
// expert e, in expert order), y = swiglu(rows W13[e]^T) W2[e]^T per expert, in one call, with W13 [E, 2I, H] (gate
// rows then up rows) and W2 [E, H, I] the plain row-major fp32 / bf16 stacks (the model's only copy of them).
//
// Why: at batch 1-8 each of the few experts with rows sees 1-3 rows, and each projection is a pass over that
// expert's weight bytes. Looping over experts in Python with one oneDNN matmul per projection plus a swiglu op
// pays dispatch and primitive overhead per call, and the packed layout is at its weakest at 1-3 rows. Here the
// dot-product blocks of gemv.cpp (gemv_block.h: each weight row read once per call, kM activation rows sharing each
// load, bf16 widened in registers) run over all experts at once:
// - phase 1, work items (expert, block of kRows gate rows and the kRows matching up rows): gate and up are rounded
//   to the weights' dtype, clamped by the limit (DeepSeek-V4; +inf: none), silu(gate) rounded, times up, rounded:
//   the roundings of the torch path (matmul in dtype, then moe.swiglu), into an fp32 buffer h [R, I] (already in
//   the de-interleaved order the bf16 dot blocks read, so phase 2 needs no conversion pass);
// - phase 2, work items (expert, block of kRows output rows of W2): out = h W2[e]^T, rounded once.
// Both phases are one at::parallel_for over a flat list of work items of the experts that have rows, so two
// threads stay busy when only four experts do; an expert without rows is never read (NaN there cannot reach the
// output). Every output element is one dot block whatever the thread split: 1 and N threads give the same bits.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "gemv_block.h"

namespace {

inline float round_to(float v, float*) { return v; }
inline float round_to(float v, c10::BFloat16*) { return static_cast<float>(c10::BFloat16(v)); }

template <typename WT>
inline void dot_any(int R, int MB, const float* x, int64_t K, const WT* w, float acc[kM][kRows]) {
  switch (R) {
    case 4: dot_rows<4>(MB, x, K, w, acc); break;
    case 3: dot_rows<3>(MB, x, K, w, acc); break;
    case 2: dot_rows<2>(MB, x, K, w, acc); break;
    default: dot_rows<1>(MB, x, K, w, acc); break;
  }
}

// Where column c of a K-wide activation row sits in the order the dot blocks read: natural for fp32 weights; for
// bf16 ones each full run of kPair columns holds its even columns then its odd ones (bf16_pairs).
inline int64_t read_pos(int64_t c, int64_t K, bool pairs) {
  constexpr int64_t run = kPair > 0 ? kPair : 1;  // (no vector code: kPair 0, nothing de-interleaved)
  if (!pairs || kPair == 0 || c >= K / run * run) return c;
  const int64_t k = c / run * run, o = c - k;
  return k + (o % 2 ? run / 2 + o / 2 : o / 2);
}

// The work items of a phase: nb blocks per expert with rows, flattened; item i is block block[i] of expert expert[i].
struct Items {
  std::vector<int64_t> expert, block;
};

Items make_items(const std::vector<int64_t>& counts, int64_t nb) {
  Items it;
  for (int64_t e = 0; e < static_cast<int64_t>(counts.size()); ++e)
    if (counts[e] > 0)
      for (int64_t b = 0; b < nb; ++b) {
        it.expert.push_back(e);
        it.block.push_back(b);
      }
  return it;
}

template <typename WT>
void moe_impl(WT* out, const float* x, const std::vector<int64_t>& counts, const WT* w13, const WT* w2, int64_t H,
              int64_t I, float limit) {
  const int64_t E = static_cast<int64_t>(counts.size());
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) start[e + 1] = start[e] + counts[e];
  const int64_t R = start[E];
  constexpr bool pairs = std::is_same<WT, c10::BFloat16>::value;
  const bool clamp = std::isfinite(limit);
  std::vector<float> h(R * I);

  // ~64 KB of weight bytes per task at least (as gemv.cpp), so a small call does not wake every thread for nothing
  const Items p1 = make_items(counts, (I + kRows - 1) / kRows);
  const int64_t grain1 = std::max<int64_t>(1, 65536 / std::max<int64_t>(2 * kRows * H * sizeof(WT), 1));
  at::parallel_for(0, static_cast<int64_t>(p1.expert.size()), grain1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = p1.expert[i], j0 = p1.block[i] * kRows;
      const int nr = static_cast<int>(std::min<int64_t>(kRows, I - j0));
      const WT* wg = w13 + (e * 2 * I + j0) * H;
      const WT* wu = w13 + (e * 2 * I + I + j0) * H;
      for (int64_t m = start[e]; m < start[e + 1]; m += kM) {
        const int MB = static_cast<int>(std::min<int64_t>(kM, start[e + 1] - m));
        float g[kM][kRows], u[kM][kRows];
        dot_any(nr, MB, x + m * H, H, wg, g);
        dot_any(nr, MB, x + m * H, H, wu, u);
        for (int a = 0; a < MB; ++a)
          for (int r = 0; r < nr; ++r) {
            float gv = round_to(g[a][r], static_cast<WT*>(nullptr));
            float uv = round_to(u[a][r], static_cast<WT*>(nullptr));
            if (clamp) {  // written so that NaN passes through, as torch.clamp does
              gv = gv > limit ? limit : gv;
              uv = uv > limit ? limit : (uv < -limit ? -limit : uv);
            }
            const float s = round_to(gv / (1.f + std::exp(-gv)), static_cast<WT*>(nullptr));
            h[(m + a) * I + read_pos(j0 + r, I, pairs)] = round_to(s * uv, static_cast<WT*>(nullptr));
          }
      }
    }
  });

  const Items p2 = make_items(counts, (H + kRows - 1) / kRows);
  const int64_t grain2 = std::max<int64_t>(1, 65536 / std::max<int64_t>(kRows * I * sizeof(WT), 1));
  at::parallel_for(0, static_cast<int64_t>(p2.expert.size()), grain2, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = p2.expert[i], n = p2.block[i] * kRows;
      const int nr = static_cast<int>(std::min<int64_t>(kRows, H - n));
      const WT* wd = w2 + (e * H + n) * I;
      for (int64_t m = start[e]; m < start[e + 1]; m += kM) {
        const int MB = static_cast<int>(std::min<int64_t>(kM, start[e + 1] - m));
        float acc[kM][kRows];
        dot_any(nr, MB, h.data() + m * I, I, wd, acc);
        for (int a = 0; a < MB; ++a)
          for (int r = 0; r < nr; ++r) store(out + (m + a) * H + n + r, acc[a][r]);
      }
    }
  });
}

// out [R, H] = the experts on rows [R, H] (sorted by expert, counts [E] int64 summing to R); w13 [E, 2I, H], w2
// [E, H, I]; all contiguous, in one dtype (fp32 or bf16); limit: the swiglu clamp, +inf for none.
void moe_experts_gemv(at::Tensor out, const at::Tensor& rows, const at::Tensor& counts, const at::Tensor& w13,
                      const at::Tensor& w2, double limit) {
  const auto dt = w13.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "moe_experts_gemv: weights must be fp32 or bf16");
  TORCH_CHECK(w13.dim() == 3 && w13.is_contiguous() && w13.size(1) % 2 == 0,
              "moe_experts_gemv: w13 must be contiguous [E, 2I, H]");
  const int64_t E = w13.size(0), I = w13.size(1) / 2, H = w13.size(2);
  TORCH_CHECK(w2.dim() == 3 && w2.is_contiguous() && w2.scalar_type() == dt && w2.size(0) == E && w2.size(1) == H &&
                  w2.size(2) == I,
              "moe_experts_gemv: w2 must be contiguous [E, H, I] in w13's dtype");
  TORCH_CHECK(rows.dim() == 2 && rows.is_contiguous() && rows.scalar_type() == dt && rows.size(1) == H,
              "moe_experts_gemv: rows must be contiguous [R, H] in the weights' dtype");
  const int64_t R = rows.size(0);
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == dt && out.size(0) == R &&
                  out.size(1) == H,
              "moe_experts_gemv: out must be contiguous [R, H] in the weights' dtype");
  TORCH_CHECK(counts.dim() == 1 && counts.scalar_type() == at::kLong && counts.is_contiguous() && counts.size(0) == E,
              "moe_experts_gemv: counts must be contiguous int64 [E]");
  const int64_t* cp = counts.data_ptr<int64_t>();
  std::vector<int64_t> cnt(cp, cp + E);
  int64_t total = 0;
  for (int64_t c : cnt) {
    TORCH_CHECK(c >= 0, "moe_experts_gemv: counts must be >= 0");
    total += c;
  }
  TORCH_CHECK(total == R, "moe_experts_gemv: counts sum to ", total, ", rows has ", R);
  if (R == 0 || H == 0) return;
  const float lim = static_cast<float>(limit);
  if (dt == at::kFloat) {
    moe_impl(out.data_ptr<float>(), rows.data_ptr<float>(), cnt, w13.data_ptr<float>(), w2.data_ptr<float>(), H, I,
             lim);
    return;
  }
  const std::vector<float> xf = bf16_pairs(rows.data_ptr<c10::BFloat16>(), R, H);  // rows widened once
  moe_impl(out.data_ptr<c10::BFloat16>(), xf.data(), cnt, w13.data_ptr<c10::BFloat16>(),
           w2.data_ptr<c10::BFloat16>(), H, I, lim);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(openinfer_cpu, m) {
  m.def("moe_experts_gemv(Tensor(a!) out, Tensor rows, Tensor counts, Tensor w13, Tensor w2, float limit) -> ()");
  m.impl("moe_experts_gemv", c10::DispatchKey::CPU, &moe_experts_gemv);
}
