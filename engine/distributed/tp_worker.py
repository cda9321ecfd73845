"""One tensor-parallel rank: its model shard, its share of the KV cache, and the step loop.

Ranks 1..k-1 run `worker_main` in spawned processes; rank 0 is the driver (`TensorParallelExecutor`).
Every step the driver broadcasts a small header (`broadcast_object_list`) and one packed
int64 tensor of the flat batch (`broadcast`); each rank runs the same forward on its heads,
and the row-parallel layers' all-reduces keep the hidden states identical on every rank.

Packed step tensor (int64, on the rank's device), T tokens, B sequences, M blocks per table:

    [ input_ids T | positions T | slot_mapping T | cu_seqlens_q B+1 | seq_lens B | block_tables B*M ]
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..attention_metadata import AttentionMetadata
from ..model_loader import iter_weights
from ..models.backend import Backend
from ..models.causal_lm import CausalLM
from ..models.config import ModelConfig
from ..models.registry import build_model
from .tp_layers import base_linear_factory, shard_config, tensor_parallel_factory

logger = logging.getLogger(__name__)

# How long a collective may wait for a peer. A dead peer is normally noticed at once (its
# sockets close, or the driver's monitor kills the group); this bounds the rest.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


@dataclass(slots=True)
class RankSpec:
    """Everything a rank needs to build its shard (picklable: it crosses the spawn)."""

    rank: int
    world: int
    backend: str  # gloo | nccl
    store_host: str
    store_port: int
    folder: str
    hf_config: dict[str, Any]
    model_config: ModelConfig  # the full model's
    dtype: torch.dtype
    device: str
    max_model_len: int
    parent_pid: int
    num_threads: int | None = None


def rank_device(base: torch.device, rank: int) -> torch.device:
    """cuda:(i + rank) for a driver on cuda:i; the CPU for every rank of a CPU driver."""
    if base.type != "cuda":
        return torch.device("cpu")
    return torch.device("cuda", (base.index or 0) + rank)


def build_shard(spec: RankSpec, device: torch.device, base_factory=None) -> CausalLM:
    """This rank's model: 1/world of the heads and MLP features, weights loaded."""
    factory = base_factory or base_linear_factory(spec.hf_config, Path(spec.folder))
    model = build_model(
        shard_config(spec.model_config, spec.world),
        spec.dtype,
        device,
        spec.max_model_len,
        Backend(
            "tensor-parallel",
            tensor_parallel_factory(factory, spec.rank, spec.world),
            fused_kernels=False,
            attention="per step",
        ),
    )
    model.load_weights(iter_weights(Path(spec.folder)))
    return model.eval()


# --------------------------------------------------------------- step packing
def pack_step(
    input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
) -> tuple[dict[str, int], torch.Tensor]:
    """The header fields and the packed int64 tensor of one flat batch (see module doc)."""
    num_seqs, max_blocks = meta.block_tables.shape
    fields = {
        "num_tokens": int(input_ids.shape[0]),
        "num_seqs": int(num_seqs),
        "max_blocks": int(max_blocks),
        "max_seqlen_q": int(meta.max_seqlen_q),
        "max_seqlen_k": int(meta.max_seqlen_k),
    }
    packed = torch.cat(
        [
            input_ids.long(),
            positions.long(),
            meta.slot_mapping.long(),
            meta.cu_seqlens_q.long(),
            meta.seq_lens.long(),
            meta.block_tables.long().reshape(-1),
        ]
    )
    return fields, packed


def packed_numel(header: dict[str, Any]) -> int:
    t, b = header["num_tokens"], header["num_seqs"]
    return 3 * t + (b + 1) + b + b * header["max_blocks"]


def unpack_step(
    packed: torch.Tensor, header: dict[str, Any], backend: str
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    t, b, m = header["num_tokens"], header["num_seqs"], header["max_blocks"]
    parts = packed.split([t, t, t, b + 1, b, b * m])
    meta = AttentionMetadata(
        slot_mapping=parts[2],
        cu_seqlens_q=parts[3].int(),
        seq_lens=parts[4].int(),
        block_tables=parts[5].int().reshape(b, m),
        max_seqlen_q=header["max_seqlen_q"],
        max_seqlen_k=header["max_seqlen_k"],
        backend=backend,
    )
    return parts[0], parts[1], meta


# ------------------------------------------------------------------ profiling
def min_over_ranks(value: int, device: torch.device) -> int:
    cell = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(cell, op=dist.ReduceOp.MIN)
    return int(cell.item())


# ------------------------------------------------------------------- the rank
def _exit_with_parent(parent_pid: int) -> None:
    """A rank must not outlive its driver (killed with SIGKILL, it runs no cleanup)."""

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(3)
            time.sleep(0.5)

    threading.Thread(target=watch, name="pagedllm-tp-parent-watch", daemon=True).start()


def worker_main(spec: RankSpec) -> None:
    """Entry point of ranks 1..k-1 (a torch.multiprocessing spawn target)."""
    _exit_with_parent(spec.parent_pid)
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    store = dist.TCPStore(
        spec.store_host, spec.store_port, spec.world, is_master=False, timeout=COLLECTIVE_TIMEOUT
    )
    store.set(f"alive/{spec.rank}", "1")
    device = rank_device(torch.device(spec.device), spec.rank)
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            spec.backend,
            store=store,
            rank=spec.rank,
            world_size=spec.world,
            timeout=COLLECTIVE_TIMEOUT,
        )
        model = build_shard(spec, device)
    except BaseException:
        store.set(f"error/{spec.rank}", traceback.format_exc())
        raise SystemExit(1) from None
    store.set(f"loaded/{spec.rank}", "1")
    try:
        _serve(model, spec, device)
    except Exception:
        # A peer died or a step failed: the group is unusable. Exit non-zero; the driver's
        # monitor sees it and fails the engine's requests.
        logger.exception("tensor-parallel rank %d stops", spec.rank)
        os._exit(1)
    dist.destroy_process_group()


@torch.inference_mode()
def _serve(model: CausalLM, spec: RankSpec, device: torch.device) -> None:
    from ..model_runner import ModelRunner, profile_kv_blocks

    runner: ModelRunner | None = None
    object_device = device if spec.backend == "nccl" else None
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, device=object_device)
        header = box[0]
        op = header["op"]
        if op == "execute":
            assert runner is not None, "execute before allocate"
            packed = torch.empty(packed_numel(header), dtype=torch.int64, device=device)
            dist.broadcast(packed, src=0)
            runner.swap(
                header.get("swap_out", []), header.get("swap_in", []), header.get("swap_ahead", [])
            )
            input_ids, positions, meta = unpack_step(packed, header, header["backend"])
            runner.forward(input_ids, positions, meta, logits_indices=None)
        elif op == "allocate":
            runner = ModelRunner(
                model,
                header["num_blocks"],
                header["block_size"],
                device,
                attention_backend=header["backend"],
                swap=header["swap"],
            )
        elif op == "profile":
            blocks = profile_kv_blocks(model, device, **header["args"])
            min_over_ranks(blocks, device)
        elif op == "shutdown":
            return
        else:
            raise RuntimeError(f"unknown tensor-parallel op {op!r}")
