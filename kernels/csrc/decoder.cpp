// A whole decoder stack in one call: the CPU fast path's kernels, composed here instead of
// from Python. The arithmetic is the module path's exactly (the same kernel functions, the
// same order, the same inputs): it only removes the Python between them (about 2 ms per
// forward for 30 layers, most of a one-row decode step's host time).
//
// The stack is a registered class (torch.classes.pagedllm.DecoderStack) built once from
// the loaded model (engine/models/fused_stack.py): the model's shape and options, its
// rotary tables, and per layer its named norms and four Linears (linear.h). Per layer, as
// engine/models/causal_lm.py's DecoderLayer and gemma.py's GemmaDecoderLayer compute it:
//
//   h        = rms_norm(x) (first layer; residual = x)  |  add_rms_norm(x, residual)
//   qkv      = qkv(h)                         [T, (Hq + 2 Hkv) D]; q, k, v are views of it
//   q, k     = rms_norm over each head        (norms "q" and "k": Qwen3, Gemma 3)
//   rotary_neox_(q, k)                        in place, this layer's table (Gemma 3's local
//                                             layers have their own); the first 2 * width
//                                             features of each head (partial: Phi-4-mini)
//   write_kv_cache_(k, v)                     into this layer's blocks
//   attn     = paged_attention_rows_(q)       [T, Hq, D], this layer's sliding window, the
//                                             stack's logit soft-cap (Gemma 2)
//   plain:    h = add_rms_norm(o(attn), residual)            "post_attention"
//             x = down(act(gate_up(h)))
//             or, in an MoE layer (Qwen3-MoE), x = moe(h): the router's softmax top-k
//             experts per token, each expert's tokens through its own gate_up / down,
//             summed with the routing weights (SparseMoE.forward's ops, in its order)
//   sandwich: h = add_rms_norm(rms_norm(o(attn)), residual)  "post_attention", then
//                                                            "pre_feedforward"
//             x = rms_norm(down(act(gate_up(h))))            "post_feedforward"  (Gemma)
//
// act is silu or gelu_tanh; a tiled gate_up runs fused with it (Linear::gated). Returns
// (x, residual) of the last layer: the caller applies the final norm. x_in is not
// modified. The intermediates live in the calling thread's step workspace, reused by every
// layer and step (layer_buffers), not in tensors allocated per op.
//
// forward's arguments: x [T, H] float32; positions [T] int64; kv: per layer (k_cache,
// v_cache) in the fast path's layout (attention.cpp); the step's slot_mapping, seq_ids,
// cu_seqlens_q, seq_lens, block_tables (engine/attention_metadata.py). With layer_groups
// (a layout of several block-table groups, engine/kv_layout.py) slot_mapping is [G, T],
// block_tables [G, B, max_blocks], and layer l writes and reads group layer_groups[l]'s.

#include "decoder.h"

#include <string>

#include "linear.h"

namespace pagedllm {
namespace {

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
//   gate_up  [T, 2I]         only where some layer's gate_up is not fused with its act
//   act      [T, I]
//   normed   [T, H]          sandwich layers only: o's output normed, then down's output
// The stack's results never alias it: the residual stream and the last layer's output
// are tensors of their own.
struct LayerBuffers {
  Tensor h, qkv, attn, proj, gate_up, act, normed;
};

LayerBuffers layer_buffers(int64_t t, const int64_t (&widths)[7]) {
  int64_t total = 0;
  for (int64_t w : widths) total += t * w;
  const Tensor block = workspace_floats(total);
  Tensor views[7];
  int64_t offset = 0;
  for (int i = 0; i < 7; ++i) {
    views[i] = block.narrow(0, offset, t * widths[i]).view({t, widths[i]});
    offset += t * widths[i];
  }
  return {views[0], views[1], views[2], views[3], views[4], views[5], views[6]};
}

using LinearPtr = c10::intrusive_ptr<Linear>;

// A mixture-of-experts MLP (engine/models/moe.py's SparseMoE): the router [E, H] float32,
// each expert's gate_up and down, top_k experts per token.
struct MoeWeights {
  Tensor router;
  std::vector<LinearPtr> gate_up, down;
  int64_t top_k = 0;
  bool norm_topk = false;

