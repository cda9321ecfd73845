"""Bounded loopback load test: 200 streamed completions from 50 concurrent clients, 20 of
which hang up mid-stream. The others must all succeed; afterwards every KV block is free,
and /metrics adds up to exactly what was sent and received."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedllm_integrations import EngineConfig, shared_engine
from pagedllm_integrations.engine.white_box import core_of
from pagedllm_integrations.server.app import create_app
from pagedllm_integrations.server.testing import ThreadedServer

MODEL = "smol-test"
ENGINE_ARGS = dict(max_model_len=512, max_num_seqs=64, kv_cache_memory=128 << 20)
NUM_REQUESTS = 200
NUM_CLIENTS = 50
DISCONNECT_EVERY = 10  # requests 0, 10, 20, ...: 20 hang-ups
MAX_TOKENS = 8
HANGUP_MAX_TOKENS = 64  # long enough that a hang-up always lands before the end


@pytest.fixture(scope="module")
def engine():
    return shared_engine(EngineConfig(disable_log_stats=True, **ENGINE_ARGS))


@pytest.fixture(scope="module")
def served(engine):
    app = create_app(engine, served_model_name=MODEL)
    with ThreadedServer(app) as running:
        yield running, app


def scrape(url: str) -> dict[str, float]:
    """Sample name (+ finished_reason) -> value, summed over other labels."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            name = sample.name
            if "finished_reason" in sample.labels:
                name += ":" + sample.labels["finished_reason"]
            values[name] = values.get(name, 0.0) + sample.value
    return values


def prompt_for(i: int) -> str:
    topics = ["rivers", "mountains", "bread", "engines", "owls", "glass", "rain", "maps"]
    return f"Request {i}. Write one short sentence about {topics[i % len(topics)]}:"


async def one_request(client: httpx.AsyncClient, i: int) -> dict:
    hang_up = i % DISCONNECT_EVERY == 0
    body = {
        "model": MODEL,
        "prompt": prompt_for(i),
        "max_tokens": HANGUP_MAX_TOKENS if hang_up else MAX_TOKENS,
        "ignore_eos": hang_up,
        "temperature": 0.8,
        "seed": i,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": 0,  # each chunk lists its tokens: the client can count them exactly
    }
    result = {"i": i, "hang_up": hang_up, "tokens": 0, "text": "", "usage": None, "done": False}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        result["status"] = response.status_code
        if response.status_code != 200:
            result["error"] = (await response.aread()).decode()
            return result
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                result["done"] = True
                break
            payload = json.loads(data)
            if "error" in payload:
                result["error"] = payload["error"]
                break
            if payload.get("usage"):
                result["usage"] = payload["usage"]
            for choice in payload["choices"]:
                result["text"] += choice["text"]
                result["tokens"] += len(choice["logprobs"]["tokens"])
                result["finish_reason"] = choice["finish_reason"]
            if hang_up and result["tokens"] >= 2:
                break  # leaving the block closes the connection mid-stream
    return result


async def run_load(url: str) -> list[dict]:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(NUM_REQUESTS):
        queue.put_nowait(i)
    results: list[dict] = []

    async def client_loop():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            while not queue.empty():
                results.append(await one_request(client, queue.get_nowait()))

    await asyncio.gather(*(client_loop() for _ in range(NUM_CLIENTS)))
    return results


def test_200_streams_50_clients_20_hang_ups(served, engine):
    server, app = served
    before = scrape(server.url)
    steps_before = engine.counters.snapshot()["steps"]
    started = time.perf_counter()
    results = asyncio.run(run_load(server.url))
    elapsed = time.perf_counter() - started

    assert len(results) == NUM_REQUESTS
    hung_up = [r for r in results if r["hang_up"]]
    completed = [r for r in results if not r["hang_up"]]
    assert len(hung_up) == NUM_REQUESTS // DISCONNECT_EVERY
    bad = [r for r in completed if r["status"] != 200 or "error" in r or not r["done"]]
    assert not bad, bad[:3]
    for r in completed:
        assert r["usage"]["completion_tokens"] == r["tokens"] <= MAX_TOKENS
        assert r["finish_reason"] in ("stop", "length")
        assert r["usage"]["prompt_tokens"] == len(engine.tokenizer(prompt_for(r["i"])).input_ids)
    assert all(r["status"] == 200 and r["tokens"] >= 2 for r in hung_up)

    # Every aborted request is released and every block comes back.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (
        app.state.server.in_flight or engine.num_free_blocks() != core_of(engine).num_blocks
    ):
        time.sleep(0.1)
    assert app.state.server.in_flight == 0
    assert engine.num_free_blocks() == core_of(engine).num_blocks

    after = scrape(server.url)

    def delta(name: str) -> float:
        return after.get("pagedllm:" + name, 0.0) - before.get("pagedllm:" + name, 0.0)

    prompt_tokens = sum(len(engine.tokenizer(prompt_for(i)).input_ids) for i in range(NUM_REQUESTS))
    assert delta("prompt_tokens_total") == prompt_tokens
    finished = {
        reason: delta(f"request_success_total:{reason}")
        for reason in ("stop", "length", "abort", "error")
    }
    assert finished["abort"] == len(hung_up)
    assert finished["stop"] + finished["length"] == len(completed)
    assert finished["error"] == 0
    assert delta("request_prompt_tokens_count") == NUM_REQUESTS
    assert delta("request_prompt_tokens_sum") == prompt_tokens
    # Generated tokens: what the completed clients were sent, plus what the aborted requests
    # made (at least what their clients read before hanging up, at most their max_tokens).
    generated = delta("generation_tokens_total")
    assert delta("request_generation_tokens_sum") == generated
    aborted_generated = generated - sum(r["tokens"] for r in completed)
    assert sum(r["tokens"] for r in hung_up) <= aborted_generated
    assert aborted_generated <= len(hung_up) * HANGUP_MAX_TOKENS
    assert after["pagedllm:num_requests_running"] == after["pagedllm:num_requests_waiting"] == 0
    assert after["pagedllm:kv_cache_usage_perc"] == 0
    assert delta("time_to_first_token_seconds_count") == NUM_REQUESTS

    snapshot = engine.counters.snapshot()
    print(
        f"\n{NUM_REQUESTS} streams, {NUM_CLIENTS} clients: {elapsed:.1f}s, "
        f"{generated:.0f} tokens generated ({generated / elapsed:.1f} tok/s), "
        f"{snapshot['steps'] - steps_before} engine steps, "
        f"largest batch {snapshot['max_seqs_in_step']} sequences"
    )
    assert snapshot["max_seqs_in_step"] > 1  # the concurrent clients were batched

    response = httpx.post(
        server.url + "/v1/completions", json={"prompt": "Still there?", "max_tokens": 2}
    )
    assert response.status_code == 200
