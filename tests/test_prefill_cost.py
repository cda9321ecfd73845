"""The depth cap on prefill chunks (engine/prefill_cost.py): its cost model, the scheduler
cutting a deep chunk while streams decode, and the engine doing so with the same tokens."""

from __future__ import annotations

import random

import pytest
from test_scheduler import make_request, make_scheduler, run_step

from pagedllm_integrations import SamplingParams
from pagedllm_integrations.engine.async_engine import AsyncEngine
from pagedllm_integrations.engine.models.config import ModelConfig
from pagedllm_integrations.engine.prefill_cost import MIN_CHUNK_TOKENS, PrefillCost, StepUnits
from pagedllm_integrations.engine.white_box import core_of

SMOLLM2 = {  # the default model's shape (SmolLM2-135M: Llama, GQA 9:3, 30 layers)
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
}


def cost_of(**changes) -> PrefillCost:
    return PrefillCost.for_model(ModelConfig.from_hf_dict({**SMOLLM2, **changes}), "cpu")


def test_a_chunk_costs_more_the_deeper_it_starts():
    cost = cost_of()
    assert cost.units(512, 0) < cost.units(512, 2048) < cost.units(512, 4096)
    # Where one token's attention costs as much as its linears on a CPU: the step times of
    # benchmarks/prefill_chunks.py put it at 770-960 keys for this model.
    crossover = next(d for d in range(0, 5000, 16) if cost.units(1, d) >= 2.0)
    assert 600 <= crossover <= 1100
    # On a GPU attention is not slowed against the linears: deeper before it costs as much.
    gpu = PrefillCost.for_model(ModelConfig.from_hf_dict(SMOLLM2), "cuda")
    assert gpu.units(512, 4096) < cost.units(512, 4096)


def test_the_longest_chunk_that_fits_and_the_floor():
    cost = cost_of()
    assert cost.tokens_within(512, 0, 100, 0) == 100  # what it wants fits: all of it
    deep = cost.tokens_within(512, 3584, 512, 0)
    assert 0 < deep < 512
    assert cost.units(deep, 3584) <= 512 < cost.units(deep + 1, 3584)
    # Nothing fits: the floor still moves the prompt, and never past what it wants.
    assert cost.tokens_within(1, 30000, 512, MIN_CHUNK_TOKENS) == MIN_CHUNK_TOKENS
    assert cost.tokens_within(1, 30000, 5, MIN_CHUNK_TOKENS) == 5
    assert cost.tokens_within(1, 30000, 512, 0) == 0


def test_sliding_layers_cost_no_more_past_their_window():
    windowed = cost_of(architectures=["MistralForCausalLM"], sliding_window=256)
    assert windowed.units(64, 10_000) == windowed.units(64, 256)
    assert cost_of().units(64, 10_000) > cost_of().units(64, 256)


def test_a_mixture_counts_the_routed_experts_only():
    moe = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "num_experts": 64,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 384,
        "head_dim": 64,
    }
    routed_4 = cost_of(**moe)
    routed_8 = cost_of(**{**moe, "num_experts_per_tok": 8})
    # More linear work per token: the same attention is a smaller share of it.
    assert routed_8.units(256, 4096) < routed_4.units(256, 4096)


def test_step_units_cap_only_while_streams_decode():
    cost = cost_of()
    idle = StepUnits(cost, 512, decoding=False)
    assert idle.cap(512, 3584) == 512  # no stream waits on this step: the token budget
    busy = StepUnits(cost, 512, decoding=True)
    first = busy.cap(512, 3584)
    assert first == cost.tokens_within(512, 3584, 512, 0)
    busy.charge(first, 3584, prefill=True)
    assert busy.cap(512, 3584 + first) == 0  # the budget is spent; no floor after the first


