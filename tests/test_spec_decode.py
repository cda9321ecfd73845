"""Speculative decoding by prompt lookup, end to end: greedy outputs (and their logprobs)
are the same with speculation on and off under batching, chunked prefill, preemption,
structured outputs, stop strings, n > 1 and streaming; sampled outputs keep the target
distribution; every KV block is free afterwards.

The tiny model here has tied embeddings and small weights, so its greedy text partly
repeats itself and partly does not: drafts are both accepted and rejected. On the CPU fast
path (the default plan) a row's logits do not depend on how many query rows its sequence
runs in a step, which is what makes the on/off identity exact.
"""

from __future__ import annotations

import asyncio

import pytest

from pagedllm_integrations import LLM, AsyncEngine, RequestOutputKind, SamplingParams
from pagedllm_integrations.engine.sampling_params import StructuredOutputsParams
from pagedllm_integrations.engine.white_box import core_of

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
SPEC_MIN1 = {**SPEC, "prompt_lookup_min": 1}
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
PROMPTS = [("one two three four five six seven " * 6) + f"item {i}" for i in range(4)] + [
    "alpha beta gamma " * 10,
    "x y z " * 20,
    "The deposit is 50 euros. The deposit is",
]


@pytest.fixture(scope="module")
def repeating_model(tiny_llama_factory):
    return str(tiny_llama_factory("spec-tied", tie_word_embeddings=True, initializer_range=0.12))


@pytest.fixture(scope="module")
def reference(repeating_model):
    """Greedy outputs without speculation: token ids and each token's logprob entries."""
    with LLM(repeating_model, disable_log_stats=True) as llm:
        return outputs_of(llm.generate(PROMPTS, GREEDY, use_tqdm=False))


def outputs_of(outputs) -> list[tuple[list[int], list]]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def all_blocks_free(llm: LLM) -> bool:
    return llm.engine.num_free_blocks() == core_of(llm).num_blocks


def spec_counts(llm: LLM) -> tuple[int, int]:
    snapshot = llm.engine.counters.snapshot()
    return snapshot["spec_decode_num_draft_tokens"], snapshot["spec_decode_num_accepted_tokens"]


def test_greedy_outputs_and_logprobs_are_identical_with_speculation(repeating_model, reference):
    with LLM(repeating_model, disable_log_stats=True, speculative_config=SPEC_MIN1) as llm:
        got = outputs_of(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        drafted, accepted = spec_counts(llm)
        assert all_blocks_free(llm)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in reference]
    assert [lp for _, lp in got] == [lp for _, lp in reference]  # bitwise: same logits rows
    assert 0 < accepted < drafted  # drafts were both kept and rejected


@pytest.mark.parametrize(
    "settings",
    [
        {"max_num_batched_tokens": 16},  # chunked prefill, drafts cut by the budget
        {"num_kv_blocks": 12, "max_model_len": 128},  # preemption, recompute
        {"num_kv_blocks": 12, "max_model_len": 128, "swap_space": 0.01},  # preemption, swap
        {"max_num_seqs": 2},  # requests wait and join a running batch
    ],
    ids=["chunked", "preempt-recompute", "preempt-swap", "two-seqs"],
)
def test_identity_holds_under_scheduling_pressure(repeating_model, reference, settings):
    with LLM(
        repeating_model, disable_log_stats=True, speculative_config=SPEC_MIN1, **settings
    ) as llm:
        got = outputs_of(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        assert all_blocks_free(llm)
        if "num_kv_blocks" in settings:
            assert llm.engine.counters.snapshot()["num_preemptions"] > 0
        assert spec_counts(llm)[1] > 0
    assert got == reference


def test_structured_outputs_reject_the_drafts_their_grammar_forbids(repeating_model):
    """A regex over the prompt's own words: drafts from the prompt are often allowed,
    sometimes not; the output is the same as without speculation and matches the regex."""
    import re

    regex = r"(one|two|three|four|five|six|seven)( (one|two|three|four|five|six|seven)){3,12}"
    params = SamplingParams(
        temperature=0, max_tokens=48, structured_outputs=StructuredOutputsParams(regex=regex)
    )
    prompts = PROMPTS[:3]
    results = {}
    for spec in (None, SPEC_MIN1):
        with LLM(repeating_model, disable_log_stats=True, speculative_config=spec) as llm:
            results[spec is None] = [
                o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)
            ]
            if spec is not None:
                drafted, accepted = spec_counts(llm)
                assert 0 < accepted < drafted
            assert all_blocks_free(llm)
    assert results[True] == results[False]
    assert all(re.fullmatch(regex, text) for text in results[True]), results[True]


