"""PagedLLM (LangChain BaseLLM) on the embedded default model: one engine batch for a
batch of prompts, real token streaming with callbacks, merged stop strings, n candidates,
token usage, logprobs, and VLLM-compatible arguments."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("langchain_core")

from langchain_core.callbacks import BaseCallbackHandler

from pagedllm_integrations.langchain import PagedLLM

# The same settings in every LangChain test file: one shared engine for the whole session.
ENGINE = {"max_model_len": 2048, "kv_cache_memory": 256 << 20}


class TokenRecorder(BaseCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[str] = []

    def on_llm_new_token(self, token: str, **kwargs) -> None:
        self.tokens.append(token)


@pytest.fixture(scope="module")
def llm() -> PagedLLM:
    return PagedLLM(temperature=0, max_new_tokens=24, engine_kwargs=ENGINE)


def test_batch_of_16_prompts_is_one_engine_batch(llm: PagedLLM) -> None:
    engine = llm.engine
    prompts = [f"Counting up: {i}, {i + 1}, {i + 2}," for i in range(16)]
    steps_before = engine.counters.snapshot()["steps"]
    result = llm.generate(prompts, max_tokens=4)
    steps = engine.counters.snapshot()["steps"] - steps_before
    sizes = list(engine.counters.batch_sizes)[-steps:]
    assert len(result.generations) == 16
    assert all(len(g) == 1 and g[0].text.strip() for g in result.generations)
    # All 16 prompts were in the engine together: one step ran every one of them.
    assert max(sizes) >= 16, sizes
    # Not 16 separate runs of ~5 steps each.
    assert steps <= 8, sizes


def test_batch_api_sends_all_prompts_at_once(llm: PagedLLM) -> None:
    engine = llm.engine
    steps_before = engine.counters.snapshot()["steps"]
    texts = llm.batch([f"{i}, {i + 1}, {i + 2}," for i in range(8)], max_tokens=3)
    steps = engine.counters.snapshot()["steps"] - steps_before
    assert len(texts) == 8
    assert max(list(engine.counters.batch_sizes)[-steps:]) >= 8


def test_stream_yields_tokens_and_fires_callbacks(llm: PagedLLM) -> None:
    recorder = TokenRecorder()
    chunks = list(llm.stream("Once upon a time", config={"callbacks": [recorder]}))
    assert len(chunks) > 1
    assert recorder.tokens == chunks
    # Greedy: the stream adds up to exactly what a plain call returns.
    assert "".join(chunks) == llm.invoke("Once upon a time")


def test_astream_yields_tokens_and_fires_callbacks(llm: PagedLLM) -> None:
    recorder = TokenRecorder()

    async def collect() -> list[str]:
        return [c async for c in llm.astream("Once upon a time", config={"callbacks": [recorder]})]

    chunks = asyncio.run(collect())
    assert len(chunks) > 1
    assert recorder.tokens == chunks
    assert "".join(chunks) == llm.invoke("Once upon a time")


def test_stop_from_init_and_from_call_both_cut(llm: PagedLLM) -> None:
    prompt = "1, 2, 3, 4,"
    reference = llm.invoke(prompt)
    assert " 7" in reference and " 9" in reference, reference
    early, late = " 7", " 9"
    cut_early = reference[: reference.index(early)]
    cut_late = reference[: reference.index(late)]

    with_init_stop = PagedLLM(temperature=0, max_new_tokens=24, stop=[late], engine_kwargs=ENGINE)
    assert with_init_stop.invoke(prompt) == cut_late
    # A call-time stop adds to the init-time one (LangChain's VLLM dropped the init one).
    assert with_init_stop.invoke(prompt, stop=[early]) == cut_early
    with_init_early = PagedLLM(temperature=0, max_new_tokens=24, stop=[early], engine_kwargs=ENGINE)
    assert with_init_early.invoke(prompt, stop=[late]) == cut_early
    # Streaming honours both too.
    assert "".join(with_init_stop.stream(prompt, stop=[early])) == cut_early


def test_n_candidates_all_returned_with_usage_and_logprobs() -> None:
    llm = PagedLLM(
        n=3, temperature=1.0, max_new_tokens=6, logprobs=2, ignore_eos=True, engine_kwargs=ENGINE
    )
    result = llm.generate(["The weather today is", "My favourite food is"], seed=7)
    assert [len(g) for g in result.generations] == [3, 3]
    for candidate in result.generations[0]:
        info = candidate.generation_info
        assert info["finish_reason"] == "length"
        assert len(info["logprobs"]) == 6
        assert all(len(t["top_logprobs"]) == 2 for t in info["logprobs"])
        total = sum(t["logprob"] for t in info["logprobs"])
        assert total == pytest.approx(info["cumulative_logprob"], abs=1e-4)
    usage = result.llm_output["token_usage"]
    assert usage["completion_tokens"] == 2 * 3 * 6
    assert usage["prompt_tokens"] == sum(
        len(llm.engine.tokenizer(p).input_ids)
        for p in ["The weather today is", "My favourite food is"]
    )
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert result.llm_output["model_name"] == "SmolLM2-135M-Instruct"


def test_best_of_returns_the_most_likely_samples() -> None:
    llm = PagedLLM(n=2, best_of=5, temperature=1.0, max_new_tokens=4, engine_kwargs=ENGINE)
    (candidates,) = llm.generate(["Hello there"], seed=3, logprobs=0).generations
    assert len(candidates) == 2
    scores = [c.generation_info["cumulative_logprob"] for c in candidates]
    assert scores == sorted(scores, reverse=True)
    # The same five seeded samples, all returned: the two kept are the two best of them.
    everything = PagedLLM(n=5, temperature=1.0, max_new_tokens=4, engine_kwargs=ENGINE)
    (all_five,) = everything.generate(["Hello there"], seed=3, logprobs=0).generations
    best = sorted(c.generation_info["cumulative_logprob"] for c in all_five)[-2:][::-1]
    assert scores == pytest.approx(best)


def test_async_generate_batches_and_matches_sync(llm: PagedLLM) -> None:
    prompts = ["The capital of France is", "Water boils at"]
    sync = [g[0].text for g in llm.generate(prompts).generations]

    async def run() -> list[str]:
        result = await llm.agenerate(prompts)
        return [g[0].text for g in result.generations]

    assert asyncio.run(run()) == sync


def test_vllm_arguments_are_accepted_and_routed() -> None:
    llm = PagedLLM(
        model=None,
        tensor_parallel_size=1,
        trust_remote_code=True,
        n=1,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        temperature=0.0,
        top_p=1.0,
        top_k=-1,
        stop=None,
        ignore_eos=False,
        max_new_tokens=8,
        logprobs=None,
        dtype="auto",
        download_dir=None,
        vllm_kwargs={"max_model_len": 1024, "seed": 5, "repetition_penalty": 1.1},
    )
    assert llm._config.max_model_len == 1024
    # As in vLLM's LLM(...), `seed` in vllm_kwargs is the engine's seed.
    assert llm._config.seed == 5
    assert llm._sampling_extra == {"repetition_penalty": 1.1}
    with pytest.raises(ValueError, match="vllm_kwargs"):
        PagedLLM(vllm_kwargs={"not_a_setting": 1})
    with pytest.raises(ValueError, match="unknown engine argument"):
        PagedLLM(engine_kwargs={"max_model_length": 1})
    with pytest.raises(ValueError, match="best_of"):
        PagedLLM(n=3, best_of=2)


def test_bad_call_argument_is_a_clear_error(llm: PagedLLM) -> None:
    with pytest.raises(ValueError, match="unknown call argument"):
        llm.invoke("Hi", temprature=0.5)
    with pytest.raises(ValueError, match="temperature"):
        llm.invoke("Hi", temperature=-1.0)


def test_identity_and_tracing_params(llm: PagedLLM) -> None:
    assert llm._llm_type == "pagedllm"
    assert llm._identifying_params["model"] == "SmolLM2-135M-Instruct"
    ls = llm._get_ls_params(stop=["x"])
    assert ls["ls_provider"] == "pagedllm"
    assert ls["ls_model_type"] == "llm"
    assert ls["ls_model_name"] == "SmolLM2-135M-Instruct"
    assert llm._get_ls_params(model="other")["ls_model_name"] == "other"


def test_instances_with_equal_settings_share_one_engine(llm: PagedLLM) -> None:
    other = PagedLLM(temperature=0.5, max_new_tokens=3, engine_kwargs=dict(ENGINE))
    assert other.engine is llm.engine


def test_timeout_aborts_the_request(llm: PagedLLM) -> None:
    slow = PagedLLM(max_new_tokens=1500, ignore_eos=True, timeout=0.5, engine_kwargs=ENGINE)
    free_before = llm.engine.num_free_blocks()
    with pytest.raises(TimeoutError):
        slow.invoke("Count forever:")
    assert llm.engine.num_free_blocks() == free_before  # its KV blocks came back