  // x [T, H] -> [T, H], the module's ops in its order (so the same bits): routing with
  // router_logits (ops.cpp: a token's logits do not depend on the tokens beside it),
  // torch's softmax and top-k; the (token, slot) pairs sorted by expert
  // (stable), so each expert runs once over a contiguous slice of its tokens; the weighted
  // results added back per token in ascending expert order. Experts no token chose cost
  // nothing: a decode step reads only the routed experts' weights.
  Tensor forward(const Tensor& x, bool gelu) const {
    const int64_t experts = static_cast<int64_t>(gate_up.size());
    Tensor probs = at::softmax(api::router_logits(x, router), -1, at::kFloat);
    auto [weights, chosen] = at::topk(probs, top_k, -1);
    if (norm_topk) weights = weights / weights.sum(-1, /*keepdim=*/true);
    weights = weights.to(x.scalar_type());
    const Tensor flat = chosen.reshape(-1);
    const Tensor order = at::argsort(flat, /*stable=*/true, /*dim=*/0, /*descending=*/false);
    const Tensor token_of = order.div(top_k, "floor");
    const Tensor counts = at::bincount(flat, {}, experts).contiguous();
    const int64_t* count = counts.data_ptr<int64_t>();
    // The (token, slot) rows in expert order and their outputs, [T * top_k, H] each, in a
    // buffer the thread keeps (grown to the largest step): for a 512-token prompt step of
    // 8 experts a token at H = 2048 they are 32 MiB each, which glibc would map, zero-fill
    // and fault in afresh for every MoE layer. Each expert's down writes straight into its
    // slice of `out`.
    const int64_t pairs = flat.numel(), hidden = x.size(1);
    thread_local Tensor pair_buffer;
    if (!pair_buffer.defined() || pair_buffer.numel() < 2 * pairs * hidden)
      pair_buffer = at::empty({2 * pairs * hidden}, x.options());
    Tensor grouped = pair_buffer.narrow(0, 0, pairs * hidden).view({pairs, hidden});
    Tensor out = pair_buffer.narrow(0, pairs * hidden, pairs * hidden).view({pairs, hidden});
    at::index_select_out(grouped, x, 0, token_of);
    int64_t start = 0;
    for (int64_t e = 0; e < experts; ++e) {
      if (count[e] == 0) continue;
      const Tensor rows = grouped.narrow(0, start, count[e]);
      Tensor expert_out = out.narrow(0, start, count[e]);
      down[e]->forward(gate_up[e]->gated(rows, gelu, nullptr, nullptr), &expert_out);
      start += count[e];
    }
    out.mul_(weights.reshape(-1).index_select(0, order).unsqueeze(1));
    return at::zeros_like(x).index_add_(0, token_of, out);
  }
};

struct DecoderLayerWeights {
  // Named norms (float32, the scale the kernel multiplies by: Gemma's 1 + w already added);
  // an undefined tensor where the layer has no such norm.
  Tensor input, post_attention, pre_feedforward, post_feedforward, q, k;
  LinearPtr qkv, o, gate_up, down;  // gate_up and down: null in an MoE layer
  std::shared_ptr<MoeWeights> moe;   // an MoE layer's MLP, else null
  int64_t sliding_window;  // 0: none
  int64_t rotary;          // index of the layer's rotary tables

