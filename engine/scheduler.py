"""Continuous batching: which tokens of which requests run in the next forward pass.

There is no prefill phase and no decode phase. Each step has one token budget
(`max_num_batched_tokens`); running requests are served first, in policy order, each
getting the tokens it still needs (one for a decoding request, a chunk of its prompt for
a prefilling one); then waiting requests are admitted while budget, `max_num_seqs` and
free blocks allow. While streams decode, a prefill chunk is also cut to what the budget
buys at its depth in the prompt (engine/prefill_cost.py: deep chunks cost more attention),
so a decoding stream's step stays short. When blocks run out the lowest-ranked running
request is preempted (recomputed later, or swapped to host memory when `swap_space`
allows, then to disk with `swap_disk_space`). The disk blocks of the swapped requests next
in line to resume are read ahead (`SchedulerOutput.swap_ahead`), so that their swap-in
finds them in memory rather than waiting on the disk.

With speculative decoding a decoding request also runs its draft tokens (a proposer's
guesses of the tokens after its last one): they take budget and KV slots like any token,
but only when there is room; a draft never preempts anyone. After the step `advance` gives
back the slots of rejected drafts, and engine/output_step.py commits the sampled tokens.
"""

from __future__ import annotations

import bisect
import logging
import os
import time

from .client_share import StepShares
from .kv_cache_manager import GroupBlocks, KVCacheManager, cdiv
from .prefill_cost import PrefillCost, StepUnits
from .request import Request, RequestStatus
from .scheduler_output import ScheduledRequest, SchedulerOutput
from .scheduler_policy import PriorityPolicy, SchedulingPolicy, make_policy
from .spec_decode.ngram import NgramProposer
from .swap_space import NO_SWAP, SwapPlan, SwapSlots

logger = logging.getLogger(__name__)

__all__ = ["PriorityPolicy", "Scheduler", "SchedulingPolicy", "make_policy"]

# Assert the scheduler's invariants after every step (the tests turn this on; in production
# it is host work on every step for a bug that the tests exist to catch).
CHECK_INVARIANTS = os.environ.get("PAGEDLLM_CHECK_INVARIANTS", "") not in ("", "0")