def decode_then_deep_prefill(cost: PrefillCost | None):
    """A scheduler (budget 512) with one stream decoding and a prompt at depth 3,584."""
    scheduler = make_scheduler(num_blocks=2048, block_size=16, budget=512, prefill_cost=cost)
    scheduler.add_request(make_request("stream", 8, max_tokens=100))
    run_step(scheduler)  # its prompt, and its first token: it decodes from now on
    long = make_request("long", 4096, max_tokens=1, start=100)
    scheduler.add_request(long)
    chunks = []
    while long.num_output_tokens == 0:
        out = run_step(scheduler)
        got = {item.request.request_id: item for item in out.scheduled}
        assert got["stream"].num_tokens == 1  # the stream gets its token every step
        chunks.append((got["long"].start, got["long"].num_tokens))
    return chunks


def test_the_scheduler_cuts_deep_chunks_beside_a_decoding_stream():
    cost = cost_of()
    capped = decode_then_deep_prefill(cost)
    uncapped = decode_then_deep_prefill(None)
    assert all(n == 511 for _, n in uncapped[:-1])  # the token budget, less the decode
    # Every capped chunk's step fits the budget in token units (the stream's token too).
    assert all(cost.units(n, start) + 1 <= 512 for start, n in capped)
    assert capped[-1][1] < 200  # deep in the prompt the chunks are short
    # The whole prompt is computed either way, in order.
    for chunks in (capped, uncapped):
        assert sum(n for _, n in chunks) == 4096
        assert [s for s, _ in chunks] == [sum(n for _, n in chunks[:i]) for i in range(len(chunks))]


def test_admitted_prompts_are_capped_at_the_depth_their_cached_prefix_reaches():
    cost = cost_of()
    scheduler = make_scheduler(num_blocks=2048, block_size=16, budget=512, prefill_cost=cost)
    warm = make_request("warm", 4096, max_tokens=1, start=100)
    scheduler.add_request(warm)
    while warm.num_output_tokens == 0:
        run_step(scheduler)  # the prompt is now in the prefix cache
    scheduler.add_request(make_request("stream", 8, max_tokens=100))
    run_step(scheduler)
    scheduler.add_request(make_request("again", 4096 + 512, max_tokens=1, start=100))
    out = run_step(scheduler)
    item = {i.request.request_id: i for i in out.scheduled}["again"]
    assert item.start >= 4000  # from the cache
    assert cost.units(item.num_tokens, item.start) + 1 <= 512 < cost.units(512, item.start)


@pytest.mark.parametrize("streams", [2])
def test_a_long_prompt_beside_decoding_streams_gets_the_same_tokens(streams):
    """End to end on the default model: with streams decoding, the long prompt's chunks are
    cut by depth (recorded from the scheduler's own outputs) and its greedy tokens equal a
    run of it alone in full 512-token chunks."""
    rng = random.Random(3)
    prompt = [rng.randint(1000, 48000) for _ in range(2048)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with AsyncEngine(max_model_len=2304, max_num_batched_tokens=512) as engine:
        alone = engine.add_request({"prompt_token_ids": prompt}, greedy).result()
        core = core_of(engine)
        assert core.scheduler.prefill_cost is not None  # the default: on
        engine.reset_prefix_cache()
        chunks: list[tuple[int, int]] = []
        schedule = core.scheduler.schedule

        def recording_schedule():  # runs on the engine thread
            out = schedule()
            decodes = sum(1 for item in out.scheduled if item.num_tokens == 1)
            for item in out.scheduled:
                if item.request.request_id == "long" and decodes:
                    chunks.append((item.start, item.num_tokens))
            return out

        core.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
        decode = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
        handles = [
            engine.add_request({"prompt_token_ids": [1000 + i] * 16}, decode)
            for i in range(streams)
        ]
        for handle in handles:
            next(iter(handle))  # decoding now
        beside = engine.add_request(
            {"prompt_token_ids": prompt}, greedy, request_id="long"
        ).result()
        for handle in handles:
            engine.abort(handle.request_id)
            handle.result()
        assert engine.num_free_blocks() == engine.num_total_blocks()
    assert beside.outputs[0].token_ids == alone.outputs[0].token_ids
    assert chunks and max(n for _, n in chunks) < 512
    assert any(n < 256 for start, n in chunks if start >= 1536)  # deep chunks are cut
