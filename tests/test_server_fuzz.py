"""Hypothesis-generated request bodies against the real server: whatever a client sends to
either POST route, the answer is never a 5xx (nor an error event inside a 200 stream), and
the server still answers afterwards. The values include what issue 17 found breaking a
step or the server: token ids outside the vocabulary, integers past int64, NaN, lone
surrogates, and structures nested past the schema limits and past Python's recursion limit.

Each body is a valid one with up to two fields (present or not) replaced by arbitrary JSON,
so both the validation paths and the generation paths are exercised. `max_tokens` is always
present and small (or broken), so a valid body generates a few tokens only.
"""

from __future__ import annotations

import collections
import json
import sys

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm_integrations import EngineConfig, shared_engine
from pagedllm_integrations.engine.white_box import core_of
from pagedllm_integrations.server.app import create_app
from pagedllm_integrations.server.testing import ThreadedServer

MODEL = "smol-test"
ENGINE_ARGS = dict(max_model_len=512, max_num_seqs=64, kv_cache_memory=128 << 20)
EXAMPLES = 100

FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.fixture(scope="module")
def engine():
    return shared_engine(EngineConfig(disable_log_stats=True, **ENGINE_ARGS))


@pytest.fixture(scope="module")
def http(engine):
    with (
        ThreadedServer(create_app(engine, served_model_name=MODEL, max_queue_len=64)) as server,
        httpx.Client(base_url=server.url, timeout=120) as client,
    ):
        yield client


# Text the tokenizer refuses: lone UTF-16 surrogates (json.dumps sends them as escapes).
surrogates = st.sampled_from(["a\ud800b", "\udc00", "\ud83d", "x\udfff\ud800"])
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-3, 3)
    | st.sampled_from([2**31, 2**63, 2**64, -(2**64), 10**30, 10**40])
    | st.floats(-5, 5)
    | st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e300])
    | st.text(max_size=12)
    | surrogates
)


def nest(depth: int, as_dict: bool) -> object:
    value: object = 1
    for _ in range(depth):
        value = {"a": value} if as_dict else [value]
    return value


# Deep structures: past the schema limit (64), past Python's recursion limit (1000).
deep = st.builds(nest, st.sampled_from([70, 300, 1200]), st.booleans())
junk = (
    st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
        ),
        max_leaves=6,
    )
    | deep
)
text = st.text(max_size=30) | surrogates
word = st.text(min_size=1, max_size=8)
# Mostly ids of the vocabulary, sometimes just past it or far outside it.
token_id = st.integers(0, 49151) | st.sampled_from([49152, 10**6, 2**63 - 1])
# A broken max_tokens: never null and never large, so the body stays cheap whatever else.
bad_max_tokens = st.sampled_from([0, -1, 2.5, "3", "many", [], {}, True])

# Valid values for every field; a body is built from these, then a few fields are broken.
sampling_fields = {
    "model": st.just(MODEL),
    "n": st.integers(1, 2),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "stop": word | st.lists(word, max_size=3),
    "stop_token_ids": st.lists(token_id, max_size=3),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries(
        {"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}
    ),
    "logit_bias": st.dictionaries(token_id.map(str), st.floats(-100, 100), max_size=3),
    "min_tokens": st.integers(0, 3),
    "ignore_eos": st.booleans(),
    "user": text,
}
completion_fields = {
    **sampling_fields,
    "logprobs": st.integers(0, 5),
    "echo": st.booleans(),
    "suffix": st.none(),
    "best_of": st.none(),
}
prompt = (
    st.text(min_size=1, max_size=40)
    | st.lists(token_id, min_size=1, max_size=8)
    | st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=3)
    | st.lists(st.lists(token_id, min_size=1, max_size=4), min_size=1, max_size=2)
)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "developer"]),
        "content": text | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text})),
    },
    optional={"name": word},
)


def nested_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for i in range(levels):
        schema = {"type": "object", "properties": {f"k{i}": schema}}
    return schema


