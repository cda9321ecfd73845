// A whole decoder stack of the Llama family (Llama, Mistral, Qwen2, SmolLM2) in one call:
// the CPU fast path's kernels, composed here instead of from Python. The arithmetic is
// the module path's exactly (the same kernel functions, the same order, the same inputs):
// it only removes the Python between them (about 2 ms per forward for 30 layers, most of
// a one-row decode step's host time).
//
// Per layer, as engine/models/causal_lm.py's DecoderLayer with Attention and GatedMLP:
//
//   h        = rms_norm(x) (first layer; residual = x)  |  add_rms_norm(x, residual)
//   qkv      = linear(h)                    [T, (Hq + 2 Hkv) D]; q, k, v are views of it
//   rotary_neox_(q, k)                      in place
//   write_kv_cache_(k, v)                   into this layer's blocks
//   attn     = paged_attention_rows_(q)     [T, Hq, D]
//   h        = add_rms_norm(linear(attn), residual)
//   x        = linear(gated_act(linear(h)))       (gate_up, then down; a tiled gate_up
//                                                  runs fused with the activation)
//
// Returns (x, residual) of the last layer: the caller applies the final norm. x_in is
// not modified. The intermediates (h, qkv, attn, ...) live in the calling thread's step
// workspace, reused by every layer and step (layer_buffers), not in tensors allocated per
// op.
//
// Arguments (L layers):
//   x [T, H] float32; positions [T] int64
//   params: per layer 18 tensors: input norm weight, post-attention norm weight, then for
//     each linear (qkv, o, gate_up, down) its (a, b, c, bias): a bf16 weight [N, K] with b,
//     c empty, or a tiled weight's (tiles, scales, mins); bias [N] float32 or empty
//   ints: per layer 13: for each linear (kind: 0 bf16, 1 u4, 2 i8; group; N), then the
//     layer's sliding window (0: none)
//   kv: per layer (k_cache, v_cache) in the fast path's layout (attention.cpp)
//   cos, sin [P, D/2] float32; the step's slot_mapping, seq_ids, cu_seqlens_q, seq_lens,
//   block_tables (engine/attention_metadata.py)

#include "kernels.h"

