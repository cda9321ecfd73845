"""Scheduler without a model: budgets, chunked prefill, preemption, policies, invariants."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm_integrations.engine.kv_cache_manager import KVCacheManager
from pagedllm_integrations.engine.output_step import commit_step
from pagedllm_integrations.engine.request import Request, RequestStatus
from pagedllm_integrations.engine.sampling_params import SamplingParams
from pagedllm_integrations.engine.scheduler import (
    PriorityPolicy,
    Scheduler,
    SchedulerOutput,
    SchedulingPolicy,
)
from pagedllm_integrations.engine.swap_space import SwapPlan


def make_scheduler(num_blocks=64, block_size=4, budget=32, max_seqs=8, chunked=True, **kw):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=kw.pop("caching", True))
    return Scheduler(kv, max_seqs, budget, max_model_len=1000, enable_chunked_prefill=chunked, **kw)


def make_request(rid: str, prompt_len: int, max_tokens: int = 4, priority: int = 0, start: int = 0):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, list(range(start, start + prompt_len)), params, priority=priority)


def run_step(scheduler: Scheduler, token: int = 7) -> SchedulerOutput:
    """Pretend to run the model: every request whose prompt is done gets `token`."""
    out = scheduler.schedule()
    tokens = [[token] if item.completes_prompt else [] for item in out.scheduled]
    update = commit_step(scheduler, out, tokens)
    assert not update.failed
    return out


def test_prefill_and_decode_share_one_step_within_the_budget():
    scheduler = make_scheduler(budget=10)
    scheduler.add_request(make_request("a", 6))
    run_step(scheduler)  # a: 6 prompt tokens, samples its first token
    scheduler.add_request(make_request("b", 20))
    out = run_step(scheduler)
    got = {item.request.request_id: item.num_tokens for item in out.scheduled}
    assert got == {"a": 1, "b": 9}  # a decodes, b takes the rest of the budget (a chunk)
    assert out.num_batched_tokens == 10


def test_chunked_prefill_on_and_off_block_edges():
    # Budget 6 with block size 4: chunk boundaries fall at 6, 12, 18 (off edges) and 24 (on).
    scheduler = make_scheduler(budget=6, block_size=4)
    request = make_request("a", 24)
    scheduler.add_request(request)
    starts = []
    while request.num_output_tokens == 0:
        out = run_step(scheduler)
        starts.append(out.scheduled[0].start)
        blocks = scheduler.kv.num_blocks_of("a")
        assert blocks == -(-(out.scheduled[0].start + out.scheduled[0].num_tokens) // 4)
    assert starts == [0, 6, 12, 18]
    assert request.num_computed_tokens == 24


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_step():
    scheduler = make_scheduler(budget=10, chunked=False)
    scheduler.add_request(make_request("a", 8))
    scheduler.add_request(make_request("b", 8))
    out = run_step(scheduler)
    assert [i.request.request_id for i in out.scheduled] == ["a"]  # b does not fit whole


def test_max_num_seqs_caps_the_batch():
    scheduler = make_scheduler(max_seqs=3, budget=100)
    for i in range(5):
        scheduler.add_request(make_request(f"r{i}", 2, start=10 * i))
    out = run_step(scheduler)
    assert len(out.scheduled) == 3 and len(scheduler.waiting) == 2


def test_preemption_frees_the_newest_request_and_it_recomputes_later():
    # 6 blocks of 4 tokens; three requests of 7 prompt tokens (2 blocks each) fill them all.
    scheduler = make_scheduler(num_blocks=6, block_size=4, budget=64, caching=False)
    requests = [make_request(f"r{i}", 7, max_tokens=6, start=100 * i) for i in range(3)]
    for r in requests:
        scheduler.add_request(r)
    run_step(scheduler)  # prompts computed (7 tokens in 2 blocks), first tokens sampled
    run_step(scheduler)  # position 7 fills the 2nd block; 9 tokens known now
    out = run_step(scheduler)  # position 8 needs a 3rd block each: someone is preempted
    assert [r.request_id for r in out.preempted] == ["r2"]
    assert requests[2].status == RequestStatus.PREEMPTED and requests[2].num_computed_tokens == 0
    assert scheduler.num_preemptions == 1
    while scheduler.has_unfinished():
        run_step(scheduler)
    assert all(r.num_output_tokens == 6 for r in requests)
    assert scheduler.kv.pool.num_free_blocks == 6


def test_swap_space_keeps_computed_tokens_of_a_preempted_request():
    scheduler = make_scheduler(
        num_blocks=6, block_size=4, budget=64, caching=False, swap=SwapPlan(host_blocks=8)
    )
    requests = [make_request(f"r{i}", 7, max_tokens=6, start=100 * i) for i in range(3)]
    for r in requests:
        scheduler.add_request(r)
    run_step(scheduler)
    run_step(scheduler)
    out = run_step(scheduler)
    assert out.swap_out and out.swap_out[0][1]  # blocks copied to host slots
    victim = out.preempted[0]
    assert victim.num_computed_tokens == 8  # kept, not recomputed
    swapped_in = []
    while scheduler.has_unfinished():
        swapped_in += run_step(scheduler).swap_in
    assert swapped_in and len(swapped_in[0][0]) == len(swapped_in[0][1])
    assert scheduler.kv.pool.num_free_blocks == 6 and scheduler.free_swap_slots.num_free == 8


def test_swap_fills_host_slots_before_disk_slots_and_counts_both_ways():
    # 1 host slot + 8 disk slots: the victim's 2 blocks take the host slot and a disk slot.
    swap = SwapPlan(host_blocks=1, disk_blocks=8, disk_dir="unused-by-the-scheduler")
    scheduler = make_scheduler(num_blocks=6, block_size=4, budget=64, caching=False, swap=swap)
    requests = [make_request(f"r{i}", 7, max_tokens=6, start=100 * i) for i in range(3)]
    for r in requests:
        scheduler.add_request(r)
    run_step(scheduler)
    run_step(scheduler)
    out = run_step(scheduler)
    ((_, slots),) = out.swap_out
    assert sorted(slots) == [0, 1]  # the lowest free slots: host memory's first
    assert scheduler.swapped_blocks() == (1, 1)
    assert scheduler.num_blocks_swapped_out == 2
    while scheduler.has_unfinished():
        run_step(scheduler)
    assert scheduler.num_blocks_swapped_in == 2 and scheduler.swapped_blocks() == (0, 0)
    assert scheduler.free_swap_slots.num_free == 9
    assert scheduler.free_swap_slots.take(2) == [0, 1]  # host memory's slot first again


def test_disk_slots_of_a_swapped_request_are_read_ahead_once_before_it_resumes():
    swap = SwapPlan(host_blocks=1, disk_blocks=8, disk_dir="unused-by-the-scheduler")
    scheduler = make_scheduler(num_blocks=6, block_size=4, budget=64, caching=False, swap=swap)
    for r in [make_request(f"r{i}", 7, max_tokens=6, start=100 * i) for i in range(3)]:
        scheduler.add_request(r)
    run_step(scheduler)
    run_step(scheduler)
    out = run_step(scheduler)
    ((_, slots),) = out.swap_out
    assert out.swap_ahead == []  # its pages were written in this very step
    read_ahead, resumed_at, step = [], None, 0
    while scheduler.has_unfinished():
        out = run_step(scheduler)
        step += 1
        read_ahead.append(out.swap_ahead)
        if out.swap_in and resumed_at is None:
            resumed_at = step
    disk_slots = [slot for slot in slots if swap.is_on_disk(slot)]
    assert read_ahead[0] == disk_slots  # the next step, before the swap-in
    assert resumed_at is not None and resumed_at > 1
    assert [slot for step in read_ahead for slot in step] == disk_slots  # once, not again
    assert scheduler.num_blocks_read_ahead == len(disk_slots)


def test_priority_policy_serves_urgent_requests_first_and_preempts_the_least_urgent():
    scheduler = make_scheduler(max_seqs=1, policy="priority")
    scheduler.add_request(make_request("low", 3, priority=5))
    scheduler.add_request(make_request("urgent", 3, priority=-1, start=50))
    out = run_step(scheduler)
    assert [i.request.request_id for i in out.scheduled] == ["urgent"]
    assert isinstance(scheduler.policy, PriorityPolicy)


def test_a_custom_policy_object_orders_the_queue():
    class ShortestPromptFirst(SchedulingPolicy):
        def sort_key(self, request):
            return (request.num_prompt_tokens, request.arrival_seq)

    scheduler = make_scheduler(max_seqs=1, policy=ShortestPromptFirst())
    scheduler.add_request(make_request("long", 9))
    scheduler.add_request(make_request("short", 2, start=50))
    assert run_step(scheduler).scheduled[0].request.request_id == "short"


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["add", "step", "step", "step", "abort"]),
            st.integers(0, 9),
            st.integers(1, 30),
            st.integers(-2, 2),
        ),
        max_size=80,
    ),
    budget=st.integers(1, 24),
    max_seqs=st.integers(1, 5),
    num_blocks=st.integers(8, 24),
    chunked=st.booleans(),
    policy=st.sampled_from(["fcfs", "priority", "short_first"]),
    clients=st.integers(1, 3),
)
def test_random_add_step_abort_never_leaks_or_breaks_budgets(
    ops, budget, max_seqs, num_blocks, chunked, policy, clients
):
    block_size = 4
    kv = KVCacheManager(num_blocks, block_size)
    max_model_len = num_blocks * block_size  # one sequence always fits the cache
    if not chunked:
        budget = max(budget, max_model_len)
    scheduler = Scheduler(kv, max_seqs, budget, max_model_len, chunked, policy)
    finished: set[str] = set()
    for op, slot, size, priority in ops:
        rid = f"r{slot}"
        if op == "add" and rid not in scheduler.requests:
            prompt = min(size, max_model_len - 1)
            scheduler.add_request(
                Request(
                    rid,
                    [slot % 3] * 4 + list(range(prompt - 4)) if prompt > 4 else list(range(prompt)),
                    SamplingParams(max_tokens=size % 7 + 1, ignore_eos=True),
                    priority=priority,
                    client_id=f"c{slot % clients}",
                )
            )
            finished.discard(rid)
        elif op == "abort" and rid in scheduler.requests:
            scheduler.finish_request(scheduler.requests[rid], RequestStatus.FINISHED_ABORTED)
            finished.add(rid)
        elif op == "step":
            out = run_step(scheduler)  # schedule() asserts its own invariants
            assert out.num_batched_tokens <= budget
            assert len(out.scheduled) <= max_seqs
            assert not {i.request.request_id for i in out.scheduled} & finished
            for item in out.scheduled:  # those that ended in this step must never return
                if item.request.is_finished:
                    finished.add(item.request.request_id)
        kv.pool.check_consistency()
    for _ in range(3000):  # what is left runs to its end: no policy or share stalls a step
        if not scheduler.has_unfinished():
            break
        run_step(scheduler)
    assert not scheduler.has_unfinished(), scheduler.requests
    assert kv.pool.num_free_blocks == num_blocks


def test_every_request_finishes_under_memory_pressure():
    scheduler = make_scheduler(num_blocks=10, block_size=4, budget=16, max_seqs=6)
    requests = [make_request(f"r{i}", 5 + i, max_tokens=10, start=100 * i) for i in range(6)]
    for r in requests:
        scheduler.add_request(r)
    for _ in range(500):
        if not scheduler.has_unfinished():
            break
        run_step(scheduler)
    assert not scheduler.has_unfinished()
    assert all(r.num_output_tokens == 10 for r in requests)
    assert scheduler.num_preemptions > 0
    assert scheduler.kv.pool.num_free_blocks == 10
