// A whole post-norm BERT layer in one call: encoder.cpp's ops and the layer's four Linears
// (linear.h), the same operations in the same order as engine/models/bert.py's fused module
// path, so the same bits, with one call from Python instead of about ten (on a 10-token
// query that Python was ~0.15 ms a layer).
//
//   x float32 [T, H], cu_seqlens int64 [B + 1]
//   h   = LayerNorm1(x + o(attention(qkv(x))))      qkv [T, 3H] viewed [T, 3, heads, H/heads]
//   out = LayerNorm2(h + down(gelu(up(h))))         -> [T, H]
//
// Registered by linear.cpp right after the Linear class its schema names (decoder.h).

#include "decoder.h"
#include "kernels.h"
#include "linear.h"

namespace pagedllm {

namespace {
using LinearPtr = c10::intrusive_ptr<Linear>;

// x [T, H] -> LN2(h + down(gelu(up(h)))), h = LN1(x + o(attention(qkv(x)))), [T, H]
Tensor encoder_layer(const Tensor& x, const Tensor& cu_seqlens, const LinearPtr& qkv,
                     const LinearPtr& o, const LinearPtr& up, const LinearPtr& down,
                     const Tensor& attn_norm_weight, const Tensor& attn_norm_bias,
                     const Tensor& out_norm_weight, const Tensor& out_norm_bias, int64_t heads,
                     double scale, double eps) {
  TORCH_CHECK(x.dim() == 2 && heads > 0 && x.size(1) % heads == 0,
              "encoder_layer: x must be [T, H] with H a multiple of ", heads, " heads, got ",
              x.sizes());
  const int64_t rows = x.size(0), hidden = x.size(1);
  TORCH_CHECK(qkv->out_features() == 3 * hidden && o->in_features() == hidden &&
                  o->out_features() == hidden && up->in_features() == hidden &&
                  down->out_features() == hidden && down->in_features() == up->out_features(),
              "encoder_layer: the linears do not fit a hidden size of ", hidden);
  const Tensor projected = qkv->forward(x).view({rows, 3, heads, hidden / heads});
  const Tensor attended = api::encoder_attention(projected, cu_seqlens, scale);
  const Tensor h = api::add_layer_norm(x, o->forward(attended.view({rows, hidden})),
                                       attn_norm_weight, attn_norm_bias, eps);
  Tensor inner = up->forward(h);
  api::gelu_erf_(inner);
  return api::add_layer_norm(h, down->forward(inner), out_norm_weight, out_norm_bias, eps);
}
}  // namespace

void register_encoder_layer(torch::Library& m) {
  m.def(
      "encoder_layer(Tensor x, Tensor cu_seqlens, __torch__.torch.classes.pagedllm.Linear qkv, "
      "__torch__.torch.classes.pagedllm.Linear o, __torch__.torch.classes.pagedllm.Linear up, "
      "__torch__.torch.classes.pagedllm.Linear down, Tensor attn_norm_weight, "
      "Tensor attn_norm_bias, Tensor out_norm_weight, Tensor out_norm_bias, int heads, "
      "float scale, float eps) -> Tensor",
      &encoder_layer);
}

}  // namespace pagedllm
