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
void write_kv_cache_(const Tensor& k, const Tensor& v, Tensor& k_cache, Tensor& v_cache,
                     const Tensor& slot_mapping);
// attention.cpp
void paged_attention_rows_(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                           Tensor& out, const Tensor& seq_ids, const Tensor& cu_seqlens_q,
                           const Tensor& seq_lens, const Tensor& block_tables, double scale,
                           int64_t window, double soft_cap);
// linear_bf16.cpp, linear_packed.cpp
Tensor bf16_linear(const Tensor& x, const Tensor& weight, Tensor* out = nullptr);
Tensor u4_tiled_linear(const Tensor& x, const Tensor& tiles, const Tensor& scales,
                       const Tensor& mins, int64_t n, Tensor* out = nullptr);
Tensor i8_tiled_linear(const Tensor& x, const Tensor& tiles, const Tensor& scales,
                       const Tensor& mins, int64_t group, int64_t n, Tensor* out = nullptr);
// The gate_up linear of a tiled weight [N, K] (gate rows 0..N/2-1, then up) and the
// gated activation at once: x [M, K] -> [M, N/2], as gated_act(linear(x)) gives it.
// `format_u4`: u4 tiles (else i8); N % 32 == 0.
Tensor gated_tiled_linear(const Tensor& x, const Tensor& tiles, const Tensor& scales,
                          const Tensor& mins, int64_t group, int64_t n, bool format_u4,
                          bool gelu, Tensor* out = nullptr);

}  // namespace api
}  // namespace pagedllm