  bool sandwich() const { return pre_feedforward.defined(); }
  int64_t inner() const { return moe ? 0 : gate_up->out_features() / 2; }
};

class DecoderStack : public torch::CustomClassHolder {
 public:
  DecoderStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double scale, double eps,
               double soft_cap, bool gelu)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), scale_(scale), eps_(eps),
        soft_cap_(soft_cap), gelu_(gelu) {
    TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim > 0,
                "DecoderStack: ", heads, " heads over ", kv_heads, " KV heads of ", head_dim);
  }

  // cos, sin [P, W] float32 (W <= D / 2: the rotated features are the first 2W of a head);
  // returns the tables' index for add_layer.
  int64_t add_rotary(Tensor cos, Tensor sin) {
    check_cpu_contiguous(cos, "cos");
    check_cpu_contiguous(sin, "sin");
    TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.dim() == 2 && cos.sizes() == sin.sizes() &&
                    sin.scalar_type() == at::kFloat && 2 * cos.size(1) <= head_dim_,
                "DecoderStack: rotary tables must be float32 [positions, <= head_dim / 2]");
    rotary_.emplace_back(cos, sin);
    return static_cast<int64_t>(rotary_.size()) - 1;
  }

  // norms: "input", "post_attention" (every layer); "pre_feedforward" and
  // "post_feedforward" (sandwich layers, both or neither); "q" and "k" (both or neither).
  void add_layer(c10::Dict<std::string, Tensor> norms, LinearPtr qkv, LinearPtr o,
                 LinearPtr gate_up, LinearPtr down, int64_t sliding_window, int64_t rotary) {
    DecoderLayerWeights w = attention_part(norms, qkv, o, sliding_window, rotary);
    const int64_t hidden = w.input.numel();
    TORCH_CHECK(gate_up->in_features() == hidden && gate_up->out_features() % 2 == 0 &&
                    down->in_features() == gate_up->out_features() / 2 &&
                    down->out_features() == hidden,
                "DecoderStack: the layer's MLP linears do not fit hidden ", hidden);
    for (const DecoderLayerWeights& other : layers_)  // one set of buffers: the same widths
      TORCH_CHECK(other.moe || other.inner() == gate_up->out_features() / 2,
                  "DecoderStack: every dense layer must have the same MLP width");
    w.gate_up = std::move(gate_up);
    w.down = std::move(down);
    layers_.push_back(std::move(w));
  }

  // An MoE layer: router [E, H] float32; its experts follow through add_expert.
  void add_moe_layer(c10::Dict<std::string, Tensor> norms, LinearPtr qkv, LinearPtr o,
                     Tensor router, int64_t top_k, bool norm_topk, int64_t sliding_window,
                     int64_t rotary) {
    DecoderLayerWeights w = attention_part(norms, qkv, o, sliding_window, rotary);
    check_cpu_contiguous(router, "router");
    TORCH_CHECK(router.scalar_type() == at::kFloat && router.dim() == 2 &&
                    router.size(1) == w.input.numel() && top_k > 0 && top_k <= router.size(0),
                "DecoderStack: the router must be float32 [experts, hidden] and 0 < top_k <= "
                "experts");
    w.moe = std::make_shared<MoeWeights>();
    w.moe->router = router;
    w.moe->top_k = top_k;
    w.moe->norm_topk = norm_topk;
    layers_.push_back(std::move(w));
  }

  // The next expert of the last layer added (an MoE layer), in expert order.
  void add_expert(LinearPtr gate_up, LinearPtr down) {
    TORCH_CHECK(!layers_.empty() && layers_.back().moe, "DecoderStack: no MoE layer to add to");
    MoeWeights& moe = *layers_.back().moe;
    const int64_t hidden = layers_.back().input.numel();
    TORCH_CHECK(static_cast<int64_t>(moe.gate_up.size()) < moe.router.size(0),
                "DecoderStack: more experts than the router has");
    TORCH_CHECK(gate_up->in_features() == hidden && gate_up->out_features() % 2 == 0 &&
                    down->in_features() == gate_up->out_features() / 2 &&
                    down->out_features() == hidden,
                "DecoderStack: an expert's linears do not fit hidden ", hidden);
    moe.gate_up.push_back(std::move(gate_up));
    moe.down.push_back(std::move(down));
  }

 private:
  // The norms, attention linears, window and rotary of a layer, checked.
  DecoderLayerWeights attention_part(const c10::Dict<std::string, Tensor>& norms,
                                     LinearPtr qkv, LinearPtr o, int64_t sliding_window,
                                     int64_t rotary) {
    DecoderLayerWeights w;
    for (const auto& item : norms) {
      const std::string& name = item.key();
      Tensor* slot = name == "input"              ? &w.input
                     : name == "post_attention"   ? &w.post_attention
                     : name == "pre_feedforward"  ? &w.pre_feedforward
                     : name == "post_feedforward" ? &w.post_feedforward
                     : name == "q"                ? &w.q
                     : name == "k"                ? &w.k
                                                  : nullptr;
      TORCH_CHECK(slot != nullptr, "DecoderStack: unknown norm '", name, "'");
      const Tensor& value = item.value();
      TORCH_CHECK(value.scalar_type() == at::kFloat && value.dim() == 1 && value.is_contiguous(),
                  "DecoderStack: norm '", name, "' must be contiguous float32 [width]");
      *slot = value;
    }
    TORCH_CHECK(w.input.defined() && w.post_attention.defined(),
                "DecoderStack: every layer needs the 'input' and 'post_attention' norms");
    TORCH_CHECK(w.pre_feedforward.defined() == w.post_feedforward.defined(),
                "DecoderStack: 'pre_feedforward' and 'post_feedforward' come together");
    TORCH_CHECK(w.q.defined() == w.k.defined(), "DecoderStack: 'q' and 'k' come together");
    const int64_t hidden = w.input.numel(), q_size = heads_ * head_dim_;
    const int64_t qkv_size = q_size + 2 * kv_heads_ * head_dim_;
    TORCH_CHECK(qkv->in_features() == hidden && qkv->out_features() == qkv_size &&
                    o->in_features() == q_size && o->out_features() == hidden,
                "DecoderStack: the layer's attention linears do not fit hidden ", hidden,
                " and ", heads_, " + 2 x ", kv_heads_, " heads of ", head_dim_);
    for (const Tensor* n : {&w.post_attention, &w.pre_feedforward, &w.post_feedforward})
      TORCH_CHECK(!n->defined() || n->numel() == hidden, "DecoderStack: a norm of width ",
                  n->numel(), " in a model of width ", hidden);
    TORCH_CHECK(!w.q.defined() || (w.q.numel() == head_dim_ && w.k.numel() == head_dim_),
                "DecoderStack: q and k norms must be [head_dim]");
    TORCH_CHECK(rotary >= 0 && rotary < static_cast<int64_t>(rotary_.size()),
                "DecoderStack: no rotary tables ", rotary);
    TORCH_CHECK(sliding_window >= 0, "DecoderStack: negative sliding window");
    TORCH_CHECK(layers_.empty() || layers_.front().input.numel() == hidden,
                "DecoderStack: every layer must have the first one's width");
    w.qkv = std::move(qkv);
    w.o = std::move(o);
    w.sliding_window = sliding_window;
    w.rotary = rotary;
    return w;
  }

 public:
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  std::tuple<Tensor, Tensor> forward(const Tensor& x_in, const Tensor& positions,
                                     at::TensorList kv, const Tensor& slot_mapping,
                                     const Tensor& seq_ids, const Tensor& cu_seqlens_q,
                                     const Tensor& seq_lens, const Tensor& block_tables,
                                     at::IntArrayRef layer_groups) const {
    const int64_t layers = num_layers();
    TORCH_CHECK(layers > 0, "DecoderStack: no layers");
    const bool grouped = !layer_groups.empty();
    TORCH_CHECK(!grouped || (static_cast<int64_t>(layer_groups.size()) == layers &&
                             slot_mapping.dim() == 2 && block_tables.dim() == 3),
                "DecoderStack: layer_groups needs one group per layer, slot_mapping [G, T] "
                "and block_tables [G, B, max_blocks]");
    TORCH_CHECK(static_cast<int64_t>(kv.size()) == 2 * layers, "DecoderStack: ", layers,
                " layers need ", 2 * layers, " caches, got ", kv.size());
    const DecoderLayerWeights& first = layers_.front();
    const int64_t t = x_in.size(0), hidden = first.input.numel();
    TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == hidden && x_in.scalar_type() == at::kFloat,
                "DecoderStack: x must be float32 [T, ", hidden, "]");
    const int64_t q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    int64_t inner = 0;  // the dense layers' MLP width (MoE layers allocate their own)
    bool all_fused = true, any_sandwich = false;
    for (const DecoderLayerWeights& w : layers_) {
      TORCH_CHECK(!w.moe || !w.moe->gate_up.empty(), "DecoderStack: an MoE layer has no experts");
      TORCH_CHECK(!w.moe || static_cast<int64_t>(w.moe->gate_up.size()) == w.moe->router.size(0),
                  "DecoderStack: an MoE layer has fewer experts than its router");
      inner = std::max(inner, w.inner());
      all_fused = all_fused && (w.moe || w.gate_up->fuses_gated());
      any_sandwich = any_sandwich || w.sandwich();
    }
    const int64_t widths[7] = {hidden,       q_size + 2 * kv_size,   q_size, hidden,
                               all_fused ? 0 : 2 * inner, inner, any_sandwich ? hidden : 0};
    LayerBuffers buf = layer_buffers(t, widths);
    Tensor x = x_in.clone();  // becomes the residual stream, updated in place
    Tensor residual;
    for (int64_t layer = 0; layer < layers; ++layer) {
      const DecoderLayerWeights& w = layers_[layer];
      const bool last = layer + 1 == layers;
      Tensor h;
      if (layer == 0) {
        residual = x;
        h = api::rms_norm(x, w.input, eps_, &buf.h);
      } else {
        h = api::add_rms_norm(x, residual, w.input, eps_, &buf.h);
      }
      Tensor qkv = w.qkv->forward(h, &buf.qkv);
      Tensor q = qkv.narrow(1, 0, q_size).view({t, heads_, head_dim_});
      Tensor k = qkv.narrow(1, q_size, kv_size).view({t, kv_heads_, head_dim_});
      Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, kv_heads_, head_dim_});
      if (w.q.defined()) {
        api::head_rms_norm_(q, w.q, eps_);
        api::head_rms_norm_(k, w.k, eps_);
      }
      const auto& [cos, sin] = rotary_[w.rotary];
      api::rotary_neox_(q, k, positions, cos, sin);
      Tensor k_cache = kv[2 * layer], v_cache = kv[2 * layer + 1];
      const Tensor slots = grouped ? slot_mapping.select(0, layer_groups[layer]) : slot_mapping;
      const Tensor tables = grouped ? block_tables.select(0, layer_groups[layer]) : block_tables;
      api::write_kv_cache_(k, v, k_cache, v_cache, slots);
      Tensor attn = buf.attn.view({t, heads_, head_dim_});
      api::paged_attention_rows_(q, k_cache, v_cache, attn, seq_ids, cu_seqlens_q, seq_lens,
                                 tables, scale_, w.sliding_window, soft_cap_);
      Tensor o = w.o->forward(buf.attn, &buf.proj);
      if (w.sandwich()) {
        Tensor normed = api::rms_norm(o, w.post_attention, eps_, &buf.normed);
        h = api::add_rms_norm(normed, residual, w.pre_feedforward, eps_, &buf.h);
        Tensor act = w.gate_up->gated(h, gelu_, &buf.gate_up, &buf.act);
        Tensor down = w.down->forward(act, &buf.normed);
        // The last layer's output is returned: a tensor of its own, not the reused buffer.
        x = last ? api::rms_norm(down, w.post_feedforward, eps_)
                 : api::rms_norm(down, w.post_feedforward, eps_, &buf.proj);
      } else if (w.moe) {
        h = api::add_rms_norm(o, residual, w.post_attention, eps_, &buf.h);
        x = w.moe->forward(h, gelu_);  // a tensor of its own
      } else {
        h = api::add_rms_norm(o, residual, w.post_attention, eps_, &buf.h);
        Tensor act = w.gate_up->gated(h, gelu_, &buf.gate_up, &buf.act);
        x = last ? w.down->forward(act) : w.down->forward(act, &buf.proj);
      }
    }
    return {x, residual};
  }

 private:
  int64_t heads_, kv_heads_, head_dim_;
  double scale_, eps_, soft_cap_;
  bool gelu_;
  std::vector<std::pair<Tensor, Tensor>> rotary_;
  std::vector<DecoderLayerWeights> layers_;
};

