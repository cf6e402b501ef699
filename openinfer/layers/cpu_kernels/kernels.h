// The entry points of the kernels that decode_blocks.cpp strings together into one op per decode-step block. Each is
// the function its own file registers as an op (same checks, same results); these names forward to it, so a fused
// block calls it directly, without the dispatcher and without a Python round trip per kernel.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

namespace oi {

// panel_gemm.cpp
void panel_gemm(at::Tensor y, const at::Tensor& x, const at::Tensor& wp, const c10::optional<at::Tensor>& bias);
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& wp, int64_t n, const c10::optional<at::Tensor>& bias);
// layer_ops.cpp
void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps);
void add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps);
void silu_and_mul(at::Tensor out, const at::Tensor& x);
void rotary_cache_write(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                        at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, int64_t rot_dim);
// paged_decode_attention.cpp
void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale);
// rope_interleaved.cpp
void rope_interleaved(at::Tensor out, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool inverse,
                      bool deinterleave);
// mla_decode.cpp
void mla_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_tables,
                          const at::Tensor& seq_lens, double scale);
// moe_ops.cpp
void moe_select(at::Tensor ids, const at::Tensor& scores, const c10::optional<at::Tensor>& bias, int64_t n_group,
                int64_t topk_group);
void swiglu(at::Tensor out, const at::Tensor& x, double limit);
void moe_combine(at::Tensor out, const at::Tensor& y, const at::Tensor& inv, const at::Tensor& weights,
                 bool accumulate);
// w4a8_gemm.cpp, w8a8_gemm.cpp
void w4a8_linear(at::Tensor y, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                 int64_t group, const c10::optional<at::Tensor>& bias);
void w8a8_linear(at::Tensor y, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                 const c10::optional<at::Tensor>& bias);
// lowbit_gemm.cpp (weight-only int8 / int4)
void int8_linear(at::Tensor y, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                 const c10::optional<at::Tensor>& bias);
void int4_linear(at::Tensor y, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                 int64_t group, const c10::optional<at::Tensor>& bias);
// moe_panels.cpp
void moe_experts_panels(at::Tensor out, const at::Tensor& rows, const at::Tensor& counts, const at::Tensor& p13,
                        const at::Tensor& p2, double limit);

// y [M, N] = x [M, K] fp32 . W^T, W a GGUF block-quantized matrix (rows of the file's bytes; gguf_gemm.cpp)
void gguf_gemm(at::Tensor y, const at::Tensor& x, const at::Tensor& data, int64_t qtype);
// the same with x quantised to int8 per 32 columns and integer dot products (gguf_q8_gemm.cpp)
void gguf_gemm_q8(at::Tensor y, const at::Tensor& x, const at::Tensor& data, int64_t qtype);
// the same through the tile kernel (gguf_q8_tiles.cpp), for the types gguf_q8_tiled_has says it takes
void gguf_gemm_q8_tiled(at::Tensor y, const at::Tensor& x, const at::Tensor& data, int64_t qtype,
                        const c10::optional<at::Tensor>& bias);
bool gguf_q8_tiled_has(int64_t qtype);
// Q4_K / Q6_K repacked 8 rows interleaved (gguf_repack.cpp), code 1000 + type: every M, y's N columns
bool gguf_is_r8(int64_t code);
void gguf_gemm_q8_r8(at::Tensor y, const at::Tensor& x, const at::Tensor& data, int64_t code,
                     const c10::optional<at::Tensor>& bias);
}  // namespace oi