namespace pagedllm {
namespace {

constexpr int64_t kTensorsPerLayer = 18;
constexpr int64_t kIntsPerLayer = 13;
enum LinearKind : int64_t { kBf16 = 0, kU4 = 1, kI8 = 2 };

// Linear j (0 qkv, 1 o, 2 gate_up, 3 down) of a layer, applied to x [T, K] -> [T, N],
// written into `out` ([T, N]) when given.
Tensor linear(const Tensor* tensors, const int64_t* ints, int64_t j, const Tensor& x,
              Tensor* out = nullptr) {
  const Tensor* t = tensors + 2 + 4 * j;
  const int64_t kind = ints[3 * j], group = ints[3 * j + 1], n = ints[3 * j + 2];
  Tensor y;
  switch (kind) {
    case kBf16: y = api::bf16_linear(x, t[0], out); break;
    case kU4: y = api::u4_tiled_linear(x, t[0], t[1], t[2], n, out); break;
    case kI8: y = api::i8_tiled_linear(x, t[0], t[1], t[2], group, n, out); break;
    default: TORCH_CHECK(false, "unknown linear kind ", kind);
  }
  if (t[3].numel() > 0) y.add_(t[3]);  // the bias, added as `out + bias` adds it
  return y;
}

// Whether a layer's gate_up (linear 2) runs fused with the gated activation
// (gated_tiled_linear): a tiled weight, whole tiles per half, no bias.
bool fused_gate_up(const Tensor* tensors, const int64_t* ints) {
  const int64_t kind = ints[6], n = ints[8];
  return (kind == kU4 || kind == kI8) && n % 32 == 0 && tensors[2 + 4 * 2 + 3].numel() == 0;
}

// The layer's MLP activation act(x W_gate^T) * (x W_up^T) [T, I] into `act`; through
// `gate_up` ([T, 2I]) only where the weight is not fused.
Tensor gated_mlp_act(const Tensor* tensors, const int64_t* ints, const Tensor& x,
                     Tensor& gate_up, Tensor& act) {
  if (fused_gate_up(tensors, ints)) {
    const Tensor* t = tensors + 2 + 4 * 2;
    return api::gated_tiled_linear(x, t[0], t[1], t[2], ints[7], ints[8], ints[6] == kU4,
                                   false, &act);
  }
  return api::gated_act(linear(tensors, ints, 2, x, &gate_up), false, &act);
}

// The calling thread's step workspace: float32 pages of its own (page_backed_floats),
// grown to the largest step and kept. While the decoder stack runs, its layer buffers live
// there; after it, the step's logits (engine/models/layers.py's LMHead writes them there
// through the step_workspace op). The two are never needed at once, so the process holds
// the larger of them (~15 MB for a 512-token prompt step; 12.6 MB of logits for a decode
// step of 64 sequences), not their sum, and neither is allocated per step: allocated per
// op, a prompt step's intermediates fragmented the heap (the process kept 30-60 MiB more
// resident after its first large jobs than their live data needed), and mapped per step,
// the logits cost 3-5 ms of page faults.
thread_local Tensor step_workspace;

Tensor workspace_floats(int64_t numel) {
  TORCH_CHECK(numel >= 0, "step_workspace: negative size ", numel);
  if (!step_workspace.defined() || step_workspace.numel() < numel) {
    step_workspace = Tensor();  // unmapped here unless a caller still holds a view of it
    step_workspace = page_backed_floats(numel);
  }
  return step_workspace.narrow(0, 0, numel);
}

// The activations of one layer, in the step workspace, reused by every layer:
//   h        [T, H]          the normed input of qkv, then of gate_up
//   qkv      [T, Nqkv]
//   attn     [T, Hq * D]
//   proj     [T, H]          o's output, then down's (the next layer's input)
//   gate_up  [T, 2I]
//   act      [T, I]
// The stack's results never alias it: the residual stream and the last layer's output
// are tensors of their own.
struct LayerBuffers {
  Tensor h, qkv, attn, proj, gate_up, act;
};

LayerBuffers layer_buffers(int64_t t, int64_t hidden, int64_t qkv, int64_t attn,
                           int64_t gate_up, int64_t act) {
  const int64_t widths[] = {hidden, qkv, attn, hidden, gate_up, act};
  int64_t total = 0;
  for (int64_t w : widths) total += t * w;
  const Tensor block = workspace_floats(total);
  Tensor views[6];
  int64_t offset = 0;
  for (int i = 0; i < 6; ++i) {
    views[i] = block.narrow(0, offset, t * widths[i]).view({t, widths[i]});
    offset += t * widths[i];
  }
  return {views[0], views[1], views[2], views[3], views[4], views[5]};
}

std::tuple<Tensor, Tensor> decoder_stack(
    const Tensor& x_in, const Tensor& positions, at::TensorList params, at::IntArrayRef ints,
    at::TensorList kv, const Tensor& cos, const Tensor& sin, const Tensor& slot_mapping,
    const Tensor& seq_ids, const Tensor& cu_seqlens_q, const Tensor& seq_lens,
    const Tensor& block_tables, double scale, double eps, int64_t heads, int64_t kv_heads,
    int64_t head_dim) {
  const int64_t layers = static_cast<int64_t>(kv.size()) / 2;
  TORCH_CHECK(static_cast<int64_t>(params.size()) == layers * kTensorsPerLayer &&
                  static_cast<int64_t>(ints.size()) == layers * kIntsPerLayer,
              "decoder_stack: ", layers, " layers need ", kTensorsPerLayer, " tensors and ",
              kIntsPerLayer, " ints each");
  const int64_t t = x_in.size(0), q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  Tensor x = x_in.clone();  // becomes the residual stream, updated in place
  Tensor residual;
  // One set of buffers serves every layer: each must have the first one's widths.
  const int64_t hidden = x_in.size(1);
  // gate_up's [T, 2I] buffer only where some layer does not fuse it with the activation
  bool all_fused = true;
  for (int64_t layer = 0; layer < layers; ++layer)
    all_fused = all_fused && fused_gate_up(params.data() + layer * kTensorsPerLayer,
                                           ints.data() + layer * kIntsPerLayer);
  LayerBuffers buf = layer_buffers(t, hidden, ints[2], q_size, all_fused ? 0 : ints[8],
                                   ints[8] / 2);
  for (int64_t layer = 0; layer < layers; ++layer) {
    const Tensor* p = params.data() + layer * kTensorsPerLayer;
    const int64_t* n = ints.data() + layer * kIntsPerLayer;
    TORCH_CHECK(n[2] == ints[2] && n[8] == ints[8] && n[5] == hidden && n[11] == hidden,
                "decoder_stack: layer ", layer, " has other widths than layer 0");
    Tensor h;
    if (layer == 0) {
      residual = x;
      h = api::rms_norm(x, p[0], eps, &buf.h);
    } else {
      h = api::add_rms_norm(x, residual, p[0], eps, &buf.h);
    }
    Tensor qkv = linear(p, n, 0, h, &buf.qkv);
    Tensor q = qkv.narrow(1, 0, q_size).view({t, heads, head_dim});
    Tensor k = qkv.narrow(1, q_size, kv_size).view({t, kv_heads, head_dim});
    Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, kv_heads, head_dim});
    api::rotary_neox_(q, k, positions, cos, sin);
    Tensor k_cache = kv[2 * layer], v_cache = kv[2 * layer + 1];
    api::write_kv_cache_(k, v, k_cache, v_cache, slot_mapping);
    Tensor attn = buf.attn.view({t, heads, head_dim});
    api::paged_attention_rows_(q, k_cache, v_cache, attn, seq_ids, cu_seqlens_q, seq_lens,
                               block_tables, scale, n[12], 0.0);
    h = api::add_rms_norm(linear(p, n, 1, buf.attn, &buf.proj), residual, p[1], eps, &buf.h);
    Tensor act = gated_mlp_act(p, n, h, buf.gate_up, buf.act);
    // The last layer's output is returned: a tensor of its own, not the reused buffer.
    x = layer + 1 < layers ? linear(p, n, 3, act, &buf.proj) : linear(p, n, 3, act);
  }
  return {x, residual};
}

}  // namespace
}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def(
      "decoder_stack(Tensor x, Tensor positions, Tensor[] params, int[] ints, Tensor[] kv, "
      "Tensor cos, Tensor sin, Tensor slot_mapping, Tensor seq_ids, Tensor cu_seqlens_q, "
      "Tensor seq_lens, Tensor block_tables, float scale, float eps, int heads, int kv_heads, "
      "int head_dim) -> (Tensor, Tensor)",
      &pagedllm::decoder_stack);
  // float32 [numel], a view of the calling thread's step workspace: valid until the next
  // decoder_stack or step_workspace call on this thread, which may overwrite it.
  m.def("step_workspace(int numel) -> Tensor", &pagedllm::workspace_floats);
}
