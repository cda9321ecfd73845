// The fast path's linear layer (linear.h): segments of output rows in their own formats,
// registered as torch.classes.pagedllm.Linear, and the ops that run it.

#include "linear.h"

#include "decoder.h"

namespace pagedllm {

Linear::Linear(int64_t in_features) : in_features_(in_features) {
  TORCH_CHECK(in_features > 0, "Linear: in_features must be positive, got ", in_features);
}

void Linear::add_bf16(Tensor weight) {
  check_cpu_contiguous(weight, "weight");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 &&
                  weight.size(1) == in_features_,
              "Linear: a bf16 segment must be bf16 [rows, ", in_features_, "], got ",
              weight.scalar_type(), " ", weight.sizes());
  const int64_t rows = weight.size(0);
  segments_.push_back({WeightKind::kBf16, 0, rows, out_features_, weight, Tensor(), Tensor()});
  out_features_ += rows;
}

void Linear::add_bf16_amx(Tensor weight) {
  add_bf16(weight);  // the same checks
  WeightSegment& s = segments_.back();
  s.kind = WeightKind::kAmxBf16;
  s.weight = api::amx_bf16_pack(weight);
}

void Linear::add_tiled(bool u4, int64_t group, int64_t rows, Tensor tiles, Tensor scales,
                       Tensor mins) {
  TORCH_CHECK(rows > 0, "Linear: a segment needs rows, got ", rows);
  api::check_tiled(tiles, scales, mins, rows, in_features_, group, u4);
  segments_.push_back({u4 ? WeightKind::kU4 : WeightKind::kI8, group, rows, out_features_,
                       tiles, scales, mins});
  out_features_ += rows;
}

void Linear::set_bias(Tensor bias) {
  TORCH_CHECK(bias.numel() == 0 || (bias.dim() == 1 && bias.scalar_type() == at::kFloat &&
                                    bias.is_contiguous()),
              "Linear: bias must be contiguous float32 [N] or empty");
  bias_ = bias;
}

std::vector<std::string> Linear::segment_formats() const {
  std::vector<std::string> formats;
  for (const WeightSegment& s : segments_) {
    if (s.kind == WeightKind::kBf16) formats.push_back("bf16");
    else if (s.kind == WeightKind::kAmxBf16) formats.push_back("bf16-amx");
    else if (s.kind == WeightKind::kU4) formats.push_back("u4/" + std::to_string(s.group));
    else  // i8 and i6 tiles run as one kind, told apart by their shape ([T, K/16, 192]: i6)
      formats.push_back((s.weight.size(-1) == 192 ? "i6/" : "i8/") + std::to_string(s.group));
  }
  return formats;
}

// One segment alone, through the single-weight kernels (the path of every one-format linear).
Tensor segment_forward(const WeightSegment& s, const Tensor& x, Tensor* out) {
  switch (s.kind) {
    case WeightKind::kBf16: return api::bf16_linear(x, s.weight, out);
    case WeightKind::kAmxBf16: return api::amx_bf16_linear(x, s.weight, s.rows, nullptr, out);
    case WeightKind::kU4: return api::u4_tiled_linear(x, s.weight, s.scales, s.mins, s.rows, out);
    case WeightKind::kI8:
      return api::i8_tiled_linear(x, s.weight, s.scales, s.mins, s.group, s.rows, out);
  }
  TORCH_CHECK(false, "unknown weight kind");
}

