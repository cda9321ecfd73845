"""How a model's layers compute: one backend, chosen once from the compute plan and handed to
the model when it is built, and what each backend can run (its capability table).

    plan (compute_plan.py) -> Backend -> CausalLM(cfg, backend, ...) -> every layer reads
    its kernels from the backend at construction; nothing is switched afterwards.

A backend names:
- `make_linear`: the linear layers' factory (dense torch, the fast path's packed / bf16
  linears, AWQ, tensor-parallel shards), and `tables`: the fast path's embedding table and
  tied head. Weight formats (quant/) come in only through these two: the models import
  nothing from quant/;
- `fused_kernels`: whether norms, rotary, the gated activation and the embedding / head run
  as the C++ kernels of the CPU fast path, or in torch (the reference);
- `attention`: the kernels.ops backend of the KV writes and attention ("cpu", "torch",
  "triton"); the model runner passes it to the layers with every step's metadata;
- `capabilities`: the model features its layers run (`FEATURES`), and `stack`: those its
  whole-step C++ decoder stack runs (empty: the layers always run as modules).

`model_features(cfg, family)` is what a model needs. A feature outside `capabilities` is
refused when the model is built (a ValueError naming it); a feature outside `stack` keeps
the layers on the module path, and the engine's load line names it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import SLIDING, ModelConfig
from .layers import LinearFactory, TableKernels, dense_linear

# Every feature a model family may need of its backend, and what it is.
FEATURES: dict[str, str] = {
    "gated_mlp": "a gated MLP (SwiGLU, GeGLU)",
    "gelu": "GeGLU's tanh-approximated gelu",
    "qk_norm": "RMSNorm over each head of q and k (Qwen3, Gemma 3)",
    "sandwich_norms": "norms after attention and the MLP as well as before (Gemma 2/3)",
    "unit_offset_norm": "(1 + w) RMSNorm weights (Gemma)",
    "logit_soft_cap": "attention scores soft-capped, cap * tanh(s / cap) (Gemma 2)",
    "final_logit_soft_cap": "logits soft-capped (Gemma 2)",
    "sliding_window": "sliding-window attention layers",
    "per_layer_rotary": "sliding layers with a rope base of their own (Gemma 3)",
    "partial_rotary": "rotary over a share of each head (Phi-4-mini)",
    "rope_scaling": "scaled rope (linear, dynamic, llama3, longrope)",
    "linear_bias": "biases on the attention or MLP linears (Qwen2)",
    "fused_checkpoint_linears": "checkpoint linears that hold q|k|v or gate|up (Phi-3)",
    "moe": "a mixture of experts MLP (Qwen3-MoE)",
    "bidirectional": "attention without a causal mask or KV cache (EmbeddingGemma)",
}


def model_features(cfg: ModelConfig, family: frozenset[str] = frozenset()) -> frozenset[str]:
    """The features a model of `cfg` needs; `family`: what its class adds that the config
    does not say (CausalLM.family_features: Gemma's sandwich norms, Phi-3's fused linears)."""
    features = {"gated_mlp", *family}
    windows = [cfg.layer_sliding_window(i) for i in range(cfg.num_layers)]
    flags = {
        "gelu": cfg.hidden_act != "silu",
        "qk_norm": cfg.qk_norm,
        "unit_offset_norm": cfg.rms_norm_unit_offset,
        "logit_soft_cap": bool(cfg.attn_logit_softcap),
        "final_logit_soft_cap": bool(cfg.final_logit_softcap),
        "sliding_window": any(windows),
        "per_layer_rotary": cfg.local_rope_theta is not None and SLIDING in (cfg.layer_types or []),
        "partial_rotary": cfg.partial_rotary_factor < 1.0,
        "rope_scaling": cfg.rope_scaling is not None or cfg.local_rope_scaling is not None,
        "linear_bias": cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias,
        "moe": cfg.num_experts > 0,
        "bidirectional": not cfg.causal,
    }
    features.update(name for name, needed in flags.items() if needed)
    unknown = features - FEATURES.keys()
    assert not unknown, f"features without an entry in FEATURES: {sorted(unknown)}"
    return frozenset(features)


ALL_FEATURES = frozenset(FEATURES)


@dataclass(frozen=True, slots=True)
class Backend:
    name: str  # for logs: "CPU fast path", "torch", "triton"
    make_linear: LinearFactory
    fused_kernels: bool
    attention: str
    capabilities: frozenset[str] = ALL_FEATURES
    stack: frozenset[str] = frozenset()
    # The fast path's embedding table and tied head (quant/packed_linear.py's, handed in).
    tables: TableKernels | None = None

    def check(self, features: frozenset[str]) -> None:
        """Refuse a model that needs what this backend's layers cannot run."""
        missing = sorted(features - self.capabilities)
        if missing:
            named = "; ".join(f"{m} ({FEATURES[m]})" for m in missing)
            raise ValueError(f"the {self.name} backend cannot run this model: it lacks {named}")

    def stack_missing(self, features: frozenset[str]) -> list[str]:
        """What of `features` keeps a model off the whole-step stack (all of them where the
        backend has none)."""
        if not self.stack:
            return ["a whole-step stack"]
        return [f"{m} ({FEATURES[m]})" for m in sorted(features - self.stack)]


# What the CPU fast path's C++ decoder stack runs (kernels/csrc/decoder.cpp): everything a
# decoder needs (its attention reads and writes the paged KV cache).
CPU_STACK = ALL_FEATURES - {"bidirectional"}


def backend_for(
    fused_cpu: bool,
    attention: str,
    make_linear: LinearFactory,
    tables: TableKernels | None = None,
) -> Backend:
    """The backend of a compute plan (compute_plan.ComputePlan: fused_cpu, attention);
    `tables`: the fast path's embedding-table kernels, which a fused model needs to load."""
    if fused_cpu:
        return Backend(
            "CPU fast path", make_linear, True, attention, ALL_FEATURES, CPU_STACK, tables
        )
    return Backend(f"{attention} attention", make_linear, False, attention)


def torch_backend(make_linear: LinearFactory = dense_linear) -> Backend:
    """The reference: eager torch, dense linears (what a model built alone gets)."""
    return backend_for(False, "torch", make_linear)
