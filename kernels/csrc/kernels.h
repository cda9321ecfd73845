// The C++ entry points of the fast path's kernels, for kernels that compose them
// (decoder.cpp runs a whole decoder stack through these, with no Python between ops).
// Each is the function its op in TORCH_LIBRARY(pagedllm) calls; shapes as there.
#pragma once

#include "common.h"

namespace pagedllm {
namespace api {

// ops.cpp
// out: where to write the result (shaped as the result), or null for a new tensor.
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps, Tensor* out = nullptr);
Tensor add_rms_norm(const Tensor& x, Tensor& residual, const Tensor& weight, double eps,
                    Tensor* out = nullptr);
void rotary_neox_(Tensor& q, Tensor& k, const Tensor& positions, const Tensor& cos,
                  const Tensor& sin);
Tensor gated_act(const Tensor& x, bool gelu, Tensor* out = nullptr);
void head_rms_norm_(Tensor& x, const Tensor& weight, double eps);
void write_kv_cache_(const Tensor& k, const Tensor& v, Tensor& k_cache, Tensor& v_cache,
                     const Tensor& slot_mapping);
// x [T, H] . weight [E, H]^T float32 by one fixed recipe per element (an MoE router).
Tensor router_logits(const Tensor& x, const Tensor& weight);
// attention.cpp
void paged_attention_rows_(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                           Tensor& out, const Tensor& seq_ids, const Tensor& cu_seqlens_q,
                           const Tensor& seq_lens, const Tensor& block_tables, double scale,
                           int64_t window, double soft_cap);
// encoder.cpp: bidirectional attention within each sequence of a step.
// qkv float32 [T, 3, H, D], cu_seqlens int64 [B + 1] -> out float32 [T, H, D]
Tensor encoder_attention(const Tensor& qkv, const Tensor& cu_seqlens, double scale);
// x float32 -> x * Phi(x) (exact gelu, erf to 1.5e-7), in place
void gelu_erf_(Tensor& x);
// x, y float32 [T, H]; weight, bias float32 [H] -> LayerNorm(y + x) float32 [T, H]
Tensor add_layer_norm(const Tensor& x, const Tensor& y, const Tensor& weight, const Tensor& bias,
                      double eps);
// linear_bf16.cpp, linear_packed.cpp
Tensor bf16_linear(const Tensor& x, const Tensor& weight, Tensor* out = nullptr);
// linear_amx_bf16.cpp: weight bf16 [N, K] -> B tiles [T, K/32, 16, 32]; x [M, K] float32 ->
// [M, N] float32 by TDPBF16PS (its own bits: encoders only). Needs amx_bf16_available().
bool amx_bf16_available();
Tensor amx_bf16_pack(const Tensor& weight);
// bias: float32 [N] added to each row (null or empty: none).
Tensor amx_bf16_linear(const Tensor& x, const Tensor& packed, int64_t n,
                       const Tensor* bias = nullptr, Tensor* out = nullptr);
Tensor u4_tiled_linear(const Tensor& x, const Tensor& tiles, const Tensor& scales,
                       const Tensor& mins, int64_t n, Tensor* out = nullptr);
// The signed-byte formats: tiles from tile_i8 ([T, K/4, 64]) or tile_i6 ([T, K/16, 192]).
Tensor i8_tiled_linear(const Tensor& x, const Tensor& tiles, const Tensor& scales,
                       const Tensor& mins, int64_t group, int64_t n, Tensor* out = nullptr);
// The gate_up linear of a tiled weight [N, K] (gate rows 0..N/2-1, then up) and the
// gated activation at once: x [M, K] -> [M, N/2], as gated_act(linear(x)) gives it.
// `format_u4`: u4 tiles (else i8 or i6); N % 32 == 0.
Tensor gated_tiled_linear(const Tensor& x, const Tensor& tiles, const Tensor& scales,
                          const Tensor& mins, int64_t group, int64_t n, bool format_u4,
                          bool gelu, Tensor* out = nullptr);
// One tiled weight of `rows` output rows whose results go to columns col .. col + rows
// of a wider output (a linear stacked from weights of different formats).
struct TiledPart {
  const Tensor* tiles;
  const Tensor* scales;
  const Tensor* mins;  // empty: no mins
  int64_t group, rows, col;
  bool u4;
};
// x [M, K] float32 -> every part's columns of out (rows ldo floats apart), x quantized once.
void tiled_linear_parts(const Tensor& x, const std::vector<TiledPart>& parts, float* out,
                        int64_t ldo);
// Refuses (TORCH_CHECK) tiles, scales and mins that do not hold an [n, k] weight.
void check_tiled(const Tensor& tiles, const Tensor& scales, const Tensor& mins, int64_t n,
                 int64_t k, int64_t group, bool u4);

}  // namespace api
}  // namespace pagedllm