class Scheduler:
    def __init__(
        self,
        kv_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        policy: str | SchedulingPolicy = "fcfs",
        swap: SwapPlan = NO_SWAP,
        proposer: NgramProposer | None = None,
        encoder_only: bool = False,
        prefill_cost: PrefillCost | None = None,
    ) -> None:
        self.kv = kv_manager
        # An encoder (bidirectional attention) runs each prompt whole in one step and
        # keeps no KV blocks: its requests take budget but never blocks, and never wait
        # on the prefix cache.
        self.encoder_only = encoder_only
        self.proposer = proposer  # speculative decoding's drafter, or None
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        # With a cost model, a prefill chunk in a step that carries decoding streams is cut
        # to what the budget buys at its depth in the prompt (engine/prefill_cost.py).
        self.prefill_cost = prefill_cost
        self.policy = make_policy(policy)
        self.waiting: list[Request] = []  # kept sorted by policy key
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Swap space (engine/swap_space.py): its free slots (host memory's go first), the
        # slots each swapped-out request holds, and the blocks copied each way so far.
        self.swap = swap
        self.free_swap_slots = SwapSlots(swap)
        self.swapped: dict[str, list[int]] = {}
        self.num_blocks_swapped_out = 0
        self.num_blocks_swapped_in = 0
        # Swapped requests whose disk slots were read ahead (once each; see _read_ahead).
        self._read_ahead_ids: set[str] = set()
        self.num_blocks_read_ahead = 0
        self.num_preemptions = 0

    # ----------------------------------------------------------------- intake
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._enqueue_waiting(request)

    def _enqueue_waiting(self, request: Request) -> None:
        keys = [self.policy.sort_key(r) for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, self.policy.sort_key(request)), request)

    def finish_request(
        self, request: Request, status: RequestStatus, uncache: bool = False
    ) -> None:
        """End a request (stop, length, abort or error) and free everything it holds."""
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request, uncache=uncache)
        self._release_swap_slots(request.request_id)
        self.requests.pop(request.request_id, None)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # --------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self.running.sort(key=self.policy.sort_key)

        # 1. Running requests, best-ranked first. Those not reached yet are the ones that
        #    get preempted when blocks run out, so the policy order is respected.
        shares = StepShares(self.running, self.waiting, budget)
        decoding = any(r.num_tokens - r.num_computed_tokens == 1 for r in self.running)
        units = StepUnits(self.prefill_cost, budget, decoding)
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            assert num_new > 0, request
            if num_new > 1 and self.enable_chunked_prefill:
                # A prefill chunk: within its client's share, after the waiting requests
                # that rank ahead of it (short_first). Held back, it keeps its blocks.
                reserved = self._reserved_ahead_of(request, index)
                num_new = min(num_new, shares.cap(request) - reserved)
                if num_new > 0:
                    num_new = units.cap(num_new, request.num_computed_tokens, reserved)
                if num_new <= 0:
                    index += 1
                    continue
            drafts = self._propose(request, num_new, budget)
            while not self.kv.allocate_slots(request, num_new, num_draft_tokens=len(drafts)):
                if drafts:  # drafts only use free room: try again without them
                    drafts = []
                    continue
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                out.scheduled.append(
                    ScheduledRequest(
                        request, num_new + len(drafts), request.num_computed_tokens, drafts
                    )
                )
                budget -= num_new + len(drafts)
                shares.charge(request, num_new + len(drafts))
                units.charge(num_new + len(drafts), request.num_computed_tokens, num_new > 1)
                out.num_draft_tokens += len(drafts)
                index += 1
                continue
            break  # the request preempted itself: nobody behind it can run either

        # 2. Waiting requests, while nothing had to be preempted this step.
        if not out.preempted:
            budget = self._admit_waiting(out, budget, shares, units)

        out.num_batched_tokens = self.max_num_batched_tokens - budget
        if self.swap.disk_blocks and self.swapped:
            self._read_ahead(out)
        now = time.monotonic()
        for item in out.scheduled:
            if item.request.first_scheduled_time is None:
                item.request.first_scheduled_time = now
            out.num_pooling += item.request.pooling is not None
        if CHECK_INVARIANTS:
            self._check_invariants(out)
        return out

    def _propose(self, request: Request, num_new: int, budget: int) -> list[int]:
        """Draft tokens for a decoding request: as many as the budget, the context length
        and its max_tokens leave room for after the token it computes anyway."""
        if self.proposer is None or num_new != request.num_tokens - request.num_computed_tokens:
            return []
        if request.pooling is not None:  # an embedding request samples nothing
            return []
        if num_new != 1:  # still prefilling
            return []
        room = min(budget - 1, self.max_model_len - request.num_tokens)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:  # the last token the request may get needs no draft
            room = min(room, max_tokens - request.num_output_tokens - 1)
        return self.proposer.propose(request, room) if room > 0 else []

    def _reserved_ahead_of(self, request: Request, index: int) -> int:
        """Tokens a running prefill (`request`, at `index` in `running`) leaves to others when
        the policy lets them pass it: one for each running decode ranked behind it (a decode
        never waits for a prefill's chunk), and what the waiting requests that rank ahead of
        it and can be admitted now (room in max_num_seqs and free blocks) want. 0 for
        policies that do not yield (fcfs, priority: today's order)."""
        if not self.policy.yields_prefill:
            return 0
        behind = self.running[index + 1 :]
        reserved = sum(1 for r in behind if r.num_tokens - r.num_computed_tokens == 1)
        key = self.policy.sort_key(request)
        blocks = 0
        room = self.max_num_seqs - len(self.running)
        for waiting in self.waiting[:room]:
            if self.policy.sort_key(waiting) >= key:
                break
            need = waiting.num_tokens - waiting.num_computed_tokens
            blocks += self.kv.blocks_for_prompt(waiting.num_tokens)
            if not self.kv.can_fit(blocks):  # it could not start: do not hold anyone back
                break
            reserved += need
        return reserved

    def _admit_waiting(
        self, out: SchedulerOutput, budget: int, shares: StepShares, units: StepUnits
    ) -> int:
        excluded: set[str | None] = set()  # clients whose share of this step is used up
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            position = shares.pick(self.waiting, self.running, excluded)
            if position is None:
                break
            request = self.waiting[position]
            if self.encoder_only:
                if request.num_tokens > budget:  # no chunks: bidirectional attention
                    break
                self._start(self.waiting.pop(position), request.num_tokens, 0, out)
                budget -= request.num_tokens
                shares.charge(request, request.num_tokens)
                continue
            swap_slots = self.swapped.get(request.request_id)
            hits: GroupBlocks = []
            if swap_slots is not None:  # its computed KV waits in host memory
                num_computed = request.num_computed_tokens
            else:
                hits, num_computed = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_computed
            if not self.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            if num_new > 1 and self.enable_chunked_prefill:
                num_new = min(num_new, shares.cap(request))
                if num_new <= 0:
                    excluded.add(request.client_id)
                    continue
                num_new = units.cap(num_new, num_computed)
                if num_new <= 0:  # the step's units are spent at this prompt's depth
                    break
            if swap_slots is not None:  # blocks for its swapped tokens come with the new ones
                ok = self.kv.allocate_slots(request, num_new)
            else:
                ok = self.kv.allocate_slots(request, num_new, hits)
            if not ok:
                break
            self.waiting.pop(position)
            if swap_slots is not None:
                block_ids = self.kv.held_block_ids(request.request_id, num_computed)
                assert len(block_ids) == len(swap_slots), (request, block_ids, swap_slots)
                out.swap_in.append((block_ids, swap_slots))
                self.num_blocks_swapped_in += len(swap_slots)
                self._release_swap_slots(request.request_id)
            else:
                self.kv.record_prefix_lookup(request.num_tokens, num_computed)
            self._start(request, num_new, num_computed, out)
            budget -= num_new
            shares.charge(request, num_new)
            units.charge(num_new, num_computed, num_new > 1)
        return budget

    def _start(self, request: Request, num_new: int, num_computed: int, out: SchedulerOutput):
        request.num_computed_tokens = num_computed
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        out.scheduled.append(ScheduledRequest(request, num_new, num_computed))

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        # Its blocks hold exactly its computed tokens: it is not scheduled in this step.
        # Only what resuming reads is copied: none of what its sliding windows have left.
        self.kv.trim_to_window(request)
        block_ids = self.kv.held_block_ids(request.request_id, request.num_computed_tokens)
        if block_ids and self.free_swap_slots.num_free >= len(block_ids):
            slots = self.free_swap_slots.take(len(block_ids))
            self.swapped[request.request_id] = slots
            out.swap_out.append((block_ids, slots))
            self.num_blocks_swapped_out += len(slots)
        else:
            request.num_computed_tokens = 0  # recompute from scratch (prefix cache may help)
            if request.pooling is not None:  # an embedding's sum restarts with its rows
                request.pooling.reset()
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(request)
        self._enqueue_waiting(request)

    def _release_swap_slots(self, request_id: str) -> None:
        self.free_swap_slots.give_back(self.swapped.pop(request_id, []))
        self._read_ahead_ids.discard(request_id)

    def _read_ahead(self, out: SchedulerOutput) -> None:
        """Ask for the disk slots of the swapped requests next in line (waiting order)
        to be read into memory during this step, once per swap-out: those whose blocks,
        with the swapped blocks ahead of them in line, fit in the KV cache, i.e. what could
        come back into it next. Not in the step that swaps a request out: its pages were
        just written. The reads are the kernel's (a hint: see SwapSpace.read_ahead); the
        swap-in itself stays where it was, before the step that resumes the request."""
        room = self.kv.pool.num_blocks
        just_out = {request.request_id for request in out.preempted}
        for request in self.waiting:
            slots = self.swapped.get(request.request_id)
            if slots is None:
                continue
            room -= len(slots)
            if room < 0:
                break
            if request.request_id in self._read_ahead_ids or request.request_id in just_out:
                continue
            self._read_ahead_ids.add(request.request_id)
            on_disk = [slot for slot in slots if self.swap.is_on_disk(slot)]
            out.swap_ahead += on_disk
            self.num_blocks_read_ahead += len(on_disk)

    def swapped_blocks(self) -> tuple[int, int]:
        """KV blocks of swapped-out requests now in host memory, and on disk."""
        held = [slot for slots in self.swapped.values() for slot in slots]
        on_disk = sum(1 for slot in held if self.swap.is_on_disk(slot))
        return len(held) - on_disk, on_disk

    # ---------------------------------------------------------- after a step
    def advance(self, item: ScheduledRequest, num_sampled: int) -> None:
        """The step computed `item`'s tokens. Of its draft tokens only the accepted ones
        (num_sampled - 1: the last sampled token is the model's own) stay computed; the
        rejected drafts' keys are stale, overwritten later, and the blocks past the
        request's computed tokens are freed. Committing the sampled tokens is
        engine/output_step.py's."""
        request = item.request
        request.num_computed_tokens += item.num_tokens
        if item.draft_token_ids:
            num_accepted = max(num_sampled - 1, 0)
            assert num_accepted <= len(item.draft_token_ids), (item, num_sampled)
            request.num_computed_tokens -= len(item.draft_token_ids) - num_accepted
            self.kv.free_unused_slots(request)

    # ------------------------------------------------------------- invariants
    def _check_invariants(self, out: SchedulerOutput) -> None:
        total = sum(item.num_tokens for item in out.scheduled)
        assert total == out.num_batched_tokens <= self.max_num_batched_tokens, total
        assert len(self.running) <= self.max_num_seqs, len(self.running)
        seen = set()
        for item in out.scheduled:
            request = item.request
            assert request.request_id not in seen, f"{request} scheduled twice"
            seen.add(request.request_id)
            assert request.status == RequestStatus.RUNNING, request
            assert item.num_tokens > 0
            assert item.start + item.num_tokens <= request.num_tokens + len(item.draft_token_ids)
            if item.draft_token_ids:
                assert item.completes_prompt, request
            if self.encoder_only:
                assert item.start == 0 and item.completes_prompt, request
                continue
            blocks = self.kv.num_entries_of(request.request_id)
            assert blocks >= cdiv(item.start + item.num_tokens, self.kv.block_size), request
        for request in self.waiting:
            assert not request.is_finished, request
