"""What a client can get wrong, over raw HTTP: each mistake gets its status code and OpenAI's
error body, never a 500, and the server keeps answering afterwards."""

from __future__ import annotations

import time

import httpx
import pytest

from pagedllm_integrations import EngineConfig, shared_engine
from pagedllm_integrations.engine.white_box import core_of
from pagedllm_integrations.server.app import create_app
from pagedllm_integrations.server.testing import ThreadedServer

MODEL = "smol-test"
KEY = "sekrit"
ENGINE_ARGS = dict(max_model_len=512, max_num_seqs=64, kv_cache_memory=128 << 20)
QUEUE_LIMIT = 4
BODY_LIMIT = 64 << 10


@pytest.fixture(scope="module")
def engine():
    return shared_engine(EngineConfig(disable_log_stats=True, **ENGINE_ARGS))


@pytest.fixture(scope="module")
def server(engine):
    app = create_app(
        engine,
        served_model_name=MODEL,
        api_key=KEY,
        max_queue_len=QUEUE_LIMIT,
        max_body_bytes=BODY_LIMIT,
    )
    with ThreadedServer(app) as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    ) as client:
        yield client


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param), error
    return error


def post_json(http: httpx.Client, path: str, text: str) -> httpx.Response:
    return http.post(path, content=text.encode(), headers={"Content-Type": "application/json"})


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("text", ['{"prompt": "hi",', "not json", "", "[1, 2]", "42", "null"])
def test_bad_json(http, path, text):
    assert_error(post_json(http, path, text), 400)


def test_bad_json_says_so(http):
    error = assert_error(post_json(http, COMPLETIONS, '{"prompt": '), 400)
    assert "JSON" in error["message"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": 5}, "prompt"),
        ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
        ({"prompt": "hi", "temperature": "hot"}, "temperature"),
        ({"prompt": "hi", "n": 0}, "n"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "hi", "stop": [1, 2]}, "stop"),
        ({"prompt": "hi", "seed": 2**70}, "seed"),
        ({"prompt": "hi", "logit_bias": {"5": 1e9}}, "logit_bias"),
        ({"prompt": "hi", "logprobs": -1}, "logprobs"),
        ({}, "prompt"),
    ],
)
def test_wrong_types_and_ranges_completions(http, body, param):
    assert_error(http.post(COMPLETIONS, json=body), 400, param)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": "hello"}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
        ({"messages": [{"content": "hi"}]}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 99}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": "all"}, "tools"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "x"}},
            "response_format",
        ),
    ],
)
def test_wrong_types_and_ranges_chat(http, body, param):
    assert_error(http.post(CHAT, json=body), 400, param)


@pytest.mark.parametrize("text", ['{"prompt": "hi", "temperature": NaN}',
                                  '{"prompt": "hi", "top_p": Infinity}'])  # fmt: skip
def test_non_finite_numbers(http, text):
    assert_error(post_json(http, COMPLETIONS, text), 400)


@pytest.mark.parametrize("prompt", ["", [], [[]], [""], [-1], [10**9]])
def test_empty_or_invalid_prompt(http, prompt):
    assert_error(http.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 2}), 400)


def test_empty_chat_content_is_not_a_crash(http):
    response = http.post(
        CHAT, json={"messages": [{"role": "user", "content": ""}], "max_tokens": 2}
    )
    assert response.status_code in (200, 400), response.text


def test_prompt_too_long(http, engine):
    long_prompt = "word " * (engine.max_model_len + 10)
    error = assert_error(http.post(COMPLETIONS, json={"prompt": long_prompt}), 400)
    assert "max_model_len" in error["message"]
    error = assert_error(
        http.post(CHAT, json={"messages": [{"role": "user", "content": long_prompt}]}), 400
    )
    assert "max_model_len" in error["message"]


@pytest.mark.parametrize("value", [0, -1])
def test_max_tokens_not_positive(http, value):
    error = assert_error(http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": value}), 400)
    assert "max_tokens" in error["message"]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": value}
    assert_error(http.post(CHAT, json=body), 400)


def test_unsupported_options_are_refused(http):
    assert_error(http.post(COMPLETIONS, json={"prompt": "hi", "suffix": "end"}), 400, "suffix")
    assert_error(http.post(COMPLETIONS, json={"prompt": "hi", "best_of": 3}), 400, "best_of")
    body = {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}
    assert_error(http.post(CHAT, json=body), 400, "top_logprobs")
    body = {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}
    assert_error(http.post(CHAT, json=body), 400, "tool_choice")
    body = {"prompt": "hi", "logit_bias": {"not-a-token": 1}}
    assert_error(http.post(COMPLETIONS, json=body), 400, "logit_bias")


def test_unknown_model_is_404(http):
    error = assert_error(http.post(COMPLETIONS, json={"prompt": "hi", "model": "gpt-9"}), 404)
    assert error["code"] == "model_not_found" and "gpt-9" in error["message"]
    body = {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}
    assert_error(http.post(CHAT, json=body), 404)


def test_unknown_route_and_method(http):
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.get(COMPLETIONS), 405)


