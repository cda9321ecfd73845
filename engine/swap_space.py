"""Where preempted requests' KV blocks wait: host memory first, then a file on disk.

When the scheduler runs out of KV blocks it preempts a running request. Without swap
space the request's tokens are computed again when it resumes; with it, its blocks are
copied out (`SchedulerOutput.swap_out`) and back (`swap_in`) before the forward pass
that needs them. Swap slots are numbered over two tiers:

    slots [0, host_blocks)                       host memory (`swap_space` GiB)
    slots [host_blocks, host_blocks+disk_blocks) a file in `swap_dir` (`swap_disk_space` GiB)

The scheduler hands out the lowest free slot first, so the disk takes only what host
memory cannot hold. On a CPU the KV cache itself is host memory, so the disk tier is what
lets many long, preempted or waiting contexts exceed RAM: their bytes go to the file and
the kernel's page cache keeps only what was touched recently (written blocks stay cached
until the kernel needs the memory, as with any file).

The disk file is reserved in full at startup (a full disk is a clear error then, not a
SIGBUS in the middle of a step), is readable by this user only, and has no name: it is
unlinked as soon as it is mapped, so nothing is left behind when the process ends, however
it ends. Every tier tensor is laid out as the KV cache's own blocks,
[slots, *block_shape], one (key, value) pair per layer.

Swap-in is a copy before the step that resumes a request. When the machine's memory is
short the kernel evicts the file's pages, and that copy would wait on the disk page by
page; so the scheduler names the disk slots of the requests next in line a few steps
earlier (`read_ahead`), and the kernel reads them in the background (MADV_WILLNEED)
while the steps run. With the pages still in memory the hint costs about a microsecond.
"""

from __future__ import annotations

import contextlib
import heapq
import math
import mmap
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .block_pool import consecutive_runs
from .config import GiB


