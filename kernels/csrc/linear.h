// A linear layer as the fast path's kernels hold it: y = x W^T (+ bias), where W stacks one
// or more segments of output rows, each in its own weight format.
//
// One segment is the common case (a whole q|k|v stack in Q4_K). Several arise where the
// checkpoint's shards differ in format: llama-quantize's Q4_K_M writes attn_q and attn_k in
// Q4_K and attn_v in Q6_K in half of the layers, so a stacked qkv is a u4 segment of q|k
// rows and an i6 segment of v rows. Each segment's columns are the bits its own linear
// would give: the activations are quantized once per call and a quantized row is the same
// whichever weight it meets (linear_packed.cpp).
//
//   segment kinds            tensors
//   bf16                     weight bf16 [rows, K]
//   bf16 on AMX tiles        packed bf16 [T, K/32, 16, 32] (linear_amx_bf16.cpp; encoders)
//   u4 (groups of 32)        tiles uint8 [T, K/32, 4, 64], scales, mins [T, K/32, 16]
//   i8 (groups of 16, 32)    tiles uint8 [T, K/4, 64], scales, mins (or empty) [T, K/G, 16]
//   i6 (groups of 16, 32)    tiles uint8 [T, K/16, 192], scales, mins as i8's
//                            (T = ceil(rows / 16); quant/packed.py's TiledWeight)
//   bias                     float32 [N] or empty
//
// Built once from Python (quant/packed_linear.py) as torch.classes.pagedllm.Linear and run
// by the ops linear / linear_out, and by the decoder stack (decoder.cpp).
#pragma once

#include <torch/custom_class.h>

#include "kernels.h"

namespace pagedllm {

enum class WeightKind : int64_t { kBf16 = 0, kU4 = 1, kI8 = 2, kAmxBf16 = 3 };

struct WeightSegment {
  WeightKind kind;
  int64_t group;  // values per scale along K (packed kinds)
  int64_t rows;   // output rows of this segment
  int64_t first;  // its first output row in the stack
  Tensor weight;  // bf16 weight or packed tiles
  Tensor scales, mins;
};

class Linear : public torch::CustomClassHolder {
 public:
  explicit Linear(int64_t in_features);

  // Segments are appended in output-row order.
  void add_bf16(Tensor weight);
  // The same weight packed for TDPBF16PS (its own bits, not add_bf16's: see
  // linear_amx_bf16.cpp); refused where the CPU has no AMX-BF16.
  void add_bf16_amx(Tensor weight);
  void add_tiled(bool u4, int64_t group, int64_t rows, Tensor tiles, Tensor scales, Tensor mins);
  void set_bias(Tensor bias);

  int64_t in_features() const { return in_features_; }
  int64_t out_features() const { return out_features_; }
  int64_t num_segments() const { return static_cast<int64_t>(segments_.size()); }
  // "bf16", "bf16-amx", "u4/32", "i8/32", "i6/16" ... per segment, for logs and tests.
  std::vector<std::string> segment_formats() const;

  // x [M, K] -> [M, N] float32, into `out` (contiguous float32 [M, N]) when given.
  Tensor forward(const Tensor& x, Tensor* out = nullptr) const;

  // A gate_up linear (gate rows 0 .. N/2-1, then up rows) and its gated activation:
  // act(x W_gate^T) * (x W_up^T) [M, N/2] into `out`. Fused in one pass where the weight is
  // one tiled segment of whole tiles per half with no bias (fuses_gated); otherwise through
  // `gate_up` ([M, N], a new tensor when null), as gated_act(forward(x)) gives the same bits.
  Tensor gated(const Tensor& x, bool gelu, Tensor* gate_up, Tensor* out) const;
  bool fuses_gated() const;

 private:
  int64_t in_features_;
  int64_t out_features_ = 0;
  std::vector<WeightSegment> segments_;
  Tensor bias_;
};

}  // namespace pagedllm