def test_stop_strings_n_and_streaming_agree_with_no_speculation(repeating_model):
    with LLM(repeating_model, disable_log_stats=True) as plain:
        text = plain.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 6]  # ends the text mid-way
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop], n=2)
    engines = {}
    for spec in (None, SPEC_MIN1):
        engine = AsyncEngine(model=repeating_model, disable_log_stats=True, speculative_config=spec)
        try:
            final = engine.add_request(PROMPTS[0], params).result()
            streamed = asyncio.run(stream_text(engine, PROMPTS[0]))
            engines[spec is None] = ([c.text for c in final.outputs], streamed)
            assert [c.finish_reason for c in final.outputs] == ["stop", "stop"]
            assert engine.num_free_blocks() == core_of(engine).num_blocks
        finally:
            engine.shutdown()
    assert engines[True] == engines[False]
    assert engines[True][0] == [text[: text.index(stop)]] * 2
    assert engines[True][1] == text  # deltas add up to the whole text


async def stream_text(engine: AsyncEngine, prompt: str) -> str:
    params = GREEDY.clone(output_kind=RequestOutputKind.DELTA, logprobs=None)
    pieces = []
    async for output in engine.generate(prompt, params):
        pieces.append(output.outputs[0].text)
    return "".join(pieces)


def test_max_tokens_is_exact_and_a_seeded_sample_repeats(repeating_model):
    with LLM(repeating_model, disable_log_stats=True, speculative_config=SPEC_MIN1) as llm:
        short = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
        assert [
            len(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, short, use_tqdm=False)
        ] == [7] * 7
        seeded = SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True, seed=5, n=3)
        first = [c.token_ids for c in llm.generate(PROMPTS[0], seeded, use_tqdm=False)[0].outputs]
        again = [
            c.token_ids
            for c in llm.generate([PROMPTS[5], PROMPTS[0]], seeded, use_tqdm=False)[1].outputs
        ]
        assert first == again  # the same seed gives the same samples, whatever shares the step
        assert all_blocks_free(llm)


def test_the_float32_path_agrees_up_to_near_ties(repeating_model, reference):
    """The torch reference path is not batch-invariant (a 1-row and a 5-row matmul may
    round differently), so identity is only up to ties within rounding: tokens agree until
    the first place where both candidates' logprobs are within 1e-4."""
    with LLM(
        repeating_model, disable_log_stats=True, dtype="float32", speculative_config=SPEC_MIN1
    ) as llm:
        got = outputs_of(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    with LLM(repeating_model, disable_log_stats=True, dtype="float32") as llm:
        expected = outputs_of(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, expected):
        for position, (token, ref_token) in enumerate(zip(tokens, ref_tokens)):
            if token != ref_token:
                candidates = ref_logprobs[position]
                assert token in candidates
                assert abs(candidates[token].logprob - candidates[ref_token].logprob) < 1e-4
                break
            assert logprobs[position][token].logprob == pytest.approx(
                ref_logprobs[position][token].logprob, abs=1e-4
            )


def test_rejection_sampling_on_a_model_keeps_its_distribution(repeating_model):
    """Temperature sampling with and without speculation: the (2nd, 3rd) generated tokens
    of 600 seeded samples follow the same distribution (chi-square test of homogeneity).
    logit_bias confines sampling to four words that fill the prompt, so drafts are
    proposed at every step and accepted or rejected by chance."""
    import torch

    words = ["red", "green", "blue", "gold"]
    with LLM(repeating_model, disable_log_stats=True) as llm:
        ids = [llm.get_tokenizer()(" " + w, add_special_tokens=False).input_ids for w in words]
    assert all(len(i) == 1 for i in ids), ids
    vocab = [i[0] for i in ids]
    prompt = [vocab[j] for j in (0, 0, 1, 1, 2, 2, 3, 3, 1, 1, 0, 0, 3, 3, 2, 2) * 2]
    base = dict(
        temperature=1.0, max_tokens=4, ignore_eos=True, logit_bias=dict.fromkeys(vocab, 100)
    )
    counts = {}
    for spec in (None, {**SPEC_MIN1, "num_speculative_tokens": 2}):
        with LLM(repeating_model, disable_log_stats=True, speculative_config=spec) as llm:
            params = [SamplingParams(seed=i, **base) for i in range(600)]
            outs = llm.generate([{"prompt_token_ids": prompt}] * 600, params, use_tqdm=False)
            pairs = [tuple(o.outputs[0].token_ids[1:]) for o in outs]
            counts[spec is None] = pairs
            if spec is not None:
                drafted, accepted = spec_counts(llm)
                assert 0.1 * drafted < accepted < 0.9 * drafted, (drafted, accepted)
    cells = sorted(set(counts[True]) | set(counts[False]))
    assert set(t for cell in cells for t in cell) <= set(vocab)
    table = torch.tensor(
        [[counts[k].count(c) for c in cells] for k in (True, False)], dtype=torch.float64
    )
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    keep = expected.min(0).values >= 5  # cells too rare for the test are pooled
    pooled = torch.cat([table[:, keep], table[:, ~keep].sum(1, keepdim=True)], dim=1)
    expected = pooled.sum(1, keepdim=True) * pooled.sum(0, keepdim=True) / pooled.sum()
    nonzero = expected[0] > 0
    statistic = float(((pooled - expected)[:, nonzero] ** 2 / expected[:, nonzero]).sum())
    dof = int(nonzero.sum()) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(statistic / 2)))
    assert dof >= 3 and p_value > 1e-3, (p_value, dof, pooled)


