"""The grammar compiler's own process: every compile in a child that can be killed.

xgrammar's compiler cannot be interrupted: a thread that runs a compile runs it to the end
(a 2 MB enum took two minutes, past any client's timeout). So compiles run in processes:

    engine process                      this process (python -m ...grammar_compile_worker)
    GrammarCompileService  --stdin-->   imports xgrammar once, holds the TokenizerInfo;
      ("compile", id, ...)              per compile, forks a child (a copy of a process that
      ("cancel", id)                    runs no other thread: safe to fork, ~ms) that compiles,
                           <--stdout--  checks the grammar's size and sends it back serialized
      ("started", id, pid)              through a pipe; a cancel is SIGKILL to that child, and
      ("done", id, ok, grammar | error, bytes)   so is a child that outgrows its memory budget

Each compile has its own child, so compiles of different clients never wait for one
another (up to `max_children` at once; more wait here for a free slot). The process ends
when the engine closes its stdin (or dies), killing its children first.

Messages are length-prefixed pickles (`write_message` / `MessageReader`): both ends are
this package, started by the engine itself.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import selectors
import signal
import struct
from collections import deque
from dataclasses import dataclass, field
from typing import Any

_LENGTH = struct.Struct("<Q")
_READ_BYTES = 1 << 20
_POLL_S = 0.05  # how often children's memory is looked at
# Separators of the generated JSON: the model's natural ", " and ": ", and no free whitespace
# (a small model given free whitespace can spend its whole token budget on newlines).
JSON_SEPARATORS = (", ", ": ")


def write_message(fd: int, message: Any) -> None:
    """One length-prefixed pickle, written whole (blocking)."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_LENGTH.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