using StackPtr = c10::intrusive_ptr<DecoderStack>;

}  // namespace

void register_decoder_stack(torch::Library& m) {
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, double, bool>())
      .def("add_rotary", &DecoderStack::add_rotary)
      .def("add_layer", &DecoderStack::add_layer)
      .def("add_moe_layer", &DecoderStack::add_moe_layer)
      .def("add_expert", &DecoderStack::add_expert)
      .def("num_layers", &DecoderStack::num_layers);
  m.def(
      "decoder_stack(__torch__.torch.classes.pagedllm.DecoderStack stack, Tensor x, "
      "Tensor positions, Tensor[] kv, Tensor slot_mapping, Tensor seq_ids, "
      "Tensor cu_seqlens_q, Tensor seq_lens, Tensor block_tables, int[] layer_groups=[]) "
      "-> (Tensor, Tensor)",
      [](const StackPtr& stack, const at::Tensor& x, const at::Tensor& positions,
         at::TensorList kv, const at::Tensor& slot_mapping, const at::Tensor& seq_ids,
         const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
         const at::Tensor& block_tables, at::IntArrayRef layer_groups) {
        return stack->forward(x, positions, kv, slot_mapping, seq_ids, cu_seqlens_q, seq_lens,
                              block_tables, layer_groups);
      });
  // float32 [numel], a view of the calling thread's step workspace: valid until the next
  // decoder_stack or step_workspace call on this thread, which may overwrite it.
  m.def("step_workspace(int numel) -> Tensor", &workspace_floats);
}

}  // namespace pagedllm
