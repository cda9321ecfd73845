"""Grammar work bounded in time and bytes (issue 43), on the real compiler process, no model.

A compile runs in a child of the compiler process: one that nobody waits for any more is
killed (not left to run for minutes in the only compile thread), compiles of different
clients run side by side, a grammar past its byte limit or memory budget is refused, and
the cache of compiled grammars is an LRU bounded in bytes.
"""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest
from compiler_processes import SLOW_REGEX, compile_children, running, wait_for

from pagedllm_integrations.engine.grammar_compile_service import CompilerUnavailableError
from pagedllm_integrations.engine.sampling_params import StructuredOutputsParams as Structured
from pagedllm_integrations.engine.structured_outputs import (
    CompileCancelledError,
    CompileTimeoutError,
    StructuredOutputManager,
    canonical_key,
    compile_limits,
)


@pytest.fixture(scope="module")
def tokenizer(default_model_folder):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(default_model_folder)


@pytest.fixture(scope="module")
def manager(tokenizer):
    """The defaults a user gets."""
    return StructuredOutputManager(tokenizer, len(tokenizer), stop_token_ids=[2])


def small_schema(name: str) -> Structured:
    return Structured(json={"type": "object", "properties": {name: {"type": "boolean"}}})


class Waiter:
    """A caller compiling `spec` on its own thread until it is done or told to stop."""

    def __init__(self, manager, spec: Structured, timeout: float | None = None) -> None:
        self.stop = threading.Event()
        self.outcome: BaseException | object | None = None
        self.thread = threading.Thread(target=self._run, args=(manager, spec, timeout))
        self.thread.start()

    def _run(self, manager, spec, timeout) -> None:
        try:
            with compile_limits(timeout=timeout, cancelled=self.stop):
                self.outcome = manager.compile(spec)
        except BaseException as error:  # asserted by the test
            self.outcome = error

    def cancel(self) -> BaseException | object | None:
        self.stop.set()
        self.thread.join()
        return self.outcome


def test_defaults():
    from pagedllm_integrations.engine import structured_outputs as so

    assert so.DEFAULT_COMPILE_TIMEOUT_S == 10.0
    assert so.DEFAULT_MAX_GRAMMAR_BYTES == 32 << 20
    assert so.DEFAULT_CACHE_MAX_BYTES == 256 << 20


def test_a_compile_nobody_waits_for_is_killed_not_left_running(manager):
    service = manager.service
    manager.compile(small_schema("warm"))  # the compiler process is up
    # Past its timeout: the caller gets its error and the compile's process is gone.
    with compile_limits(timeout=0.5), pytest.raises(CompileTimeoutError, match=r"0\.5 s"):
        manager.compile(Structured(regex=SLOW_REGEX))
    assert wait_for(lambda: not compile_children(service))
    # Its client leaving (the cancel flag): the same.
    waiter = Waiter(manager, Structured(regex=SLOW_REGEX + "z"))
    assert wait_for(lambda: len(compile_children(service)) == 1)
    running = compile_children(service)
    assert isinstance(waiter.cancel(), CompileCancelledError)
    assert wait_for(lambda: not compile_children(service) & running)
    assert not manager._pending
    assert canonical_key(Structured(regex=SLOW_REGEX)) not in manager._cache


def test_compiles_of_different_clients_do_not_queue_behind_one_another(manager):
    service = manager.service
    slow = Waiter(manager, Structured(regex=SLOW_REGEX + "q"))
    assert wait_for(lambda: len(compile_children(service)) == 1)
    # A new schema from another client compiles while the slow compile runs (with one
    # compile thread it would wait minutes behind it and time out).
    with compile_limits(timeout=60):
        compiled = manager.compile(small_schema("beside_a_slow_one"))
    assert compiled.key == canonical_key(small_schema("beside_a_slow_one"))
    assert slow.thread.is_alive()
    assert isinstance(slow.cancel(), CompileCancelledError)
    assert wait_for(lambda: not compile_children(service))


