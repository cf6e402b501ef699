// Batched bf16 GEMM on vdpbf16ps for MLA's absorbed decode (layers/mla.py) on CPUs with AVX512-BF16 (Zen 4,
// Cooper Lake, Sapphire Rapids and later): y[h] = x[h] W[h]^T with W[h] [N, K] stored in "pair panels"
// Wq[h] [NP = ceil(N / 16), KP = ceil(K / 2), 16, 2] (cpu_ops.pack_pair_panels: panel p, pair k holds W[16p + c,
// 2k + j] at [c][j]; rows past N and the column past an odd K are zeros). One 64-byte row of a panel is then one
// vdpbf16ps operand: 16 columns x 2 k, multiplied by a broadcast (x[2k], x[2k + 1]) of an activation row into
// 16 fp32 sums, with no horizontal sums and no widening.
//
// Why: on a native-bf16 CPU the absorbed W_UK / W_UV GEMMs ([H, B, Dn] x [H, Dn, L], [H, B, L] x [H, L, Dv]) went
// to torch.bmm (oneDNN), which at decode batch sizes runs per-head GEMMs of 1-32 rows far under the copy bandwidth:
// the 6 layers of issue 38's DeepSeek-V3 shape (12 heads, L 512, Dn = Dv = 128; 18 MB of bf16) took ~2 ms a step at
// batch 1 (~9 GB/s) on a Zen 4. The fp32-widening panel kernel (panel_gemm.cpp) reached 29 GB/s at batch 1 there but
// fell behind bmm from batch 16 (FMA-bound); this one keeps the streaming of the panels and the arithmetic rate of
// the bf16 dot product.
// - A task is (head, group of up to 4 panels = 64 columns); rows go in chunks of up to 6: 24 accumulators, 4
//   weight vectors, 1 broadcast of the 32 registers. Each weight vector feeds 6 products, each broadcast 4.
// - Every panel is one contiguous stream of KP x 64 bytes and a group's 4 panels follow each other, so the weights
//   are read front to back once per call (the first chunk of rows from memory, the others from L1 / L2).
// - Sums are fp32 in pair order, rounded once into y (as torch's CPU bf16 GEMM); products of two bf16 are exact
//   in fp32, so only the order of the sums differs from bmm (and bf16 subnormals count as zero, as the instruction
//   defines). Each output is the same sum whatever rows share its chunk.
// ``pair_panels_built()`` says whether the build has the instruction (layers/dispatch.py asks it).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define OI_PAIR_PANELS 1
#endif

namespace {

constexpr int kPanel = 16;  // columns per panel
#ifdef OI_PAIR_PANELS
using BF = c10::BFloat16;
constexpr int kG = 4;   // panels per task
constexpr int kMB = 6;  // rows per chunk

// the pair (x[k2], x[k2 + 1]) of a row broadcast to the 16 lanes (one 32-bit broadcast load); last: the odd K's
// last column with a zero
inline __m512bh pair(const BF* x) {
  int v;
  std::memcpy(&v, x, sizeof v);
  return (__m512bh)_mm512_set1_epi32(v);
}
inline __m512bh last(const BF* x) {
  uint16_t v;
  std::memcpy(&v, x, sizeof v);
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(v));
}

// y[m][16 g + c] for M rows (stride xs / ys) and G panels of wq (panel stride ps = KP * 32 elements)
template <int M, int G>
inline void tile(const BF* __restrict__ x, int64_t xs, const BF* __restrict__ wq, int64_t ps, int64_t K,
                 BF* __restrict__ y, int64_t ys, int cols, const float* bias) {
  __m512 a[M][G];
  for (int m = 0; m < M; ++m)
    for (int g = 0; g < G; ++g) a[m][g] = _mm512_setzero_ps();
  const auto step = [&](int64_t kp, bool odd_tail) {
    __m512bh w[G];
    for (int g = 0; g < G; ++g) w[g] = (__m512bh)_mm512_loadu_si512(wq + g * ps + kp * 2 * kPanel);
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = odd_tail ? last(x + m * xs + 2 * kp) : pair(x + m * xs + 2 * kp);
      for (int g = 0; g < G; ++g) a[m][g] = _mm512_dpbf16_ps(a[m][g], w[g], xv);
    }
  };
  const int64_t full = K / 2;
  for (int64_t kp = 0; kp < full; ++kp) step(kp, false);
  if (K % 2) step(full, true);
  for (int m = 0; m < M; ++m)
    for (int g = 0; g < G; ++g) {
      const int n = std::min(kPanel, cols - g * kPanel);
      if (n <= 0) break;
      const __m512 v = bias ? _mm512_add_ps(a[m][g], _mm512_loadu_ps(bias + g * kPanel)) : a[m][g];
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);  // round to nearest even, as c10::BFloat16
      if (n == kPanel) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * ys + g * kPanel), h);
      } else {
        _mm256_mask_storeu_epi16(y + m * ys + g * kPanel, static_cast<__mmask16>((1u << n) - 1u), h);
      }
    }
}

