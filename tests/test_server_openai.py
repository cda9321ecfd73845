"""The real server (uvicorn on a loopback port) driven by the clients people use with it:
the official `openai` SDK (sync, async, streaming), LangChain's ChatOpenAI and LlamaIndex's
OpenAILike. Every greedy answer is checked against the engine's own offline API for the
same prompt, so the HTTP layer is shown to carry the engine's text, tokens and usage intact."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")

from pagedllm_integrations import EngineConfig, SamplingParams, shared_engine  # noqa: E402
from pagedllm_integrations.server.app import create_app  # noqa: E402
from pagedllm_integrations.server.testing import ThreadedServer  # noqa: E402

MODEL = "smol-test"
ENGINE_ARGS = dict(max_model_len=512, max_num_seqs=64, kv_cache_memory=128 << 20)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def engine():
    return shared_engine(EngineConfig(disable_log_stats=True, **ENGINE_ARGS))


@pytest.fixture(scope="module")
def server(engine):
    with ThreadedServer(create_app(engine, served_model_name=MODEL)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def offline(engine, prompt, **params):
    """The engine's answer without HTTP, the reference for every greedy check:
    (text, token ids, finish reason)."""
    params.setdefault("temperature", 0.0)
    *_, final = engine.generate_sync(prompt, SamplingParams(**params))
    output = final.outputs[0]
    return output.text, output.token_ids, output.finish_reason


def chat_ids(engine, messages) -> list[int]:
    text = engine.apply_chat_template(messages)
    return engine.tokenizer(text, add_special_tokens=False).input_ids


def test_models_lists_the_served_name(client, engine):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == engine.max_model_len


def test_completion_matches_the_engine(client, engine):
    prompt = "The capital of France is"
    text, token_ids, _ = offline(engine, prompt, max_tokens=8)
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    choice = response.choices[0]
    assert choice.text == text
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(engine.tokenizer(prompt).input_ids)
    assert response.usage.completion_tokens == len(token_ids) == 8
    assert response.id.startswith("cmpl-") and response.model == MODEL


def test_completion_logprobs_in_openai_shape(client):
    response = client.completions.create(
        model=MODEL, prompt="One, two, three,", max_tokens=4, temperature=0, logprobs=3
    )
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 4
    assert "".join(logprobs.tokens) == response.choices[0].text
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) <= 3 and chosen <= 0.0
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the top token
    assert logprobs.text_offset == [
        sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))
    ]


def test_several_prompts_and_n(client, engine):
    prompts = ["Red, green,", "Monday, Tuesday,"]
    response = client.completions.create(
        model=MODEL, prompt=prompts, n=2, max_tokens=3, seed=3, logprobs=0
    )
    assert sorted(c.index for c in response.choices) == [0, 1, 2, 3]
    # OpenAI counts each prompt once, however many completions it has.
    assert response.usage.prompt_tokens == sum(len(engine.tokenizer(p).input_ids) for p in prompts)
    assert response.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in response.choices)


def test_seed_makes_sampling_reproducible(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=7)
    first = client.completions.create(**kwargs).choices[0].text
    second = client.completions.create(**kwargs).choices[0].text
    assert first == second


def test_stop_string_ends_the_completion(client, engine):
    prompt = "Count: 1, 2, 3, 4, 5,"
    text, _, _ = offline(engine, prompt, max_tokens=12)
    stop = text.strip()[:2] if text.strip() else ","
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop]
    )
    assert response.choices[0].finish_reason == "stop"
    assert stop not in response.choices[0].text
    assert text.startswith(response.choices[0].text)


def test_chat_matches_the_engine(client, engine):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text, token_ids, _ = offline(
        engine, {"prompt_token_ids": chat_ids(engine, messages)}, max_tokens=10
    )
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0
    )
    assert response.choices[0].message.content == text
    assert response.choices[0].message.role == "assistant"
    assert response.usage.prompt_tokens == len(chat_ids(engine, messages))
    assert response.usage.completion_tokens == len(token_ids)


def test_chat_stream_with_usage_and_cached_tokens(client, engine):
    messages = [
        {"role": "system", "content": "You are a terse assistant. " * 6},
        {"role": "user", "content": "Name a colour."},
    ]
    text, token_ids, reason = offline(
        engine, {"prompt_token_ids": chat_ids(engine, messages)}, max_tokens=8
    )
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reason
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == len(token_ids)
    assert usage.prompt_tokens == len(chat_ids(engine, messages))
    # The prompt was just run offline: its full blocks come from the prefix cache.
    assert usage.prompt_tokens_details.cached_tokens >= 16
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_logprobs(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say yes."}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    assert "".join(t.token for t in content) == response.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert bytes(entry.bytes).decode() == entry.token


def test_async_client_concurrent_requests(server, engine):
    prompts = [f"List {i} fruits:" for i in range(1, 5)]
    expected = [offline(engine, p, max_tokens=6)[0] for p in prompts]

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x") as client:
            responses = await asyncio.gather(
                *(
                    client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0)
                    for p in prompts
                )
            )
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Hi"}],
                max_tokens=4,
                stream=True,
            )
            streamed = [chunk async for chunk in stream]
        return [r.choices[0].text for r in responses], streamed

    texts, streamed = asyncio.run(main())
    assert texts == expected
    assert streamed[-1].choices[0].finish_reason in ("length", "stop")


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]}},
            "required": ["city"],
        },
    },
}


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_returns_a_tool_call(client, stream):
    pytest.importorskip("pagedllm_integrations.chat.tool_calls")
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL],
        tool_choice="required",
        max_tokens=64,
        temperature=0,
    )
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls, finish = choice.message.tool_calls, choice.finish_reason
    assert finish == "tool_calls"
    assert len(calls) >= 1
    assert calls[0].function.name == "get_weather" and calls[0].id
    assert json.loads(calls[0].function.arguments)["city"] in ("Paris", "London", "Tokyo")


def test_tool_result_turn(client):
    """The second turn of a tool loop: the call and its result go back in as messages."""
    pytest.importorskip("pagedllm_integrations.chat.tool_calls")
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    response = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"},
        ],
        tools=[WEATHER_TOOL],
        max_tokens=8,
        temperature=0,
    )
    choice = response.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls


def test_langchain_bind_tools(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    pytest.importorskip("pagedllm_integrations.chat.tool_calls")
    llm = langchain_openai.ChatOpenAI(
        base_url=server.url + "/v1", api_key="x", model=MODEL, temperature=0, max_tokens=64
    )
    message = llm.bind_tools([WEATHER_TOOL], tool_choice="any").invoke("Weather in Tokyo?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    assert message.tool_calls[0]["args"]["city"] in ("Paris", "London", "Tokyo")


def test_response_format_json_schema_returns_valid_json(client):
    pytest.importorskip("pagedllm_integrations.engine.structured_outputs")
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Rome"]},
            "rank": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["city", "rank"],
        "additionalProperties": False,
    }
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give a city and its rank as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
        max_tokens=40,
        temperature=0,
    )
    value = json.loads(response.choices[0].message.content)
    assert set(value) == {"city", "rank"}
    assert value["city"] in ("Paris", "Rome") and 1 <= value["rank"] <= 9


def test_langchain_chat_openai(server, engine):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        base_url=server.url + "/v1", api_key="x", model=MODEL, temperature=0, max_tokens=8
    )
    messages = [{"role": "user", "content": "Tell me a joke."}]
    text, _, _ = offline(engine, {"prompt_token_ids": chat_ids(engine, messages)}, max_tokens=8)
    assert llm.invoke("Tell me a joke.").content == text
    assert "".join(chunk.content for chunk in llm.stream("Tell me a joke.")) == text


def test_llama_index_openai_like(server, engine):
    openai_like = pytest.importorskip(
        "llama_index.llms.openai_like",
        reason="llama-index-llms-openai-like is not installed (it pins openai<3)",
    )
    llm = openai_like.OpenAILike(
        model=MODEL,
        api_base=server.url + "/v1",
        api_key="x",
        is_chat_model=True,
        context_window=engine.max_model_len,
        max_tokens=8,
        temperature=0,
    )
    from llama_index.core.llms import ChatMessage

    messages = [{"role": "user", "content": "Tell me a joke."}]
    text, _, _ = offline(engine, {"prompt_token_ids": chat_ids(engine, messages)}, max_tokens=8)
    reply = llm.chat([ChatMessage(role="user", content="Tell me a joke.")])
    assert reply.message.content == text
    streamed = list(llm.stream_chat([ChatMessage(role="user", content="Tell me a joke.")]))
    assert streamed[-1].message.content == text


def test_metrics_parse_with_vllm_names(server, client):
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    text = httpx.get(server.url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "num_preemptions",
        "prompt_tokens",
        "generation_tokens",
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "request_success",
        "kv_swapped_blocks_host",
        "kv_swapped_blocks_disk",
        "kv_blocks_swapped_out",
        "kv_blocks_swapped_in",
        "kv_blocks_swap_read_ahead",
        "kv_disk_tier_blocks",
        "kv_disk_tier_blocks_taken",
        "kv_disk_tier_block_reads",
    ):
        family = families["pagedllm:" + name]
        assert family.samples, name
        assert all(s.labels["model_name"] == MODEL for s in family.samples)
    assert families["pagedllm:generation_tokens"].samples[0].value >= 2


def test_health(server):
    response = httpx.get(server.url + "/health")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_top_renders_from_metrics(server, capsys):
    import argparse

    from pagedllm_integrations.server import top

    args = argparse.Namespace(url=server.url, interval=0.1, api_key=None, iterations=2)
    assert top.run(args) == 0
    out = capsys.readouterr().out
    assert "running" in out and "tokens/s" in out and "KV cache" in out and MODEL in out


def test_example_script_runs_against_a_cli_server():
    """examples/openai_client.py starts `pagedllm serve` itself, runs three calls, stops it."""
    # Its own process group: if it hangs, the server it started goes down with it (killing
    # the script alone would leave an orphaned server holding a GB).
    script = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "openai_client.py"), "--max-tokens", "8"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        stdout, stderr = script.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(script.pid, signal.SIGKILL)
        script.communicate()
        raise
    assert script.returncode == 0, stderr[-3000:]
    assert "completion:" in stdout and "chat:" in stdout and "tool call:" in stdout