@dataclass(frozen=True)
class SwapPlan:
    """How many KV blocks each swap tier holds (picklable: tensor-parallel ranks get it)."""

    host_blocks: int = 0
    disk_blocks: int = 0
    disk_dir: str | None = None  # folder of the disk tier's (unnamed) file

    @property
    def num_blocks(self) -> int:
        return self.host_blocks + self.disk_blocks

    def is_on_disk(self, slot: int) -> bool:
        return slot >= self.host_blocks

    @classmethod
    def from_sizes(
        cls, host_gib: float, disk_gib: float, disk_dir: str | None, bytes_per_block: int
    ) -> SwapPlan:
        disk_blocks = int(disk_gib * GiB) // bytes_per_block
        if disk_blocks and disk_dir is None:
            disk_dir = default_swap_dir()
        return cls(int(host_gib * GiB) // bytes_per_block, disk_blocks, disk_dir)


NO_SWAP = SwapPlan()


class SwapSlots:
    """The free slots of a SwapPlan, lowest first (host memory's before the disk's).

    Slots never handed out are a counter, not a list, so a large disk tier costs no memory
    here; slots given back wait in a min-heap, all of them below the counter."""

    def __init__(self, plan: SwapPlan):
        self.num_slots = plan.num_blocks
        self._next_fresh = 0
        self._returned: list[int] = []

    @property
    def num_free(self) -> int:
        return len(self._returned) + self.num_slots - self._next_fresh

    def take(self, count: int) -> list[int]:
        assert count <= self.num_free, "take() more swap slots than are free"
        slots = []
        for _ in range(count):
            if self._returned:
                slots.append(heapq.heappop(self._returned))
            else:
                slots.append(self._next_fresh)
                self._next_fresh += 1
        return slots

    def give_back(self, slots: list[int]) -> None:
        for slot in slots:
            heapq.heappush(self._returned, slot)


def describe_swap(plan: SwapPlan, bytes_per_block: int) -> str:
    """The startup log line's words for the swap tiers ("" when there are none)."""
    parts = []
    if plan.host_blocks:
        parts.append(f"{plan.host_blocks * bytes_per_block / GiB:.2f} GiB in host memory")
    if plan.disk_blocks:
        parts.append(
            f"{plan.disk_blocks * bytes_per_block / GiB:.2f} GiB on disk in {plan.disk_dir}"
        )
    return f"; swap space {', '.join(parts)} ({plan.num_blocks} blocks)" if parts else ""


def default_swap_dir() -> str:
    """pagedllm's cache folder (on disk; /tmp is often memory), made private if new."""
    from ..kernels.cache_dir import cache_dir

    folder = cache_dir() / "swap"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    return str(folder)


def unnamed_file(folder: str, nbytes: int, setting: str = "swap_disk_space") -> int:
    """A read-write fd of a new file of nbytes in folder that no other process can open
    (`setting`: what sized it, for the error when the disk is too small).

    O_TMPFILE makes it without a name; where the file system lacks it, a private named
    file is unlinked at once. The space is reserved now (posix_fallocate), so that writing
    to the mapping later cannot fail for lack of disk space."""
    try:
        fd = os.open(folder, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except (AttributeError, OSError):
        fd, path = tempfile.mkstemp(prefix="pagedllm-swap-", dir=folder)
        os.unlink(path)
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as error:
            raise OSError(
                f"cannot reserve {nbytes / GiB:.2f} GiB of disk in {folder}: "
                f"{error.strerror}; lower {setting} or choose another swap_dir"
            ) from error
    except BaseException:
        os.close(fd)
        raise
    return fd


class SwapSpace:
    """The swap tiers' tensors of one process (one rank's heads under tensor parallelism)."""

    def __init__(
        self,
        plan: SwapPlan,
        k_shape: tuple[int, ...],
        v_shape: tuple[int, ...],
        num_layers: int,
        dtype: torch.dtype,
        pin_memory: bool = False,
    ):
        """k_shape, v_shape: one layer's KV cache shapes, blocks along dim 0."""
        self.plan = plan
        k_block, v_block = tuple(k_shape[1:]), tuple(v_shape[1:])
        self.host: list[tuple[torch.Tensor, torch.Tensor]] = [
            (
                torch.zeros((plan.host_blocks, *k_block), dtype=dtype, pin_memory=pin_memory),
                torch.zeros((plan.host_blocks, *v_block), dtype=dtype, pin_memory=pin_memory),
            )
            for _ in range(num_layers if plan.host_blocks else 0)
        ]
        self.disk: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._mapping: mmap.mmap | None = None
        if plan.disk_blocks:
            self._map_disk(plan, k_block, v_block, num_layers, dtype)

    def _map_disk(self, plan: SwapPlan, k_block, v_block, num_layers: int, dtype) -> None:
        assert plan.disk_dir is not None
        element = torch.tensor([], dtype=dtype).element_size()
        k_numel = plan.disk_blocks * math.prod(k_block)
        v_numel = plan.disk_blocks * math.prod(v_block)
        nbytes = num_layers * (k_numel + v_numel) * element
        fd = unnamed_file(plan.disk_dir, nbytes)
        try:
            self._mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)  # the mapping keeps the file
        whole = torch.frombuffer(self._mapping, dtype=dtype, count=nbytes // element)
        self._disk_base = whole.data_ptr()
        offset = 0
        for _ in range(num_layers):
            k = whole[offset : offset + k_numel].view(plan.disk_blocks, *k_block)
            offset += k_numel
            v = whole[offset : offset + v_numel].view(plan.disk_blocks, *v_block)
            offset += v_numel
            self.disk.append((k, v))

    def _tiers(self, block_ids: list[int], slots: list[int]):
        """(tier tensors, KV-cache block ids, slots within the tier) for each tier in use."""
        host = [(b, s) for b, s in zip(block_ids, slots) if not self.plan.is_on_disk(s)]
        disk = [
            (b, s - self.plan.host_blocks)
            for b, s in zip(block_ids, slots)
            if self.plan.is_on_disk(s)
        ]
        for tier, pairs in ((self.host, host), (self.disk, disk)):
            if pairs:
                blocks, tier_slots = zip(*pairs)
                yield tier, list(blocks), list(tier_slots)

    def store(self, kv_caches, block_ids: list[int], slots: list[int]) -> None:
        """Copy KV-cache blocks block_ids (every layer) into swap slots."""
        for tier, blocks, tier_slots in self._tiers(block_ids, slots):
            device_idx = torch.tensor(blocks, device=kv_caches[0][0].device)
            for (k, v), (tk, tv) in zip(kv_caches, tier):
                tk[tier_slots] = k[device_idx].to("cpu")
                tv[tier_slots] = v[device_idx].to("cpu")

    def load(self, kv_caches, block_ids: list[int], slots: list[int]) -> None:
        """Copy swap slots back into KV-cache blocks block_ids (every layer)."""
        for tier, blocks, tier_slots in self._tiers(block_ids, slots):
            device = kv_caches[0][0].device
            device_idx = torch.tensor(blocks, device=device)
            for (k, v), (tk, tv) in zip(kv_caches, tier):
                k[device_idx] = tk[tier_slots].to(device)
                v[device_idx] = tv[tier_slots].to(device)

    def read_ahead(self, slots: Sequence[int]) -> None:
        """Ask the kernel to read the disk tier's pages of these swap slots (every layer)
        into memory in the background; host slots and an empty list are a no-op."""
        if self._mapping is None:
            return
        for start, length in self.disk_ranges(slots):
            self._mapping.madvise(mmap.MADV_WILLNEED, start, length)

    def disk_ranges(self, slots: Sequence[int]) -> list[tuple[int, int]]:
        """(offset, length) in the disk file of the bytes of these swap slots, one range
        per run of consecutive slots, layer, key and value; each starts at a page, as
        madvise wants (so it may begin up to a page before the run's first byte)."""
        first_disk = self.plan.host_blocks
        tier_slots = sorted(s - first_disk for s in slots if self.plan.is_on_disk(s))
        ranges = []
        for _, first, count in consecutive_runs(tier_slots):
            for pair in self.disk:
                for tensor in pair:
                    row = tensor.stride(0) * tensor.element_size()  # bytes per slot
                    offset = tensor.data_ptr() - self._disk_base + first * row
                    aligned = offset - offset % mmap.PAGESIZE
                    ranges.append((aligned, offset + count * row - aligned))
        return ranges

    def close(self) -> None:
        """Drop the tier tensors and unmap the disk file (its space is freed with it)."""
        self.host, self.disk = [], []
        if self._mapping is not None:
            with contextlib.suppress(BufferError):  # a view still alive: unmapped with it
                self._mapping.close()
            self._mapping = None
