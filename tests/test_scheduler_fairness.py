"""Fair shares across clients and the short_first policy, driven through the scheduler
directly (no model, no clock: arrival times are set by hand)."""

from __future__ import annotations

import pytest

from pagedllm_integrations.engine.client_share import _water_level
from pagedllm_integrations.engine.kv_cache_manager import KVCacheManager
from pagedllm_integrations.engine.output_step import commit_step
from pagedllm_integrations.engine.request import Request, RequestStatus
from pagedllm_integrations.engine.sampling_params import SamplingParams
from pagedllm_integrations.engine.scheduler import Scheduler, SchedulerOutput, make_policy
from pagedllm_integrations.engine.short_first import ShortFirstPolicy, remaining_work


def make_scheduler(budget=32, max_seqs=64, num_blocks=512, policy="fcfs") -> Scheduler:
    kv = KVCacheManager(num_blocks, 4, enable_caching=True)
    return Scheduler(kv, max_seqs, budget, max_model_len=4000, policy=policy)


def req(rid, prompt_len, client=None, max_tokens=1, arrival=0.0, start=0) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    tokens = [start + i for i in range(prompt_len)]
    return Request(rid, tokens, params, client_id=client, arrival_time=arrival)


def step(scheduler: Scheduler) -> SchedulerOutput:
    out = scheduler.schedule()  # asserts the scheduler's invariants (conftest turns them on)
    tokens = [[7] if item.completes_prompt else [] for item in out.scheduled]
    assert not commit_step(scheduler, out, tokens).failed
    return out


def steps_to_first_token(scheduler: Scheduler, request: Request, limit: int = 500) -> int:
    for count in range(1, limit + 1):
        step(scheduler)
        if request.num_output_tokens:
            return count
    raise AssertionError(f"{request} had no token after {limit} steps")


def burst(scheduler: Scheduler, client: str | None, count: int = 16, length: int = 40) -> None:
    for i in range(count):
        scheduler.add_request(req(f"long{i}", length, client, start=1000 * (i + 1)))


def test_water_level_splits_the_budget_and_gives_unused_share_away():
    assert _water_level([100, 100], 32) == 16
    assert _water_level([5, 100], 32) == 27  # the small demand leaves the rest to the other
    assert _water_level([5, 6], 32) == 6  # everything fits: no cap below the largest demand
    assert _water_level([100, 100, 100], 32) == 10


def test_a_second_clients_chat_passes_a_burst_of_long_prompts():
    # The second case at small scale: one client sends 16 prompts of 40 tokens, a
    # second client's chat arrives after them. Tagged by client, the chat gets its token in
    # the next step; untagged (one client, today's first come first served), it waits for
    # every long prompt ahead of it.
    fair = make_scheduler()
    burst(fair, "tenant-a")
    step(fair)
    chat = req("chat", 5, "tenant-b", start=50_000)
    fair.add_request(chat)
    assert steps_to_first_token(fair, chat) == 1

    fcfs = make_scheduler()
    burst(fcfs, None)
    step(fcfs)
    chat = req("chat", 5, None, start=50_000)
    fcfs.add_request(chat)
    assert steps_to_first_token(fcfs, chat) >= 16 * 40 // 32 - 2


def test_a_running_long_prefill_is_held_to_its_clients_share():
    scheduler = make_scheduler(budget=32)
    scheduler.add_request(req("a", 400, "tenant-a", start=0))
    step(scheduler)  # a alone takes the whole budget
    scheduler.add_request(req("b", 400, "tenant-b", start=5000))
    out = step(scheduler)
    assert {i.request.request_id: i.num_tokens for i in out.scheduled} == {"a": 16, "b": 16}
    assert out.num_batched_tokens == 32


def test_the_client_with_fewest_running_requests_is_admitted_next():
    scheduler = make_scheduler(budget=64, max_seqs=4)
    for i in range(3):
        scheduler.add_request(req(f"a{i}", 4, "tenant-a", max_tokens=50, start=100 * i))
    step(scheduler)  # a0..a2 run and decode from now on
    scheduler.add_request(req("a3", 4, "tenant-a", max_tokens=50, start=900))
    scheduler.add_request(req("b0", 4, "tenant-b", max_tokens=50, start=950))
    out = step(scheduler)  # one free seat: b0, although a3 came first
    admitted = [i.request.request_id for i in out.scheduled if i.start == 0]
    assert admitted == ["b0"]


def test_one_client_is_scheduled_exactly_as_without_clients():
    def trace(client):
        scheduler = make_scheduler(budget=16, num_blocks=40, max_seqs=3)
        for i in range(6):
            scheduler.add_request(req(f"r{i}", 10 + 3 * i, client, max_tokens=5, start=100 * i))
        seen = []
        while scheduler.has_unfinished():
            out = step(scheduler)
            seen.append([(i.request.request_id, i.start, i.num_tokens) for i in out.scheduled])
        return seen

    assert trace("only-one") == trace(None)


def test_short_first_orders_waiting_requests_by_remaining_work():
    scheduler = make_scheduler(budget=512, policy="short_first")
    scheduler.add_request(req("long", 300, max_tokens=10, arrival=0.0, start=0))
    scheduler.add_request(req("mid", 60, max_tokens=10, arrival=0.01, start=1000))
    scheduler.add_request(req("short", 8, max_tokens=2, arrival=0.02, start=2000))
    assert [r.request_id for r in scheduler.waiting] == ["short", "mid", "long"]
    fcfs = make_scheduler(budget=512)
    for r in (req("long", 300, arrival=0), req("mid", 60, arrival=0.01, start=1000)):
        fcfs.add_request(r)
    assert [r.request_id for r in fcfs.waiting] == ["long", "mid"]


