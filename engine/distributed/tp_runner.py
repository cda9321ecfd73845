"""The driver side of tensor parallelism: rank 0 in the engine's process, ranks 1..k-1 spawned.

    LLMEngine (scheduler, KV cache manager, sampler)        driver process = rank 0
      TensorParallelExecutor.execute(out, block_tables)
        ModelRunner.prepare() -> flat batch
        broadcast_object_list(header) + broadcast(packed)  ---> ranks 1..k-1 (tp_worker._serve)
        forward on rank 0's shard   <-- all-reduce per attention and per MLP output -->
        lm_head on rank 0 only -> logits [N, vocab]

Lifecycle: `launch` starts the ranks and waits until every one has loaded its shard,
`allocate` makes every rank's KV cache ([num_blocks, block_size, Hkv/k, D] per layer),
`shutdown` stops them. A monitor thread watches the rank processes: if one dies, the others
are killed, and every later `execute` raises, so the engine fails its requests cleanly
instead of hanging on a collective with a dead peer.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.connection
import multiprocessing.process
import os
import socket
import threading
import time
import weakref
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..config import EngineConfig
from ..kv_disk_tier import NO_KV_DISK, KVDiskPlan
from ..kv_layout import KVLayout
from ..model_runner import ModelRunner, profile_kv_blocks
from ..models.causal_lm import CausalLM
from ..models.config import ModelConfig
from ..models.layers import LinearFactory
from ..scheduler import SchedulerOutput
from ..swap_space import NO_SWAP, SwapPlan
from .tp_layers import check_tensor_parallel
from .tp_worker import (
    COLLECTIVE_TIMEOUT,
    RankSpec,
    build_shard,
    min_over_ranks,
    pack_step,
    rank_device,
    worker_main,
)

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT = 600.0  # seconds for every rank to start and load its shard
_last_launched: weakref.ref | None = None
_live: weakref.WeakSet[TensorParallelExecutor] = weakref.WeakSet()


@atexit.register
def _quiet_at_exit() -> None:
    """At interpreter exit multiprocessing terminates the daemonic ranks (SIGTERM, exit
    code -15) after this runs (atexit is last in, first out): that is an ending, not a rank
    dying, so the monitors must not report it."""
    for executor in list(_live):
        executor._closing = True


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorParallelExecutor:
    """The engine's executor under tensor parallelism (see engine/executor.py): rank 0's
    shard and KV cache in a ModelRunner here; `execute` drives every rank each step."""

    def __init__(self) -> None:  # use TensorParallelExecutor.launch
        self.model: CausalLM
        self.device: torch.device  # set by launch, as are the model and the store
        self._store: dist.TCPStore
        self.world = 1
        self.dist_backend = "gloo"
        self.attention_backend = "auto"
        self.gpu_memory_utilization = 0.9
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self.runner: ModelRunner | None = None  # rank 0's KV cache, after allocate()
        self._dead: str | None = None
        self._closing = False
        self._group_up = False
        self._allocated = False
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- startup
    @classmethod
    def launch(
        cls,
        config: EngineConfig,
        folder: str,
        hf_config: dict,
        model_config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        base_factory: LinearFactory,
    ) -> TensorParallelExecutor:
        """Start ranks 1..k-1, join them as rank 0, load every shard; raise if any fails."""
        global _last_launched
        world = config.tensor_parallel_size
        check_tensor_parallel(model_config, world)
        previous = _last_launched() if _last_launched is not None else None
        if previous is not None and not previous._allocated:
            previous.shutdown()  # its engine failed after launch (e.g. a KV budget error)
        if dist.is_initialized():
            raise ValueError(
                "tensor_parallel_size > 1 needs this process's torch.distributed default group, "
                "but one is already initialized (another tensor-parallel engine is running here?); "
                "shut that engine down first"
            )
        if device.type == "cuda":
            first = device.index or 0
            if first + world > torch.cuda.device_count():
                raise ValueError(
                    f"tensor_parallel_size {world} on cuda:{first} needs GPUs {first}.."
                    f"{first + world - 1}, but only {torch.cuda.device_count()} are visible"
                )
        backend = os.environ.get("PAGEDLLM_TP_BACKEND") or (
            "nccl" if device.type == "cuda" else "gloo"
        )
        self = cls()
        self.world, self.dist_backend, self.device = world, backend, device
        self.attention_backend = config.attention_backend
        self.gpu_memory_utilization = config.gpu_memory_utilization
        threads = None
        if device.type == "cpu":  # k ranks share the cores: do not oversubscribe them
            threads = max(1, (os.cpu_count() or 1) // world)
        port = _free_port()
        store = dist.TCPStore(
            "127.0.0.1", port, world, is_master=True, timeout=COLLECTIVE_TIMEOUT,
            wait_for_workers=False,
        )  # fmt: skip
        self._store = store
        context = mp.get_context("spawn")
        base_spec: dict[str, Any] = dict(
            world=world,
            backend=backend,
            store_host="127.0.0.1",
            store_port=port,
            folder=str(folder),
            hf_config=hf_config,
            model_config=model_config,
            dtype=dtype,
            device=str(device),
            max_model_len=max_model_len,
            parent_pid=os.getpid(),
            num_threads=threads,
        )
        try:
            for rank in range(1, world):
                process = context.Process(
                    target=worker_main,
                    args=(RankSpec(rank=rank, **base_spec),),
                    name=f"pagedllm-tp-rank{rank}",
                    daemon=True,
                )
                process.start()
                self.processes.append(process)
            self._wait_for("alive")
            if device.type == "cuda":
                torch.cuda.set_device(device)
            dist.init_process_group(
                backend, store=store, rank=0, world_size=world, timeout=COLLECTIVE_TIMEOUT
            )
            self._group_up = True
            self.model = build_shard(RankSpec(rank=0, **base_spec), device, base_factory)
            self._wait_for("loaded")
        except BaseException:
            self._teardown()
            raise
        threading.Thread(target=self._monitor, name="pagedllm-tp-monitor", daemon=True).start()
        _last_launched = weakref.ref(self)
        _live.add(self)
        logger.info("tensor parallel: %d ranks (%s) on %s", world, backend, device)
        return self

    def _wait_for(self, stage: str) -> None:
        """Until every worker rank has set `<stage>/<rank>`; a rank that fails ends the wait."""
        deadline = time.monotonic() + _STARTUP_TIMEOUT
        pending = set(range(1, self.world))
        while pending:
            for rank in sorted(pending):
                if self._store.check([f"error/{rank}"]):
                    message = self._store.get(f"error/{rank}").decode(errors="replace")
                    raise RuntimeError(
                        f"tensor-parallel rank {rank} failed to start:\n{message.strip()}"
                    )
                if self._store.check([f"{stage}/{rank}"]):
                    pending.discard(rank)
                elif not self.processes[rank - 1].is_alive():
                    code = self.processes[rank - 1].exitcode
                    raise RuntimeError(
                        f"tensor-parallel rank {rank} exited (code {code}) before it was {stage}"
                    )
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel ranks {sorted(pending)} not {stage} in time")
            time.sleep(0.05)

    def _broadcast_header(self, header: dict) -> None:
        box = [header]
        dist.broadcast_object_list(
            box, src=0, device=self.device if self.dist_backend == "nccl" else None
        )

    def allocate(
        self,
        num_blocks: int,
        block_size: int,
        swap: SwapPlan = NO_SWAP,
        kv_disk: KVDiskPlan = NO_KV_DISK,
        layout: KVLayout | None = None,
    ) -> None:
        """Make every rank's KV cache and swap space (this rank's in a ModelRunner)."""
        assert not kv_disk.blocks, "the KV disk tier is one process's (refused by the config)"
        assert layout is None or not layout.grouped, "ranks keep the plain KV layout"
        self._check_alive()
        header = dict(
            op="allocate",
            num_blocks=num_blocks,
            block_size=block_size,
            backend=self.attention_backend,
            swap=swap,
        )
        self._guarded(lambda: self._broadcast_header(header))
        self.runner = ModelRunner(
            self.model,
            num_blocks,
            block_size,
            self.device,
            attention_backend=self.attention_backend,
            swap=swap,
        )
        self._allocated = True

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Rank 0's share of the KV cache (its heads), per layer."""
        return self.runner.kv_caches if self.runner is not None else []

    def profile_num_blocks(self, per_block: int, tokens: int, block_size: int) -> int:
        """KV blocks per rank that fit on the fullest GPU after a warm-up forward (CUDA)."""
        self._check_alive()
        args: dict[str, Any] = dict(
            tokens=tokens,
            block_size=block_size,
            backend=self.attention_backend,
            per_block=per_block,
            gpu_memory_utilization=self.gpu_memory_utilization,
        )

        def run() -> int:
            self._broadcast_header(dict(op="profile", args=args))
            with torch.inference_mode():
                blocks = profile_kv_blocks(self.model, self.device, **args)
            return min_over_ranks(blocks, self.device)

        return self._guarded(run)

    # ------------------------------------------------------------------- steps
    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, block_tables: list[list[list[int]]]
    ) -> tuple[torch.Tensor, list[int], dict]:
        """Run one step on every rank; returns logits [N, vocab] (float32) and their rows
        (and no pooled parts: embedding requests are refused under tensor parallelism)."""
        self._check_alive()
        runner = self.runner
        assert runner is not None, "allocate() the KV cache before the first step"
        input_ids, positions, meta, logits_indices, sampled_rows = runner.prepare(out, block_tables)
        fields, packed = pack_step(input_ids, positions, meta)
        header = dict(
            op="execute",
            backend=self.attention_backend,
            swap_out=out.swap_out,
            swap_in=out.swap_in,
            swap_ahead=out.swap_ahead,
            **fields,
        )

        def run() -> torch.Tensor:
            self._broadcast_header(header)
            dist.broadcast(packed, src=0)
            runner.swap(out.swap_out, out.swap_in, out.swap_ahead)
            return runner.forward(input_ids, positions, meta, logits_indices)

        return self._guarded(run), sampled_rows, {}

    def _guarded(self, run):
        """Run a collective section; any failure in it leaves the ranks out of step: the
        group is torn down and the error re-raised (the engine fails the step's requests)."""
        try:
            return run()
        except BaseException as error:
            # A collective that failed because a rank died: name the rank, not the socket.
            # The socket error can arrive before the dying process is reaped (is_alive() is
            # still True then), so give the monitor, which wakes when a rank exits, up to a
            # second to record which rank it was, whatever is_alive() says right now.
            deadline = time.monotonic() + 1.0
            while self._dead is None and time.monotonic() < deadline:
                time.sleep(0.05)
            self._mark_dead(f"tensor-parallel step failed: {type(error).__name__}: {error}")
            self._teardown()
            raise RuntimeError(
                f"{self._dead}; the tensor-parallel group is gone, restart the engine"
            ) from error

    def _check_alive(self) -> None:
        if self._dead is not None:
            self._teardown()  # on the engine thread, the one that owns the group
            raise RuntimeError(
                f"{self._dead}; the tensor-parallel group is gone, restart the engine"
            )

    # --------------------------------------------------------------- shutdown
    def _monitor(self) -> None:
        sentinels = {p.sentinel: p for p in self.processes}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._closing:
            return
        process = sentinels[cast(int, ready[0])]  # wait() returns the sentinels it was given
        process.join(timeout=1)
        self._mark_dead(f"tensor-parallel {process.name} died (exit code {process.exitcode})")
        logger.error("%s; stopping the other ranks", self._dead)
        self._kill_workers()
        if self.dist_backend == "nccl":  # NCCL collectives do not notice dead peers: abort them
            abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
            if abort is not None:
                try:
                    abort()
                except Exception:  # best effort; the engine thread may be blocked in it
                    logger.exception("could not abort the NCCL group")

    def _mark_dead(self, message: str) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = message

    def _kill_workers(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)

    def _teardown(self) -> None:
        self._closing = True  # the monitor must not report the deaths we cause
        self._kill_workers()
        with self._lock:
            group_up, self._group_up = self._group_up, False
        if group_up and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                logger.exception("destroying the tensor-parallel group failed")

    def claim_thread(self) -> None:
        """Nothing to do: the ranks run eager torch ops, on torch's threads."""

    def shutdown(self) -> None:
        """Stop every rank (politely first) and leave the process group. Idempotent."""
        if self._group_up and self._dead is None and not self._closing:
            self._closing = True
            try:
                self._broadcast_header(dict(op="shutdown"))
                for process in self.processes:
                    process.join(timeout=10)
            except Exception:
                logger.exception("tensor-parallel shutdown message failed; killing the ranks")
        self._closing = True
        self._teardown()

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.processes if p.pid is not None]

    @staticmethod
    def rank_device(device: torch.device, rank: int) -> torch.device:
        return rank_device(device, rank)
