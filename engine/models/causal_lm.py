"""The decoder-only language model every family is: embedding -> decoder layers -> final
norm -> lm_head, over the paged KV cache; and how checkpoint tensors find their places.

A family file subclasses `CausalLM`, says how to build one decoder layer (`make_layer`),
and, where its checkpoints differ from the Hugging Face Llama layout, how names map
(`checkpoint_name`) and which checkpoint linears are fused (`fused_linears`).

Loading. Every linear is made through `self.make_linear`, which records each of its
checkpoint prefixes (model.layers.3.self_attn.k_proj -> (the stacked qkv module, shard 1)).
A checkpoint tensor `<prefix>.<suffix>` (weight, bias, AWQ qweight/qzeros/scales) goes to
that module's `load(suffix, tensor, shard)`, so dense, AWQ, tensor-parallel and other
linear kinds load the same way. Every other tensor (norms, embeddings, routers) is the
parameter of the same path in this module tree, `model.` dropped. What a checkpoint lacks,
or holds beyond this, is a ValueError naming it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from .attention import Attention
from .backend import Backend, model_features, torch_backend
from .config import SLIDING, ModelConfig
from .layers import (
    GatedMLP,
    LMHead,
    RMSNorm,
    VocabEmbedding,
    as_dense,
    split_fused,
)
from .rotary import RotaryEmbedding


class DecoderLayer(nn.Module):
    """Pre-norm residual block (Llama, Qwen, Phi): x + attn(norm(x)), then x + mlp(norm(x)).

    Layers pass (sub-layer output, residual stream) along instead of their sum, so that the
    add and the next norm are one step (one fused kernel on the CPU fast path).
    """

    def __init__(
        self, attn: Attention, mlp: nn.Module, cfg: ModelConfig, dtype, device, fused: bool
    ):
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        size, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps, dtype, device, fused=fused)
        self.post_attention_layernorm = RMSNorm(size, eps, dtype, device, fused=fused)

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


class CausalLM(nn.Module):
    # checkpoint linear name -> the names of the stacked shards it holds, e.g. Phi-3's
    # "qkv_proj" -> (q_proj, k_proj, v_proj); its tensors are split along the outputs.
    fused_linears: dict[str, tuple[str, ...]] = {}
    # What the family needs beyond what its config says (backend.FEATURES).
    family_features: frozenset[str] = frozenset()

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        backend: Backend | None = None,
        embed_scale: float | None = None,
    ):
        """backend: how the layers compute (backend.py), the torch reference by default: its
        linear factory, and whether norms, rotary, activation and the embedding / head run
        as the C++ kernels of the CPU fast path. It refuses a model needing a feature it
        lacks (a ValueError naming it)."""
        super().__init__()
        backend = backend or torch_backend()
        self.features = model_features(cfg, self.family_features)
        backend.check(self.features)
        self.backend = backend
        fused_cpu = self.fused_cpu = backend.fused_kernels
        self.config = cfg
        self.dtype = dtype
        self._factory = backend.make_linear
        self._linears: dict[str, tuple[nn.Module, int]] = {}
        self.embed_tokens = VocabEmbedding(
            cfg.vocab_size, cfg.hidden_size, dtype, device, fused_cpu, backend.tables
        )
        # Gemma multiplies embeddings by sqrt(hidden), rounded to the model dtype first.
        self.embed_scale = (
            None if embed_scale is None else torch.tensor(embed_scale, dtype=dtype, device=device)
        )
        self.rotary, self.local_rotary = self._make_rotaries(cfg, max_model_len, dtype, device)
        self.layers = nn.ModuleList(
            self.make_layer(cfg, i, self._rotary_of(i), dtype, device)
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, dtype, device, cfg.rms_norm_unit_offset, fused_cpu
        )
        self.lm_head = LMHead(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype,
            device,
            fused_cpu,
            tied_to=self.embed_tokens if cfg.tie_word_embeddings else None,
            tables=backend.tables,
        )
        for param in self.parameters():
            param.requires_grad_(False)
        # The decoder layers as one C++ call (fused_stack.py), built at the first forward
        # pass (once the weights are in): None = not yet, False = this model's layers differ.
        self._stack: Any = None

    # ------------------------------------------------------------ what families fill in
    def make_layer(
        self,
        cfg: ModelConfig,
        index: int,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        device: torch.device,
    ) -> nn.Module:
        """The default: a pre-norm block of attention and a gated MLP."""
        prefix = f"model.layers.{index}"
        fused = self.fused_cpu
        attn = Attention(
            cfg, index, f"{prefix}.self_attn", self.make_linear, rotary, dtype, device, fused
        )
        mlp = GatedMLP(
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.mlp_bias,
            cfg.hidden_act,
            f"{prefix}.mlp",
            self.make_linear,
            dtype,
            device,
            fused,
        )
        return DecoderLayer(attn, mlp, cfg, dtype, device, fused)

    def checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor's name in the Llama layout, or None to skip it."""
        return None if "rotary_emb" in name else name

    def make_linear(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool,
        prefixes: list[str],
        dtype: torch.dtype,
        device: torch.device,
    ) -> nn.Module:
        """The LinearFactory given to the layers: the model's factory, and a note of where
        each checkpoint prefix loads."""
        module = self._factory(in_features, output_sizes, bias, prefixes, dtype, device)
        for shard, prefix in enumerate(prefixes):
            self._linears[prefix] = (module, shard)
        return module

    # --------------------------------------------------------------------- forward
    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale.to(x.dtype)
        stack = self.fused_stack() if meta.backend == "cpu" else None
        if stack is not None:
            x, residual = stack(x, positions, kv_caches, meta)
        else:
            residual = None
            for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
                x, residual = layer(positions, x, kv_cache, meta.for_layer(index), residual)
        return self.norm(x, residual)[0]

    use_fused_stack = True  # False: run the layers module by module (the reference)

    def fused_stack(self) -> Any:
        """The decoder layers as one C++ call, or None where the backend has no stack, the
        model needs a feature the stack lacks (its capability table), or the layers hold
        something else it does not run (`stack_status` says what)."""
        if not (self.backend.stack and self.use_fused_stack):
            return None
        if self._stack is None:
            missing = self.backend.stack_missing(self.features)
            if missing:
                self._stack, self._stack_missing = False, ", ".join(missing)
            else:
                from .fused_stack import build_fused_stack

                stack, self._stack_missing = build_fused_stack(self)
                self._stack = stack or False
        return self._stack or None

    _stack_missing = ""

    def stack_status(self) -> str:
        """How the decoder layers run, for the engine's load line (call once loaded)."""
        if not self.fused_cpu:
            return "decoder layers as modules"
        if self.fused_stack() is not None:
            return "decoder layers as one C++ stack"
        if not self.use_fused_stack:
            return "decoder layers as modules (asked for)"
        return f"decoder layers as modules: the C++ stack does not run {self._stack_missing}"

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in float32 (soft-capped where the family does)."""
        logits = self.lm_head(hidden)  # float32
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    # --------------------------------------------------------------------- weights
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into the model; complain about gaps."""
        params = self._plain_parameters()
        expected = set(self._linears) | set(params) | {"model.embed_tokens.weight"}
        if not self.config.tie_word_embeddings:
            expected.add("lm_head")
        loaded: set[str] = set()
        for raw_name, tensor in weights:
            name = self.checkpoint_name(raw_name)
            if name is not None:
                loaded |= self._load_one(name, tensor, params, raw_name)
        missing = sorted(expected - loaded)
        if missing:
            shown = ", ".join(missing[:6]) + (" ..." if len(missing) > 6 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")

    def _plain_parameters(self) -> dict[str, nn.Parameter]:
        """Checkpoint name (without suffix handling) -> parameter, for everything that is not
        inside a linear made by make_linear: embeddings, norms, routers."""
        linear_params = {id(p) for module, _ in self._linears.values() for p in module.parameters()}
        linear_params |= {id(b) for module, _ in self._linears.values() for b in module.buffers()}
        plain = {}
        for path, param in self.named_parameters(remove_duplicate=False):
            if id(param) in linear_params or path.startswith(("embed_tokens.", "lm_head.")):
                continue  # the embedding and head load through their own `load`
            plain[f"model.{path}"] = param
        return plain

    def _load_one(
        self, name: str, tensor: Any, params: dict[str, nn.Parameter], raw: str
    ) -> set[str]:
        if name == "model.embed_tokens.weight":
            self.embed_tokens.load(tensor)
            return {name}
        if name == "lm_head.weight":
            if not self.config.tie_word_embeddings:
                self.lm_head.load(tensor)
            return {"lm_head"}
        if name in params:
            _copy(params[name], tensor, name)
            return {name}
        prefix, _, suffix = name.rpartition(".")
        if prefix in self._linears:
            module, shard = self._linears[prefix]
            module.load(suffix, tensor, shard)  # type: ignore[operator]
            return {prefix}
        parent, _, leaf = prefix.rpartition(".")
        if leaf in self.fused_linears:
            parts = [f"{parent}.{part}" for part in self.fused_linears[leaf]]
            if all(part in self._linears for part in parts):
                sizes = [_shard_size(self._linears[part]) for part in parts]
                for part, piece in zip(parts, split_fused(suffix, tensor, sizes)):
                    module, shard = self._linears[part]
                    if isinstance(piece, torch.Tensor):
                        piece = piece.contiguous()
                    module.load(suffix, piece, shard)  # type: ignore[operator]
                return set(parts)
        raise ValueError(f"unexpected tensor {raw!r} in the checkpoint")

    # --------------------------------------------------------------------- rotary
    def _make_rotaries(
        self, cfg: ModelConfig, max_model_len: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[RotaryEmbedding, RotaryEmbedding | None]:
        rotary_dim = int(cfg.head_dim * cfg.partial_rotary_factor)
        positions = max(max_model_len, 1)
        fused = self.fused_cpu
        rotary = RotaryEmbedding(
            cfg.head_dim, positions, cfg.rope_theta, cfg.rope_scaling, dtype, device, rotary_dim,
            fused,
        )  # fmt: skip
        local = None
        if cfg.local_rope_theta is not None:
            local = RotaryEmbedding(
                cfg.head_dim,
                positions,
                cfg.local_rope_theta,
                cfg.local_rope_scaling,
                dtype,
                device,
                rotary_dim,
                fused,
            )
        return rotary, local

    def _rotary_of(self, layer: int) -> RotaryEmbedding:
        types = self.config.layer_types
        if self.local_rotary is not None and types is not None and types[layer] == SLIDING:
            return self.local_rotary
        return self.rotary


def _shard_size(entry: tuple[nn.Module, int]) -> int:
    module, shard = entry
    sizes: Any = getattr(module, "output_sizes", None)
    if sizes is None:  # a wrapper (tensor parallel) around the real linear
        sizes = module.inner.output_sizes  # type: ignore[union-attr]
    return int(sizes[shard])


def _copy(dst: torch.Tensor, src: Any, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != model {tuple(dst.shape)}")
    dst.data.copy_(as_dense(src, dst.dtype))