def test_callers_of_one_constraint_share_its_compile_until_the_last_one_leaves(manager):
    service = manager.service
    spec = Structured(regex=SLOW_REGEX + "w")
    first = Waiter(manager, spec)
    assert wait_for(lambda: len(compile_children(service)) == 1)
    second = Waiter(manager, spec)
    key = canonical_key(spec)
    assert wait_for(lambda: getattr(manager._pending.get(key), "waiters", 0) == 2)
    child = compile_children(service)
    assert isinstance(first.cancel(), CompileCancelledError)
    assert compile_children(service) == child  # the other caller still waits for it
    assert isinstance(second.cancel(), CompileCancelledError)
    assert wait_for(lambda: not compile_children(service))


def test_a_grammar_past_the_byte_limit_is_refused(tokenizer, manager):
    limited = StructuredOutputManager(
        tokenizer, len(tokenizer), stop_token_ids=[2], max_grammar_bytes=100_000
    )
    options = [f"a fairly long option text number {i} with words" for i in range(1000)]
    with pytest.raises(ValueError, match=r"compiles to a grammar of .* MiB; the limit is"):
        limited.compile(Structured(json={"type": "string", "enum": options}))
    assert len(limited._cache) == 0
    assert limited.compile(Structured(json={"type": "string", "enum": options[:50]})).nbytes
    # The same schema is well within the default limit.
    assert manager.compile(Structured(json={"type": "string", "enum": options})).nbytes > 100_000
    with pytest.raises(ValueError, match="max_grammar_bytes must be a positive"):
        StructuredOutputManager(tokenizer, len(tokenizer), max_grammar_bytes=0)


def test_the_cache_is_bounded_in_bytes_least_recently_used_first(tokenizer):
    probe = StructuredOutputManager(tokenizer, len(tokenizer), stop_token_ids=[2])
    size = probe.compile(small_schema("k0")).nbytes
    cache = StructuredOutputManager(
        tokenizer, len(tokenizer), stop_token_ids=[2], cache_max_bytes=int(size * 3.5)
    )
    specs = [small_schema(f"k{i}") for i in range(5)]
    assert {cache.compile(spec).nbytes for spec in specs[:3]} == {size}
    first = cache.compile(specs[0])  # a hit: now the most recently used
    assert cache.compile(specs[0]) is first
    cache.compile(specs[3])  # over the bound: the least recently used (k1) goes
    keys = [canonical_key(spec) for spec in specs]
    assert [key in cache._cache for key in keys] == [True, False, True, True, False]
    assert cache.cache_bytes == 3 * size <= cache._cache.max_bytes
    cache.compile(specs[4])
    assert [key in cache._cache for key in keys] == [True, False, False, True, True]


def test_a_compile_past_its_memory_budget_is_killed(manager):
    service = manager.service
    big_enum = json.dumps({"enum": [f"{i:05d}" + "a" * 1000 for i in range(200)]})
    job = service.submit("json", big_enum, max_bytes=1 << 30, memory_budget=8 << 20)
    with pytest.raises(ValueError, match="more than 8 MiB of memory"):
        job.future.result(timeout=600)
    assert wait_for(lambda: not compile_children(service))
    assert manager.compile(small_schema("after_the_kill")).nbytes > 0  # it serves on


def test_a_dead_compiler_process_costs_only_the_compiles_in_it(manager):
    service = manager.service
    waiter = Waiter(manager, Structured(regex=SLOW_REGEX + "k"))
    assert wait_for(lambda: len(compile_children(service)) == 1)
    (child,) = compile_children(service)
    old = service.pid
    os.kill(old, signal.SIGKILL)
    waiter.thread.join()
    assert isinstance(waiter.outcome, CompilerUnavailableError)  # the server's fault: a 500
    assert wait_for(lambda: not running(child))  # its compile died with it
    assert manager.compile(small_schema("after_a_restart")).nbytes > 0  # a new process
    assert service.pid not in (None, old)
