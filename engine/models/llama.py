"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2) over the paged KV cache.

The model sees one flat batch per step: `input_ids [T]`, `positions [T]` and an
`AttentionMetadata`; it reads and writes keys and values only through slot mappings and
block tables.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...kernels import ops
from ..attention_metadata import AttentionMetadata
from ..gguf_loader import as_dense
from .layers import (
    LinearFactory,
    LMHead,
    RMSNorm,
    RotaryEmbedding,
    VocabEmbedding,
    dense_linear,
    enable_fused_cpu_kernels,
    silu_and_mul,
)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(slots=True)
class LlamaConfig:
    """The fields of a Hugging Face config.json that the forward pass needs."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    torch_dtype: str | None = None

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> LlamaConfig:
        architectures = cfg.get("architectures") or []
        arch = architectures[0] if architectures else cfg.get("model_type", "?")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; pagedllm runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        # transformers 5 keeps theta and scaling in `rope_parameters`; 4.x in two fields.
        rope = dict(cfg.get("rope_parameters") or {})
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or (
            rope if rope.get("rope_type", "default") != "default" else None
        )
        is_qwen2 = arch == "Qwen2ForCausalLM"
        attention_bias = bool(cfg.get("attention_bias", False))
        sliding = cfg.get("sliding_window")
        if is_qwen2 and not cfg.get("use_sliding_window", False):
            sliding = None
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_window=int(sliding) if sliding else None,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        )


class LlamaAttention(nn.Module):
    def __init__(
        self,
        cfg: LlamaConfig,
        prefix: str,
        make_linear: LinearFactory,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.sliding_window = cfg.sliding_window
        self.qkv_proj = make_linear(
            cfg.hidden_size,
            [self.q_size, self.kv_size, self.kv_size],
            cfg.qkv_bias,
            [f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"],
            dtype,
            device,
        )
        self.o_proj = make_linear(
            self.q_size, [cfg.hidden_size], cfg.o_bias, [f"{prefix}.o_proj"], dtype, device
        )
        self.rotary = rotary

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        x: torch.Tensor,  # [T, hidden]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # 2 x [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        k_cache, v_cache = kv_cache
        ops.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping, backend=meta.backend)
        out = torch.empty_like(q)
        ops.paged_attention(
            q,
            k_cache,
            v_cache,
            out,
            meta.cu_seqlens_q,
            meta.seq_lens,
            meta.block_tables,
            self.scale,
            sliding_window=self.sliding_window,
            max_seqlen_q=meta.max_seqlen_q,
            max_seqlen_k=meta.max_seqlen_k,
            backend=meta.backend,
            k_new=k,
            v_new=v,
        )
        return self.o_proj(out.view(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(
        self,
        cfg: LlamaConfig,
        prefix: str,
        make_linear: LinearFactory,
        dtype: torch.dtype,
        device: torch.device,
        fused: bool = False,
    ):
        super().__init__()
        self.fused = fused
        self.gate_up_proj = make_linear(
            cfg.hidden_size,
            [cfg.intermediate_size, cfg.intermediate_size],
            cfg.mlp_bias,
            [f"{prefix}.gate_proj", f"{prefix}.up_proj"],
            dtype,
            device,
        )
        self.down_proj = make_linear(
            cfg.intermediate_size,
            [cfg.hidden_size],
            cfg.mlp_bias,
            [f"{prefix}.down_proj"],
            dtype,
            device,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), self.fused))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, index, make_linear, rotary, dtype, device, fused=False):
        super().__init__()
        prefix = f"model.layers.{index}"
        self.self_attn = LlamaAttention(
            cfg, f"{prefix}.self_attn", make_linear, rotary, dtype, device
        )
        self.mlp = LlamaMLP(cfg, f"{prefix}.mlp", make_linear, dtype, device, fused)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        x: torch.Tensor,  # [T, hidden]: the previous layer's MLP output (or the embedding)
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        residual: torch.Tensor | None,  # [T, hidden]: the residual stream before x is added
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream it is to be added to)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(positions, h, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


# checkpoint name -> (module path, shard index); the suffix (weight, bias, qweight, ...) follows.
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(\w+)$")


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        cfg: LlamaConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        make_linear: LinearFactory = dense_linear,
        fused_cpu: bool = False,
    ):
        """fused_cpu: the CPU fast path (C++ kernels for norms, rotary, activation and the
        embedding / head; linears come from `make_linear`, e.g. quant.packed_linear)."""
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.embed_tokens = VocabEmbedding(
            cfg.vocab_size, cfg.hidden_size, dtype, device, fused_cpu
        )
        self.rotary = RotaryEmbedding(
            cfg.head_dim,
            max(max_model_len, 1),
            cfg.rope_theta,
            cfg.rope_scaling,
            dtype,
            device,
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, make_linear, self.rotary, dtype, device, fused_cpu)
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = LMHead(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype,
            device,
            fused_cpu,
            tied_to=self.embed_tokens if cfg.tie_word_embeddings else None,
        )
        if fused_cpu:
            enable_fused_cpu_kernels(self)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        x = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(positions, x, kv_cache, meta, residual)
        return self.norm(x, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in float32."""
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into the model; complain about gaps."""
        expected = self._expected_names()
        loaded: set[str] = set()
        for name, tensor in weights:
            target = self._load_one(name, tensor)
            if target is not None:
                loaded.add(target)
        missing = sorted(expected - loaded)
        if missing:
            shown = ", ".join(missing[:6]) + (" ..." if len(missing) > 6 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")

    def _expected_names(self) -> set[str]:
        names = {"embed_tokens", "norm"}
        if not self.config.tie_word_embeddings:
            names.add("lm_head")
        for i in range(self.config.num_layers):
            names |= {f"{i}.input_layernorm", f"{i}.post_attention_layernorm"}
            names |= {f"{i}.{key}" for key in _STACKED}
        return names

    def _load_one(self, name: str, tensor: torch.Tensor) -> str | None:
        if name.startswith("model.embed_tokens."):
            self.embed_tokens.load(tensor)
            return "embed_tokens"
        if name == "model.norm.weight":
            self.norm.weight.data.copy_(as_dense(tensor, self.dtype))
            return "norm"
        if name == "lm_head.weight":
            if not self.config.tie_word_embeddings:
                self.lm_head.load(tensor)
            return "lm_head"
        if "rotary_emb" in name:
            return None
        layer_norm = re.match(
            r"^model\.layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.weight$", name
        )
        if layer_norm:
            i, which = int(layer_norm.group(1)), layer_norm.group(2)
            getattr(self.layers[i], which).weight.data.copy_(as_dense(tensor, self.dtype))
            return f"{i}.{which}"
        match = _LAYER_NAME.match(name)
        if match and match.group(3) in _STACKED:
            i, block, proj, suffix = (
                int(match.group(1)),
                match.group(2),
                match.group(3),
                match.group(4),
            )
            module_name, shard = _STACKED[proj]
            module = getattr(getattr(self.layers[i], block), module_name)
            module.load(suffix, tensor, shard)
            return f"{i}.{proj}"
        raise ValueError(f"unexpected tensor {name!r} in the checkpoint")
