"""A server that one client cannot take down (issue 43): each class of abuse reproduced
against the real server, and the fix shown.

Fast (in the default suite): raw-socket clients against a server with short timeouts and
small connection caps; prompts far past the context; a large response held mid-encoding
while /health answers; shutdown with and without a grace period. Slow (`-m slow`): the
issue's own sizes against `pagedllm serve` in a process of its own (256 file descriptors,
300 half-sent requests, 16 chats of 4 MiB, n=128 x 256 tokens x 20 logprobs, SIGTERM with
long streams).
"""

from __future__ import annotations

import json
import socket
import threading
from contextlib import closing

import httpx
import pytest

from pagedllm_integrations import EngineConfig, shared_engine
from pagedllm_integrations.server import responses
from pagedllm_integrations.server.app import create_app
from pagedllm_integrations.server.connections import ConnectionLimits
from pagedllm_integrations.server.testing import ThreadedServer

ENGINE_ARGS = dict(max_model_len=512, max_num_seqs=64, kv_cache_memory=128 << 20)
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
WAIT_S = 60  # a socket read that should end long before: it fails the test, not hangs it
QUICK = ConnectionLimits(header_timeout=1.0, body_timeout=1.0, keep_alive_timeout=1.0)
CAPPED = ConnectionLimits(
    header_timeout=120.0, body_timeout=120.0, keep_alive_timeout=120.0,
    max_connections=6, max_connections_per_client=4,
)  # fmt: skip


@pytest.fixture(scope="module")
def engine():
    return shared_engine(EngineConfig(disable_log_stats=True, **ENGINE_ARGS))


@pytest.fixture(scope="module")
def quick(engine):
    """Timeouts of one second: what a slow or silent client meets."""
    with ThreadedServer(create_app(engine, connection_limits=QUICK)) as running:
        yield running


@pytest.fixture(scope="module")
def capped(engine):
    """Long timeouts, four connections per client address, six in all."""
    with ThreadedServer(create_app(engine, connection_limits=CAPPED)) as running:
        yield running


