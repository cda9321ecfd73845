"""Issue 43 over HTTP: what a hostile or careless client's grammar work costs the others.

Fast: every JSON Schema keyword the grammar would break is a 400 naming it, through
response_format and forced tool calls, and the server serves on. Slow (the reproductions
of the issue): a 2 MB enum gets its 400 at the compile timeout and its compile is killed
there, while other clients' new schemas compile meanwhile; distinct large enums leave the
server's memory where it was.
"""

from __future__ import annotations

import threading

import httpx
import pytest
from compiler_processes import compile_children, wait_for

from pagedllm_integrations.engine.async_engine import AsyncEngine
from pagedllm_integrations.engine.config import EngineConfig
from pagedllm_integrations.server.app import create_app
from pagedllm_integrations.server.testing import ThreadedServer

MODEL = "tiny-abuse-grammar"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def engine(tiny_llama_factory, default_model_folder):
    folder = tiny_llama_factory("abuse-grammar")
    (folder / "chat_template.jinja").write_text(
        (default_model_folder / "chat_template.jinja").read_text()
    )
    config = EngineConfig(model=str(folder), disable_log_stats=True, max_model_len=1024)
    with AsyncEngine(config) as running:
        yield running


@pytest.fixture(scope="module")
def server(engine):
    with ThreadedServer(create_app(engine, served_model_name=MODEL)) as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=600) as client:
        yield client


def schema_body(schema: dict, max_tokens: int = 4) -> dict:
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    return {"messages": USER, "max_tokens": max_tokens, "response_format": rf}


def assert_400(response: httpx.Response, *words: str) -> str:
    assert response.status_code == 400, (response.status_code, response.text[:500])
    message = response.json()["error"]["message"]
    for word in words:
        assert word in message, message
    return message


def all_free(engine: AsyncEngine) -> bool:
    return engine.num_free_blocks() == engine.num_total_blocks()


OBJ = {"type": "object", "properties": {"a": {"type": "integer"}}}
UNENFORCEABLE = [
    ("not", {"not": {"type": "string"}}),
    ("pattern", {"type": "string", "pattern": "^(?!abc)[a-z]+$"}),
    ("if", {"if": {"type": "integer"}, "then": {"minimum": 5}}),
    ("multipleOf", {"type": "number", "multipleOf": 0.5}),
    ("maxLength", {"type": "string", "maxLength": -1}),
    ("anyOf", {"anyOf": []}),
    ("required", {**OBJ, "required": ["a", "x"]}),
]


def test_unenforceable_schemas_are_a_400_naming_the_keyword(engine, http):
    for keyword, schema in UNENFORCEABLE:
        assert_400(http.post(CHAT, json=schema_body(schema)), f"'{keyword}'")
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "number", "multipleOf": 3}}}}}  # fmt: skip
    body = {"messages": USER, "max_tokens": 8, "tools": [tool], "tool_choice": "required"}
    assert_400(http.post(CHAT, json=body), "'multipleOf'")
    # The server serves on, schemas it can enforce included.
    fine = {**OBJ, "required": ["a"]}
    assert http.post(CHAT, json=schema_body(fine, 12)).status_code == 200
    assert wait_for(lambda: all_free(engine))


# ---------------------------------------------------------- the issue's reproductions
def big_enum(strings: int, chars: int, tag: str) -> dict:
    return {"enum": [f"{tag}{i:05d}" + "a" * (chars - 6 - len(tag)) for i in range(strings)]}


@pytest.mark.slow
def test_a_2mb_enum_gets_its_400_and_its_compile_ends_there(engine, server, http):
    """2,000 strings of 1,000 characters: its compile would run for two minutes."""
    state = server.app.state.server
    manager = engine._inputs.structured_outputs
    http.post(CHAT, json=schema_body({"type": "boolean"}))  # the compiler process is up
    hostile: dict = {}

    def send() -> None:
        hostile["response"] = httpx.post(
            server.url + CHAT, json=schema_body(big_enum(2000, 1000, "e")), timeout=600
        )

    thread = threading.Thread(target=send)
    thread.start()
    assert wait_for(lambda: len(compile_children(manager.service)) >= 1)
    # Meanwhile other clients' new schemas and forced tool calls compile (with one compile
    # thread they got 400 "did not compile" for two minutes).
    for i in range(3):
        schema = {"type": "object", "properties": {f"other{i}": {"type": "integer"}}}
        assert http.post(CHAT, json=schema_body(schema)).status_code == 200
    tool = {"type": "function", "function": {"name": "g", "parameters": OBJ}}
    body = {"messages": USER, "max_tokens": 8, "tools": [tool], "tool_choice": "required"}
    assert http.post(CHAT, json=body).status_code == 200
    thread.join()
    timeout = state.limits.compile_timeout
    assert_400(hostile["response"], f"did not compile within {timeout:g} s")
    # Its compile was killed at the timeout, not left to run on.
    assert wait_for(lambda: not compile_children(manager.service), seconds=30)
    assert wait_for(lambda: all_free(engine))


def test_a_dead_compiler_process_is_a_503_not_the_clients_400(engine, server, http):
    """The compiler process dies while a request's constraint compiles: the server's fault,
    answered 503 (retry), not 400 (your schema); the next constraint compiles in a new one."""
    import os
    import signal

    from compiler_processes import SLOW_REGEX

    manager = engine._inputs.structured_outputs
    http.post(CHAT, json=schema_body({"type": "boolean"}))  # the compiler process is up
    outcome: dict = {}
    body = {"messages": USER, "max_tokens": 4, "structured_outputs": {"regex": SLOW_REGEX}}

    def send() -> None:
        outcome["response"] = httpx.post(server.url + CHAT, json=body, timeout=600)

    thread = threading.Thread(target=send)
    thread.start()
    assert wait_for(lambda: len(compile_children(manager.service)) >= 1)
    os.kill(manager.service.pid, signal.SIGKILL)
    thread.join()
    response = outcome["response"]
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "compiler_unavailable"
    schema = {"type": "object", "properties": {"after": {"type": "integer"}}}
    assert http.post(CHAT, json=schema_body(schema)).status_code == 200
    assert wait_for(lambda: all_free(engine))


def resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / (1 << 20)


@pytest.mark.slow
def test_distinct_large_enums_leave_the_memory_where_it_was(engine, http):
    """Eight distinct enums of 400 strings of 1,000 characters (392 KiB each): each kept
    ~118 MiB in the grammar cache (+948 MiB in all); now each is refused for its compiled
    size (or its compile time) and the cache stays within its bound."""
    manager = engine._inputs.structured_outputs
    http.post(CHAT, json=schema_body({"type": "boolean"}))
    before = resident_mib()
    responses: list[httpx.Response] = []

    def send(tag: str) -> None:
        body = schema_body(big_enum(400, 1000, tag))
        responses.append(httpx.post(http.base_url.join(CHAT), json=body, timeout=600))

    threads = [threading.Thread(target=send, args=(f"t{i}",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for response in responses:
        message = assert_400(response)
        assert "the limit is 32.0 MiB" in message or "compile timeout" in message, message
    assert manager.cache_bytes <= manager._cache.max_bytes
    assert resident_mib() - before < 200
    assert wait_for(lambda: not compile_children(manager.service), seconds=30)
