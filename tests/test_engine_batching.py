"""Continuous batching end to end: prefix caching, preemption, concurrency, streaming, abort."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from pagedllm_integrations import LLM, AsyncEngine, RequestOutputKind, SamplingParams
from pagedllm_integrations.engine.swap_space import SwapPlan, SwapSpace
from pagedllm_integrations.engine.white_box import core_of

GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama_dir):
    engine = AsyncEngine(model=str(tiny_llama_dir), disable_log_stats=True, max_num_seqs=64)
    yield engine
    engine.shutdown()


def prompts_for_concurrency(n: int) -> list[str]:
    topics = ["rivers", "stars", "bread", "trains", "music", "glaciers", "owls", "maps"]
    return [
        f"Question {i}: tell me about {topics[i % len(topics)]} number {i * 7}." for i in range(n)
    ]


def solo_outputs(
    engine: AsyncEngine, prompts: list[str], params: SamplingParams
) -> list[list[int]]:
    return [engine.add_request(p, params).result().outputs[0].token_ids for p in prompts]


def all_blocks_free(engine: AsyncEngine) -> bool:
    return engine.num_free_blocks() == core_of(engine).num_blocks


def test_prefix_caching_on_and_off_give_identical_greedy_outputs(tiny_llama_dir):
    system = "You are a careful assistant. " * 30
    prompts = [system + q for q in ("Name a fruit.", "Name a colour.", "Name a city.")]
    results = {}
    for caching in (True, False):
        with LLM(str(tiny_llama_dir), enable_prefix_caching=caching, disable_log_stats=True) as llm:
            first = llm.generate(prompts[0], GREEDY, use_tqdm=False)
            rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
            results[caching] = [o.outputs[0].token_ids for o in first + rest]
            cached = [o.num_cached_tokens for o in rest]
            if caching:
                shared_blocks = len(llm.get_tokenizer()(system).input_ids) // 16
                assert all(c >= (shared_blocks - 1) * 16 for c in cached), cached
            else:
                assert cached == [0, 0]
    assert results[True] == results[False]


def test_a_shared_system_prompt_is_computed_once_on_the_default_model(default_llm):
    default_llm.reset_prefix_cache()
    system = "You answer questions about the Harbor Lane bicycle shop. " * 40  # ~480 tokens
    first = default_llm.generate(system + "When does it open?", GREEDY, use_tqdm=False)[0]
    second = default_llm.generate(system + "Where is it?", GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    prompt_len = len(second.prompt_token_ids)
    # Everything but the tail of the shared text (a partial block) and the new question hits.
    assert second.num_cached_tokens >= prompt_len - 32
    assert second.num_cached_tokens % 16 == 0


def test_preemption_under_a_tiny_kv_budget_keeps_every_output_and_frees_every_block(
    tiny_llama_dir,
):
    prompts = prompts_for_concurrency(12)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(str(tiny_llama_dir), disable_log_stats=True) as roomy:
        expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    # 12 requests x ~56 tokens need ~48 blocks of 16; give them 10.
    with LLM(
        str(tiny_llama_dir), num_kv_blocks=10, max_model_len=128, disable_log_stats=True
    ) as tight:
        outputs = tight.generate(prompts, params, use_tqdm=False)
        stats = tight.engine.counters.snapshot()
        assert stats["num_preemptions"] > 0
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert all_blocks_free(tight.engine)


def test_swapping_preempted_requests_to_host_memory_keeps_outputs(tiny_llama_dir):
    prompts = prompts_for_concurrency(8)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(str(tiny_llama_dir), disable_log_stats=True) as roomy:
        expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    with LLM(
        str(tiny_llama_dir),
        num_kv_blocks=10,
        max_model_len=128,
        swap_space=0.01,
        enable_prefix_caching=False,
        disable_log_stats=True,
    ) as tight:
        outputs = tight.generate(prompts, params, use_tqdm=False)
        assert tight.engine.counters.snapshot()["num_preemptions"] > 0
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert all_blocks_free(tight.engine)


def test_swapping_preempted_requests_to_disk_keeps_outputs_and_leaves_no_file(
    tiny_llama_dir, tmp_path
):
    prompts = prompts_for_concurrency(8)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(str(tiny_llama_dir), disable_log_stats=True) as roomy:
        expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    swap_dir = tmp_path / "swap"
    swap_dir.mkdir()
    # No host swap space: every preempted block goes to the disk tier's file.
    with LLM(
        str(tiny_llama_dir),
        num_kv_blocks=10,
        max_model_len=128,
        swap_disk_space=0.01,
        swap_dir=str(swap_dir),
        enable_prefix_caching=False,
        disable_log_stats=True,
    ) as tight:
        outputs = tight.generate(prompts, params, use_tqdm=False)
        stats = tight.engine.counters.snapshot()
        assert stats["num_preemptions"] > 0
        assert stats["blocks_swapped_out"] > 0
        assert stats["blocks_swapped_in"] == stats["blocks_swapped_out"]
        # Requests waiting for their turn had their blocks read ahead of the swap-in.
        assert 0 < stats["blocks_swap_read_ahead"] <= stats["blocks_swapped_out"]
        assert (stats["swapped_blocks_host"], stats["swapped_blocks_disk"]) == (0, 0)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert all_blocks_free(tight.engine)
        assert list(swap_dir.iterdir()) == []  # the swap file has no name, even while in use


class _MadviseLog:
    """Stands in for the swap file's mmap and records each madvise call."""

    def __init__(self, mapping):
        self.mapping, self.calls = mapping, []

    def madvise(self, option, start, length):
        self.calls.append((option, start, length))
        self.mapping.madvise(option, start, length)  # the real call must accept it too

    def close(self):
        self.mapping.close()