def test_api_key_required(server):
    body = {"prompt": "hi", "max_tokens": 1}
    missing = httpx.post(server.url + COMPLETIONS, json=body)
    assert assert_error(missing, 401)["code"] == "invalid_api_key"
    wrong = httpx.post(server.url + COMPLETIONS, json=body, headers={"Authorization": "Bearer x"})
    assert_error(wrong, 401)
    assert_error(httpx.get(server.url + "/metrics"), 401)
    assert_error(httpx.get(server.url + "/v1/models"), 401)
    assert httpx.get(server.url + "/health").status_code == 200  # probes need no key


def test_oversized_body_is_413(http):
    big = {"prompt": "x" * (BODY_LIMIT + 1000), "max_tokens": 1}
    error = assert_error(http.post(COMPLETIONS, json=big), 413)
    assert str(BODY_LIMIT) in error["message"]

    def chunks():  # no Content-Length: the limit must hold while reading
        yield b'{"prompt": "'
        for _ in range(BODY_LIMIT // 1000 + 2):
            yield b"y" * 1000
        yield b'"}'

    chunked = http.post(COMPLETIONS, content=chunks(), headers={"Content-Type": "application/json"})
    assert_error(chunked, 413)


def test_queue_over_limit_is_503_and_recovers(server, http, engine):
    body = {"prompt": "Tell a long story:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    clients = [
        httpx.Client(base_url=server.url, headers=http.headers, timeout=60) for _ in range(2)
    ]
    streams, lines = [], []
    try:
        # Fill the queue: 2 requests x n=2 = 4 sequences, each waited on until it streams.
        for client in clients:
            context = client.stream("POST", COMPLETIONS, json={**body, "n": 2})
            response = context.__enter__()
            streams.append(context)
            assert response.status_code == 200
            # Keep the line iterator: dropping it closes the response, a disconnect.
            lines.append(response.iter_lines())
            next(lines[-1])
        busy = http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 1})
        error = assert_error(busy, 503)
        assert error["code"] == "queue_full"
        too_many = http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 1, "n": 5})
        assert_error(too_many, 400, "n")  # can never fit: not a retryable 503
    finally:
        for context in streams:
            context.__exit__(None, None, None)  # disconnect mid-stream
        for client in clients:
            client.close()
    # The disconnects abort the requests: the slots and every KV block come back.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        response = http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 1})
        if response.status_code == 200:
            break
        assert_error(response, 503)
        time.sleep(0.2)
    assert response.status_code == 200
    while engine.num_free_blocks() != core_of(engine).num_blocks and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine.num_free_blocks() == core_of(engine).num_blocks


def test_client_leaving_a_plain_request_aborts_it(server, http, engine):
    app_state = server.app.state.server
    # As many tokens as the context holds, and a client that leaves after 0.5 s: the
    # request must still be running when the server looks for the disconnect (every
    # 0.25 s). 400 tokens and 1.5 s raced the engine once one stream decoded ~300 tok/s.
    body = {
        "prompt": "Tell a long story:",
        "max_tokens": engine.max_model_len - 32,
        "ignore_eos": True,
    }
    aborted_before = aborted_count(http)
    with pytest.raises(httpx.ReadTimeout):
        http.post(COMPLETIONS, json=body, timeout=0.5)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (
        app_state.in_flight or engine.num_free_blocks() != core_of(engine).num_blocks
    ):
        time.sleep(0.1)
    assert app_state.in_flight == 0
    assert engine.num_free_blocks() == core_of(engine).num_blocks
    assert aborted_count(http) == aborted_before + 1  # aborted, not run to its end


def aborted_count(http: httpx.Client) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if (
                sample.name.endswith("request_success_total")
                and sample.labels["finished_reason"] == "abort"
            ):
                return sample.value
    return 0.0


def test_server_still_answers(http):
    response = http.post(COMPLETIONS, json={"prompt": "Hello", "max_tokens": 2, "model": MODEL})
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] >= 1
    assert http.get("/health").status_code == 200
