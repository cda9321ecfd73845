"""Which KV blocks each request owns, and prefix caching over full blocks.

Block hashes are chained so that a hash names a whole prefix, not just one block:

    h_0 = H(root, tokens[0:B])           root = H(model identity, cache_salt)
    h_i = H(h_{i-1}, tokens[i*B:(i+1)*B])

Only full blocks are hashed. A request's longest cached prefix is looked up block by
block; it is capped at `num_tokens - 1` tokens because the last prompt token must be
computed to produce the logits of the first sampled token.

One request's blocks after `allocate_slots(req, num_new_tokens, hits)`:

    | computed before | prefix hits  |  new tokens this step  | (free tail of last block)
    |<-- req.num_computed_tokens --->|<--- num_new_tokens --->|
    |  existing blocks| touched hits |   freshly allocated blocks  |

Groups (engine/kv_layout.py). A request has one block table per group: entry i of every
table covers tokens [i*B, (i+1)*B). Group 0 (or the only group) keeps every entry; a
sliding-window group frees an entry as soon as the window of the step's first new token
has left it, and leaves it empty (None; block 0 in the tables the kernels read, which
never read it):

    group 0 (full):      [b0  b1  b2  b3  b4  b5  b6]
    group 1 (window 40): [--  --  --  b9  b12 b13 b15]    first new token at 98, B 16:
                                                          the window starts at 59 (entry 3)

A block of a sliding group is registered in the prefix cache under `group_hash(h_i, g)`;
a prefix hit reaches only as far as each sliding group still has the blocks its window
needs at the hit's end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import xxhash

from .block_pool import BlockPool, KVCacheBlock
from .kv_layout import first_kept_entry, group_hash
from .request import Request

# One request's blocks: per group, per table entry (None: freed, out of the window).
GroupBlocks = list[list[KVCacheBlock | None]]


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


def hash_block(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    data = parent_hash.to_bytes(8, "little") + np.asarray(token_ids, dtype=np.int64).tobytes()
    return xxhash.xxh3_64_intdigest(data)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        model_identity: str = "",
        memory_blocks: int | None = None,
        group_windows: Sequence[int | None] = (None,),
    ) -> None:
        """memory_blocks: the first blocks, in memory; the rest are the KV disk tier's
        (engine/kv_disk_tier.py). Default: all in memory. group_windows: per block-table
        group its sliding window (None: every entry kept); KVLayout.group_windows."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.group_windows = tuple(group_windows)
        self.windowed = any(window is not None for window in self.group_windows)
        self.pool = BlockPool(num_blocks, memory_blocks)
        self.req_blocks: dict[str, GroupBlocks] = {}
        # The same tables as block ids (a freed entry: 0), kept in step with req_blocks so
        # that a step's tables are not rebuilt from every entry of every group.
        self.req_ids: dict[str, list[list[int]]] = {}
        # How many of a request's table entries are registered in the prefix cache.
        self.req_num_cached_blocks: dict[str, int] = {}
        self._identity = model_identity
        # Statistics for /metrics: tokens looked up and tokens found, since start.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Told of every admission's prefix hits (the request, its first len(hits) blocks):
        # the disk level of the cache (engine/disk_prefix_cache.py) counts them there.
        self.hit_listener: Callable[[Request, list[KVCacheBlock]], None] | None = None

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    # ----------------------------------------------------------------- hashing
    def _root_hash(self, request: Request) -> int:
        salt = f"{self._identity}\x00{request.cache_salt or ''}"
        return xxhash.xxh3_64_intdigest(salt.encode())

    def _block_tokens(self, request: Request, index: int) -> tuple[int, ...]:
        start = index * self.block_size
        return tuple(request.all_token_ids[start : start + self.block_size])

    def _update_block_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend request.block_hashes to every full block within the first num_tokens."""
        hashes = request.block_hashes
        for index in range(len(hashes), num_tokens // self.block_size):
            parent = hashes[-1] if hashes else self._root_hash(request)
            hashes.append(hash_block(parent, self._block_tokens(request, index)))

    def full_block_hashes(self, request: Request, num_tokens: int) -> list[int]:
        """The chained hashes of the full blocks within the first num_tokens tokens."""
        self._update_block_hashes(request, num_tokens)
        return request.block_hashes[: num_tokens // self.block_size]

    def _first_kept(self, group: int, first_new_position: int) -> int:
        return first_kept_entry(self.group_windows[group], first_new_position, self.block_size)

    # --------------------------------------------------------------- lookups
    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """The longest cached prefix of a request that holds no blocks: (its blocks per
        group, its tokens)."""
        if not self.enable_caching:
            return [], 0
        if request.pooling is not None and not request.pooling.reads_prefix_cache:
            return [], 0  # mean / CLS pooling needs the hidden state of every prompt row
        max_hit_tokens = request.num_tokens - 1
        self._update_block_hashes(request, max_hit_tokens)
        chain: list[KVCacheBlock] = []
        for index in range(max_hit_tokens // self.block_size):
            block = self.pool.lookup(
                request.block_hashes[index], self._block_tokens(request, index)
            )
            if block is None:
                break
            chain.append(block)
        if not chain:
            return [], 0
        hits: GroupBlocks = [list(chain)]
        if self.windowed:
            hits = self._windowed_hits(request, chain)
        return hits, len(hits[0]) * self.block_size

    def _windowed_hits(self, request: Request, chain: list[KVCacheBlock]) -> GroupBlocks:
        """Cut a hit of len(chain) blocks to where every sliding group has the entries its
        window needs just after it, and collect those entries.

        Entries are checked from the end down, each once per group: a missing entry m
        rules out every hit length whose window covers m, so the next candidate is m."""
        num_hit = len(chain)
        found: list[dict[int, KVCacheBlock]] = [{} for _ in self.group_windows]
        settled = False
        while not settled and num_hit > 0:
            settled = True
            for group in range(self.num_groups):
                if self.group_windows[group] is None:
                    continue
                first = self._first_kept(group, num_hit * self.block_size)
                for index in range(num_hit - 1, first - 1, -1):
                    if index in found[group]:
                        continue
                    block = self.pool.lookup(
                        group_hash(request.block_hashes[index], group),
                        self._block_tokens(request, index),
                    )
                    if block is None:
                        num_hit, settled = index, False
                        break
                    found[group][index] = block
                if not settled:
                    break
        hits: GroupBlocks = []
        for group, window in enumerate(self.group_windows):
            if window is None:
                hits.append(list(chain[:num_hit]))
            else:
                first = self._first_kept(group, num_hit * self.block_size)
                hits.append([None] * first + [found[group][i] for i in range(first, num_hit)])
        return hits

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (not every retry while it waits for blocks)."""
        if self.enable_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    # ------------------------------------------------------------ allocation
    def can_fit(self, num_blocks: int) -> bool:
        return num_blocks <= self.pool.num_free_blocks

    def blocks_for_prompt(self, num_tokens: int) -> int:
        """About the blocks a request of `num_tokens` holds once its prompt is in: every
        entry of a full group, about a window's worth of a sliding one."""
        entries = cdiv(num_tokens, self.block_size)
        return sum(
            entries if window is None else min(entries, cdiv(window, self.block_size) + 1)
            for window in self.group_windows
        )

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: GroupBlocks | None = None,
        num_draft_tokens: int = 0,
    ) -> bool:
        """Make room for `num_new_tokens` more tokens of `request`; False if blocks ran out.

        `new_computed_blocks` are prefix-cache hits (per group, get_computed_blocks) that
        start right after the request's computed tokens (only for a request that has no
        blocks yet). `num_draft_tokens` speculative tokens after those get slots too, but
        no block is hashed for them: only tokens that are the request's own are ever
        registered in the prefix cache. A request with no blocks and computed tokens (one
        coming back from swap space) gets blocks for those tokens too: every entry up to
        its first new token, in a sliding group only those its window still reaches.
        Entries of sliding groups that the window of the first new token has left are
        freed, whether or not the new blocks fit.
        """
        hits: GroupBlocks = new_computed_blocks or [[] for _ in self.group_windows]
        groups = self.req_blocks.get(request.request_id)
        if groups is None:
            groups = [[] for _ in self.group_windows]
        num_hit_tokens = len(hits[0]) * self.block_size
        first_new = request.num_computed_tokens + num_hit_tokens
        total_tokens = first_new + num_new_tokens
        num_entries = cdiv(total_tokens + num_draft_tokens, self.block_size)
        ids = self.req_ids.get(request.request_id)
        self._free_out_of_window(groups, first_new, ids)
        num_needed = 0
        for group, blocks in enumerate(groups):
            first = self._first_kept(group, first_new)
            start = len(blocks) + len(hits[group])
            num_needed += max(num_entries - max(start, first), 0)
        # Hits that sit in the free queue stop being free once touched.
        touched = [block for group_hits in hits for block in group_hits if block is not None]
        num_hits_now_free = sum(1 for block in touched if block.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_hits_now_free:
            return False  # a request's groups are kept only once it holds blocks
        self.pool.touch(touched)
        if hits[0] and self.hit_listener is not None:
            self.hit_listener(request, [block for block in hits[0] if block is not None])
        fresh = iter(self.pool.get_new_blocks(num_needed)) if num_needed else iter(())
        if ids is None:
            ids = [[] for _ in self.group_windows]
        # Sliding groups first: they take back the blocks their windows just freed (without
        # a hash those head the free queue), so the full layers' new blocks come from the
        # untouched part of the pool, after their earlier ones, and a long context's
        # full-attention reads stream through memory instead of hopping between blocks.
        for group in reversed(range(len(groups))):
            blocks = groups[group]
            known = len(blocks)
            blocks.extend(hits[group])
            first = self._first_kept(group, first_new)
            if len(blocks) < first:
                blocks.extend([None] * (first - len(blocks)))
            blocks.extend(next(fresh) for _ in range(num_entries - len(blocks)))
            ids[group].extend(0 if block is None else block.block_id for block in blocks[known:])
        self.req_blocks[request.request_id] = groups
        self.req_ids[request.request_id] = ids
        if self.enable_caching:
            self._cache_full_blocks(request, groups, total_tokens)
        return True

    def _free_out_of_window(
        self, groups: GroupBlocks, first_new: int, ids: list[list[int]] | None
    ) -> None:
        """Free the entries of sliding groups that no query from `first_new` on reads.

        The freed entries are always a prefix of a table, so the walk goes back from the
        new window's start to the first entry already freed: a step's cost is what it
        frees, not the sequence's length."""
        for group, blocks in enumerate(groups):
            index = min(self._first_kept(group, first_new), len(blocks)) - 1
            gone: list[KVCacheBlock] = []
            while index >= 0:
                block = blocks[index]
                if block is None:
                    break
                gone.append(block)
                blocks[index] = None
                if ids is not None:
                    ids[group][index] = 0
                index -= 1
            if gone:  # earliest first: the entries next to the window stay cached longest
                self.pool.free_blocks(reversed(gone))

    def _cache_full_blocks(self, request: Request, groups: GroupBlocks, num_tokens: int) -> None:
        """Register the blocks that are full once this step's tokens are written.

        They are registered at allocation, before the forward pass runs: a request
        scheduled later in the same step may hit them, which is safe because every layer
        writes this step's keys and values before any attention reads them.
        """
        num_cached = self.req_num_cached_blocks.get(request.request_id, 0)
        num_full = num_tokens // self.block_size
        if num_full <= num_cached:
            return
        self._update_block_hashes(request, num_full * self.block_size)
        for index in range(num_cached, num_full):
            tokens = self._block_tokens(request, index)
            for group, blocks in enumerate(groups):
                block = blocks[index]
                if block is not None:
                    self.pool.cache_block(
                        block, group_hash(request.block_hashes[index], group), tokens
                    )
        self.req_num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request, uncache: bool = False) -> None:
        """Release a request's blocks, tail first, so its prefix stays cached longest.

        uncache: also forget the hashes of blocks no one else holds (after a failed step
        their contents were never written).
        """
        groups = self.req_blocks.pop(request.request_id, [])
        self.req_ids.pop(request.request_id, None)
        self.req_num_cached_blocks.pop(request.request_id, None)
        # Sliding groups first: group 0's chain is what every hit starts from.
        for blocks in reversed(groups):
            held = [block for block in blocks if block is not None]
            if uncache:
                for block in held:
                    if block.ref_cnt == 1:
                        self.pool.uncache(block)
            self.pool.free_blocks(reversed(held))

    def trim_to_window(self, request: Request) -> None:
        """Free what the request's sliding groups no longer need from its computed tokens
        on (before it is swapped out: only what it resumes with is copied)."""
        groups = self.req_blocks.get(request.request_id)
        if groups is not None:
            self._free_out_of_window(
                groups, request.num_computed_tokens, self.req_ids.get(request.request_id)
            )

    def free_unused_slots(self, request: Request) -> None:
        """Give back the blocks past a request's computed tokens (the slots of its rejected
        draft tokens). None of them is hashed: they hold no token of the request yet."""
        groups = self.req_blocks.get(request.request_id)
        keep = cdiv(request.num_computed_tokens, self.block_size)
        if groups is None:
            return
        ids = self.req_ids.get(request.request_id, [])
        for blocks, group_ids in zip(groups, ids):
            if len(blocks) <= keep:
                continue
            unused = [block for block in blocks[keep:] if block is not None]
            del blocks[keep:]
            del group_ids[keep:]
            self.pool.free_blocks(reversed(unused))

    def get_block_tables(self, request_id: str) -> list[list[int]]:
        """Every group's block table of a request; a freed entry reads as block 0. The
        manager's own lists: read them before the next allocation, never change them."""
        return self.req_ids.get(request_id) or [[] for _ in self.group_windows]

    def held_block_ids(self, request_id: str, num_tokens: int) -> list[int]:
        """The blocks that hold a request's first `num_tokens` tokens, group after group,
        entries in order, freed ones left out: what a swap-out copies and, after the
        swap-in's allocation, where the copies go back (the same entries, in the same
        order, when both follow trim_to_window / allocate_slots at the same position)."""
        entries = cdiv(num_tokens, self.block_size)
        groups = self.req_blocks.get(request_id) or []
        return [
            block.block_id for blocks in groups for block in blocks[:entries] if block is not None
        ]

    def num_blocks_of(self, request_id: str) -> int:
        """The blocks a request holds, every group's."""
        groups = self.req_blocks.get(request_id) or []
        return sum(1 for blocks in groups for block in blocks if block is not None)

    def num_entries_of(self, request_id: str) -> int:
        """How many tokens' worth of table entries (in blocks) a request has."""
        groups = self.req_blocks.get(request_id)
        return len(groups[0]) if groups else 0

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    @property
    def usage(self) -> float:
        return self.pool.usage