Tensor Linear::forward(const Tensor& x_in, Tensor* out_buffer) const {
  TORCH_CHECK(!segments_.empty(), "Linear used before its weights were added");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == in_features_, "Linear: x must be [M, ",
              in_features_, "], got ", x_in.sizes());
  TORCH_CHECK(bias_.numel() == 0 || bias_.numel() == out_features_,
              "Linear: bias of ", bias_.numel(), " for ", out_features_, " outputs");
  Tensor y;
  if (segments_.size() == 1 && segments_[0].kind == WeightKind::kAmxBf16)  // adds the bias
    return api::amx_bf16_linear(x_in, segments_[0].weight, segments_[0].rows, &bias_, out_buffer);
  if (segments_.size() == 1) {
    y = segment_forward(segments_[0], x_in, out_buffer);
  } else {
    const Tensor x = x_in.scalar_type() == at::kFloat ? x_in.contiguous()
                                                      : x_in.to(at::kFloat).contiguous();
    const int64_t m = x.size(0);
    y = float_output(out_buffer, m, out_features_, x.options());
    std::vector<api::TiledPart> parts;
    for (const WeightSegment& s : segments_)
      if (s.kind == WeightKind::kU4 || s.kind == WeightKind::kI8)
        parts.push_back({&s.weight, &s.scales, &s.mins, s.group, s.rows, s.first,
                         s.kind == WeightKind::kU4});
    api::tiled_linear_parts(x, parts, y.data_ptr<float>(), out_features_);
    for (const WeightSegment& s : segments_)
      if (s.kind == WeightKind::kBf16 || s.kind == WeightKind::kAmxBf16)
        y.narrow(1, s.first, s.rows).copy_(segment_forward(s, x, nullptr));
  }
  if (bias_.numel() > 0) y.add_(bias_);  // the bias, added as `out + bias` adds it
  return y;
}

bool Linear::fuses_gated() const {
  if (segments_.size() != 1 || bias_.numel() > 0) return false;
  const WeightSegment& s = segments_[0];
  return (s.kind == WeightKind::kU4 || s.kind == WeightKind::kI8) && s.rows % 32 == 0;
}

Tensor Linear::gated(const Tensor& x, bool gelu, Tensor* gate_up, Tensor* out) const {
  TORCH_CHECK(out_features_ % 2 == 0, "a gate_up linear needs an even number of outputs");
  if (fuses_gated()) {
    const WeightSegment& s = segments_[0];
    return api::gated_tiled_linear(x, s.weight, s.scales, s.mins, s.group, s.rows,
                                   s.kind == WeightKind::kU4, gelu, out);
  }
  return api::gated_act(forward(x, gate_up), gelu, out);
}

}  // namespace pagedllm

namespace {
using LinearPtr = c10::intrusive_ptr<pagedllm::Linear>;
}

// The classes come first: the op schemas below name them.
TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.class_<pagedllm::Linear>("Linear")
      .def(torch::init<int64_t>())
      .def("add_bf16", &pagedllm::Linear::add_bf16)
      .def("add_bf16_amx", &pagedllm::Linear::add_bf16_amx)
      .def("add_tiled", &pagedllm::Linear::add_tiled)
      .def("set_bias", &pagedllm::Linear::set_bias)
      .def("in_features", &pagedllm::Linear::in_features)
      .def("out_features", &pagedllm::Linear::out_features)
      .def("num_segments", &pagedllm::Linear::num_segments)
      .def("segment_formats", &pagedllm::Linear::segment_formats);
  pagedllm::register_decoder_stack(m);
  pagedllm::register_encoder_layer(m);
  // x [M, K] float32 -> [M, N] float32
  m.def("linear(__torch__.torch.classes.pagedllm.Linear weight, Tensor x) -> Tensor",
        [](const LinearPtr& weight, const at::Tensor& x) { return weight->forward(x); });
  // The same into a given contiguous float32 [M, N] (the LM head's logits).
  m.def("linear_out(__torch__.torch.classes.pagedllm.Linear weight, Tensor x, Tensor(a!) out)"
        " -> ()",
        [](const LinearPtr& weight, const at::Tensor& x, at::Tensor out) {
          weight->forward(x, &out);
        });
  // A gate_up linear and its gated activation: x [M, K] -> [M, N/2]
  m.def("gated_linear(__torch__.torch.classes.pagedllm.Linear weight, Tensor x, bool gelu)"
        " -> Tensor",
        [](const LinearPtr& weight, const at::Tensor& x, bool gelu) {
          return weight->gated(x, gelu, nullptr, nullptr);
        });
}
