// Blocks of a decode step as one op each: a DeepSeek layer's MLA attention (projections, norms, rope, the latent cache
// write, the absorbed attention, o_proj) and its MoE (router, shared expert, routed experts, combine), and a whole
// Llama-family decoder layer (norms, fused qkv, rotary + cache write, paged attention, o_proj, SwiGLU MLP). Each is the
// Python path's sequence of kernel and ATen calls, in the same order on the same tensors, so the results are the
// same bits (tests/test_decode_blocks.py); what goes away is the Python between them. At batch 1 that glue was
// ~0.4 ms per attention and ~0.3 ms per MoE layer of a ~12 ms DeepSeek-V3 bench step (about 50 tensor calls, each
// ~1-2 us of Python and dispatch), the same order as the weights' streaming time in those layers. The callers
// (models/deepseek_v3/attention.py, layers/deepseek_moe.py, models/llama.py) take these only on the CPU, for
// decode-only steps, on a single rank, with weights in the panel layout, and keep their Python path for the rest.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <limits>
#include <tuple>
#include <vector>

#include "kernels.h"

namespace {

// x [T, D] (normed hidden) -> o_proj(attention) [T, hidden]. q_a / q_a_norm undefined: no q LoRA (q_b is q_proj).
// w_uk [H, L / 16, Dn, 16] and w_uv [H, Dv / 16, L, 16]: MLA's absorbed per-head panels (layers/mla.py).
at::Tensor mla_decode_block(const at::Tensor& x, const c10::optional<at::Tensor>& q_a,
                            const c10::optional<at::Tensor>& q_a_norm, const at::Tensor& q_b, int64_t q_b_n,
                            const at::Tensor& kv_a, const at::Tensor& kv_a_norm, const at::Tensor& w_uk,
                            const at::Tensor& w_uv, const at::Tensor& o_proj, int64_t hidden, const at::Tensor& cos,
                            const at::Tensor& sin, const at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t heads, int64_t nope,
                            int64_t rope, int64_t lora, int64_t v_dim, double lora_eps, double scale) {
  TORCH_CHECK(x.dim() == 2 && kv_cache.dim() == 3 && kv_cache.size(2) == lora + rope && q_b_n == heads * (nope + rope),
              "mla_decode_block: x must be [T, D], the cache [blocks, block_size, L + R], q_b's width H (Dn + R)");
  TORCH_CHECK(kv_cache.scalar_type() == x.scalar_type(), "mla_decode_block: the cache must be in x's dtype");
  const int64_t T = x.size(0);
  at::Tensor q;
  if (q_a.has_value()) {
    TORCH_CHECK(q_a_norm.has_value(), "mla_decode_block: q_a needs its norm");
    at::Tensor qa = oi::panel_linear(x, *q_a, q_a_norm->numel(), c10::nullopt);
    at::Tensor qn = at::empty(qa.sizes(), qa.options());
    oi::rms_norm(qn, qa, *q_a_norm, lora_eps);
    q = oi::panel_linear(qn, q_b, q_b_n, c10::nullopt);
  } else {
    q = oi::panel_linear(x, q_b, q_b_n, c10::nullopt);
  }
  const auto qs = q.view({T, heads, nope + rope}).split_with_sizes({nope, rope}, -1);
  const at::Tensor& q_nope = qs[0];
  const at::Tensor& q_pe_raw = qs[1];
  const at::Tensor kv = oi::panel_linear(x, kv_a, lora + rope, c10::nullopt);
  const at::Tensor c_kv_raw = kv.narrow(1, 0, lora), k_pe_raw = kv.narrow(1, lora, rope);
  at::Tensor c_kv = at::empty(c_kv_raw.sizes(), x.options());
  oi::rms_norm(c_kv, c_kv_raw, kv_a_norm, lora_eps);
  // DeepSeek's interleaved rope, written de-interleaved (models/deepseek_v3/attention.py's _rope)
  at::Tensor q_pe = at::empty({T, heads, rope}, x.options());
  const at::Tensor cos_c = cos.contiguous(), sin_c = sin.contiguous();
  oi::rope_interleaved(q_pe, q_pe_raw, cos_c, sin_c, false, true);
  at::Tensor k_pe = at::empty({T, 1, rope}, x.options());
  oi::rope_interleaved(k_pe, k_pe_raw.view({T, 1, rope}), cos_c, sin_c, false, true);
  // this step's latents into the cache (layers/mla.py's forward), then the absorbed decode (its _fast)
  const at::Tensor latent = at::cat({c_kv, k_pe.view({T, rope})}, -1);
  kv_cache.view({-1, lora + rope}).index_copy_(0, slot_mapping, latent);
  at::Tensor q_lat = at::empty({heads, T, lora}, x.options());
  oi::panel_gemm(q_lat, q_nope.transpose(0, 1), w_uk, c10::nullopt);
  const at::Tensor qcat = at::cat({q_lat, q_pe.transpose(0, 1)}, -1).transpose(0, 1);  // [T, H, L + R] view
  at::Tensor o_hm = at::empty({heads, T, lora}, x.options());
  oi::mla_decode_attention(o_hm.transpose(0, 1), qcat, kv_cache, block_tables.contiguous(), seq_lens.contiguous(), scale);
  at::Tensor out = at::empty({T, heads, v_dim}, x.options());
  oi::panel_gemm(out.transpose(0, 1), o_hm, w_uv, c10::nullopt);
  return oi::panel_linear(out.view({T, heads * v_dim}), o_proj, hidden, c10::nullopt);
}

// layers/deepseek_moe.py's DeepseekMoE.forward for a single rank: router (scoring 0 sigmoid, 1 softmax,
// 2 sqrtsoftplus; noaux_tc selection), the shared expert when given, the routed experts on their panels, and the
// combine onto the shared output. x [T, H] -> [T, H].
at::Tensor moe_block(const at::Tensor& x, const at::Tensor& gate_w, const c10::optional<at::Tensor>& bias,
                     int64_t scoring, int64_t top_k, int64_t n_group, int64_t topk_group, bool norm_topk_prob,
                     double routed_scale, const c10::optional<at::Tensor>& shared_gate_up,
                     const c10::optional<at::Tensor>& shared_down, int64_t shared_inter, const at::Tensor& p13,
                     const at::Tensor& p2, double limit) {
  TORCH_CHECK(x.dim() == 2 && scoring >= 0 && scoring <= 2, "moe_block: x must be [T, H], scoring 0-2");
  const int64_t T = x.size(0), H = x.size(1), E = p13.size(0);
  // router: fp32 logits and scores, the kernel's selection, weights gathered, normalised and scaled
  const at::Tensor logits = at::matmul(x.to(at::kFloat), gate_w.to(at::kFloat).t());
  at::Tensor scores;
  if (scoring == 0) scores = at::sigmoid(logits);
  else if (scoring == 1) scores = logits.softmax(-1);
  else scores = at::softplus(logits, 1, 20).sqrt();
  at::Tensor ids = at::empty({T, top_k}, x.options().dtype(at::kLong));
  oi::moe_select(ids, scores.contiguous(),
                 bias.has_value() ? c10::optional<at::Tensor>(bias->to(at::kFloat).contiguous()) : c10::nullopt,
                 n_group, topk_group);
  at::Tensor w = scores.gather(1, ids);
  if (norm_topk_prob) w = w / (w.sum(-1, true) + 1e-20);
  w = w * routed_scale;
  // shared expert (DeepseekMLP): gate|up, swiglu, down
  c10::optional<at::Tensor> shared;
  if (shared_gate_up.has_value()) {
    TORCH_CHECK(shared_down.has_value(), "moe_block: the shared expert needs both matrices");
    const at::Tensor gu = oi::panel_linear(x, *shared_gate_up, 2 * shared_inter, c10::nullopt);
    at::Tensor act = at::empty({T, shared_inter}, x.options());
    oi::swiglu(act, gu, limit);
    shared = oi::panel_linear(act, *shared_down, H, c10::nullopt);
  }
  // routed experts (layers/moe.py's fused_experts): pairs sorted by expert, the experts, the weighted combine
  const at::Tensor flat = ids.reshape(-1);
  const at::Tensor order = at::argsort(flat, true, 0, false);
  const at::Tensor rows = x.index_select(0, at::floor_divide(order, top_k)).contiguous();
  const at::Tensor counts = at::bincount(flat, c10::nullopt, E);
  at::Tensor y = at::empty({rows.size(0), H}, x.options());
  oi::moe_experts_panels(y, rows, counts, p13, p2, limit);
  at::Tensor inv = at::empty_like(order);
  inv.index_put_({order}, at::arange(order.numel(), order.options()));
  at::Tensor dst = shared.has_value() ? *shared : at::empty({T, H}, x.options());
  oi::moe_combine(dst, y, inv, w.to(at::kFloat).contiguous(), shared.has_value());
  return dst;
}

// One of a Llama layer's linears, as Linear.matmul runs it (no bias): kind 0 the panel layout (w the panels, n the
// output width), 1 w4a8, 2 w8a8, 3 weight-only int8, 4 weight-only symmetric int4 (w the packed weight, scales its
// scales, group the int4 / w4a8 group; QuantizedWeight.matmul: x widened to fp32 and zero-padded to the packed width,
// the kernel's fp32 result back in x's dtype). Kinds 3 / 4 only below their decoded-GEMM row count: the caller
// (layers/decode_blocks.py) keeps the Python path for larger steps.
// 5 / 6 a GGUF weight (w its block bytes, group its GGML type code; 6 with int8 activations), 7 a fused GGUF weight
// whose row blocks have different types (GGUFWeightParts: Q4_K_M's q / k in Q4_K, v in Q6_K): its parts are
// weights[group ..] of the layer's list, scales an int64 [parts, 3] table of (type code, rows, int8 activations),
// each part's output written into its columns (GGUFWeightParts.matmul's concatenation).
enum LinearKind : int64_t {
  kPanels = 0, kW4A8 = 1, kW8A8 = 2, kInt8 = 3, kInt4 = 4, kGGUF = 5, kGGUFQ8 = 6, kGGUFParts = 7
};

at::Tensor layer_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& scales,
                        int64_t kind, int64_t group, int64_t n, at::TensorList all) {
  if (kind == kPanels) return oi::panel_linear(x, w, n, c10::nullopt);
  at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  at::Tensor y = at::empty({x.size(0), n}, x.options().dtype(at::kFloat));
  if (kind == kGGUFParts) {
    TORCH_CHECK(scales.has_value() && scales->dim() == 2 && scales->size(1) == 3 && scales->scalar_type() == at::kLong,
                "llama_decode_layer: a GGUF parts linear needs an int64 [parts, 3] table");
    const at::Tensor tab = scales->contiguous();
    const int64_t* t = tab.data_ptr<int64_t>();
    const int64_t parts = tab.size(0);
    TORCH_CHECK(group >= 0 && group + parts <= static_cast<int64_t>(all.size()),
                "llama_decode_layer: a GGUF parts linear's parts are missing from the weights");
    xf = xf.contiguous();
    int64_t col = 0;
    for (int64_t p = 0; p < parts; ++p) {
      const int64_t rows = t[3 * p + 1];
      const at::Tensor& wp = all[group + p];
      TORCH_CHECK(wp.size(0) == rows && col + rows <= n, "llama_decode_layer: a GGUF part's rows disagree");
      at::Tensor yp = at::empty({x.size(0), rows}, y.options());
      if (t[3 * p + 2])
        oi::gguf_gemm_q8(yp, xf, wp, t[3 * p]);
      else
        oi::gguf_gemm(yp, xf, wp, t[3 * p]);
      y.narrow(1, col, rows).copy_(yp);
      col += rows;
    }
    TORCH_CHECK(col == n, "llama_decode_layer: a GGUF parts linear's rows do not add up to its width");
    return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
  }
  if (kind == kGGUF || kind == kGGUFQ8) {  // the file's block bytes [n, row bytes]; ``group``: the GGML type code
    TORCH_CHECK(w.size(0) == n, "llama_decode_layer: a GGUF linear's data must have n rows");
    if (kind == kGGUF)
      oi::gguf_gemm(y, xf.contiguous(), w, group);
    else  // activations as int8 per 32 columns (KernelSelection.gguf_int8)
      oi::gguf_gemm_q8(y, xf.contiguous(), w, group);
    return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
  }
  TORCH_CHECK(kind >= kW4A8 && kind <= kInt4 && scales.has_value() && scales->size(0) == n,
              "llama_decode_layer: a linear is kind 0 (panels), 1 (w4a8), 2 (w8a8), 3 (int8), 4 (int4), 5 "
              "(GGUF) or 6 (GGUF, int8 activations), quantised ones 1-4 with scales [n, ...]");
  if (kind == kW4A8 || kind == kInt4) {  // packed two per byte, K padded
    const int64_t kp = w.size(1) * 2;
    if (kp != xf.size(1)) xf = at::constant_pad_nd(xf, {0, kp - xf.size(1)});
  }
  xf = xf.contiguous();
  switch (kind) {
    case kW4A8: oi::w4a8_linear(y, xf, w, *scales, group, c10::nullopt); break;
    case kW8A8: oi::w8a8_linear(y, xf, w, *scales, c10::nullopt); break;
    case kInt8: oi::int8_linear(y, xf, w, *scales, c10::nullopt); break;
    default: oi::int4_linear(y, xf, w, *scales, group, c10::nullopt); break;
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// models/llama.py's LlamaDecoderLayer.forward for a step of decodes: x [T, hidden] the previous layer's MLP output
// (or the embeddings, with residual undefined: then x itself becomes the residual, as in the Python path), both
// updated in place like add_rms_norm_ does there. Returns the MLP's output; the residual is the tensor the caller
// holds. weights / scales / kinds / groups: the four linears (qkv, o, gate_up, down) as layer_linear takes them
// (weights past the fourth: the parts of kind-7 linears);
// cos / sin the rotary tables [max_pos, rot_dim / 2].
at::Tensor llama_decode_layer(at::Tensor x, const c10::optional<at::Tensor>& residual, const at::Tensor& in_norm,
                              at::TensorList weights, const c10::List<c10::optional<at::Tensor>>& scales,
                              at::IntArrayRef kinds, at::IntArrayRef groups, const at::Tensor& positions,
                              const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache,
                              const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                              const at::Tensor& seq_lens, int64_t heads, int64_t kv_heads, int64_t head_dim,
                              int64_t rot_dim, double scale, const at::Tensor& post_norm, int64_t inter, double eps) {
  TORCH_CHECK(x.dim() == 2 && k_cache.dim() == 4 && k_cache.scalar_type() == x.scalar_type(),
              "llama_decode_layer: x must be [T, hidden] and the caches [blocks, block_size, Hk, D] in x's dtype");
  TORCH_CHECK(weights.size() >= 4 && scales.size() == 4 && kinds.size() == 4 && groups.size() == 4,
              "llama_decode_layer: four linears (qkv, o, gate_up, down), then any GGUF parts");
  const int64_t T = x.size(0), hidden = x.size(1);
  const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  const int64_t widths[4] = {q_size + 2 * kv_size, hidden, 2 * inter, hidden};
  auto linear = [&](int i, const at::Tensor& in) {
    return layer_linear(in, weights[i], scales.get(i), kinds[i], groups[i], widths[i], weights);
  };
  // input_layernorm: RMSNorm(x) into a new tensor for the first layer, else the fused residual add in place
  at::Tensor h, res;
  if (residual.has_value()) {
    res = *residual;
    oi::add_rms_norm(x, res, in_norm, eps);
    h = x;
  } else {
    res = x;
    h = at::empty(x.sizes(), x.options());
    oi::rms_norm(h, x, in_norm, eps);
  }
  // attention: the fused projection, rotary on q / k in place and k / v into the cache, the paged decode kernel
  at::Tensor qkv = linear(0, h);
  oi::rotary_cache_write(qkv, positions.contiguous(), cos, sin, k_cache, v_cache, slot_mapping.contiguous(), heads,
                         kv_heads, head_dim, rot_dim);
  const at::Tensor q = qkv.narrow(1, 0, q_size).view({T, heads, head_dim});
  at::Tensor attn = at::empty({T, heads, head_dim}, x.options());
  oi::paged_decode_attention(attn, q, k_cache, v_cache, block_tables.contiguous(), seq_lens.contiguous(), scale);
  at::Tensor o = linear(1, attn.view({T, q_size}));
  // post_attention_layernorm (in place on o and the residual), then the SwiGLU MLP
  oi::add_rms_norm(o, res, post_norm, eps);
  const at::Tensor gu = linear(2, o);
  at::Tensor act = at::empty({T, inter}, x.options());
  oi::silu_and_mul(act, gu);
  return linear(3, act);
}

// Every decoder layer of a decode-only step as one op: llama_decode_layer per layer, in order, with the Python loop's
// hand-over (x <- the layer's output, the residual from the first layer's input on). The layers' lists are
// flattened: weights[offsets[l] .. offsets[l + 1]) are layer l's (its four linears, then any GGUF parts, ``groups``
// relative to that start), scales / kinds / groups four per layer, norms two per layer (input, post-attention),
// caches two per layer (K, V). What goes away is the Python between the layers (~25 us per layer at batch 1: the
// module call, the step checks, the forward context's tables, the op's argument boxing).
std::tuple<at::Tensor, at::Tensor> llama_decode_layers(
    at::Tensor x, at::TensorList weights, const c10::List<c10::optional<at::Tensor>>& scales, at::IntArrayRef kinds,
    at::IntArrayRef groups, at::IntArrayRef offsets, at::TensorList norms, at::TensorList caches,
    const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t heads, int64_t kv_heads, int64_t head_dim,
    int64_t rot_dim, double scale, int64_t inter, double eps) {
  const int64_t L = static_cast<int64_t>(offsets.size()) - 1;
  TORCH_CHECK(L >= 1 && static_cast<int64_t>(kinds.size()) == 4 * L && static_cast<int64_t>(groups.size()) == 4 * L &&
                  static_cast<int64_t>(scales.size()) == 4 * L && static_cast<int64_t>(norms.size()) == 2 * L &&
                  static_cast<int64_t>(caches.size()) == 2 * L && offsets[0] == 0 &&
                  offsets[L] == static_cast<int64_t>(weights.size()),
              "llama_decode_layers: per layer four linears (kinds, groups, scales), two norms, two caches, and "
              "weight offsets [0 .. len(weights)]");
  c10::optional<at::Tensor> residual;
  for (int64_t l = 0; l < L; ++l) {
    TORCH_CHECK(offsets[l + 1] - offsets[l] >= 4, "llama_decode_layers: layer ", l, " has fewer than four weights");
    const at::TensorList w(weights.data() + offsets[l], offsets[l + 1] - offsets[l]);
    c10::List<c10::optional<at::Tensor>> sc;
    sc.reserve(4);
    for (int64_t i = 0; i < 4; ++i) sc.push_back(scales.get(4 * l + i));
    at::Tensor out = llama_decode_layer(x, residual, norms[2 * l], w, sc, kinds.slice(4 * l, 4),
                                        groups.slice(4 * l, 4), positions, cos, sin, caches[2 * l],
                                        caches[2 * l + 1], slot_mapping, block_tables, seq_lens, heads, kv_heads,
                                        head_dim, rot_dim, scale, norms[2 * l + 1], inter, eps);
    if (!residual.has_value()) residual = x;  // the first layer's input, summed into in place from here on
    x = out;
  }
  return {x, *residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(openinfer_cpu, m) {
  m.def(
      "mla_decode_block(Tensor x, Tensor? q_a, Tensor? q_a_norm, Tensor q_b, int q_b_n, Tensor kv_a, Tensor kv_a_norm, "
      "Tensor w_uk, Tensor w_uv, Tensor o_proj, int hidden, Tensor cos, Tensor sin, Tensor(a!) kv_cache, "
      "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, int heads, int nope, int rope, int lora, "
      "int v_dim, float lora_eps, float scale) -> Tensor");
  m.impl("mla_decode_block", c10::DispatchKey::CPU, &mla_decode_block);
  m.def(
      "moe_block(Tensor x, Tensor gate_w, Tensor? bias, int scoring, int top_k, int n_group, int topk_group, "
      "bool norm_topk_prob, float routed_scale, Tensor? shared_gate_up, Tensor? shared_down, int shared_inter, "
      "Tensor p13, Tensor p2, float limit) -> Tensor");
  m.impl("moe_block", c10::DispatchKey::CPU, &moe_block);
  m.def(
      "llama_decode_layer(Tensor(a!) x, Tensor(b!)? residual, Tensor in_norm, Tensor[] weights, Tensor?[] scales, "
      "int[] kinds, int[] groups, Tensor positions, Tensor cos, Tensor sin, Tensor(c!) k_cache, Tensor(d!) v_cache, "
      "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, int heads, int kv_heads, int head_dim, int rot_dim, "
      "float scale, Tensor post_norm, int inter, float eps) -> Tensor");
  m.impl("llama_decode_layer", c10::DispatchKey::CPU, &llama_decode_layer);
  m.def(
      "llama_decode_layers(Tensor(a!) x, Tensor[] weights, Tensor?[] scales, int[] kinds, int[] groups, int[] offsets, "
      "Tensor[] norms, Tensor(b!)[] caches, Tensor positions, Tensor cos, Tensor sin, Tensor slot_mapping, "
      "Tensor block_tables, Tensor seq_lens, int heads, int kv_heads, int head_dim, int rot_dim, float scale, "
      "int inter, float eps) -> (Tensor, Tensor)");
  m.impl("llama_decode_layers", c10::DispatchKey::CPU, &llama_decode_layers);
}