schema = st.sampled_from(
    [
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"type": "string", "maxLength": 3},
        {"enum": ["x", "y"]},
        {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        {"type": "string", "pattern": "(ab){1,5000}"},  # a repetition past the limit
    ]
) | st.builds(nested_schema, st.sampled_from([3, 40, 300]))
tool = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["get_weather", "lookup"])},
            optional={"description": text, "parameters": schema},
        ),
    }
)
chat_fields = {
    **sampling_fields,
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 5),
    "max_completion_tokens": st.integers(1, 3),
    "tools": st.lists(tool, min_size=1, max_size=2, unique_by=lambda t: t["function"]["name"]),
    "tool_choice": st.sampled_from(
        ["none", "auto", "required", {"type": "function", "function": {"name": "get_weather"}}]
    ),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}])
    | st.builds(
        lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}, schema
    ),
}


@st.composite
def bodies(draw, required: dict, optional: dict) -> dict:
    """A valid body, then 0-2 of its fields (present or not) replaced by arbitrary JSON."""
    body = draw(st.fixed_dictionaries({"max_tokens": st.integers(1, 3), **required},
                                      optional=optional))  # fmt: skip
    names = sorted({*required, *optional})
    broken = draw(st.sampled_from([0, 0, 1, 2]))  # half the bodies stay valid
    for name in draw(
        st.lists(st.sampled_from(names), min_size=broken, max_size=broken, unique=True)
    ):
        body[name] = draw(junk)
    # Rare cases compare with a middle value: hypothesis draws the bounds far more often.
    if draw(st.integers(0, 9)) == 5:
        body["max_tokens"] = draw(bad_max_tokens)
    if draw(st.integers(0, 19)) == 10:
        body["model"] = "some-other-model"
    return body


completion_bodies = bodies({"prompt": prompt}, completion_fields)
chat_bodies = bodies({"messages": st.lists(message, min_size=1, max_size=3)}, chat_fields)


STATUSES: collections.Counter = collections.Counter()


def check(http: httpx.Client, path: str, content: bytes, tally: bool = True) -> None:
    headers = {"Content-Type": "application/json"}
    with http.stream("POST", path, content=content, headers=headers) as response:
        text = response.read().decode("utf-8", "replace")
    if tally:
        STATUSES[path, response.status_code] += 1
    assert response.status_code < 500, (content[:500], text[:500])
    if response.status_code != 200:
        error = json.loads(text)["error"]
        assert error["message"] and error["type"]
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", text[-500:]
        for event in events[:-1]:
            assert "error" not in json.loads(event), event
    else:
        assert json.loads(text)["choices"]


def dumps(value: object) -> bytes:
    """JSON with \\u escapes (lone surrogates included); deep values need a deeper stack."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20_000))
    try:
        return json.dumps(value).encode()
    finally:
        sys.setrecursionlimit(limit)


@FUZZ
@given(body=completion_bodies)
def test_fuzz_completions(http, body):
    check(http, "/v1/completions", dumps(body))


@FUZZ
@given(body=chat_bodies)
def test_fuzz_chat(http, body):
    check(http, "/v1/chat/completions", dumps(body))


@settings(max_examples=40, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(raw=st.binary(max_size=64) | junk.map(dumps))
def test_fuzz_raw_bodies(http, raw):
    for path in ("/v1/completions", "/v1/chat/completions"):
        check(http, path, raw, tally=False)


def test_still_answers_after_fuzzing(http, engine):
    print("\nstatus counts:", dict(STATUSES))
    # Both kinds of outcome happened: the fuzzing reached generation, and validation.
    # (Only when the fuzz tests ran in this session: `-k` can select this test alone.)
    for path in ("/v1/completions", "/v1/chat/completions"):
        if any(p == path for p, _ in STATUSES):
            assert STATUSES[path, 200] >= 10 and STATUSES[path, 400] >= 10, dict(STATUSES)
    response = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert response.status_code == 200
    assert http.get("/health").json() == {"status": "ok"}
    assert engine.num_free_blocks() == core_of(engine).num_blocks