def test_read_ahead_asks_for_the_pages_of_the_named_disk_slots_in_every_layer(tmp_path):
    import mmap

    plan = SwapPlan(host_blocks=2, disk_blocks=40, disk_dir=str(tmp_path))
    k_shape, v_shape = (10, 16, 2, 8), (10, 16, 2, 16)  # v rows twice k's: two row sizes
    space = SwapSpace(plan, k_shape, v_shape, num_layers=3, dtype=torch.float32)
    log = space._mapping = _MadviseLog(space._mapping)
    base = space._disk_base
    space.read_ahead([0, 1])  # host slots: nothing to read
    assert log.calls == []
    slots = [5, 6, 7, 20, 41]  # tier slots 3, 4, 5, 18, 39: two runs and a single
    space.read_ahead(slots)
    ranges = [(start, start + length) for _, start, length in log.calls]
    assert all(option == mmap.MADV_WILLNEED for option, _, _ in log.calls)
    assert all(start % mmap.PAGESIZE == 0 for start, _ in ranges)
    assert len(ranges) == 3 * 3 * 2  # runs x layers x (key, value)
    wanted = []
    for k, v in space.disk:
        for tensor in (k, v):
            row = tensor[0].numel() * tensor.element_size()
            for slot in slots:
                first = tensor.data_ptr() - base + (slot - plan.host_blocks) * row
                wanted.append((first, first + row))
    for first, end in wanted:  # every byte of every named slot is asked for
        assert any(start <= first and end <= stop for start, stop in ranges), (first, end)
    for start, stop in ranges:  # and nothing more: each ends where a named slot ends and
        assert any(stop == end for _, end in wanted)  # starts less than a page before one
        assert any(0 <= first - start < mmap.PAGESIZE for first, _ in wanted)
    space.close()


def test_swap_settings_that_cannot_work_are_refused(tiny_llama_dir, tmp_path):
    with pytest.raises(ValueError, match="swap_disk_space must be >= 0"):
        LLM(str(tiny_llama_dir), swap_disk_space=-1)
    with pytest.raises(
        ValueError, match="swap_dir is set but swap_disk_space and kv_disk_space are 0"
    ):
        LLM(str(tiny_llama_dir), swap_dir=str(tmp_path))
    with pytest.raises(OSError, match=r"cannot reserve .* GiB of disk in .*lower swap_disk_space"):
        LLM(str(tiny_llama_dir), swap_disk_space=1e6, swap_dir=str(tmp_path))


