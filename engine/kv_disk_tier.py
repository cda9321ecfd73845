"""KV blocks past memory: the tail of the KV cache in a file that the kernel pages.

With `kv_disk_space` set (CPU), the KV cache holds `kv_cache_memory`'s blocks in memory
and `kv_disk_space`'s more after them, in one unnamed file in `swap_dir`:

    blocks [0, memory_blocks)                           anonymous memory (as without it)
    blocks [memory_blocks, memory_blocks + disk_blocks) a shared mapping of the file

Each layer's key and value tensors are one range of virtual memory whose tail is mapped
from the file at a fixed address right after the memory part, so attention and the KV
writes reach every block as they always do: no kernel knows the tier exists. The block
pool hands out memory blocks first (engine/block_pool.py), so the file takes only what
memory cannot hold: one sequence longer than the KV memory, or many sequences at once.

The kernel's page cache keeps the file's recently used pages while memory allows and
reads the others back from disk when a step touches them. Unlike anonymous memory on a
machine without swap, those pages can always be reclaimed, so a context larger than
memory slows down instead of being killed. The file is reserved in full at startup (a full
disk is a clear error then, not a SIGBUS mid-step), is readable by this user only, and
has no name (engine/swap_space.py's `unnamed_file`), so nothing is left behind.

The file also extends the prefix cache: a cached memory block that is about to be reused
is copied into a free block of the file and keeps its hash there (engine/block_pool.py,
`kv_block_copier` below), so a prefix that memory no longer holds is still a hit.

(The swap tiers of engine/swap_space.py are another thing: they hold the blocks of
requests that are not running, copied out and back in whole.)
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .config import GiB
from .swap_space import default_swap_dir, unnamed_file

_PAGE = mmap.PAGESIZE
_PROT_NONE, _PROT_READ_WRITE = 0, mmap.PROT_READ | mmap.PROT_WRITE
_MAP_FIXED = 0x10  # Linux's value; Python's mmap module does not export it
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)


@dataclass(frozen=True)
class KVDiskPlan:
    """How many KV blocks live in the file, after the memory blocks (picklable)."""

    blocks: int = 0
    folder: str | None = None

    @classmethod
    def from_size(cls, gib: float, folder: str | None, bytes_per_block: int) -> KVDiskPlan:
        blocks = int(gib * GiB) // bytes_per_block
        if blocks and folder is None:
            folder = default_swap_dir()
        return cls(blocks, folder if blocks else None)

    def describe(self, bytes_per_block: int) -> str:
        """The startup log line's words for the tier ("" without one)."""
        if not self.blocks:
            return ""
        return (
            f" + {self.blocks} on disk ({self.blocks * bytes_per_block / GiB:.2f} GiB in "
            f"{self.folder}, paged by the kernel)"
        )


NO_KV_DISK = KVDiskPlan()


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ctypes.c_long,
    ]  # fmt: skip
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


class KVDiskFile:
    """The file behind the disk tier of every KV tensor of one process, and the tensors.

    `zeros(shape, dtype)` makes one KV tensor [blocks, *block_shape] whose last
    `plan.blocks` blocks (more exactly: from the page that holds the first of them) are
    mapped from the next region of the file; the rest is anonymous memory."""

    def __init__(self, plan: KVDiskPlan, shapes: list[tuple[int, ...]], dtype: torch.dtype):
        assert plan.blocks > 0 and plan.folder is not None
        self.plan = plan
        self.dtype = dtype
        self._libc = _libc()
        self._regions = [self._file_bytes(shape) for shape in shapes]
        self._fd: int | None = unnamed_file(plan.folder, sum(self._regions), "kv_disk_space")
        self._offset = 0

    def _split(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """(bytes of the tensor, byte where its file part starts: page-aligned)."""
        element = torch.tensor([], dtype=self.dtype).element_size()
        block_bytes = math.prod(shape[1:]) * element
        memory_blocks = shape[0] - self.plan.blocks
        return shape[0] * block_bytes, (memory_blocks * block_bytes) // _PAGE * _PAGE

    def _file_bytes(self, shape: tuple[int, ...]) -> int:
        total, boundary = self._split(shape)
        return _round_up(total - boundary, _PAGE)

    def zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The next KV tensor (shapes in the order given at construction), all zeros."""
        assert self._fd is not None, "every tensor of the file is made already"
        total, boundary = self._split(shape)
        file_bytes = self._file_bytes(shape)
        reserved = boundary + file_bytes
        libc = self._libc
        # One range of addresses for the whole tensor, then its two parts mapped into it.
        base = self._mmap(None, reserved, _PROT_NONE,
                          mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)  # fmt: skip
        try:
            if boundary:
                self._mmap(base, boundary, _PROT_READ_WRITE,
                           mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED, -1, 0)  # fmt: skip
                libc.madvise(base, boundary, _MADV_HUGEPAGE)  # as model_runner's KV cache
            self._mmap(base + boundary, file_bytes, _PROT_READ_WRITE,
                       mmap.MAP_SHARED | _MAP_FIXED, self._fd, self._offset)  # fmt: skip
        except BaseException:
            libc.munmap(base, reserved)
            raise
        self._offset += file_bytes
        if self._offset == sum(self._regions):  # the mappings keep the file
            os.close(self._fd)
            self._fd = None
        memory = (ctypes.c_char * total).from_address(base)
        # Unmapped when the last tensor over it is gone (frombuffer holds `memory`).
        weakref.finalize(memory, libc.munmap, base, reserved)
        numel = total // torch.tensor([], dtype=self.dtype).element_size()
        return torch.frombuffer(memory, dtype=self.dtype, count=numel).view(shape)

    def _mmap(self, addr, length: int, prot: int, flags: int, fd: int, offset: int) -> int:
        result = self._libc.mmap(addr, length, prot, flags, fd, offset)
        if result is None or result == ctypes.c_void_p(-1).value:
            error = ctypes.get_errno()
            raise OSError(error, f"cannot map the KV disk tier: {os.strerror(error)}")
        return int(result)

    def close(self) -> None:
        """Close the file descriptor (idempotent): the mappings made hold the file, and
        tensors not made yet cannot be made after this."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def kv_block_copier(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
) -> Callable[[list[tuple[int, int]]], None]:
    """BlockPool.copy_blocks over these KV tensors: copy every layer's keys and values of
    each (source, destination) block pair, runs of consecutive pairs as one slice copy per
    tensor (numpy's memcpy: torch's bf16 index copies on the CPU run at a tenth of it, and
    its large copies wait for a free core on a busy machine)."""

    def copy(moves: list[tuple[int, int]]) -> None:
        for source, destination, length in _runs_of_pairs(moves):
            for tensor in (t for pair in kv_caches for t in pair):
                rows = tensor[source : source + length]
                np.copyto(
                    tensor[destination : destination + length].view(torch.uint8).numpy(),
                    rows.view(torch.uint8).numpy(),
                )

    return copy


def _runs_of_pairs(moves: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(first source, first destination, length) of each run of pairs that both count up
    by one (the pool pops both queues mostly in block order)."""
    runs: list[tuple[int, int, int]] = []
    for source, destination in moves:
        if runs:
            first_source, first_destination, length = runs[-1]
            if (source, destination) == (first_source + length, first_destination + length):
                runs[-1] = (first_source, first_destination, length + 1)
                continue
        runs.append((source, destination, 1))
    return runs