class MessageReader:
    """Splits a byte stream into the messages of `write_message`."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        self._buffer += data
        messages = []
        while len(self._buffer) >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(self._buffer)
            end = _LENGTH.size + length
            if len(self._buffer) < end:
                break
            messages.append(pickle.loads(bytes(self._buffer[_LENGTH.size : end])))
            del self._buffer[:end]
        return messages


def compile_grammar(compiler: Any, kind: str, text: str) -> Any:
    """One constraint (see structured_outputs.canonical_key) with an xgrammar GrammarCompiler."""
    if kind == "json":
        return compiler.compile_json_schema(
            text, any_whitespace=False, separators=JSON_SEPARATORS, strict_mode=True
        )
    if kind == "json_object":  # not strict: any object, any properties
        return compiler.compile_json_schema(
            text, any_whitespace=False, separators=JSON_SEPARATORS, strict_mode=False
        )
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind in ("choice", "ebnf"):
        return compiler.compile_grammar(text, root_rule_name="root")
    if kind == "lark":
        return compiler.compile_lark(text)
    raise ValueError(f"unknown structured_outputs kind {kind!r}")


def _resident_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None  # not Linux, or gone


@dataclass(slots=True)
class _Child:
    job_id: int
    pid: int
    fd: int
    base_rss: int | None
    memory_budget: int  # bytes it may grow by
    data: bytearray = field(default_factory=bytearray)
    killed_because: str | None = None


class _Server:
    def __init__(self, out_fd: int, compiler: Any, max_children: int) -> None:
        self.out_fd = out_fd  # the pipe to the engine
        self.compiler = compiler  # warmed up here, so that every child starts warm
        self.max_children = max_children
        self.queue: deque[tuple[int, str, str, int, int]] = deque()
        self.running: dict[int, _Child] = {}
        self.selector = selectors.DefaultSelector()
        self.reader = MessageReader()

    def serve(self) -> None:
        self.selector.register(0, selectors.EVENT_READ, None)
        while True:
            for key, _ in self.selector.select(timeout=_POLL_S):
                if key.data is None:
                    data = os.read(0, _READ_BYTES)
                    if not data:  # the engine closed its end or died
                        self.stop()
                        return
                    for message in self.reader.feed(data):
                        self.handle(message)
                else:
                    self.read_child(key.data)
            self.check_memory()
            while self.queue and len(self.running) < self.max_children:
                self.start(*self.queue.popleft())

    def handle(self, message: tuple) -> None:
        if message[0] == "compile":
            self.queue.append(message[1:])
        elif message[0] == "cancel":
            job_id = message[1]
            self.queue = deque(job for job in self.queue if job[0] != job_id)
            child = self.running.get(job_id)
            if child is not None:
                self.kill(child, "cancelled")

    def start(self, job_id: int, kind: str, text: str, max_bytes: int, memory: int) -> None:
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: compile, answer, and leave without any cleanup
            try:
                _die_with_parent()
                os.close(read_fd)
                os.close(self.out_fd)  # the engine's pipe stays the server's alone
                os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
                write_message(write_fd, _compile_job(self.compiler, kind, text, max_bytes))
            finally:
                os._exit(0)
        os.close(write_fd)
        child = _Child(job_id, pid, read_fd, _resident_bytes(os.getpid()), memory)
        self.running[job_id] = child
        self.selector.register(read_fd, selectors.EVENT_READ, child)
        write_message(self.out_fd, ("started", job_id, pid))

    def read_child(self, child: _Child) -> None:
        data = os.read(child.fd, _READ_BYTES)
        if data:
            child.data += data
            return
        self.selector.unregister(child.fd)
        os.close(child.fd)
        _, status = os.waitpid(child.pid, 0)
        del self.running[child.job_id]
        messages = MessageReader().feed(bytes(child.data))
        if messages and child.killed_because is None:
            ok, payload, nbytes = messages[0]
            write_message(self.out_fd, ("done", child.job_id, ok, payload, nbytes))
            return
        why = child.killed_because or (
            f"the compiler crashed (signal {os.WTERMSIG(status)})"
            if os.WIFSIGNALED(status)
            else "the compiler ended without an answer"
        )
        write_message(self.out_fd, ("done", child.job_id, False, why, 0))

    def check_memory(self) -> None:
        for child in list(self.running.values()):
            rss = _resident_bytes(child.pid)
            if child.base_rss is None or rss is None or child.killed_because is not None:
                continue
            if rss - child.base_rss > child.memory_budget:
                self.kill(
                    child,
                    f"compiling it took more than {child.memory_budget >> 20} MiB of memory "
                    "(the compile memory limit)",
                )

    def kill(self, child: _Child, why: str) -> None:
        child.killed_because = why
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGKILL)

    def stop(self) -> None:
        for child in list(self.running.values()):
            self.kill(child, "stopped")
        for child in list(self.running.values()):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(child.pid, 0)


def _die_with_parent() -> None:
    """A child outlives a killed server only until its compile ends; on Linux, not at all."""
    parent = os.getppid()
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(0)


def _compile_job(compiler: Any, kind: str, text: str, max_bytes: int) -> tuple[bool, str, int]:
    """(ok, serialized grammar or error message, grammar bytes); runs in the forked child."""
    try:
        grammar = compile_grammar(compiler, kind, text)
    except Exception as error:  # xgrammar raises RuntimeError and friends
        return False, str(error), 0
    nbytes = int(grammar.memory_size_bytes)
    if nbytes > max_bytes:
        return (
            False,
            f"it compiles to a grammar of {nbytes / (1 << 20):.1f} MiB; the limit is "
            f"{max_bytes / (1 << 20):.1f} MiB (simplify it: fewer or shorter enum values, "
            "smaller length bounds)",
            nbytes,
        )
    return True, grammar.serialize_json(), nbytes


def main() -> None:
    # Ctrl-C in a terminal reaches the whole process group: the engine decides when this
    # process ends (by closing its stdin), not the signal.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The messages go out on a copy of stdout; stdout itself becomes stderr, so that a
    # library printing to it cannot break them.
    out_fd = os.dup(1)
    os.dup2(2, 1)
    reader = MessageReader()
    messages: list[Any] = []
    while not messages:
        data = os.read(0, _READ_BYTES)
        if not data:
            return
        messages = reader.feed(data)
    _, info_json, max_children = messages[0]
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(info_json)
    # One compiler (one thread, no cache), warmed up by a first compile: its lazily built
    # tables are then inherited by every child instead of built again in each.
    compiler = xgr.GrammarCompiler(info, cache_enabled=False, max_threads=1)
    compile_grammar(compiler, "json", '{"type": "object", "properties": {"a": {"type": "string"}}}')
    server = _Server(out_fd, compiler, max_children)
    for message in messages[1:]:
        server.handle(message)
    server.reader = reader
    write_message(out_fd, ("ready", os.getpid()))
    server.serve()


if __name__ == "__main__":
    main()
