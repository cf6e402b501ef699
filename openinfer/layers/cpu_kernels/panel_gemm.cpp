// GEMM on an fp32 or bf16 weight packed in 16-column panels (layers/linear.py, layers/mla.py; packed by
// cpu_ops.pack_panels): y[h] = x[h] W[h]^T (+ bias) with W[h] [N, K] stored as Wp[h] [NP = ceil(N / 16), K, 16]
// (panel p, row k holds W[16p .. 16p + 15, k]; the rows past N are zeros). One op for a plain linear (H = 1) and for
// a batch of per-head matrices (MLA's absorbed W_UK / W_UV). bf16 weights are widened in registers (panel_tile.h):
// on a CPU without native bf16 this replaces torch's emulated bf16 GEMM and the row-major gemv kernel.
//
// Why our own layout and loop instead of oneDNN's prepacked weight: on this project's AVX2 host (Zen 3, 1 thread,
// weights cycled through 160 MB so they stream from memory) this loop measured 1.15-1.45x oneDNN's
// _linear_pointwise on its own packed layout at every M from 1 to 2048 and every shape tried (32000 x 512,
// 1536 x 512, 2048 x 512, 512 x 1024, 8192 x 4096): at M = 1 10.0-11.0 vs 6.3-8.7 GFLOP/s (20-22 GB/s of weight,
// the copy bandwidth), M = 8 45 vs 34-38, M = 16 60-68 vs 42-53, M = 32 73-79 vs 60-65, M = 512 88-96 vs 69-85.
// - Every panel is one contiguous K x 64-byte stream, and the panels follow each other: the whole matrix is read
//   front to back once per call, whatever M (the hardware prefetcher's best case).
// - A panel is read from memory by the first row tile and from L1 / L2 by the others (K x 64 bytes: 32 KB at
//   K = 512, 256 KB at K = 4096), so the weight bytes cross the memory bus once per call.
// - The row tile is the classic AVX2 6 x 16 register block: 12 accumulators, 2 weight vectors, 1 broadcast; each
//   k step is 8 loads for 12 FMAs, so the FMA ports bound it, and 12 independent chains cover the FMA latency.
//   Tiles of 1-3 rows split k over 2-4 chains instead (latency, not ports, would bind them); the first tile of a
//   panel prefetches ahead from 4 rows up (panel_tile.h has the split and the figures).
// - Panels are split over at::parallel_for, so the threads split the weight bytes; prefill-sized M runs in row
//   blocks that stay in L2 while a thread's panels go by (panel_tile.h's kRowBlock).
// Accumulation is fp32 in k order; the result differs from F.linear only by summation order. The vectors are GCC
// vector extensions of 8 floats: ymm on AVX2 and AVX-512 builds, pairs of xmm on a plain x86-64 build (same
// code, same results up to FMA contraction).
#include <ATen/Parallel.h>
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "panel_tile.h"
#include "kernels.h"

namespace {

template <typename WT>
void run(at::Tensor& y, const at::Tensor& x, const at::Tensor& wp, const float* b) {
  const int64_t H = wp.size(0), NP = wp.size(1), K = wp.size(2), M = x.size(1), N = y.size(2);
  const float* xp = x.data_ptr<float>();
  const WT* w = wp.data_ptr<WT>();
  WT* yp = y.data_ptr<WT>();
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), ys0 = y.stride(0), ys1 = y.stride(1);
  // >= ~64 KB of weight per task, so a small matrix does not wake every thread for nothing
  const int64_t grain = std::max<int64_t>(1, 65536 / static_cast<int64_t>(kPanel * K * sizeof(WT)));
  const int64_t MB = row_block(M);  // (panel_tile.h: row blocks for prefill-sized M)
  at::parallel_for(0, H * NP, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
      const int64_t mb = std::min(MB, M - m0);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t h = t / NP, p = t % NP, n = p * kPanel;
        const int cols = static_cast<int>(std::min<int64_t>(kPanel, N - n));
        panel_rows(xp + h * xs0 + m0 * xs1, xs1, w + t * K * kPanel, K, yp + h * ys0 + m0 * ys1 + n, ys1, mb, cols,
                   b ? b + n : nullptr);
      }
    }
  });
}

