"""Embedding engines yield the CPU to generation engines in the same process.

A RAG app runs an embedding model (its own engine: an encoder such as all-MiniLM) beside a
chat model. Both engines' kernels share the process's cores and its one kernel thread
pool, so a batch of documents embedded while chat streams decode would take about half of
the streams' speed for as long as it runs. Indexing is background work, a stream is a user
waiting: while any generation engine of this process has requests in flight, an
embedding-only engine pauses after each step, so that its steps take at most
`embedding_cpu_share` of the time (the pause is step time x (1 - share) / share). Alone, it
runs flat out.

    generation engine:  mark_generating(self, has requests)   after every step
    embedding engine:   time.sleep(pause_after(step seconds, share))
"""

from __future__ import annotations

import threading

DEFAULT_EMBEDDING_CPU_SHARE = 0.2

_lock = threading.Lock()
_generating: set[int] = set()  # id() of the generation engines with requests in flight


def mark_generating(engine: object, busy: bool) -> None:
    key = id(engine)
    with _lock:
        if busy:
            _generating.add(key)
        else:
            _generating.discard(key)


def generation_running() -> bool:
    return bool(_generating)


def pause_after(step_seconds: float, share: float) -> float:
    """Seconds an embedding engine waits after a step of `step_seconds` (0 when no
    generation runs, or share is 1)."""
    if share >= 1.0 or not _generating:
        return 0.0
    return step_seconds * (1.0 - share) / share
