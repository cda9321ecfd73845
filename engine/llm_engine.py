"""The synchronous engine core: add requests, `step()`, read outputs.

It is not thread-safe by design: exactly one thread (the `AsyncEngine`'s engine thread)
calls `add_request`, `abort_request` and `step`. Requests are tokenized and validated
before, on the caller's thread, by `self.inputs` (an `InputProcessor`), so a bad request
fails there, before it reaches the engine; what arrives is a frozen `EngineRequest`, and
`add_request` builds the live state that runs it (`self.request_states`).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import replace
from typing import Any

import torch

from .config import EngineConfig
from .disk_prefix_cache import PendingLoad
from .engine_builder import EngineBuilder, EngineParts
from .engine_request import EngineRequest
from .metrics import EngineCounters, IterationStats, LoggingStatLogger, SchedulerStats, StatLogger
from .model_info import PromptType
from .output_processor import RequestGroup, finished_request_stats, make_request_output
from .output_step import commit_step
from .outputs import RequestOutput
from .pooling_step import finish_pooled
from .request import Request, RequestStatus
from .row_faults import sample_rows
from .scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

# How long a step with nothing to run waits for a request's prefix blocks to be read.
LOAD_WAIT_SECONDS = 0.05

__all__ = ["EngineRequest", "LLMEngine", "PromptType"]


class LLMEngine(EngineParts):
    """The engine step loop over its parts (engine/engine_builder.py builds them)."""

    def __init__(self, config: EngineConfig):
        super().__init__(**vars(EngineBuilder(config).build()))
        self.groups: dict[str, RequestGroup] = {}  # user requests in flight, by id
        # Steps in a row that failed as a whole (the health check reports a wedged engine).
        self.consecutive_failed_steps = 0
        self.counters = EngineCounters()
        self.stat_loggers: list[StatLogger] = [self.counters]
        if not config.disable_log_stats:
            self.stat_loggers.append(LoggingStatLogger(config.log_stats_interval))
        # save_prefix(request_id) before its request arrives: the futures its save fulfils.
        self._saves_on_arrival: dict[str, Future] = {}
        # Requests whose prefix blocks are being read from disk, not scheduled yet; and the
        # reads of requests aborted meanwhile (their blocks are freed once the read ends).
        self._loading: dict[str, tuple[RequestGroup, PendingLoad]] = {}
        self._abandoned_loads: list[PendingLoad] = []

    # ----------------------------------------------------------- request flow
    def add_request(self, request: EngineRequest) -> None:
        """Take a validated request (engine thread): build its live state and queue it."""
        if request.request_id in self.groups:
            raise ValueError(f"request id {request.request_id!r} is already running")
        group = self.request_states.build(request)
        self.groups[request.request_id] = group
        if self.disk_cache is not None:
            saved = self._saves_on_arrival.pop(request.request_id, None)
            if saved is not None:
                self.disk_cache.save_when_computed(group.children[0], saved)
            # The samples of n > 1 share the prompt: its blocks are read once, for the first.
            pending = self.disk_cache.begin_load(group.children[0])
            if pending is not None:  # scheduled once its blocks are read (_admit_loaded)
                self._loading[request.request_id] = (group, pending)
                return
        for child in group.children:
            self.scheduler.add_request(child)

    def _admit_loaded(self) -> None:
        """Schedule the requests whose prefix blocks have been read from disk, and free the
        blocks of reads whose request was aborted. When nothing else can run, wait a little
        for any read to end (a step with no work would only spin); commands such as aborts
        are still taken between those waits."""
        if not self.scheduler.has_unfinished():
            pendings = [pending for _, pending in self._loading.values()] + self._abandoned_loads
            wait([pending.future for pending in pendings], timeout=LOAD_WAIT_SECONDS,
                 return_when=FIRST_COMPLETED)  # fmt: skip
        for pending in [p for p in self._abandoned_loads if p.future.done()]:
            self._abandoned_loads.remove(pending)
            self.disk_cache.finish_load(pending)  # type: ignore[union-attr]
        for request_id, (group, pending) in list(self._loading.items()):
            if not pending.future.done():
                continue
            del self._loading[request_id]
            self.disk_cache.finish_load(pending)  # type: ignore[union-attr]
            for child in group.children:
                self.scheduler.add_request(child)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request now; its blocks are freed. Returns its final output (or None)."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        loading = self._loading.pop(request_id, None)
        if loading is not None:  # the reader still writes its blocks: freed once it is done
            self._abandoned_loads.append(loading[1])
        for child in group.children:
            self.scheduler.finish_request(child, RequestStatus.FINISHED_ABORTED)
        return self._make_output(group)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups) or bool(self._abandoned_loads)

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample, and return the outputs of requests that changed."""
        if self._loading or self._abandoned_loads:
            self._admit_loaded()
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
        block_tables = [
            self.kv_manager.get_block_tables(item.request.request_id) for item in out.scheduled
        ]

        def recompute_logits() -> torch.Tensor:  # the same step again, its swaps already done
            return self.executor.execute(replace(out, swap_out=[], swap_in=[]), block_tables)[0]

        tokens: list[list[int]] = [[] for _ in out.scheduled]
        logprobs: list[list] = [[] for _ in out.scheduled]
        try:
            logits, sampled_rows, pooled = self.executor.execute(out, block_tables)
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
            num_waiting=len(self.scheduler.waiting) + len(self._loading),
            kv_cache_usage=self.kv_manager.usage,
            prefix_cache_queries=self.kv_manager.prefix_cache_queries,
            prefix_cache_hits=self.kv_manager.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            kv_tokens_held=sum(r.num_computed_tokens for r in running),
            kv_slots_reserved=block_size * sum(kv.num_entries_of(r.request_id) for r in running),
            prefix_cache_disk_loaded=self.disk_cache.loaded_tokens if self.disk_cache else 0,
            prefix_cache_disk_written=self.disk_cache.written_tokens if self.disk_cache else 0,
            swapped_blocks_host=swapped_host,
            swapped_blocks_disk=swapped_disk,
            blocks_swapped_out=self.scheduler.num_blocks_swapped_out,
            blocks_swapped_in=self.scheduler.num_blocks_swapped_in,
            blocks_swap_read_ahead=self.scheduler.num_blocks_read_ahead,
            kv_disk_blocks=kv.pool.num_disk_blocks_in_use,
            kv_disk_blocks_taken=kv.pool.num_disk_blocks_taken,
            kv_disk_block_reads=runner.kv_disk_block_reads if runner is not None else 0,
            kv_disk_blocks_demoted=kv.pool.num_blocks_demoted,
        )

    def _log_stats(self, iteration: IterationStats) -> None:
        stats = self.scheduler_stats()
        for stat_logger in self.stat_loggers:
            stat_logger.record(stats, iteration)

    def reset_prefix_cache(self) -> bool:
        return self.kv_manager.reset_prefix_cache()

    def save_prefix(self, request_id: str) -> Future:
        """Before the request `request_id` is added: write its prompt's full blocks to the
        prefix-cache directory once they are computed. The future gives the tokens in them
        once the files are written."""
        if self.disk_cache is None:
            raise ValueError("save_prefix needs a prefix-cache directory: set prefix_cache_dir")
        future: Future = Future()
        self._saves_on_arrival[request_id] = future
        return future

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
