"""Encoders for embeddings: BERT (all-MiniLM, bge, e5, ...) and NomicBERT
(nomic-embed-text, Ollama's default embedding model). Bidirectional attention, post-norm
layers, no KV cache, no LM head; the forward pass gives the hidden states an embedding is
pooled from.

    BERT:  ids, positions -> word + position + token-type(0) embeddings -> LayerNorm
             -> N x [ x = LN(x + o(attention(qkv(x))));  x = LN(x + down(gelu(up(x)))) ]
    Nomic: ids -> word + token-type(0) embeddings -> LayerNorm
             -> N x [ x = LN(x + o(attention(rope(qkv(x)))));
                      x = LN(x + down(silu(gate(x)) * up(x))) ]
           (neox rotary, base 1000 in v1/v1.5; no biases; q, k, v one fused tensor)
      -> hidden [T, hidden]

The two differ only in what `EncoderLayout` names: where the tensors are in the
checkpoint, position table or rotary, gelu or gated feed-forward, biases.

Each sequence attends to all of its own tokens (no causal mask) and none of the others':
the scheduler runs an encoder's prompt whole in one step (engine/scheduler.py), so the
rows of sequence i in the flat batch are all of it (meta.cu_seqlens_q). The linears come
from the engine's LinearFactory (on the CPU fast path, quant/packed_linear.encoder_linear:
bf16 weights on AMX-BF16 tiles where the CPU has them, else the vdpbf16ps kernels, or int8
GGUF blocks); on the fast path attention, rotary, the activations and the residual
LayerNorms are C++ ops too (kernels/csrc/encoder.cpp; for BERT, with the linears, one call
a layer: encoder_layer.cpp), and the embeddings' sum torch, all in float32.
Off it (dtype="float32"), everything is torch: the reference the parity tests pin.

Checkpoints: Hugging Face `BertModel` names, with or without the `bert.` prefix of the
task heads' checkpoints (whose `cls.*` / `pooler.*` tensors are not used); nomic's
`NomicBertModel` names (`encoder.layers.N.attn.Wqkv`, `mlp.fc11` / `fc12` / `fc2`, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..attention_metadata import AttentionMetadata
from .backend import Backend, torch_backend
from .config import ModelConfig, common_fields
from .layers import LinearFactory, as_dense
from .rotary import RotaryEmbedding
from .split_work import SplitWork

BERT_ARCHITECTURES = ("BertModel", "BertForMaskedLM", "BertForPreTraining")
NOMIC_BERT_ARCHITECTURES = ("NomicBertModel",)
# In place: each runs on its own rows of the step's activations.
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], object]] = {
    "gelu": lambda x: torch.ops.aten.gelu_(x),
    "relu": lambda x: x.relu_(),
    "gelu_new": lambda x: torch.ops.aten.gelu_(x, approximate="tanh"),
}
# Checkpoint tensors the embedding model does not use.
_UNUSED = ("pooler.", "cls.", "embeddings.position_ids")


@dataclass(frozen=True, slots=True)
class EncoderLayout:
    """What a family of encoders computes, and where its tensors are in its checkpoint.
    Per-layer names follow `layer` ("encoder.layer.3" + "." + the name)."""

    layer: str  # the layers' prefix, {i} for the index
    qkv: tuple[str, ...]  # q, k, v shards (one name: stored fused)
    attn_out: str
    attn_norm: str
    ffn_in: tuple[str, ...]  # up; or gate, up for a gated (SwiGLU) feed-forward
    ffn_out: str
    out_norm: str
    embed_norm: str
    rotary: bool  # neox rotary on q and k (no position table)

    @property
    def gated(self) -> bool:
        return len(self.ffn_in) == 2


BERT_LAYOUT = EncoderLayout(
    layer="encoder.layer.{i}",
    qkv=("attention.self.query", "attention.self.key", "attention.self.value"),
    attn_out="attention.output.dense",
    attn_norm="attention.output.LayerNorm",
    ffn_in=("intermediate.dense",),
    ffn_out="output.dense",
    out_norm="output.LayerNorm",
    embed_norm="embeddings.LayerNorm",
    rotary=False,
)
# nomic-ai's modeling code (and llama.cpp's nomic-bert graph): fc12 is the gate, fc11 up.
NOMIC_BERT_LAYOUT = EncoderLayout(
    layer="encoder.layers.{i}",
    qkv=("attn.Wqkv",),
    attn_out="attn.out_proj",
    attn_norm="norm1",
    ffn_in=("mlp.fc12", "mlp.fc11"),
    ffn_out="mlp.fc2",
    out_norm="norm2",
    embed_norm="emb_ln",
    rotary=True,
)


def encoder_layout(architecture: str) -> EncoderLayout:
    return NOMIC_BERT_LAYOUT if architecture in NOMIC_BERT_ARCHITECTURES else BERT_LAYOUT


def parse_bert_config(cfg: dict[str, Any]) -> ModelConfig:
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(
            f"BERT with position_embedding_type {cfg['position_embedding_type']!r} is not "
            "supported (pagedllm runs absolute position embeddings)"
        )
    act = cfg.get("hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise ValueError(f"BERT activation {act!r} is not supported ({', '.join(_ACTIVATIONS)})")
    fields = common_fields(cfg, max_position_embeddings=512)
    fields.update(
        rms_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        hidden_act=act,
        causal=False,
        type_vocab_size=int(cfg.get("type_vocab_size", 2)),
        eos_token_ids=[],
    )
    return ModelConfig(**fields)


def parse_nomic_bert_config(cfg: dict[str, Any]) -> ModelConfig:
    """nomic-ai's NomicBertModel config.json (GPT-2 style names: n_embd, n_layer, ...).

    What it may say and pagedllm does not run is refused: pre-norm layers, a share of each
    head rotated, interleaved rotary, biases (v1 / v1.5 have none), the MoE variant
    (nomic-embed-text-v2-moe). The context is 2,048 tokens where the file says
    8,192 positions and 2,048 trained ones (nomic-embed-text v1 / v1.5, as llama.cpp's
    converter and Ollama run them; beyond that nomic's code scales rotary dynamically).
    """
    act = cfg.get("activation_function", "swiglu")
    checks = {
        "prenorm": (cfg.get("prenorm", False), False),
        "rotary_emb_fraction": (float(cfg.get("rotary_emb_fraction", 1.0)), 1.0),
        "rotary_emb_interleaved": (cfg.get("rotary_emb_interleaved", False), False),
        "activation_function": (act, "swiglu"),
        "moe_every_n_layers": (cfg.get("moe_every_n_layers") or 0, 0),
        "use_rms_norm": (cfg.get("use_rms_norm") or False, False),
        "rotary_head_dim": (cfg.get("rotary_head_dim") or False, False),
    }
    for name, (value, supported) in checks.items():
        if value != supported:
            raise ValueError(
                f"NomicBert with {name}={value!r} is not supported (pagedllm runs "
                f"{name}={supported!r}: nomic-embed-text v1 / v1.5)"
            )
    biases = {cfg.get(k, False) for k in ("qkv_proj_bias", "mlp_fc1_bias", "mlp_fc2_bias")}
    if biases != {False}:
        raise ValueError("NomicBert with bias tensors is not supported (v1 / v1.5 have none)")
    hidden = int(cfg["n_embd"])
    positions = int(cfg.get("n_positions", 2048))
    trained = int(cfg.get("max_trained_positions") or positions)
    fields = common_fields(
        {
            "vocab_size": cfg["vocab_size"],
            "hidden_size": hidden,
            "intermediate_size": cfg.get("n_inner") or 4 * hidden,
            "num_hidden_layers": cfg["n_layer"],
            "num_attention_heads": cfg["n_head"],
            "max_position_embeddings": min(positions, trained),
            "rope_theta": cfg.get("rotary_emb_base", 10000.0),
            "torch_dtype": cfg.get("torch_dtype"),
            "architectures": cfg.get("architectures"),
        }
    )
    fields.update(
        rms_norm_eps=float(cfg.get("layer_norm_epsilon", 1e-12)),
        hidden_act="silu",
        causal=False,
        type_vocab_size=int(cfg.get("type_vocab_size", 2)),
        eos_token_ids=[],
    )
    return ModelConfig(**fields)


class BertLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        prefix: str,
        make_linear: LinearFactory,
        dtype,
        device,
        fused_kernels: bool = False,
        layout: EncoderLayout = BERT_LAYOUT,
        rotary: RotaryEmbedding | None = None,
    ):
        """fused_kernels: attention, rotary, the activation and the residual norms run as
        C++ ops (kernels/csrc/encoder.cpp; the CPU fast path), else torch (the reference).
        rotary: the encoder's one table (layouts with `rotary`)."""
        super().__init__()
        hidden, self.heads = cfg.hidden_size, cfg.num_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.rotary = rotary
        self.intermediate = cfg.intermediate_size
        qkv_sizes = [3 * hidden] if len(layout.qkv) == 1 else [hidden] * 3
        self.qkv = make_linear(
            hidden,
            qkv_sizes,
            cfg.qkv_bias,
            [f"{prefix}.{name}" for name in layout.qkv],
            dtype,
            device,
        )
        self.attn_out = make_linear(
            hidden, [hidden], cfg.o_bias, [f"{prefix}.{layout.attn_out}"], dtype, device
        )
        self.up = make_linear(  # [gate | up] for a gated feed-forward
            hidden,
            [cfg.intermediate_size] * len(layout.ffn_in),
            cfg.mlp_bias,
            [f"{prefix}.{name}" for name in layout.ffn_in],
            dtype,
            device,
        )
        self.down = make_linear(
            cfg.intermediate_size,
            [hidden],
            cfg.mlp_bias,
            [f"{prefix}.{layout.ffn_out}"],
            dtype,
            device,
        )
        self.attn_norm = nn.LayerNorm(hidden, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.out_norm = nn.LayerNorm(hidden, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.gated = layout.gated
        if not self.gated:
            self.act = _ACTIVATIONS[cfg.hidden_act]
        self.hidden_act = cfg.hidden_act
        self.fused_kernels = fused_kernels
        self._layer_kernels: list | None = None  # whole_layer_kernels, once decided

    def whole_layer_kernels(self) -> list | None:
        """The C++ Linears of qkv, o, up, down when the layer runs as one C++ op
        (encoder_layer.cpp: the same operations as the fused path below, in one
        call): fused kernels, BERT's layer (exact gelu, no rotary), all four linears C++
        ones (quant/packed_linear.PackedStackedLinear). Decided at the first forward, once
        the weights are in."""
        if self._layer_kernels is None:
            linears = (self.qkv, self.attn_out, self.up, self.down)
            kernels = [getattr(m, "kernel_linear", lambda: None)() for m in linears]
            bert_layer = not self.gated and self.rotary is None and self.hidden_act == "gelu"
            complete = all(k is not None for k in kernels)
            self._layer_kernels = kernels if self.fused_kernels and bert_layer and complete else []
        return self._layer_kernels or None

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        bounds: list[int],
        cu_seqlens: torch.Tensor,
        split: SplitWork,
    ) -> torch.Tensor:
        """x [T, hidden]; positions [T] (within each sequence); sequence i is rows
        bounds[i]:bounds[i + 1] (cu_seqlens: the same, int64 [B + 1], for the C++ attention)."""
        kernels = self.whole_layer_kernels()
        if kernels is not None:
            return torch.ops.pagedllm.encoder_layer(
                x, cu_seqlens, *kernels,
                self.attn_norm.weight, self.attn_norm.bias, self.out_norm.weight,
                self.out_norm.bias, self.heads, self.scale, self.attn_norm.eps,
            )  # fmt: skip
        rows = x.shape[0]
        qkv = self.qkv(x).view(rows, 3, self.heads, self.head_dim)
        if self.rotary is not None:  # in place on the fast path; q, k [T, heads, head_dim]
            q, k = self.rotary(positions, qkv[:, 0], qkv[:, 1])
            if not self.fused_kernels:
                qkv = torch.stack((q, k, qkv[:, 2]), dim=1)
        if self.fused_kernels:  # the C++ op: one call for every sequence and head
            out = torch.ops.pagedllm.encoder_attention(qkv, cu_seqlens, self.scale)
        else:
            out = torch.empty(rows, self.heads, self.head_dim, dtype=x.dtype, device=x.device)

            def attend(group: list[tuple[int, int]]) -> None:
                for start, end in group:
                    # Two batched matmuls and a softmax over [heads, L, L] (L <= 512): on one
                    # thread 2x faster than torch's flash kernel at 256 tokens and 9x at 10.
                    q, k, v = qkv[start:end].permute(1, 2, 0, 3)  # each [heads, L, head_dim]
                    scores = torch.bmm(q * self.scale, k.transpose(1, 2)).softmax(dim=-1)
                    out[start:end] = torch.bmm(scores, v).transpose(0, 1)

            split.run(attend, split.sequences(bounds))
        x = self._add_norm(x, self.attn_out(out.view(rows, -1)), self.attn_norm, split)
        return self._add_norm(x, self.down(self._feed_forward_act(x, split)), self.out_norm, split)

    def _feed_forward_act(self, x: torch.Tensor, split: SplitWork) -> torch.Tensor:
        """act(up(x)), or silu(gate(x)) * up(x) for a gated layer: [T, intermediate]."""
        hidden = self.up(x)
        if self.gated:
            if self.fused_kernels:
                return torch.ops.pagedllm.gated_act(hidden, False)
            gate, up = hidden.split([self.intermediate, self.intermediate], dim=-1)
            return F.silu(gate) * up
        if self.fused_kernels and self.hidden_act == "gelu":
            torch.ops.pagedllm.gelu_erf_(hidden)
        else:
            split.run(lambda r: self.act(hidden[r[0] : r[1]]), split.rows(hidden.shape[0]))
        return hidden

    def _add_norm(
        self, x: torch.Tensor, y: torch.Tensor, norm: nn.LayerNorm, split: SplitWork
    ) -> torch.Tensor:
        """norm(x + y), rows split over the threads (y may be overwritten)."""
        if self.fused_kernels:
            return torch.ops.pagedllm.add_layer_norm(x, y, norm.weight, norm.bias, norm.eps)
        out = torch.empty_like(x)

        def piece(r: tuple[int, int]) -> None:
            a, b = r
            summed = y[a:b].to(x.dtype).add_(x[a:b])
            out[a:b] = F.layer_norm(summed, norm.normalized_shape, norm.weight, norm.bias, norm.eps)

        split.run(piece, split.rows(x.shape[0]))
        return out


class BertEncoder(nn.Module):
    """The encoder as the engine runs it: forward(ids, positions, kv_caches, meta) -> hidden.
    `kv_caches` is empty: an encoder keeps nothing between steps."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        backend: Backend | None = None,
    ):
        """backend: how the layers compute (backend.py): its linear factory, and whether
        the CPU fast path's kernel pool splits the work outside the linears."""
        super().__init__()
        backend = backend or torch_backend()
        make_linear = backend.make_linear
        self.backend = backend
        self.config = cfg
        self.dtype = dtype
        self.fused_cpu = backend.fused_kernels
        self._split: SplitWork | None = None  # made on the engine's thread, at the first step
        self._linears: dict[str, tuple[nn.Module, int]] = {}
        hidden = cfg.hidden_size

        def table(rows: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(rows, hidden, dtype=dtype, device=device))

        self.layout = layout = encoder_layout(cfg.architecture)
        self.word_embeddings = table(cfg.vocab_size)
        # Absolute positions: a table; rotary: one cos/sin table every layer reads.
        self.position_embeddings = None if layout.rotary else table(cfg.max_position_embeddings)
        self.rotary = (
            RotaryEmbedding(
                cfg.head_dim,
                cfg.max_position_embeddings,
                cfg.rope_theta,
                None,
                dtype,
                device,
                fused=self.fused_cpu,
            )
            if layout.rotary
            else None
        )
        self.token_type_embeddings = table(max(cfg.type_vocab_size, 1))
        self.embed_norm = nn.LayerNorm(hidden, cfg.rms_norm_eps, dtype=dtype, device=device)

        def recording_factory(
            in_features, output_sizes, bias, prefixes, dtype, device
        ) -> nn.Module:
            # (LinearFactory's parameter names, so that it is one to the type checker)
            module = make_linear(in_features, output_sizes, bias, prefixes, dtype, device)
            for shard, prefix in enumerate(prefixes):
                self._linears[prefix] = (module, shard)
            return module

        self.layers = nn.ModuleList(
            BertLayer(
                cfg,
                layout.layer.format(i=i),
                recording_factory,
                dtype,
                device,
                self.fused_cpu,
                layout,
                self.rotary,
            )
            for i in range(cfg.num_layers)
        )
        for param in self.parameters():
            param.requires_grad_(False)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = F.embedding(input_ids, self.word_embeddings)
        if self.position_embeddings is not None:
            x = x + F.embedding(positions, self.position_embeddings)
        x = self.embed_norm(x + self.token_type_embeddings[0])
        cu_seqlens = meta.cu_seqlens_q.to(torch.int64).contiguous()
        bounds = cu_seqlens.tolist()
        split = self._split_work()
        for layer in self.layers:
            x = layer(x, positions, bounds, cu_seqlens, split)
        return x

    def _split_work(self) -> SplitWork:
        """On the fast path, the kernel pool's thread count (the engine's thread runs
        torch on one); elsewhere torch's own threads do it, and there is nothing to split."""
        if self._split is None:
            threads = int(torch.ops.pagedllm.pool_threads()) if self.fused_cpu else 1
            self._split = SplitWork(threads)
        return self._split

    # ------------------------------------------------------------------ weights
    def _plain(self) -> dict[str, nn.Parameter]:
        """Checkpoint name -> parameter for everything outside the linears."""
        layout = self.layout
        plain = {
            "embeddings.word_embeddings.weight": self.word_embeddings,
            "embeddings.token_type_embeddings.weight": self.token_type_embeddings,
            f"{layout.embed_norm}.weight": self.embed_norm.weight,
            f"{layout.embed_norm}.bias": self.embed_norm.bias,
        }
        if self.position_embeddings is not None:
            plain["embeddings.position_embeddings.weight"] = self.position_embeddings
        for i, layer in enumerate(self.layers):
            prefix = layout.layer.format(i=i)
            norms: list[tuple[Any, str]] = [
                (layer.attn_norm, layout.attn_norm),
                (layer.out_norm, layout.out_norm),
            ]  # nn.LayerNorms (torch types module attributes loosely)
            for norm, name in norms:
                plain[f"{prefix}.{name}.weight"] = norm.weight
                plain[f"{prefix}.{name}.bias"] = norm.bias
        return plain

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        plain = self._plain()
        expected = set(plain) | set(self._linears)
        loaded: set[str] = set()
        for raw, tensor in weights:
            name = raw.removeprefix("bert.")
            # Old checkpoints name LayerNorm parameters gamma / beta.
            name = name.replace("LayerNorm.gamma", "LayerNorm.weight")
            name = name.replace("LayerNorm.beta", "LayerNorm.bias")
            if name.startswith(_UNUSED):
                continue
            if name in plain:
                param = plain[name]
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"{raw}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}"
                    )
                param.data.copy_(as_dense(tensor, param.dtype))
                loaded.add(name)
                continue
            prefix, _, suffix = name.rpartition(".")
            if prefix not in self._linears:
                raise ValueError(f"unexpected tensor {raw!r} in the checkpoint")
            module, shard = self._linears[prefix]
            module.load(suffix, tensor, shard)  # type: ignore[operator]
            loaded.add(prefix)
        missing = sorted(expected - loaded)
        if missing:
            shown = ", ".join(missing[:6]) + (" ..." if len(missing) > 6 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")