template <int G>
inline void tile_m(int M, const BF* x, int64_t xs, const BF* wq, int64_t ps, int64_t K, BF* y, int64_t ys,
                   int cols, const float* bias) {
  switch (M) {
    case 6: tile<6, G>(x, xs, wq, ps, K, y, ys, cols, bias); break;
    case 5: tile<5, G>(x, xs, wq, ps, K, y, ys, cols, bias); break;
    case 4: tile<4, G>(x, xs, wq, ps, K, y, ys, cols, bias); break;
    case 3: tile<3, G>(x, xs, wq, ps, K, y, ys, cols, bias); break;
    case 2: tile<2, G>(x, xs, wq, ps, K, y, ys, cols, bias); break;
    default: tile<1, G>(x, xs, wq, ps, K, y, ys, cols, bias); break;
  }
}
#endif

// y [H, M, N] = x [H, M, K] Wq^T (+ bias [N], H = 1); Wq [H, NP, KP, 16, 2] contiguous bf16; x, y and the bias
// bf16, x and y possibly strided views with unit stride in the last dim. The bias is added to the fp32 sums before
// the one rounding (as torch's CPU bf16 linear).
void pair_panel_gemm(at::Tensor y, const at::Tensor& x, const at::Tensor& wq, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(wq.dim() == 5 && wq.size(3) == kPanel && wq.size(4) == 2 && wq.is_contiguous() &&
                  wq.scalar_type() == at::kBFloat16,
              "pair_panel_gemm: wq must be contiguous bf16 [H, NP, KP, 16, 2]");
  const int64_t H = wq.size(0), NP = wq.size(1), KP = wq.size(2);
  TORCH_CHECK(x.dim() == 3 && x.size(0) == H && x.stride(2) == 1 && x.scalar_type() == at::kBFloat16,
              "pair_panel_gemm: x must be bf16 [H, M, K] with unit stride in K");
  const int64_t M = x.size(1), K = x.size(2);
  TORCH_CHECK((K + 1) / 2 == KP, "pair_panel_gemm: x has K = ", K, ", wq holds ", KP, " pairs");
  TORCH_CHECK(y.dim() == 3 && y.size(0) == H && y.size(1) == M && y.stride(2) == 1 &&
                  y.scalar_type() == at::kBFloat16 && (y.size(2) + kPanel - 1) / kPanel == NP,
              "pair_panel_gemm: y must be bf16 [H, M, N] with unit stride in N, N in wq's ", NP, " panels");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (H == 1 && bias->dim() == 1 && bias->size(0) == y.size(2)),
              "pair_panel_gemm: bias must be [N] (one matrix, H = 1)");
#ifdef OI_PAIR_PANELS
  std::vector<float> bf;  // the bias widened once, padded to whole panels
  if (has_bias) {
    const at::Tensor b = bias->to(at::kFloat).contiguous();
    bf.assign(NP * kPanel, 0.f);
    std::copy(b.data_ptr<float>(), b.data_ptr<float>() + b.numel(), bf.begin());
  }
  const float* bp = has_bias ? bf.data() : nullptr;
  const int64_t N = y.size(2), groups = (NP + kG - 1) / kG, ps = KP * 2 * kPanel;
  const BF* xp = x.data_ptr<BF>();
  const BF* wp = wq.data_ptr<BF>();
  BF* yp = y.data_ptr<BF>();
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), ys0 = y.stride(0), ys1 = y.stride(1);
  at::parallel_for(0, H * groups, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t h = t / groups, p0 = (t % groups) * kG, n0 = p0 * kPanel;
      const int G = static_cast<int>(std::min<int64_t>(kG, NP - p0));
      const int cols = static_cast<int>(std::min<int64_t>(kG * kPanel, N - n0));
      const BF* w = wp + (h * NP + p0) * ps;
      const int64_t nc = (M + kMB - 1) / kMB;  // chunks of near-equal size (7 rows: 4 + 3)
      for (int64_t c = 0; c < nc; ++c) {
        const int64_t m0 = c * M / nc, mb = (c + 1) * M / nc - m0;
        const BF* xr = xp + h * xs0 + m0 * xs1;
        BF* yr = yp + h * ys0 + m0 * ys1 + n0;
        switch (G) {
          case 4: tile_m<4>(static_cast<int>(mb), xr, xs1, w, ps, K, yr, ys1, cols, bp ? bp + n0 : nullptr); break;
          case 3: tile_m<3>(static_cast<int>(mb), xr, xs1, w, ps, K, yr, ys1, cols, bp ? bp + n0 : nullptr); break;
          case 2: tile_m<2>(static_cast<int>(mb), xr, xs1, w, ps, K, yr, ys1, cols, bp ? bp + n0 : nullptr); break;
          default: tile_m<1>(static_cast<int>(mb), xr, xs1, w, ps, K, yr, ys1, cols, bp ? bp + n0 : nullptr); break;
        }
      }
    }
  });
#else
  TORCH_CHECK(false, "pair_panel_gemm: this build has no AVX512-BF16 (pair_panels_built() is false)");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(openinfer_cpu, m) {
  m.def("pair_panel_gemm(Tensor(a!) y, Tensor x, Tensor wq, Tensor? bias) -> ()");
  m.impl("pair_panel_gemm", c10::DispatchKey::CPU, &pair_panel_gemm);
  m.def("pair_panels_built() -> bool", []() -> bool {
#ifdef OI_PAIR_PANELS
    return true;
#else
    return false;
#endif
  });
}