def test_the_default_model_answers_a_rag_question_identically_and_faster_per_step(default_llm):
    """The embedded model quoting its context: most drafts are accepted, and the answer is
    the one the engine without speculation gives."""
    context = (
        "Rentals: a city bike costs 15 euros per day, a mountain bike 25 euros per day and "
        "an electric bike 40 euros per day. The deposit is 50 euros per bike, paid by card."
    )
    messages = [
        {"role": "system", "content": "Answer from the context, quoting it."},
        {"role": "user", "content": f"{context}\n\nWhat do the bikes cost per day?"},
    ]
    params = SamplingParams(temperature=0, max_tokens=48)
    expected = default_llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
    with LLM(
        disable_log_stats=True,
        max_model_len=2048,
        kv_cache_memory=256 << 20,
        speculative_config=SPEC,
    ) as llm:
        got = llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
        snapshot = llm.engine.counters.snapshot()
        assert all_blocks_free(llm)
    assert got.token_ids == expected.token_ids
    assert snapshot["spec_decode_acceptance_rate"] > 0.3, snapshot
    assert snapshot["steps"] < len(got.token_ids)  # several tokens per step on average


def test_wrappers_and_the_server_pass_speculation_on(repeating_model, capsys):
    import argparse

    import httpx

    from pagedllm_integrations.engine.factory import create_engine
    from pagedllm_integrations.langchain import ChatPagedLLM
    from pagedllm_integrations.llama_index import PagedLlamaIndexLLM
    from pagedllm_integrations.server.app import create_app
    from pagedllm_integrations.server.testing import ThreadedServer

    chat = ChatPagedLLM(model=repeating_model, engine_kwargs={"speculative_config": SPEC})
    assert chat._config.speculation is not None
    index_llm = PagedLlamaIndexLLM(
        model=repeating_model, engine_kwargs={"speculative_config": SPEC}
    )
    assert index_llm._config.speculation == chat._config.speculation

    from pagedllm_integrations import EngineConfig

    engine = create_engine(
        EngineConfig(model=repeating_model, disable_log_stats=True, speculative_config=SPEC_MIN1)
    )
    try:
        with ThreadedServer(create_app(engine, served_model_name="tiny")) as server:
            body = {"model": "tiny", "prompt": PROMPTS[4], "max_tokens": 24, "temperature": 0}
            assert (
                httpx.post(server.url + "/v1/completions", json=body, timeout=120).status_code
                == 200
            )
            metrics = httpx.get(server.url + "/metrics").text
            from pagedllm_integrations.server import top

            top_args = argparse.Namespace(url=server.url, interval=0.1, api_key=None, iterations=1)
            assert top.run(top_args) == 0
            assert "draft tokens accepted" in capsys.readouterr().out
        assert "pagedllm:spec_decode_num_draft_tokens_total" in metrics
        assert (
            'pagedllm:spec_decode_acceptance_rate_per_pos{model_name="tiny",position="0"}'
            in metrics
        )
    finally:
        engine.shutdown()
