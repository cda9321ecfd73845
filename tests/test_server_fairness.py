"""Fair admission across clients, over HTTP (issue 42's two cases at small scale).

A client is its `user` field, its X-PagedLLM-User header, or its address (server/clients.py).
One client's large request takes that client's share, never the server: a request larger
than the share is a 400 that says the limit, a client at its share gets a 429, and another
client's chat is served meanwhile. In the engine each step's token budget is shared between
clients, so a burst of long prompts from one client does not hold another's chat back.
"""

from __future__ import annotations

import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedllm_integrations import EngineConfig, shared_engine
from pagedllm_integrations.server.app import create_app
from pagedllm_integrations.server.clients import CLIENT_HEADER
from pagedllm_integrations.server.testing import ThreadedServer

MODEL = "smol-test"
# A small step budget: a long prompt takes many steps, as an 8k prompt does at full scale.
ENGINE_ARGS = dict(
    max_model_len=2048, max_num_seqs=32, max_num_batched_tokens=64, kv_cache_memory=256 << 20
)
PER_CLIENT = 4
QUEUE = 16


@pytest.fixture(scope="module")
def engine():
    return shared_engine(EngineConfig(disable_log_stats=True, **ENGINE_ARGS))


@pytest.fixture(scope="module")
def server(engine):
    app = create_app(
        engine, served_model_name=MODEL, max_queue_len=QUEUE, max_seqs_per_client=PER_CLIENT
    )
    with ThreadedServer(app) as running:
        yield running


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def chat(http: httpx.Client, user: str) -> httpx.Response:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 4,
        "user": user,
    }
    return http.post("/v1/chat/completions", json=body)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def client_samples(url: str) -> dict[tuple[str, str, str], float]:
    found = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name.startswith("pagedllm:client_sequences_"):
                key = (sample.name, sample.labels["client"], sample.labels.get("reason", ""))
                found[key] = sample.value
    return found


def test_a_request_larger_than_a_clients_share_is_a_400_that_says_the_limit(http):
    # The n=128 x 4 prompts, scaled: 4 prompts x n=4 = 16 sequences, share 4.
    body = {"model": MODEL, "prompt": ["a", "b", "c", "d"], "n": 4, "max_tokens": 4}
    error = error_of(http.post("/v1/completions", json={**body, "user": "big"}), 400)
    assert f"at most {PER_CLIENT}" in error["message"] and "16 sequences" in error["message"]
    assert error["code"] == "client_limit_exceeded"
    assert chat(http, "someone-else").status_code == 200  # nobody else is refused


def test_a_client_at_its_share_gets_429_while_another_clients_chat_is_served(server, http):
    body = {
        "model": MODEL,
        "prompt": ["one", "two"],
        "n": 2,  # 4 sequences: exactly the share
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
        "user": "heavy",
    }
    with http.stream("POST", "/v1/completions", json=body) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # it is running
        again = {**body, "prompt": "three", "n": 1, "stream": False, "max_tokens": 2}
        error = error_of(http.post("/v1/completions", json=again), 429)
        assert error["code"] == "client_queue_full" and f"at most {PER_CLIENT}" in error["message"]
        # The same client named by the header instead of the field is the same client.
        del again["user"]
        headers = {CLIENT_HEADER: "heavy"}
        error_of(http.post("/v1/completions", json=again, headers=headers), 429)
        served = chat(http, "light")  # another client, while the heavy one streams
        assert served.status_code == 200, served.text
        assert served.json()["choices"][0]["message"]["content"]
    samples = client_samples(server.url)
    admitted = "pagedllm:client_sequences_admitted_total"
    refused = "pagedllm:client_sequences_refused_total"
    assert samples[(admitted, "user:heavy", "")] >= 4
    assert samples[(refused, "user:heavy", "client_queue_full")] >= 2
    assert samples[(admitted, "user:light", "")] >= 1
    # Every sequence of the heavy client ended (its stream was closed): it may send again.
    for _ in range(200):
        if chat(http, "heavy").status_code == 200:
            break
    else:
        raise AssertionError("the heavy client's sequences were never released")


def test_a_burst_of_long_prompts_does_not_hold_another_clients_chat(http):
    # The second case, scaled: one request of 4 long, distinct prompts with
    # max_tokens 1 (each prompt takes ~28 steps of the 64-token budget alone), then another
    # client's chat. First come first served, the chat would wait until the last long
    # prompt is admitted, after the first has ended. With fair shares it gets its share of
    # every step and ends before any long prompt has its token.
    prompts = [[1000 + p] + [(37 * i + p) % 5000 + 200 for i in range(1800)] for p in range(4)]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 1, "stream": True, "user": "bulk"}
    admitted = threading.Event()
    first_token = threading.Event()
    result: dict = {}

    def send_bulk() -> None:
        with (
            httpx.Client(base_url=str(http.base_url), timeout=600) as own,
            own.stream("POST", "/v1/completions", json=body) as stream,
        ):
            result["status"] = stream.status_code
            admitted.set()
            chunks = result["chunks"] = []
            for line in stream.iter_lines():
                if line.startswith("data: {"):
                    first_token.set()  # a long prompt has its token
                    chunks.append(line)

    sender = threading.Thread(target=send_bulk)
    sender.start()
    try:
        assert admitted.wait(600)  # the response began: its sequences are in the engine
        served = chat(http, "chatter")
        assert served.status_code == 200, served.text
        chat_ended_first = not first_token.is_set()
    finally:
        sender.join(600)
    assert result["status"] == 200
    assert len(result["chunks"]) >= 4
    assert chat_ended_first, "the chat should end before any of the long prompts"


def test_the_limit_is_checked_when_the_app_is_made(engine):
    with pytest.raises(ValueError, match="max_seqs_per_client"):
        create_app(engine, max_seqs_per_client=0)


def test_the_default_share_is_a_quarter_of_the_queue(engine):
    app = create_app(engine)
    state = app.state.server
    assert state.clients.limit == state.max_queue_len // 4 == 128


def test_serve_takes_the_policy_and_the_per_client_limit():
    import argparse

    from pagedllm_integrations.server.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser, "serve")
    args = parser.parse_args(["--scheduling-policy", "short_first", "--max-seqs-per-client", "8"])
    assert (args.scheduling_policy, args.max_seqs_per_client) == ("short_first", 8)
    defaults = parser.parse_args([])
    assert (defaults.scheduling_policy, defaults.max_seqs_per_client) == ("fcfs", 128)
    with pytest.raises(SystemExit):
        parser.parse_args(["--scheduling-policy", "shortest"])


def test_client_names_come_from_user_then_header_then_address():
    from starlette.requests import Request

    from pagedllm_integrations.server.clients import client_identity

    def request(headers=(), host="10.0.0.7") -> Request:
        raw = [(k.encode(), v.encode()) for k, v in headers]
        return Request({"type": "http", "headers": raw, "client": (host, 5000)})

    assert client_identity(request(), None) == "addr:10.0.0.7"
    assert client_identity(request([(CLIENT_HEADER, "team-a")]), None) == "user:team-a"
    assert client_identity(request([(CLIENT_HEADER, "team-a")]), "bob") == "user:bob"
    long_name = client_identity(request(), "x" * 500)  # bounded, and still one per name
    assert len(long_name) < 80 and long_name != client_identity(request(), "x" * 499)
