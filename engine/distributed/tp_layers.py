"""Megatron-style sharding of every model family: a TP-aware `LinearFactory` and rank configs.

Rank r of k holds:

    qkv_proj      column-parallel: its Hq/k query heads, Hkv/k KV heads   [hidden] -> [(Hq+2Hkv)/k * D]
    o_proj        row-parallel:    the input columns of its heads          [Hq/k * D] -> [hidden], all-reduce
    gate_up_proj  column-parallel: I/k of the intermediate features        [hidden] -> [2 I/k]
    down_proj     row-parallel:    the same I/k input features             [I/k] -> [hidden], all-reduce

so each decoder block does exactly two all-reduces (attention output, MLP output). Norms
(q/k norms too: they act within one head), rotary tables, the embedding and lm_head are
replicated. A mixture-of-experts layer splits every expert's intermediate features the
same way (the router is replicated, so every rank routes alike); its down_proj reduces
once per expert that received tokens this step, not once per layer. Query head h uses KV head
h // (Hq/Hkv); cutting both head lists into k contiguous slices keeps every query head on
the rank of its KV head.

Checkpoint tensors are sliced as they are loaded, one at a time, so no rank ever holds more
than its shard plus one full checkpoint tensor in flight.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..models.config import ModelConfig
from ..models.layers import LinearFactory, dense_linear

# Checkpoint suffix -> the dim that holds the output features (column-parallel slicing).
# Dense: weight [N, K]; AWQ: qweight [K, N/8], qzeros [K/G, N/8], scales [K/G, N].
_OUT_DIM = {"weight": 0, "bias": 0, "qweight": 1, "qzeros": 1, "scales": 1}
# ... and the dim that holds the input features (row-parallel slicing).
_IN_DIM = {"weight": 1, "qweight": 0, "qzeros": 0, "scales": 0}
_ROW_PARALLEL = ("o_proj", "down_proj")


def check_tensor_parallel(cfg: ModelConfig, world: int) -> None:
    """ValueError unless `cfg` can be split over `world` ranks by heads and features."""
    if world == 1:
        return
    problems = []
    if cfg.num_heads % world:
        problems.append(f"num_attention_heads {cfg.num_heads}")
    if cfg.num_kv_heads % world:
        problems.append(f"num_key_value_heads {cfg.num_kv_heads}")
    if cfg.intermediate_size % world:
        problems.append(f"intermediate_size {cfg.intermediate_size}")
    if cfg.num_experts and cfg.moe_intermediate_size % world:
        problems.append(f"moe_intermediate_size {cfg.moe_intermediate_size}")
    if problems:
        sizes: tuple[int, ...] = (cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size)
        sizes += (cfg.moe_intermediate_size,) if cfg.num_experts else ()
        usable = [k for k in range(2, cfg.num_kv_heads + 1) if not any(n % k for n in sizes)]
        raise ValueError(
            f"tensor_parallel_size {world} must divide {', '.join(problems)} of this model "
            f"(heads are split across ranks, KV heads are not replicated); sizes that work: "
            f"{usable or 'none above 1'}"
        )


def shard_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The config one rank builds its model from: 1/world of the heads and MLP features.

    The attention scale stays the full model's: it depends on head_dim (or Gemma's
    query_pre_attn_scalar), neither of which is split.
    """
    check_tensor_parallel(cfg, world)
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // world,
        num_kv_heads=cfg.num_kv_heads // world,
        intermediate_size=cfg.intermediate_size // world,
        moe_intermediate_size=cfg.moe_intermediate_size // world,
    )


def _dense(tensor: Any) -> torch.Tensor:
    """GGUF blocks are dequantized before slicing (ranks run the float path)."""
    from ..models.layers import as_dense

    return as_dense(tensor, torch.float32) if not isinstance(tensor, torch.Tensor) else tensor


def _slice(tensor: torch.Tensor, dim: int, rank: int, world: int, what: str) -> torch.Tensor:
    size = tensor.shape[dim]
    if size % world:
        raise ValueError(
            f"{what}: dim {dim} of size {size} cannot be split over {world} tensor-parallel ranks"
        )
    part = size // world
    return tensor.narrow(dim, rank * part, part)


class ColumnParallelLinear(nn.Module):
    """Holds 1/world of each stacked shard's output features; no communication."""

    def __init__(self, inner: nn.Module, rank: int, world: int):
        super().__init__()
        self.inner: Any  # the wrapped linear: it has `load` (models/layers.py, LoadableLinear)
        self.inner, self.rank, self.world = inner, rank, world

    def load(self, suffix: str, tensor: Any, shard: int) -> None:
        tensor = _dense(tensor)
        if suffix not in _OUT_DIM:
            raise ValueError(f"unexpected checkpoint tensor '{suffix}' for a linear layer")
        piece = _slice(tensor, _OUT_DIM[suffix], self.rank, self.world, f"{suffix} shard {shard}")
        self.inner.load(suffix, piece.contiguous(), shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class RowParallelLinear(nn.Module):
    """Holds 1/world of the input features; sums the partial outputs with one all-reduce.

    The bias is added once, by rank 0 (the other ranks keep their inner bias at zero).
    """

    def __init__(self, inner: nn.Module, rank: int, world: int, group: Any = None):
        super().__init__()
        self.inner: Any  # the wrapped linear: it has `load`
        self.inner, self.rank, self.world, self.group = inner, rank, world, group

    def load(self, suffix: str, tensor: Any, shard: int) -> None:
        tensor = _dense(tensor)
        if suffix == "bias":
            if self.rank == 0:
                self.inner.load(suffix, tensor, shard)
            return
        if suffix not in _IN_DIM:
            raise ValueError(f"unexpected checkpoint tensor '{suffix}' for a linear layer")
        piece = _slice(tensor, _IN_DIM[suffix], self.rank, self.world, f"{suffix} shard {shard}")
        self.inner.load(suffix, piece.contiguous(), shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)  # [T, hidden] partial sum over this rank's input features
        dist.all_reduce(out, group=self.group)
        return out


def tensor_parallel_factory(
    base: LinearFactory, rank: int, world: int, group: Any = None
) -> LinearFactory:
    """Wrap a LinearFactory (dense or AWQ) so that the layers it makes are this rank's shard.

    The model is built from `shard_config`, so the sizes the model asks for are already the
    per-rank ones; the wrapper only decides the parallel style from the checkpoint prefix and
    slices tensors at load time.
    """

    def make(
        in_features: int,
        output_sizes: list[int],
        bias: bool,
        prefixes: list[str],
        dtype: torch.dtype,
        device: torch.device,
    ) -> nn.Module:
        inner = base(in_features, output_sizes, bias, prefixes, dtype, device)
        if prefixes[0].rsplit(".", 1)[-1] in _ROW_PARALLEL:
            return RowParallelLinear(inner, rank, world, group)
        return ColumnParallelLinear(inner, rank, world)

    return make


def base_linear_factory(hf_config: dict[str, Any], folder: Path) -> LinearFactory:
    """The single-device factory for a checkpoint (what LLMEngine picks), for worker ranks."""
    method = (hf_config.get("quantization_config") or {}).get("quant_method")
    if method == "awq":
        from ...quant.awq_linear import awq_linear_factory

        return awq_linear_factory(
            hf_config["quantization_config"], folder, dense_linear=dense_linear
        )
    return dense_linear