def connect(server: ThreadedServer, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket()
    sock.settimeout(WAIT_S)
    sock.bind((source, 0))
    sock.connect((server.host, server.port))
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """One response with a Content-Length (status, body), leaving the connection open."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed after {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split()[1]), body


def status_and_error(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


HEALTH = b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n"


# ---------------------------------------------------------------- connection hygiene
def test_a_silent_connection_is_closed(quick):
    with closing(connect(quick)) as sock:
        assert read_until_closed(sock) == b""  # never sent a byte: closed, no answer


def test_a_half_sent_request_head_gets_408_and_is_closed(quick):
    with closing(connect(quick)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Ty")
        status, error = status_and_error(read_until_closed(sock))
    assert status == 408 and error["code"] == "header_timeout"


def test_an_idle_keep_alive_connection_is_closed(quick):
    with closing(connect(quick)) as sock:
        sock.sendall(HEALTH)
        assert read_response(sock)[0] == 200
        assert read_until_closed(sock) == b""  # idle past the keep-alive timeout


def test_a_slow_body_gets_408_and_is_closed(quick):
    with closing(connect(quick)) as sock:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n"
        sock.sendall(head + b'{"prompt": ')  # 11 of the 100 bytes, then nothing
        status, error = status_and_error(read_until_closed(sock))
    assert status == 408 and error["code"] == "body_timeout"


def test_a_declared_oversized_body_gets_413_without_being_sent(capped):
    """A 4 GiB Content-Length and no body: answered at once (the body timeout here is two
    minutes; before the fix nothing ever answered)."""
    with closing(connect(capped)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 4294967296\r\n\r\n"
        )
        status, body = read_response(sock)
    assert status == 413
    assert json.loads(body)["error"]["code"] == "body_too_large"


def test_connections_are_capped_per_client_and_in_all(capped):
    held = []
    try:
        for _ in range(4):  # the per-client limit, each one admitted (it answers)
            held.append(connect(capped))
            held[-1].sendall(HEALTH)
            assert read_response(held[-1])[0] == 200
        with closing(connect(capped)) as fifth:
            status, error = status_and_error(read_until_closed(fifth))
        assert status == 429 and error["code"] == "too_many_connections"
        # Another address is not held back by the first one's connections...
        other = connect(capped, "127.0.0.2")
        held.append(other)
        other.sendall(HEALTH)
        assert read_response(other)[0] == 200
        held.append(connect(capped, "127.0.0.2"))
        held[-1].sendall(HEALTH)
        assert read_response(held[-1])[0] == 200
        # ...until the server's own limit (6) is reached.
        with closing(connect(capped, "127.0.0.3")) as seventh:
            status, error = status_and_error(read_until_closed(seventh))
        assert status == 503 and error["code"] == "too_many_connections"
    finally:
        for sock in held:
            sock.close()
    # Closed connections are released: the first address is admitted again.
    for _ in range(200):
        with closing(connect(capped)) as sock:
            sock.sendall(HEALTH)
            reply = read_until_closed_or_response(sock)
        if reply == 200:
            break
    assert reply == 200


def read_until_closed_or_response(sock: socket.socket) -> int:
    data = sock.recv(65536)
    return int(data.split()[1]) if data else 0


# ---------------------------------------------------------------- early refusal
def test_a_prompt_far_past_the_context_is_refused_before_tokenizing(quick, engine):
    huge = "many words of text " * 200_000  # 3.8 MB: ~800k tokens, the context is 512
    with httpx.Client(base_url=quick.url, timeout=WAIT_S) as http:
        for path, body in [
            (COMPLETIONS, {"prompt": huge, "max_tokens": 1}),
            (CHAT, {"messages": [{"role": "user", "content": huge}], "max_tokens": 1}),
        ]:
            response = http.post(path, json=body)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["code"] == "context_length_exceeded"
            # Only the character bound says this: no token was counted.
            assert "characters" in error["message"] and "max_model_len" in error["message"]


def test_the_bound_never_refuses_a_prompt_that_fits(quick, engine):
    """The longest token of this tokenizer is a newline and 80 spaces: a prompt of it
    repeated has exactly one token per 81 characters, as tight as the bound can be."""
    longest = "\n" + " " * 80
    assert quick.app.state.server.prompt_bound.token_chars == len(longest)
    max_len = engine.max_model_len
    fits = longest * (max_len - 1)  # max_len - 1 tokens and one to generate
    assert len(engine.tokenizer(fits).input_ids) == max_len - 1
    with httpx.Client(base_url=quick.url, timeout=WAIT_S) as http:
        ok = http.post(COMPLETIONS, json={"prompt": fits, "max_tokens": 1})
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["prompt_tokens"] == max_len - 1
        too_long = http.post(COMPLETIONS, json={"prompt": fits + longest, "max_tokens": 1})
    assert too_long.status_code == 400
    assert "characters" in too_long.json()["error"]["message"]


# ---------------------------------------------------------------- off the event loop
def test_a_large_response_is_encoded_off_the_event_loop(quick, monkeypatch):
    """The encoding of a plain response is held until /health has answered: on the event
    loop, /health could not answer and the hold would never end."""
    entered, health_answered = threading.Event(), threading.Event()
    real = responses.encode_json

    def held_encode(payload):
        entered.set()
        assert health_answered.wait(WAIT_S), "/health did not answer while a response encoded"
        return real(payload)

    monkeypatch.setattr(responses, "encode_json", held_encode)
    body = {"prompt": "Once upon a time", "n": 8, "max_tokens": 12, "logprobs": 5}
    result: dict = {}

    def post() -> None:
        with httpx.Client(base_url=quick.url, timeout=WAIT_S * 2) as http:
            result["response"] = http.post(COMPLETIONS, json=body)

    poster = threading.Thread(target=post)
    poster.start()
    assert entered.wait(WAIT_S)
    with httpx.Client(base_url=quick.url, timeout=WAIT_S) as http:
        assert http.get("/health").status_code == 200
    health_answered.set()
    poster.join(WAIT_S * 2)
    response = result["response"]
    assert response.status_code == 200
    choices = response.json()["choices"]
    assert len(choices) == 8 and all(len(c["logprobs"]["tokens"]) == 12 for c in choices)


def test_the_piecewise_encoding_is_starlettes_byte_for_byte():
    from starlette.responses import JSONResponse

    payload = {
        "id": "x",
        "choices": [{"text": "é\u2028\U0001f600", "logprobs": {"a": [1.5, -2e-9]}}] * 3,
        "usage": {"prompt_tokens": 1},
        "empty": [],
    }
    assert responses.encode_json(payload) == JSONResponse(payload).body
    assert responses.encode_json({"choices": []}) == JSONResponse({"choices": []}).body


# ---------------------------------------------------------------- shutdown
LONG_STREAM = {
    "prompt": "Once upon a time",
    "max_tokens": 480,
    "ignore_eos": True,
    "temperature": 0,
    "stream": True,
}


def stream_events(url: str, body: dict, started: threading.Event, events: list) -> None:
    """Read a whole stream into `events` (parsed data lines, and "[DONE]")."""
    with (
        httpx.Client(base_url=url, timeout=WAIT_S * 2) as http,
        http.stream("POST", COMPLETIONS, json=body) as response,
    ):
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
                started.set()


def run_shutdown(engine, shutdown_timeout: float, signals: int, body: dict) -> list:
    """Start a stream, send `signals` shutdown requests (what SIGTERM does) once it runs,
    and return its events; the server must have stopped and every KV block be free."""
    app = create_app(engine, connection_limits=QUICK)
    server = ThreadedServer(app, shutdown_timeout=shutdown_timeout).start()
    started, events = threading.Event(), []
    reader = threading.Thread(target=stream_events, args=(server.url, body, started, events))
    reader.start()
    try:
        assert started.wait(WAIT_S)
        for _ in range(signals):
            server.request_shutdown()
        reader.join(WAIT_S * 2)
        server.thread.join(WAIT_S)
        assert not reader.is_alive() and not server.thread.is_alive()
    finally:
        server.stop()
    with pytest.raises(httpx.ConnectError):  # it admits nothing more
        httpx.get(server.url + "/health", timeout=5)
    assert engine.num_free_blocks() == engine.num_total_blocks()
    return events


def finish_reason(events: list) -> str:
    assert events[-1] == "[DONE]", events[-3:]  # a clean end of stream
    return events[-2]["choices"][0]["finish_reason"]


def test_shutdown_lets_a_running_stream_finish_within_the_grace_period(engine):
    short = {**LONG_STREAM, "max_tokens": 24}
    events = run_shutdown(engine, shutdown_timeout=WAIT_S, signals=1, body=short)
    assert finish_reason(events) == "length"
    assert sum(len(e["choices"][0]["text"]) > 0 for e in events[:-1]) > 1


def test_shutdown_aborts_a_stream_past_the_grace_period(engine):
    events = run_shutdown(engine, shutdown_timeout=0.5, signals=1, body=LONG_STREAM)
    assert finish_reason(events) == "abort"


def test_a_second_shutdown_signal_aborts_at_once(engine):
    # A grace period far longer than the stream: only the second signal can end it early.
    events = run_shutdown(engine, shutdown_timeout=3600, signals=2, body=LONG_STREAM)
    assert finish_reason(events) == "abort"
