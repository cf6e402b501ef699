// Small-M dense linear (layers/linear.py): y[M, N] = x[M, K] W^T (+ bias) for decode-sized M (1..~8), with W
// the plain row-major [N, K] weight in fp32 or bf16 (the model's only copy of it).
//
// Why: at batch 1 a linear is a pass over its weight bytes; everything else is noise. torch's paths do not get
// near the memory bandwidth on this project's AVX2 hosts (oneDNN on a prepacked fp32 weight streamed ~55 % of the
// copy bandwidth; bf16 runs an emulated GEMM there that is slower than fp32 although it reads half the bytes).
// Here:
// - each weight row is read from memory exactly once per call, whatever M: rows go in blocks of kRows, and every
//   activation row passes over a block while it sits in L1 (kRows x K x 4 bytes <= 45 KB for K = 2816 fp32; L2
//   holds it when L1 does not);
// - independent accumulators: kRows rows side by side, and with one activation row two chains per weight row
//   (even / odd vectors), so the loop is bound by loads, not by the FMA latency;
// - bf16 weights are widened in registers by a 16-bit shift / a mask (bf16 is the top half of an fp32: exact),
//   never converted into memory;
// - output rows are split over at::parallel_for in whole blocks, so the threads split the bytes.
// - no software prefetch: prefetching the same rows 256 B, 1 KB or 4 KB ahead measured within the noise of the
//   hardware prefetcher alone (1 thread, the bench model's shapes), so the loop stays plain.
// x is widened to fp32 once per call (M x K is tiny next to N x K); accumulation is fp32, rounded to y's dtype
// once (as torch's CPU bf16 GEMM does), so the result differs from F.linear only by summation order. NaN / inf in
// x propagate as in any dot product (no padding, no masking: the K tail runs scalar).
// Vector code: AVX-512 (16 floats) under __AVX512F__, else AVX2 + FMA (8 floats), else a plain loop. One set of
// templates serves both widths through the small V traits in gemv_block.h (vec.h is not used: its 16-float vectors are
// compiler vector extensions, and this kernel wants the explicit bf16 even/odd split there).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gemv_block.h"

namespace {

template <typename WT, typename YT>
void gemv_impl(YT* y, const float* x, const WT* w, const WT* bias, int64_t M, int64_t N, int64_t K) {
  const int64_t nblocks = (N + kRows - 1) / kRows;
  // ~64 KB of weight bytes per task at least, so a small layer does not wake every thread for nothing
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(kRows * K * sizeof(WT), 1));
  at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * kRows;
      const int R = static_cast<int>(std::min<int64_t>(kRows, N - n));
      const WT* wb = w + n * K;
      for (int64_t m = 0; m < M; m += kM) {
        const int MB = static_cast<int>(std::min<int64_t>(kM, M - m));
        float acc[kM][kRows];
        switch (R) {
          case 4: dot_rows<4>(MB, x + m * K, K, wb, acc); break;
          case 3: dot_rows<3>(MB, x + m * K, K, wb, acc); break;
          case 2: dot_rows<2>(MB, x + m * K, K, wb, acc); break;
          default: dot_rows<1>(MB, x + m * K, K, wb, acc); break;
        }
        for (int i = 0; i < MB; ++i)
          for (int r = 0; r < R; ++r) {
            const float v = acc[i][r];
            store(y + (m + i) * N + n + r, bias ? v + widen(bias[n + r]) : v);
          }
      }
    }
  });
}

// y = x W^T + bias. y [M, N] and x [M, K] in the weight's dtype (fp32 or bf16), all contiguous; bias [N] or None.
void dense_gemv(at::Tensor y, const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const auto dt = weight.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "dense_gemv: weight must be fp32 or bf16");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "dense_gemv: weight must be contiguous [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == dt && x.size(1) == K,
              "dense_gemv: x must be contiguous [M, K] in the weight's dtype");
  const int64_t M = x.size(0);
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && y.scalar_type() == dt && y.size(0) == M && y.size(1) == N,
              "dense_gemv: y must be contiguous [M, N] in the weight's dtype");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == dt && bias->is_contiguous() && bias->numel() == N,
                "dense_gemv: bias must be contiguous [N] in the weight's dtype");
  if (M == 0 || N == 0) return;
  if (dt == at::kFloat) {
    gemv_impl(y.data_ptr<float>(), x.data_ptr<float>(), weight.data_ptr<float>(),
              bias ? bias->data_ptr<float>() : nullptr, M, N, K);
    return;
  }
  const std::vector<float> xf = bf16_pairs(x.data_ptr<c10::BFloat16>(), M, K);  // x widened once
  gemv_impl(y.data_ptr<c10::BFloat16>(), xf.data(), weight.data_ptr<c10::BFloat16>(),
            bias ? bias->data_ptr<c10::BFloat16>() : nullptr, M, N, K);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(openinfer_cpu, m) {
  m.def("dense_gemv(Tensor(a!) y, Tensor x, Tensor weight, Tensor? bias) -> ()");
  m.impl("dense_gemv", c10::DispatchKey::CPU, &dense_gemv);
}
