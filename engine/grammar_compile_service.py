"""The engine's side of the grammar compiler process (engine/grammar_compile_worker.py).

One service per tokenizer in a Python process, shared by every engine on that tokenizer
(`shared_service`); its process starts at the first compile and lives until the
interpreter exits (or dies: the next compile starts a new one). `submit` returns at once
with a `CompileJob`; the job's future gives `(serialized grammar, bytes)` or a ValueError
that says why the constraint does not compile; `cancel` kills the job's child process.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import hashlib
import itertools
import logging
import os
import queue
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from .grammar_compile_worker import MessageReader, write_message

logger = logging.getLogger(__name__)

# Compiles at once, each in its own child process (more wait for a free one).
MAX_CONCURRENT_COMPILES = 4
# Memory one compile may take beyond what its process started with; past it, it is killed.
COMPILE_MEMORY_BUDGET = 1 << 30
STARTUP_TIMEOUT_S = 120.0  # importing xgrammar (and torch) on a busy machine


class CompilerUnavailableError(RuntimeError):
    """The compiler process could not start or ended (not the constraint's fault)."""


@dataclass(slots=True, eq=False)
class CompileJob:
    """One compile in the compiler process."""

    job_id: int
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    pid: int | None = None  # of the child running it, once started

    def done(self) -> bool:
        return self.future.done()


class GrammarCompileService:
    """Talks to one compiler process (thread-safe)."""

    def __init__(
        self, tokenizer_info_json: str, max_concurrent: int = MAX_CONCURRENT_COMPILES
    ) -> None:
        self._info_json = tokenizer_info_json
        self.max_concurrent = max_concurrent
        self.owner_pid = os.getpid()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._jobs: dict[int, CompileJob] = {}
        self._process: subprocess.Popen | None = None
        self._outbox: queue.SimpleQueue[Any] | None = None
        self._ready = threading.Event()
        self._failed: str | None = None  # why the current process is unusable

    # ---------------------------------------------------------------- requests
    def submit(
        self, kind: str, text: str, max_bytes: int, memory_budget: int = COMPILE_MEMORY_BUDGET
    ) -> CompileJob:
        """Compile one constraint (see structured_outputs.canonical_key): a grammar past
        `max_bytes` is refused, a compile that grows its process by more than
        `memory_budget` bytes is killed; both are a ValueError from the job's future."""
        with self._lock:
            self._ensure_started()
            job = CompileJob(next(self._ids))
            self._jobs[job.job_id] = job
            assert self._outbox is not None
            self._outbox.put(("compile", job.job_id, kind, text, max_bytes, memory_budget))
        return job

    def cancel(self, job: CompileJob) -> None:
        """Stop the job: its child is killed, or it never starts."""
        with self._lock:
            if self._jobs.pop(job.job_id, None) is not None and self._outbox is not None:
                self._outbox.put(("cancel", job.job_id))
        job.future.cancel()

    @property
    def ready(self) -> bool:
        """The process answers (it imports xgrammar first: seconds after it starts)."""
        return self._ready.is_set()

    @property
    def pid(self) -> int | None:
        """The compiler process, while one runs (its children are the compiles)."""
        with self._lock:
            running = self._process is not None and self._failed is None
            return self._process.pid if running and self._process else None

    # ----------------------------------------------------------------- process
    def _ensure_started(self) -> None:
        """Under the lock: a running process, or a new one."""
        if self._process is not None and self._failed is None:
            return
        module = f"{__package__}.grammar_compile_worker"
        process = subprocess.Popen(
            [sys.executable, "-P", "-m", module],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
        )
        self._process, self._failed = process, None
        self._ready = threading.Event()
        self._outbox = outbox = queue.SimpleQueue[tuple[Any, ...]]()
        outbox.put(("init", self._info_json, self.max_concurrent))
        threads: list[tuple[Any, tuple[Any, ...], str]] = [
            (self._write_loop, (process, outbox), "writer"),
            (self._read_loop, (process, outbox, self._ready), "reader"),
        ]
        for target, args, name in threads:
            threading.Thread(
                target=target, args=args, name=f"pagedllm-grammar-{name}", daemon=True
            ).start()
        logger.debug("grammar compiler process %d started", process.pid)

    def _write_loop(self, process: subprocess.Popen, outbox: queue.SimpleQueue) -> None:
        """Messages to the process in order; a write never blocks a caller."""
        assert process.stdin is not None
        fd = process.stdin.fileno()
        while True:
            message = outbox.get()
            if message is None:
                break
            try:
                write_message(fd, message)
            except OSError:
                break  # the process ended: the reader fails its jobs
        with contextlib.suppress(OSError):
            process.stdin.close()

    def _read_loop(
        self, process: subprocess.Popen, outbox: queue.SimpleQueue, ready: threading.Event
    ) -> None:
        assert process.stdout is not None
        fd = process.stdout.fileno()
        reader = MessageReader()
        while True:
            try:
                data = os.read(fd, 1 << 20)
            except OSError:
                data = b""
            if not data:
                break
            for message in reader.feed(data):
                self._dispatch(message, ready)
        process.wait()
        with self._lock:
            if self._process is process:
                self._failed = (
                    f"the grammar compiler process ended (exit code {process.returncode})"
                )
                jobs, self._jobs = list(self._jobs.values()), {}
                outbox.put(None)
                self._outbox = None
            else:
                jobs = []
        for job in jobs:
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                job.future.set_exception(CompilerUnavailableError(self._failed or "ended"))
        if jobs:
            logger.warning("grammar compiler process %d ended with jobs running", process.pid)

    def _dispatch(self, message: tuple, ready: threading.Event) -> None:
        if message[0] == "ready":
            ready.set()
            return
        with self._lock:
            job = self._jobs.get(message[1])
            if job is not None and message[0] == "done":
                del self._jobs[message[1]]
        if job is None:
            return  # cancelled meanwhile
        if message[0] == "started":
            job.pid = message[2]
            return
        _, _, ok, payload, nbytes = message
        _settle(job.future, (payload, nbytes) if ok else None, None if ok else payload)

    def close(self, timeout: float = 5.0) -> None:
        """End the process (it kills its children first)."""
        with self._lock:
            process, outbox = self._process, self._outbox
            self._process, self._outbox, self._failed = None, None, "closed"
        if outbox is not None:
            outbox.put(None)
        if process is not None:
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _settle(future: concurrent.futures.Future, result: Any, error: str | None) -> None:
    if future.done():
        return
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(ValueError(error))


_SERVICES: dict[str, GrammarCompileService] = {}
_SERVICES_LOCK = threading.Lock()


def shared_service(tokenizer_info_json: str) -> GrammarCompileService:
    """The process-wide service for one tokenizer (its serialized xgrammar TokenizerInfo)."""
    # By process too: a forked child must not talk over its parent's pipes.
    key = f"{os.getpid()}:{hashlib.sha256(tokenizer_info_json.encode()).hexdigest()}"
    with _SERVICES_LOCK:
        service = _SERVICES.get(key)
        if service is None:
            service = _SERVICES[key] = GrammarCompileService(tokenizer_info_json)
        return service


@atexit.register
def _close_all() -> None:
    with _SERVICES_LOCK:
        services = list(_SERVICES.values())
    for service in services:
        if service.owner_pid == os.getpid():
            service.close()
