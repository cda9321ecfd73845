"""How a step's forward pass runs: one interface, chosen once at engine setup.

    LLMEngine.step():  schedule -> Executor.execute(step, block_tables) -> sample -> update
                                   |
         LocalExecutor             this process's model and KV cache (eager torch)
         TensorParallelExecutor    rank 0 here, ranks 1..k-1 spawned (distributed/tp_runner.py)

Every executor is built in two stages, because the KV cache is sized after the weights are
in memory (on GPU, from what a warm-up forward leaves free):

    executor = build_executor(...)             weights loaded; executor.model is rank 0's
    executor.allocate(num_blocks, block_size)  KV cache (and swap tiers) on every rank
    executor.execute(step, block_tables)       -> logits [N, vocab] float32, sampled rows,
                                                  pooled parts of embedding requests
    executor.shutdown()

The thread that will call `execute` calls `executor.claim_thread()` first (the engine's
thread, each time it starts).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from .compute_plan import ComputePlan
from .config import EngineConfig
from .kv_disk_tier import NO_KV_DISK, KVDiskPlan
from .kv_layout import KVLayout
from .model_loader import iter_weights
from .model_runner import ModelRunner, profile_kv_blocks
from .models.backend import backend_for
from .models.causal_lm import CausalLM
from .models.config import ModelConfig
from .models.layers import LinearFactory, TableKernels
from .models.registry import build_model
from .pooling import PooledParts
from .scheduler import SchedulerOutput
from .swap_space import NO_SWAP, SwapPlan


class Executor(Protocol):
    """Runs the model over one scheduled step."""

    model: nn.Module  # this process's model (a shard of it under tensor parallelism)
    runner: ModelRunner | None  # this process's runner, once allocated

    def profile_num_blocks(self, per_block: int, tokens: int, block_size: int) -> int:
        """KV blocks that fit in GPU memory after a warm-up forward of `tokens` (CUDA only)."""
        ...

    def allocate(
        self,
        num_blocks: int,
        block_size: int,
        swap: SwapPlan = NO_SWAP,
        kv_disk: KVDiskPlan = NO_KV_DISK,
        layout: KVLayout | None = None,
    ) -> None:
        """Make the KV cache (and the swap space's tiers) on every rank; its last
        kv_disk.blocks blocks in the KV disk tier (one process only); its tensors and
        block-table groups as `layout` says (default: the plain one)."""
        ...

    def execute(
        self, step: SchedulerOutput, block_tables: list[list[list[int]]]
    ) -> tuple[torch.Tensor, list[int], PooledParts]:
        """Run one step (block_tables[i][g]: group g's table of step.scheduled[i]): logits [N, vocab] float32 and the indexes (into step.scheduled)
        of the requests they belong to, in order: one row each, or 1 + k rows for a
        request verifying k draft tokens; and what the step adds to each embedding
        request's pooled vector."""
        ...

    def claim_thread(self) -> None:
        """Called by the thread that will run `execute`, before its first step."""
        ...

    def shutdown(self) -> None:
        """Release what outlives the object (processes, process groups). Idempotent."""
        ...


class LocalExecutor:
    """The whole model in this process, run eagerly by one ModelRunner."""

    def __init__(
        self, model: CausalLM, device: torch.device, config: EngineConfig, plan: ComputePlan
    ):
        self.model = model
        self.device = device
        self.config = config
        self.plan = plan
        self.runner: ModelRunner | None = None

    def profile_num_blocks(self, per_block: int, tokens: int, block_size: int) -> int:
        return profile_kv_blocks(
            self.model,
            self.device,
            tokens=tokens,
            block_size=block_size,
            backend=self.plan.attention_backend,
            per_block=per_block,
            gpu_memory_utilization=self.config.gpu_memory_utilization,
            num_logit_rows=min(tokens, self.config.max_num_seqs * self._rows_per_seq()),
        )

    def _rows_per_seq(self) -> int:
        """Logits rows a sequence can need in one step (1 + its draft tokens)."""
        spec = self.config.speculation
        return 1 + (spec.num_speculative_tokens if spec is not None else 0)

    def allocate(
        self,
        num_blocks: int,
        block_size: int,
        swap: SwapPlan = NO_SWAP,
        kv_disk: KVDiskPlan = NO_KV_DISK,
        layout: KVLayout | None = None,
    ) -> None:
        self.runner = ModelRunner(
            self.model,
            num_blocks,
            block_size,
            self.device,
            attention_backend=self.plan.attention_backend,
            swap=swap,
            kv_cache_dtype=self.plan.kv_cache_dtype,
            kv_disk=kv_disk,
            layout=layout,
        )

    def execute(
        self, step: SchedulerOutput, block_tables: list[list[list[int]]]
    ) -> tuple[torch.Tensor, list[int], PooledParts]:
        assert self.runner is not None, "allocate() the KV cache before the first step"
        return self.runner.execute(step, block_tables)

    def claim_thread(self) -> None:
        """On the CPU fast path, this thread's steps run on the kernels' own thread pool
        (kernels/csrc/thread_pool.cpp, `kernel_thread`): torch's own ops on it (indexing,
        the sampler) run on it alone, so that no OpenMP worker spins beside the pool after
        them. The pool uses `num_threads` threads, or torch's thread count as this thread
        finds it now. Elsewhere torch's threads do the work, and nothing changes."""
        if self.plan.fused_cpu:
            torch.ops.pagedllm.kernel_thread(self.config.num_threads or torch.get_num_threads())

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every distinct (key, value) tensor pair of the KV cache (per layer in the plain
        layout): what block copies go over."""
        return self.runner.kv_slots if self.runner is not None else []

    def shutdown(self) -> None:
        pass


def _tables(plan: ComputePlan) -> TableKernels | None:
    """The fast path's embedding-table kernels (a weight format: quant/packed_linear.py)."""
    if not plan.fused_cpu:
        return None
    from ..quant.packed_linear import packed_matmul, table_weight

    return TableKernels(to_kernel=table_weight, matmul=packed_matmul)


def build_executor(
    config: EngineConfig,
    folder: Path,
    hf_config: dict[str, Any],
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    make_linear: LinearFactory,
    plan: ComputePlan,
) -> LocalExecutor | Any:
    """Load the weights the way `config` asks: in this process, or split over k ranks."""
    if config.tensor_parallel_size > 1:
        from .distributed.tp_runner import TensorParallelExecutor

        return TensorParallelExecutor.launch(
            config, str(folder), hf_config, model_config, dtype, device, max_model_len,
            make_linear,
        )  # fmt: skip
    backend = backend_for(plan.fused_cpu, plan.attention_backend, make_linear, _tables(plan))
    model = build_model(model_config, dtype, device, max_model_len, backend)
    model.load_weights(iter_weights(folder))
    return LocalExecutor(model.eval(), device, config, plan)
