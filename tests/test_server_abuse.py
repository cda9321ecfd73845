"""A server that one client cannot take down (issue 43): each class of abuse reproduced
against the real server, and the fix shown.

Fast (in the default suite): raw-socket clients against a server with short timeouts and
small connection caps; prompts far past the context; a large response held mid-encoding
while /health answers. Slow (`-m slow`): the issue's own sizes against `pagedllm serve` in a
process of its own (256 file descriptors, 300 half-sent requests, a 4 GiB Content-Length,
16 chats of 4 MiB) and n=128 x 256 tokens x 20 logprobs. Shutdown: test_server_shutdown.py;
fields: test_server_fields.py.
"""

from __future__ import annotations

import json
import socket
import threading
from contextlib import closing

import httpx
import pytest
from served import Served

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


# ---------------------------------------------------------------- slow: the sizes
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    server = Served(tmp_path_factory.mktemp("serve"))
    yield server
    server.stop()


def chat_body(content: str, **fields) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 8, **fields}


def outcome(sock: socket.socket) -> int | str:
    try:
        return status_and_error(read_until_closed(sock))[0]
    except ConnectionResetError:
        return "reset"


@pytest.mark.slow
def test_300_half_sent_requests_cannot_starve_a_server_of_256_descriptors(served):
    held = []
    try:
        for _ in range(300):
            sock = socket.create_connection(("127.0.0.1", served.port), timeout=WAIT_S)
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-")
            held.append(sock)
        with served.client("127.0.0.2") as other:
            assert other.get("/health").status_code == 200
            answer = other.post("/v1/chat/completions", json=chat_body("Hi"))
            assert answer.status_code == 200, answer.text
        # Every one of the 300 ends: the ones past the per-client cap at once (429, or a
        # reset once too many are being refused at once), the others when the header
        # timeout passes (408); none stays open.
        outcomes = [outcome(sock) for sock in held]
    finally:
        for sock in held:
            sock.close()
    per_client = 96  # half of (256 descriptors - 64 kept for the rest)
    assert outcomes.count(408) == per_client
    assert outcomes.count(429) + outcomes.count("reset") == 300 - per_client
    assert outcomes.count(429) >= 32  # the refusals that linger are read in full


@pytest.mark.slow
def test_a_4_gib_content_length_is_answered(served):
    with closing(socket.create_connection(("127.0.0.1", served.port), timeout=WAIT_S)) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + served.key.encode()
            + b"\r\nContent-Length: 4294967296\r\n\r\n"
        )
        assert read_response(sock)[0] == 413


@pytest.mark.slow
def test_16_chats_of_4_mb_are_refused_while_a_normal_chat_is_served(served):
    huge = "lorem ipsum dolor " * 222_000  # 4.0 MB, under the 4 MiB body limit
    results: dict[int, httpx.Response] = {}

    def send(index: int, body: dict) -> None:
        with served.client() as http:
            results[index] = http.post("/v1/chat/completions", json=body)

    threads = [threading.Thread(target=send, args=(i, chat_body(huge))) for i in range(16)]
    threads.append(threading.Thread(target=send, args=(16, chat_body("Say hello."))))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    for index in range(16):
        error = results[index].json()["error"]
        assert results[index].status_code == 400 and "characters" in error["message"]
    assert results[16].status_code == 200, results[16].text


@pytest.mark.slow
def test_a_47_mb_response_is_encoded_while_health_answers(quick, monkeypatch):
    """n=128 x 256 tokens x 20 top logprobs, held mid-encoding until /health answered."""
    entered, health_answered = threading.Event(), threading.Event()
    real = responses.encode_json

    def held_encode(payload):
        entered.set()
        assert health_answered.wait(600)
        return real(payload)

    monkeypatch.setattr(responses, "encode_json", held_encode)
    body = {**chat_body("Tell a story."), "n": 128, "max_tokens": 256, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 20}  # fmt: skip
    result: dict = {}

    def post() -> None:
        with httpx.Client(base_url=quick.url, timeout=1200) as http:
            result["response"] = http.post(CHAT, json=body)

    poster = threading.Thread(target=post)
    poster.start()
    assert entered.wait(1200)
    with httpx.Client(base_url=quick.url, timeout=WAIT_S) as http:
        assert http.get("/health").status_code == 200
    health_answered.set()
    poster.join(1200)
    response = result["response"]
    assert response.status_code == 200 and len(response.content) > 40 << 20
    choices = response.json()["choices"]
    assert len(choices) == 128
    assert all(len(c["logprobs"]["content"]) == 256 for c in choices)
    assert all(len(t["top_logprobs"]) == 20 for t in choices[0]["logprobs"]["content"])