// y [H, M, N] = x [H, M, K] Wp^T (+ bias [N]); Wp [H, NP, K, 16] contiguous fp32 or bf16, x, y and bias in its
// dtype; x and y may be strided views (unit stride in the last dim). bf16: x and the bias are widened to fp32 once
// per call (M x K is small next to the weight), sums are fp32, rounded once into y (as torch's CPU bf16 GEMM).
void panel_gemm(at::Tensor y, const at::Tensor& x, const at::Tensor& wp, const c10::optional<at::Tensor>& bias) {
  const auto dt = wp.scalar_type();
  TORCH_CHECK(wp.dim() == 4 && wp.size(3) == kPanel && wp.is_contiguous() && (dt == at::kFloat || dt == at::kBFloat16),
              "panel_gemm: wp must be contiguous fp32 or bf16 [H, NP, K, 16]");
  const int64_t H = wp.size(0), NP = wp.size(1), K = wp.size(2);
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == dt && x.size(0) == H && x.size(2) == K &&
                  (K <= 1 || x.stride(2) == 1),
              "panel_gemm: x must be [H, M, K] in wp's dtype with unit stride in K");
  const int64_t M = x.size(1);
  TORCH_CHECK(y.dim() == 3 && y.scalar_type() == dt && y.size(0) == H && y.size(1) == M &&
                  y.size(2) > (NP - 1) * kPanel && y.size(2) <= NP * kPanel && y.stride(2) == 1,
              "panel_gemm: y must be [H, M, N] in wp's dtype with unit stride in N and N in the panels' last 16 "
              "columns");
  const int64_t N = y.size(2);
  at::Tensor bf;
  if (bias.has_value()) {
    TORCH_CHECK(H == 1 && bias->scalar_type() == dt && bias->numel() == N,
                "panel_gemm: bias must be [N] in wp's dtype, with H = 1");
    bf = bias->to(at::kFloat).contiguous();
  }
  if (M == 0 || N == 0) return;
  if (K == 0) {  // an empty sum: the bias alone
    y.zero_();
    if (bias.has_value()) y.add_(*bias);
    return;
  }
  const float* b = bias.has_value() ? bf.data_ptr<float>() : nullptr;
  if (dt == at::kFloat) return run<float>(y, x, wp, b);
  run<c10::BFloat16>(y, x.to(at::kFloat), wp, b);  // x widened once (a contiguous fp32 copy)
}

// A plain linear on one panel matrix: x [..., K] (unit stride in K) Wp^T (+ bias) -> a new [..., n], with Wp [NP, K,
// 16]. The same loop as panel_gemm; the reshapes and the allocation happen here rather than as a dozen Python-side
// tensor calls per linear (~10 us of Python per call, 33 linears in a DeepSeek-V3 bench decode step at batch 1).
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& wp, int64_t n, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(wp.dim() == 3 && x.dim() >= 1 && x.size(-1) == wp.size(1),
              "panel_linear: wp must be [NP, K, 16] and x [..., K]");
  const int64_t K = wp.size(1);
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);  // not reshape(-1, K): K may be 0
  at::Tensor x2 = x.reshape({rows, K});
  if (K > 1 && x2.stride(1) != 1) x2 = x2.contiguous();
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = n;
  at::Tensor y = at::empty(sizes, x.options());
  panel_gemm(y.view({1, x2.size(0), n}), x2.unsqueeze(0), wp.unsqueeze(0), bias);
  return y;
}

}  // namespace

namespace oi {
void panel_gemm(at::Tensor y, const at::Tensor& x, const at::Tensor& wp, const c10::optional<at::Tensor>& bias) {
  ::panel_gemm(std::move(y), x, wp, bias);
}
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& wp, int64_t n, const c10::optional<at::Tensor>& bias) {
  return ::panel_linear(x, wp, n, bias);
}
}  // namespace oi

TORCH_LIBRARY_FRAGMENT(openinfer_cpu, m) {
  m.def("panel_gemm(Tensor(a!) y, Tensor x, Tensor wp, Tensor? bias) -> ()");
  m.impl("panel_gemm", c10::DispatchKey::CPU, &panel_gemm);
  m.def("panel_linear(Tensor x, Tensor wp, int n, Tensor? bias) -> Tensor");
  m.impl("panel_linear", c10::DispatchKey::CPU, &panel_linear);
}
