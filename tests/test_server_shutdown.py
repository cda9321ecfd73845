"""Shutdown (issue 43): SIGTERM stops admitting, running streams get a grace period
(--shutdown-timeout), then are aborted with a clean end of stream (a last chunk with
finish_reason "abort", then [DONE]); a second SIGTERM aborts at once; every KV block is free
afterwards. Fast: in process, `request_shutdown()` standing for the signal. Slow: real
SIGTERMs to `pagedllm serve` streaming 1,500-token completions."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import pytest
from served import Served

from pagedllm_integrations import EngineConfig, shared_engine
from pagedllm_integrations.server.app import create_app
from pagedllm_integrations.server.connections import ConnectionLimits
from pagedllm_integrations.server.testing import ThreadedServer

ENGINE_ARGS = dict(max_model_len=512, max_num_seqs=64, kv_cache_memory=128 << 20)
COMPLETIONS = "/v1/completions"
WAIT_S = 60
QUICK = ConnectionLimits(header_timeout=1.0, body_timeout=1.0, keep_alive_timeout=1.0)


@pytest.fixture(scope="module")
def engine():
    return shared_engine(EngineConfig(disable_log_stats=True, **ENGINE_ARGS))


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


def long_streams(server: Served, count: int) -> tuple[list[threading.Thread], list[list]]:
    body = {**LONG_STREAM, "max_tokens": 1500}
    events: list[list] = [[] for _ in range(count)]
    started = [threading.Event() for _ in range(count)]
    threads = []
    for index in range(count):

        def read(index: int = index) -> None:
            with (
                server.client() as http,
                http.stream("POST", COMPLETIONS, json=body) as response,
            ):
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        data = line[6:]
                        events[index].append("[DONE]" if data == "[DONE]" else json.loads(data))
                        started[index].set()

        threads.append(threading.Thread(target=read))
        threads[-1].start()
    for flag in started:
        assert flag.wait(600)
    return threads, events


def _accepting(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        return True
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize(("grace", "signals"), [("2", 1), ("3600", 2)])
def test_sigterm_ends_1500_token_streams_cleanly(tmp_path, grace, signals):
    """One SIGTERM: streams get the grace period, then end with "abort" and [DONE]; a
    second SIGTERM does not wait for the (hour-long) grace period. serve exits 0."""
    server = Served(tmp_path, "--shutdown-timeout", grace)
    try:
        threads, events = long_streams(server, 4)
        server.process.send_signal(signal.SIGTERM)
        if signals == 2:
            # Signals do not queue: the second is sent once the first has closed the port.
            while _accepting(server.port):
                time.sleep(0.1)
            server.process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(600)
        assert server.process.wait(600) == 0, (tmp_path / "serve.log").read_text()[-3000:]
    finally:
        server.stop()
    for stream in events:
        assert finish_reason(stream) == "abort"
