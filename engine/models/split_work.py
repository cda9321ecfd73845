"""Torch work between two kernel calls, spread over the cores (the CPU fast path).

On the fast path the engine's thread runs torch's own ops on one thread (see
`executor.claim_thread`: OpenMP workers spinning after each of torch's parallel regions
steal the kernel pool's core). That suits a decoder, whose torch ops are small; an encoder
step's attention, activation and residual norms run over thousands of rows and would then
use one core of several. `SplitWork` runs such work as pieces on this thread and on helper
threads (one fewer than the pool's threads, each with one torch thread): sequences split
by attention cost, rows split evenly. Each piece writes its own rows, so results do not
depend on who ran a piece. Used on the fast path only (its C++ kernels are loaded).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")


def _one_torch_thread() -> None:
    # This thread's OpenMP count only. torch.set_num_threads would also set the process's
    # default, which every thread started later (an engine's next thread) would take.
    torch.ops.pagedllm.kernel_thread(1)


def _inference(fn: Callable[[T], object], piece: T) -> None:
    with torch.inference_mode():  # thread-local: the engine thread's mode is not inherited
        fn(piece)


class SplitWork:
    def __init__(self, threads: int):
        self.threads = max(threads, 1)
        self._helpers = (
            ThreadPoolExecutor(
                self.threads - 1, thread_name_prefix="pagedllm-split", initializer=_one_torch_thread
            )
            if self.threads > 1
            else None
        )

    def run(self, fn: Callable[[T], object], pieces: Sequence[T]) -> None:
        """fn(piece) for every piece: the first here, the others on the helpers."""
        if self._helpers is None or len(pieces) < 2:
            for piece in pieces:
                fn(piece)
            return
        futures = [self._helpers.submit(_inference, fn, piece) for piece in pieces[1:]]
        fn(pieces[0])
        for future in futures:
            future.result()

    def rows(self, count: int) -> list[tuple[int, int]]:
        """[start, end) ranges of `count` rows, one per thread (fewer for a few rows)."""
        parts = min(self.threads, max(count // 64, 1))
        size = -(-count // parts)
        return [(start, min(start + size, count)) for start in range(0, count, size)]

    def sequences(self, bounds: list[int]) -> list[list[tuple[int, int]]]:
        """The sequences (row ranges from cumulative `bounds`) in one group per thread,
        balanced by attention cost (length squared), longest first."""
        spans = sorted(itertools.pairwise(bounds), key=lambda s: s[0] - s[1])
        groups: list[list[tuple[int, int]]] = [[] for _ in range(min(self.threads, len(spans)))]
        load = [0] * len(groups)
        for start, end in spans:
            lightest = load.index(min(load))
            groups[lightest].append((start, end))
            load[lightest] += (end - start) ** 2
        return groups

    def close(self) -> None:
        if self._helpers is not None:
            self._helpers.shutdown(wait=False)