def test_64_requests_from_8_threads_match_their_solo_outputs_and_stream(tiny_engine):
    prompts = prompts_for_concurrency(64)
    expected = solo_outputs(tiny_engine, prompts, GREEDY)
    results: dict[int, list[int]] = {}
    chunks: dict[int, int] = {}
    delta = GREEDY.clone(output_kind=RequestOutputKind.DELTA)
    before = tiny_engine.counters.snapshot()["max_seqs_in_step"]

    def worker(indexes: list[int]) -> None:
        for i in indexes:
            tokens: list[int] = []
            count = 0
            for output in tiny_engine.generate_sync(prompts[i], delta):
                tokens += output.outputs[0].token_ids
                count += 1
            results[i], chunks[i] = tokens, count

    # Each thread submits its 8 requests one after another, but 8 threads run at once.
    threads = [threading.Thread(target=worker, args=(list(range(t, 64, 8)),)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(64)] == expected
    assert all(chunks[i] > 1 for i in range(64))  # streamed token by token, not in one piece
    assert tiny_engine.counters.snapshot()["max_seqs_in_step"] >= max(before, 2)
    assert all_blocks_free(tiny_engine)


def test_64_requests_from_an_asyncio_loop_match_their_solo_outputs(tiny_engine):
    prompts = prompts_for_concurrency(64)
    expected = solo_outputs(tiny_engine, prompts, GREEDY)
    delta = GREEDY.clone(output_kind=RequestOutputKind.DELTA)

    async def one(prompt: str) -> tuple[list[int], int]:
        tokens, pieces = [], 0
        async for output in tiny_engine.generate(prompt, delta):
            tokens += output.outputs[0].token_ids
            pieces += 1
        return tokens, pieces

    async def main():
        return await asyncio.gather(*(one(p) for p in prompts))

    results = asyncio.run(main())
    assert [tokens for tokens, _ in results] == expected
    assert all(pieces == len(tokens) for tokens, pieces in results)
    assert tiny_engine.counters.snapshot()["max_seqs_in_step"] >= 32
    assert all_blocks_free(tiny_engine)


def test_abort_mid_stream_frees_blocks_and_others_finish(tiny_engine):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    keep = tiny_engine.add_request("keep going", params.clone(max_tokens=30))
    doomed = tiny_engine.add_request("stop me", params)
    for output in doomed:
        if len(output.outputs[0].token_ids) >= 3:
            tiny_engine.abort(doomed.request_id)
    final = output
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert keep.result().outputs[0].finish_reason == "length"
    assert all_blocks_free(tiny_engine)


def test_abandoned_async_stream_aborts_its_request(tiny_engine):
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)

    async def read_two():
        async for output in tiny_engine.generate("abandon me", params):
            if len(output.outputs[0].token_ids) >= 2:
                break  # the generator's cleanup aborts the request

    asyncio.run(read_two())
    # The abort is processed by the engine thread; a round trip through it settles it.
    assert tiny_engine.call(lambda: len(core_of(tiny_engine).groups)) == 0
    assert all_blocks_free(tiny_engine)


def test_duplicate_request_id_is_refused_without_disturbing_the_first(tiny_engine):
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    first = tiny_engine.add_request("one", params, request_id="same-id")
    with pytest.raises(ValueError, match="already in flight"):
        tiny_engine.add_request("two", params, request_id="same-id")
    assert first.result().outputs[0].finish_reason == "length"


def test_parallel_samples_share_the_prompt_blocks(tiny_engine):
    before = tiny_engine.counters.snapshot()["prefix_cache_hits"]
    prompt = "A long prompt that several samples share. " * 12
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=8)
    output = tiny_engine.add_request(prompt, params).result()
    assert len(output.outputs) == 4
    assert len({tuple(o.token_ids) for o in output.outputs}) > 1  # different samples
    full_blocks = (len(output.prompt_token_ids) - 1) // 16
    hits = tiny_engine.counters.snapshot()["prefix_cache_hits"] - before
    assert hits >= 3 * full_blocks * 16  # samples 1..3 reuse sample 0's prompt blocks


def test_priority_scheduling_runs_urgent_requests_first(tiny_llama_dir):
    with LLM(
        str(tiny_llama_dir), scheduling_policy="priority", max_num_seqs=1, disable_log_stats=True
    ) as llm:
        params = SamplingParams(temperature=0, max_tokens=4)
        outputs = llm.generate(
            ["low one", "urgent", "low two"], params, priority=[5, -10, 5], use_tqdm=False
        )
        order = sorted(outputs, key=lambda o: o.metrics.first_token_time)
        assert order[0].prompt == "urgent"


def engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "pagedllm-engine" and t.is_alive()]


def test_an_idle_engine_parks_its_thread_and_wakes_for_the_next_request(tiny_llama_dir):
    """No thread (and so no OpenMP pool) is kept while idle; every command restarts one."""
    import time

    from pagedllm_integrations.engine import async_engine

    engine = AsyncEngine(model=str(tiny_llama_dir), disable_log_stats=True)
    try:
        assert engine.is_running and not engine_threads()  # nothing started before any work
        first = engine.add_request("wake up", GREEDY).result().outputs[0].token_ids
        deadline = time.monotonic() + 10 * async_engine.IDLE_EXIT_SECONDS + 5
        while engine_threads() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine_threads(), "the idle engine thread did not end"
        assert engine.is_running
        # Each kind of command wakes it: a request (same output), a call, an abort.
        assert engine.add_request("wake up", GREEDY).result().outputs[0].token_ids == first
        assert all_blocks_free(engine)
        engine.abort("no-such-request")
        stream = engine.add_request("again", SamplingParams(temperature=0, max_tokens=200))
        engine.abort(stream.request_id)
        assert stream.result().outputs[0].finish_reason == "abort"
        assert all_blocks_free(engine)
    finally:
        engine.shutdown()
    assert not engine.is_running and not engine_threads()


def test_shutting_down_a_parked_engine_refuses_new_requests(tiny_llama_dir):
    from pagedllm_integrations.engine.async_engine import EngineDeadError

    engine = AsyncEngine(model=str(tiny_llama_dir), disable_log_stats=True)
    engine.shutdown()  # its thread never started
    with pytest.raises(EngineDeadError):
        engine.add_request("too late", GREEDY)