def test_short_first_lets_a_chat_pass_a_running_long_prefill():
    scheduler = make_scheduler(budget=32, policy="short_first")
    long = req("long", 400, max_tokens=8, arrival=0.0)
    scheduler.add_request(long)
    step(scheduler)
    chat = req("chat", 6, max_tokens=4, arrival=0.05, start=9000)
    scheduler.add_request(chat)
    out = step(scheduler)
    got = {i.request.request_id: i.num_tokens for i in out.scheduled}
    assert got == {"chat": 6, "long": 26}  # the chat's whole prompt, the long one the rest
    assert chat.num_output_tokens == 1
    # Under fcfs the same chat waits until the long prompt is done.
    fcfs = make_scheduler(budget=32)
    fcfs.add_request(req("long", 400, max_tokens=8, arrival=0.0))
    step(fcfs)
    chat = req("chat", 6, max_tokens=4, arrival=0.05, start=9000)
    fcfs.add_request(chat)
    assert steps_to_first_token(fcfs, chat) >= 400 // 32 - 1


def test_short_first_never_holds_a_decode_back_for_a_prefill_chunk():
    # A long request that has waited past its deadline ranks ahead of a newer short one;
    # its prefill chunks still leave one token per step to the short one's decode.
    scheduler = make_scheduler(budget=32, policy=ShortFirstPolicy(aging_tokens_per_s=100.0))
    chat = req("chat", 4, max_tokens=6, arrival=50.0, start=9000)
    scheduler.add_request(chat)
    step(scheduler)  # the chat's prompt: it decodes from now on
    long = req("long", 400, max_tokens=8, arrival=0.0)  # deadline 4.08 s < the chat's 50.06
    scheduler.add_request(long)
    assert scheduler.policy.sort_key(long) < scheduler.policy.sort_key(chat)
    for _ in range(5):
        out = step(scheduler)
        got = {i.request.request_id: i.num_tokens for i in out.scheduled}
        assert got == {"long": 31, "chat": 1}
    assert chat.is_finished


def test_short_first_aging_bounds_the_wait_of_a_long_request():
    # One seat and max_tokens=1: each step serves exactly the best-ranked waiting request.
    # A long request arrives at t=0 with 101 tokens of work; a short one (9 tokens of
    # work) arrives every 50 ms for ever. Ranked by work alone the long one would never
    # run. With aging at 100 tokens/s its deadline is 0 + 101/100 = 1.01 s, so it runs
    # before every short request that arrived after 1.01 s, and only the shorts that
    # arrived before that ran ahead of it.
    policy = ShortFirstPolicy(aging_tokens_per_s=100.0)
    scheduler = make_scheduler(budget=128, max_seqs=1, policy=policy)
    long = req("long", 100, arrival=0.0)
    scheduler.add_request(long)
    deadline = policy.deadline(long)
    assert deadline == pytest.approx(1.01)
    ran_before_long = []
    for k in range(1, 200):
        scheduler.add_request(req(f"s{k}", 8, arrival=0.05 * k, start=10_000 * k))
        out = step(scheduler)
        (item,) = out.scheduled
        if item.request is long:
            break
        ran_before_long.append(item.request)
    else:
        raise AssertionError("the long request never ran")
    assert ran_before_long, "short requests should pass the long one at first"
    assert all(r.arrival_time <= deadline for r in ran_before_long)
    assert long.is_finished


def test_remaining_work_counts_prompt_left_and_output_left():
    request = req("r", 50, max_tokens=20)
    assert remaining_work(request) == 70
    request.num_computed_tokens = 30
    assert remaining_work(request) == 40
    no_max = Request("n", [1, 2, 3], SamplingParams(max_tokens=None))
    assert remaining_work(no_max, default_output=10) == 13


def test_bad_aging_rate_is_refused():
    with pytest.raises(ValueError, match="aging_tokens_per_s"):
        ShortFirstPolicy(aging_tokens_per_s=0)
    with pytest.raises(ValueError, match="short_first"):
        make_policy("shortest")
    assert make_policy("short_first").name == "short_first"


@pytest.mark.parametrize("policy", ["fcfs", "short_first"])
def test_clients_and_short_first_finish_everything_under_memory_pressure(policy):
    scheduler = make_scheduler(budget=16, max_seqs=5, num_blocks=24, policy=policy)
    requests = [
        req(f"r{i}", 5 + 7 * (i % 4), f"c{i % 3}", max_tokens=6, arrival=0.01 * i, start=100 * i)
        for i in range(12)
    ]
    for request in requests:
        scheduler.add_request(request)
    for _ in range(2000):
        if not scheduler.has_unfinished():
            break
        step(scheduler)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in requests)
    assert scheduler.kv.pool.num_free_blocks == 24


def test_short_first_on_the_engine_gives_the_same_greedy_tokens_as_fcfs(default_llm):
    # The order of service changes when each request runs, never what it generates: the
    # default model's batches are bit-exact whatever their mix. Mixed lengths, so that
    # short_first really reorders them and chunks the long ones around the short.
    from pagedllm_integrations import LLM, SamplingParams

    prompts = [
        "Tell me a long story about a lighthouse keeper. " * 30,
        "Hi!",
        "List three rivers.",
        "Describe the water cycle in detail. " * 12,
    ]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (24, 4, 8, 16)]
    expected = [out.outputs[0].token_ids for out in default_llm.generate(prompts, params)]
    llm = LLM(
        disable_log_stats=True, max_model_len=2048, max_num_seqs=32,
        max_num_batched_tokens=64, scheduling_policy="short_first",
    )  # fmt: skip
    try:
        got = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    finally:
        llm.shutdown()
    assert got == expected
