"""The synchronous engine core: add requests, `step()`, read outputs.

It is not thread-safe by design: exactly one thread (the `AsyncEngine`'s engine thread)
calls `add_group`, `abort_request` and `step`. Requests are tokenized and validated
before, on the caller's thread, by `self.inputs` (an `InputProcessor`), so a bad request
fails there, before it reaches the engine.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from .compute_plan import choose_plan
from .config import ContextLengthError, EngineConfig, GiB
from .disk_prefix_cache import DiskPrefixCache
from .executor import build_executor
from .generation_config import generation_defaults, read_generation_config
from .heap import release_freed_memory
from .input_processor import InputProcessor
from .kv_cache_manager import KVCacheManager
from .kv_disk_tier import NO_KV_DISK, KVDiskPlan
from .kv_sizing import ContextFit, check_blocks_hold_a_sequence, fit_cpu_context, kv_bytes_per_block
from .metrics import EngineCounters, IterationStats, LoggingStatLogger, SchedulerStats, StatLogger
from .model_info import ModelInfo, PromptType
from .model_loader import load_tokenizer, read_config, resolve_model
from .models.config import ModelConfig
from .models.layers import LinearFactory, dense_linear
from .output_processor import RequestGroup, finished_request_stats, make_request_output
from .output_step import commit_step
from .outputs import RequestOutput
from .pooling import read_pooler_config
from .pooling_step import finish_pooled, model_tasks
from .request import Request, RequestStatus
from .row_faults import sample_rows
from .sampler import Sampler
from .scheduler import Scheduler, SchedulerOutput
from .spec_decode.ngram import NgramProposer
from .spec_decode.verifier import DraftVerifier
from .step_budget import step_budget
from .swap_space import SwapPlan, describe_swap

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine", "PromptType", "RequestGroup"]


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        started = time.perf_counter()
        self.device = _resolve_device(config.device)
        source = resolve_model(config.model, config.revision, config.download_dir)
        self.model_name = config.served_model_name or source.name
        self.model_folder = source.folder
        hf_config = read_config(source.folder)
        self.model_config = ModelConfig.from_hf_dict(hf_config)
        self.pooler = read_pooler_config(
            source.folder, hf_config, self.model_config.causal, config.pooler_config
        )
        self.plan = choose_plan(
            self.device,
            config.dtype,
            config.kv_cache_dtype,
            config.attention_backend,
            hf_config,
            self.model_config.torch_dtype,
            config.tensor_parallel_size,
        )
        self._check_num_threads()
        self.dtype = self.plan.dtype
        block_size = config.block_size
        bytes_per_block = kv_bytes_per_block(
            self.model_config, block_size, self.plan.kv_cache_dtype, config.tensor_parallel_size
        )
        self.max_model_len = self._resolve_max_model_len(source.context_length)
        kv_disk = self._kv_disk_plan(bytes_per_block)
        fit = self._fit_context(bytes_per_block, kv_disk.blocks)
        self.tokenizer = load_tokenizer(config.tokenizer or source.folder, config.revision)
        # Parsing a large vocabulary's tokenizer.json peaks at hundreds of MiB (Gemma 3's:
        # ~580): hand those pages back before the weights load, so the peaks do not add up.
        release_freed_memory()
        generation_config = read_generation_config(source.folder)
        self.eos_token_ids = self._eos_token_ids(generation_config)
        self.generation_defaults = {
            **generation_defaults(generation_config, self.model_name),
            **source.sampling_defaults,  # an Ollama Modelfile's PARAMETERs
        }
        self.executor = build_executor(
            config,
            source.folder,
            hf_config,
            self.model_config,
            self.dtype,
            self.device,
            self.max_model_len,
            self._linear_factory(hf_config, source.folder),
            self.plan,
        )
        self.model = self.executor.model  # this process's model (rank 0's shard under TP)
        self.vocab_size = self.model_config.vocab_size

        encoder = not self.model_config.causal
        self.max_num_batched_tokens = step_budget(config, self.device, self.max_model_len, encoder)
        memory_blocks = self._determine_num_blocks(block_size, bytes_per_block, fit, kv_disk)
        self.num_blocks = memory_blocks + kv_disk.blocks  # the pool's: memory, then disk
        swap = SwapPlan.from_sizes(
            config.swap_space, config.swap_disk_space, config.swap_dir, bytes_per_block
        )
        self.kv_cache_bytes = memory_blocks * bytes_per_block  # in memory
        self.kv_manager = KVCacheManager(
            self.num_blocks,
            block_size,
            config.enable_prefix_caching,
            model_identity=source.origin,
            memory_blocks=memory_blocks,
        )
        self.scheduler = Scheduler(
            self.kv_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            policy=config.scheduling_policy,
            swap=swap,
            proposer=NgramProposer(config.speculation) if config.speculation else None,
            encoder_only=encoder,
        )
        self.executor.allocate(self.num_blocks, block_size, swap, kv_disk)
        self.disk_cache: DiskPrefixCache | None = None
        if config.prefix_cache_dir is not None:
            self.disk_cache = DiskPrefixCache.create(
                config.prefix_cache_dir,
                int(config.prefix_cache_max_gib * GiB),
                self.kv_manager,
                self.executor.kv_caches,
                folder=source.folder,
                model_name=self.model_name,
                model=self.model,
                model_config=self.model_config,
                plan=self.plan,
                device=self.device,
            )
        self.sampler = Sampler(self.vocab_size, self.device, seed=config.seed)
        self.verifier = DraftVerifier(self.sampler)
        self.groups: dict[str, RequestGroup] = {}
        # Steps in a row that failed as a whole (the health check reports a wedged engine).
        self.consecutive_failed_steps = 0
        self.counters = EngineCounters()
        self.stat_loggers: list[StatLogger] = [self.counters]
        if not config.disable_log_stats:
            self.stat_loggers.append(LoggingStatLogger(config.log_stats_interval))
        self.info = ModelInfo(
            name=self.model_name,
            architecture=self.model_config.architecture,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
            block_size=block_size,
            generation_defaults=dict(self.generation_defaults),
            tasks=model_tasks(config.runner, encoder, config.tensor_parallel_size),
            embedding_size=self.pooler.embedding_size(self.model_config.hidden_size),
            pooler=self.pooler,
        )
        self.inputs = InputProcessor(config, self.tokenizer, self.info, self.device)
        self.load_time = time.perf_counter() - started
        if encoder:
            logger.info("%s is an embedding model: %s", self.model_name, self.pooler.describe())
        logger.info(
            "loaded %s (%s; %s, %s) in %.1fs: %d KV blocks of %d tokens (%.2f GiB)%s, "
            "max_model_len %d%s%s",
            self.model_name,
            self.plan.describe(),
            self.model.stack_status() if hasattr(self.model, "stack_status") else "",
            self.device,
            self.load_time,
            memory_blocks,
            block_size,
            self.kv_cache_bytes / GiB,
            kv_disk.describe(bytes_per_block),
            self.max_model_len,
            fit.note,
            describe_swap(swap, bytes_per_block),
        )

    # ------------------------------------------------------------ model setup
    def _check_num_threads(self) -> None:
        """num_threads sets the threads of the CPU fast path's kernels: on a GPU the CPU
        does no such work (noted); a CPU path on torch's threads refuses it."""
        threads = self.config.num_threads
        if threads is None or self.plan.fused_cpu:
            return
        if self.device.type != "cpu":
            logger.warning(
                "num_threads=%d has no effect: the model runs on %s", threads, self.device
            )
            return
        raise ValueError(
            f"num_threads={threads} sets the threads of the CPU fast path's kernels, and "
            f"this engine runs {self.plan.describe()} on torch's threads: call "
            "torch.set_num_threads(n) instead"
        )

    def _resolve_max_model_len(self, model_default: int | None) -> int:
        """The setting, else the model's own (an Ollama num_ctx), else its context length
        (which `_fit_context` may lower to what the KV cache holds)."""
        limit = self.model_config.max_position_embeddings
        if self.config.max_model_len is None:
            # sentence-transformers' max_seq_length: the length the model was tuned for
            # (all-MiniLM-L6-v2: 256 of its 512 positions).
            trained = self.pooler.max_seq_length if not self.model_config.causal else None
            return min(limit, trained or limit, model_default or limit)
        if self.config.max_model_len > limit and (
            not self.model_config.rope_scaling or not self.model_config.causal
        ):
            raise ContextLengthError(self.config.max_model_len, limit)
        return self.config.max_model_len

    def _kv_disk_plan(self, bytes_per_block: int) -> KVDiskPlan:
        """The KV disk tier (kv_disk_space): a CPU decoder's, in one process."""
        if not self.config.kv_disk_space:
            return NO_KV_DISK
        if self.device.type != "cpu" or not self.model_config.causal:
            raise ValueError(
                f"kv_disk_space is for a decoder's KV cache on a CPU; this engine runs "
                f"{'an encoder' if not self.model_config.causal else 'on ' + str(self.device)}"
            )
        return KVDiskPlan.from_size(
            self.config.kv_disk_space, self.config.swap_dir, bytes_per_block
        )

    def _fit_context(self, bytes_per_block: int, disk_blocks: int) -> ContextFit:
        """A CPU engine's KV budget, with max_model_len lowered to it (and the KV disk
        tier's blocks) when not set: before the model is built, as rotary tables and
        long-context scaling follow max_model_len."""
        config = self.config
        if self.device.type != "cpu" or not self.model_config.causal or config.num_kv_blocks:
            return ContextFit(self.max_model_len, 0)
        if bytes_per_block <= 0:  # more tensor-parallel ranks than KV heads: refused with
            return ContextFit(self.max_model_len, 0)  # its own message when ranks are built
        fit = fit_cpu_context(
            self.max_model_len,
            config.max_model_len is None,
            config.kv_cache_memory,
            bytes_per_block,
            config.block_size,
            disk_blocks=disk_blocks,
        )
        self.max_model_len = fit.max_model_len
        return fit

    def _eos_token_ids(self, generation_config: dict[str, Any]) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        eos = generation_config.get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
        return tuple(sorted(ids))

    def _linear_factory(self, hf_config: dict[str, Any], folder: Path) -> LinearFactory:
        method = (hf_config.get("quantization_config") or {}).get("quant_method")
        if method in (None, "gguf"):  # GGUF blocks reach the linears as they are
            if self.config.quantization == "awq":
                raise ValueError(
                    "quantization='awq' needs an AWQ checkpoint (quantization_config.quant_method "
                    "'awq' in config.json); make one with `pagedllm quantize`"
                )
            if self.plan.fused_cpu:
                from ..quant.packed_linear import amx_bf16_available, encoder_linear, packed_linear

                if self.model_config.causal:
                    return packed_linear
                if amx_bf16_available():
                    logger.info("encoder linears: dense weights on AMX-BF16 tiles")
                return encoder_linear
            return dense_linear
        if method == "awq":
            from ..quant.awq_linear import awq_linear_factory

            kernel = "packed" if self.plan.fused_cpu else "auto"
            return awq_linear_factory(
                hf_config["quantization_config"], folder, kernel, dense_linear=dense_linear
            )
        raise ValueError(f"unsupported quantization method {method!r} (pagedllm runs AWQ)")

    def _determine_num_blocks(
        self, block_size: int, per_block: int, fit: ContextFit, kv_disk: KVDiskPlan
    ) -> int:
        """KV blocks in memory; with the disk tier's, they must hold one sequence."""
        if not self.model_config.causal:
            return 1  # an encoder keeps nothing between steps (the pool needs one block)
        if self.config.num_kv_blocks is not None:
            num_blocks = self.config.num_kv_blocks
        elif self.device.type == "cuda":
            tokens = min(self.max_num_batched_tokens, self.max_model_len)
            num_blocks = self.executor.profile_num_blocks(per_block, tokens, block_size)
        else:
            num_blocks = fit.kv_budget_bytes // per_block
        holds = (num_blocks + kv_disk.blocks) * block_size
        if self.config.max_model_len is None and 0 < holds < self.max_model_len:
            # Not set: as long as the cache holds (vLLM's estimated maximum model length).
            logger.warning(
                "max_model_len lowered from the model's %d to %d tokens: what the KV cache holds",
                self.max_model_len,
                holds,
            )
            self.max_model_len = holds
        check_blocks_hold_a_sequence(num_blocks + kv_disk.blocks, block_size, self.max_model_len)
        return int(num_blocks)

    # ----------------------------------------------------------- request flow
    def add_group(self, group: RequestGroup) -> None:
        if group.request_id in self.groups:
            raise ValueError(f"request id {group.request_id!r} is already running")
        self.groups[group.request_id] = group
        if self.disk_cache is not None:  # the siblings share the prompt, so its blocks
            self.disk_cache.load(group.children[0])
        for child in group.children:
            self.scheduler.add_request(child)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request now; its blocks are freed. Returns its final output (or None)."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        for child in group.children:
            self.scheduler.finish_request(child, RequestStatus.FINISHED_ABORTED)
        return self._make_output(group)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample, and return the outputs of requests that changed."""
        out = self.scheduler.schedule()
        iteration = IterationStats(
            num_batched_tokens=out.num_batched_tokens, num_seqs=len(out.scheduled)
        )
        touched: dict[str, RequestGroup] = {}
        if not out.is_empty:
            self._run(out, iteration, touched)
        if self.disk_cache is not None:
            self.disk_cache.after_step()
        outputs = []
        for group in touched.values():
            output = self._make_output(group)
            if output is not None:
                outputs.append(output)
            if group.finished:
                self.groups.pop(group.request_id, None)
                self._record_finished(group, iteration)
        self._log_stats(iteration)
        return outputs

    def _run(self, out: SchedulerOutput, iteration: IterationStats, touched: dict) -> None:
        """execute -> sample -> update, for one scheduled step."""
        block_ids = [
            self.kv_manager.get_block_ids(item.request.request_id) for item in out.scheduled
        ]

        def recompute_logits() -> torch.Tensor:  # the same step again, its swaps already done
            return self.executor.execute(replace(out, swap_out=[], swap_in=[]), block_ids)[0]

        tokens: list[list[int]] = [[] for _ in out.scheduled]
        logprobs: list[list] = [[] for _ in out.scheduled]
        try:
            logits, sampled_rows, pooled = self.executor.execute(out, block_ids)
            failed = self._sample(
                out, logits, sampled_rows, tokens, logprobs, iteration, recompute_logits
            )
        except Exception as error:  # the whole step failed: fail its requests, keep serving
            logger.exception(
                "engine step failed; failing the %d requests in it", len(out.scheduled)
            )
            self.consecutive_failed_steps += 1
            for item in out.scheduled:
                self._fail(item.request, f"{type(error).__name__}: {error}", touched, uncache=True)
            return
        self.consecutive_failed_steps = 0
        for index, message in failed.items():
            self._fail(out.scheduled[index].request, message, touched)
        update = commit_step(self.scheduler, out, tokens, logprobs, iteration)
        for request, message in update.failed:
            self._fail(request, message, touched)
        if out.num_pooling:
            update.changed.extend(finish_pooled(out, pooled, self.scheduler, iteration))
        for request in update.changed:
            group = self.groups.get(request.parent_id or request.request_id)
            if group is not None:
                touched[group.request_id] = group

    def _sample(
        self,
        out: SchedulerOutput,
        logits: torch.Tensor,  # [sum of each sampled request's 1 + drafts, vocab]
        sampled_rows: list[int],
        tokens: list[list[int]],
        logprobs: list[list],
        iteration: IterationStats,
        recompute_logits: Callable[[], torch.Tensor],
    ) -> dict[int, str]:
        """Fill tokens[i] / logprobs[i] for each sampled out.scheduled[i]: one sampled token,
        or, for a request that verified drafts, its accepted drafts and one more. Returns
        {i: why} for the requests whose row raised in the sampler (they get no token)."""
        if not out.num_draft_tokens:
            return self._sample_plain(logits, sampled_rows, out, tokens, logprobs, recompute_logits)
        # Rows of requests without drafts go through the sampler as in any step; requests
        # with drafts through the verifier.
        plain_rows, plain, drafting_rows, drafting = [], [], [], []  # type: ignore[var-annotated]
        row = 0
        for index in sampled_rows:
            num_rows = 1 + len(out.scheduled[index].draft_token_ids)
            if num_rows == 1:
                plain_rows.append(row)
                plain.append(index)
            else:
                drafting_rows.extend(range(row, row + num_rows))
                drafting.append(index)
            row += num_rows
        failed: dict[int, str] = {}
        if plain:
            failed = self._sample_plain(
                logits[plain_rows], plain, out, tokens, logprobs,
                lambda: recompute_logits()[plain_rows],
            )  # fmt: skip
        items = [out.scheduled[i] for i in drafting]
        verified = self.verifier(
            logits[drafting_rows] if plain else logits,
            [item.request for item in items],
            [item.draft_token_ids for item in items],
        )
        for position, index in enumerate(drafting):
            tokens[index] = verified.token_ids[position]
            logprobs[index] = verified.logprobs[position]
        iteration.record_drafts(
            [len(item.draft_token_ids) for item in items], verified.num_accepted
        )
        return failed

    def _sample_plain(
        self,
        logits: torch.Tensor,  # [len(indices), vocab]: one row per request
        indices: list[int],
        out: SchedulerOutput,
        tokens: list[list[int]],
        logprobs: list[list],
        recompute_logits: Callable[[], torch.Tensor],
    ) -> dict[int, str]:
        """One token for each out.scheduled[i], i in indices. A row that raises in the
        sampler fails its request only (engine/row_faults.py): {i: why}."""
        requests = [out.scheduled[i].request for i in indices]
        sampled, failed_rows = sample_rows(self.sampler, logits, requests, recompute_logits)
        failed: dict[int, str] = {}
        for row, index in enumerate(indices):
            if row in failed_rows:
                failed[index] = failed_rows[row]
            else:
                tokens[index] = [sampled.token_ids[row]]
                logprobs[index] = [sampled.logprobs[row]]
        return failed

    def _fail(self, request: Request, message: str, touched: dict, uncache: bool = False) -> None:
        request.error = message
        self.scheduler.finish_request(request, RequestStatus.FINISHED_ERROR, uncache=uncache)
        group = self.groups.get(request.parent_id or request.request_id)
        if group is not None:
            group.error = message
            for sibling in group.children:
                self.scheduler.finish_request(
                    sibling, RequestStatus.FINISHED_ERROR, uncache=uncache
                )
            touched[group.request_id] = group

    # ----------------------------------------------------------------- outputs
    def _make_output(self, group: RequestGroup) -> Any:
        return make_request_output(group)

    def _record_finished(self, group: RequestGroup, iteration: IterationStats) -> None:
        iteration.finished.extend(finished_request_stats(group))

    def scheduler_stats(self) -> SchedulerStats:
        running, kv, block_size = self.scheduler.running, self.kv_manager, self.config.block_size
        swapped_host, swapped_disk = self.scheduler.swapped_blocks()
        runner = self.executor.runner
        return SchedulerStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv_manager.usage,
            prefix_cache_queries=self.kv_manager.prefix_cache_queries,
            prefix_cache_hits=self.kv_manager.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            kv_tokens_held=sum(r.num_computed_tokens for r in running),
            kv_slots_reserved=block_size * sum(kv.num_blocks_of(r.request_id) for r in running),
            prefix_cache_disk_loaded=self.disk_cache.loaded_tokens if self.disk_cache else 0,
            prefix_cache_disk_written=self.disk_cache.written_tokens if self.disk_cache else 0,
            swapped_blocks_host=swapped_host,
            swapped_blocks_disk=swapped_disk,
            blocks_swapped_out=self.scheduler.num_blocks_swapped_out,
            blocks_swapped_in=self.scheduler.num_blocks_swapped_in,
            kv_disk_blocks=kv.pool.num_disk_blocks_in_use,
            kv_disk_blocks_taken=kv.pool.num_disk_blocks_taken,
            kv_disk_block_reads=runner.kv_disk_block_reads if runner is not None else 0,
        )

    def _log_stats(self, iteration: IterationStats) -> None:
        stats = self.scheduler_stats()
        for stat_logger in self.stat_loggers:
            stat_logger.record(stats, iteration)

    def reset_prefix_cache(self) -> bool:
        return self.kv_manager.reset_prefix_cache()

    def save_prefix(self, request: Request) -> Future:
        """Before `request` is added: write its prompt's full blocks to the prefix-cache
        directory once they are computed. The future gives the tokens in them once the
        files are written."""
        if self.disk_cache is None:
            raise ValueError("save_prefix needs a prefix-cache directory: set prefix_cache_dir")
        return self.disk_cache.save_when_computed(request)

    def shutdown(self) -> None:
        """Release the model: the tensor-parallel ranks, the weights and the KV cache.

        The tensors are dropped here, not when the last reference to this object goes,
        so that whatever still holds the engine (a wrapper, a closure) does not keep
        gigabytes alive; the engine cannot run afterwards.
        """
        if self.disk_cache is not None:
            self.disk_cache.close()
        if self.executor is not None:
            self.executor.shutdown()
        self.executor = None  # type: ignore[assignment]
        self.model = None  # type: ignore[assignment]
        self.sampler = None  # type: ignore[assignment]
        self.groups.clear()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for but CUDA is not available")
    return resolved
