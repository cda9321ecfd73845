"""Fixed-size KV blocks with reference counts, an LRU free queue and the prefix-cache index.

Pure Python, no torch: the pool only decides which block ids hold which tokens. The
tensors that hold the keys and values live in the model runner.

Eviction order. Free blocks sit in one doubly linked queue; allocation pops from the
head. A freed block without a hash (its contents can never be hit) goes to the head so
it is reused first; a freed block with a hash goes to the tail so it survives as long as
possible for a future prefix hit. A hit on a free block takes it out of the middle of
the queue in O(1).

    head -> [unhashed ...][hashed, least recently used ... most recently used] <- tail

Tiers. With a KV disk tier (engine/kv_disk_tier.py) the blocks from `memory_blocks` on
live in a file that the kernel pages; they have a queue of their own, in the same order,
and are handed out only when no memory block is free, so the file takes only what memory
cannot hold.

Cold prefix blocks go down a tier. With a disk tier and `copy_blocks` set (the engine
sets it to copy KV blocks in its tensors), a cached memory block that is about to be
reused for new tokens is not dropped from the prefix cache: its keys and values are copied
into a free block of the file (the file's unhashed blocks first, then its least recently
used cached ones) and its hash moves there. A later prompt with that prefix hits it where
it lies: attention reads it from the file's pages (the kernel reads them back from disk if
it had to write them out), and nothing copies it back. The copies are made before
`get_new_blocks` returns, so before anything can write the memory block's new tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

# (source block id, destination block id) pairs to copy, all layers' keys and values.
BlockCopier = Callable[[list[tuple[int, int]]], None]


@dataclass(eq=False, slots=True)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Chained hash of this block's tokens and every block before it; None while the block
    # is not full or not registered in the prefix cache.
    block_hash: int | None = None
    # The tokens behind the hash: a hit is confirmed by equality, so a hash collision can
    # never serve another prompt's keys and values.
    token_ids: tuple[int, ...] | None = None
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinels: O(1) popleft, append and remove."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-2)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def append(self, block: KVCacheBlock) -> None:
        self._insert_after(self._tail.prev_free, block)  # type: ignore[arg-type]

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, anchor: KVCacheBlock, block: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"{block} is already in the free queue")
        nxt = anchor.next_free
        assert nxt is not None
        anchor.next_free = block
        block.prev_free = anchor
        block.next_free = nxt
        nxt.prev_free = block
        self._len += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """All KV blocks of one engine and the hash -> block index of the prefix cache."""

    def __init__(self, num_blocks: int, memory_blocks: int | None = None) -> None:
        """memory_blocks: the blocks in memory, the first ones (default: all of them)."""
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.memory_blocks = num_blocks if memory_blocks is None else memory_blocks
        assert 0 <= self.memory_blocks <= num_blocks, (memory_blocks, num_blocks)
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks[: self.memory_blocks])
        self.disk_queue = FreeBlockQueue(self.blocks[self.memory_blocks :])
        self.cached: dict[int, KVCacheBlock] = {}
        self.num_disk_blocks_taken = 0  # disk-tier blocks handed out, since start
        # Set by the engine where a disk tier exists: cold cached memory blocks are then
        # copied into the file instead of being dropped (see the module's docstring).
        self.copy_blocks: BlockCopier | None = None
        self.num_blocks_demoted = 0  # cached memory blocks moved to the file, since start

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue) + len(self.disk_queue)

    @property
    def num_disk_blocks_in_use(self) -> int:
        return self.num_blocks - self.memory_blocks - len(self.disk_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def _queue_of(self, block: KVCacheBlock) -> FreeBlockQueue:
        return self.free_queue if block.block_id < self.memory_blocks else self.disk_queue

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, only {self.num_free_blocks} free")
        blocks = []
        moves: list[tuple[int, int]] = []
        for _ in range(n):
            if len(self.free_queue):
                block = self.free_queue.popleft()
                if block.block_hash is not None and self.copy_blocks is not None:
                    self._demote(block, moves)
            else:
                block = self.disk_queue.popleft()
                self.num_disk_blocks_taken += 1
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        if moves:
            assert self.copy_blocks is not None
            self.copy_blocks(moves)
        return blocks

    def _demote(self, block: KVCacheBlock, moves: list[tuple[int, int]]) -> None:
        """Move cached memory block `block`'s hash to a free block of the file (queued
        as its most recently used) and record the copy; nothing when the file has no free
        block. A destination handed out later in the same call loses the hash again, as
        any evicted block does (its copy is then wasted, never wrong)."""
        if not len(self.disk_queue):
            return
        target = self.disk_queue.popleft()
        self._evict(target)
        assert block.block_hash is not None
        target.block_hash, target.token_ids = block.block_hash, block.token_ids
        self.cached[block.block_hash] = target
        block.block_hash = block.token_ids = None
        self.disk_queue.append(target)
        moves.append((block.block_id, target.block_id))
        self.num_blocks_demoted += 1

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found in the prefix cache."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._queue_of(block).remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; `ordered` goes first-to-evict first."""
        for block in ordered:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"double free of {block}"
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self._queue_of(block).appendleft(block)
                else:
                    self._queue_of(block).append(block)

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> KVCacheBlock | None:
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def cache_block(self, block: KVCacheBlock, block_hash: int, token_ids: tuple[int, ...]) -> None:
        """Register a full block under its hash (a duplicate of a cached block stays unhashed)."""
        if block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        block.token_ids = token_ids
        self.cached[block_hash] = block

    def uncache(self, block: KVCacheBlock) -> None:
        """Forget a block's hash (its contents are not trustworthy, e.g. a failed step)."""
        self._evict(block)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None
            block.token_ids = None

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash. Refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            self._evict(block)
        return True

    def check_consistency(self) -> None:
        """Every block is either referenced or free, never both; the index points at itself."""
        free_ids = {b.block_id for b in self.free_queue} | {b.block_id for b in self.disk_queue}
        assert all(b.block_id < self.memory_blocks for b in self.free_queue)
        assert len(free_ids) == self.num_free_blocks
        for block in self.blocks:
            assert (block.ref_cnt == 0) == (block.block_id in free_ids), block
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, block


def consecutive_runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(position in ids, first id, length) of each run of ids that count up by one:
    [3, 4, 5, 9] -> [(0, 3, 3), (3, 9, 1)].

    Blocks move run by run, one slice copy (or one madvise) per run and layer: torch's
    index_select and index_copy_ on bf16 CPU tensors run at a tenth of memcpy speed, and
    blocks come off the free queues mostly in order."""
    runs: list[tuple[int, int, int]] = []
    for position, value in enumerate(ids):
        if runs and runs[-1][1] + runs[-1][2] == value:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((position, value, 1))
    return runs
