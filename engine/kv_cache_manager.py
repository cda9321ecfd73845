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
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import xxhash

from .block_pool import BlockPool, KVCacheBlock
from .request import Request


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
    ) -> None:
        """memory_blocks: the first blocks, in memory; the rest are the KV disk tier's
        (engine/kv_disk_tier.py). Default: all in memory."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, memory_blocks)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many of a request's blocks are registered in the prefix cache.
        self.req_num_cached_blocks: dict[str, int] = {}
        self._identity = model_identity
        # Statistics for /metrics: tokens looked up and tokens found, since start.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Told of every admission's prefix hits (the request, its first len(hits) blocks):
        # the disk level of the cache (engine/disk_prefix_cache.py) counts them there.
        self.hit_listener: Callable[[Request, list[KVCacheBlock]], None] | None = None

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

    # --------------------------------------------------------------- lookups
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of a request that holds no blocks: (blocks, tokens)."""
        if not self.enable_caching:
            return [], 0
        if request.pooling is not None and not request.pooling.reads_prefix_cache:
            return [], 0  # mean / CLS pooling needs the hidden state of every prompt row
        max_hit_tokens = request.num_tokens - 1
        self._update_block_hashes(request, max_hit_tokens)
        hits: list[KVCacheBlock] = []
        for index in range(max_hit_tokens // self.block_size):
            block = self.pool.lookup(
                request.block_hashes[index], self._block_tokens(request, index)
            )
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (not every retry while it waits for blocks)."""
        if self.enable_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    # ------------------------------------------------------------ allocation
    def can_fit(self, num_blocks: int) -> bool:
        return num_blocks <= self.pool.num_free_blocks

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_draft_tokens: int = 0,
    ) -> bool:
        """Make room for `num_new_tokens` more tokens of `request`; False if blocks ran out.

        `new_computed_blocks` are prefix-cache hits that start right after the request's
        computed tokens (only for a request that has no blocks yet). `num_draft_tokens`
        speculative tokens after those get slots too, but no block is hashed for them:
        only tokens that are the request's own are ever registered in the prefix cache.
        """
        hits = new_computed_blocks or []
        blocks = self.req_blocks.setdefault(request.request_id, [])
        num_hit_tokens = len(hits) * self.block_size
        total_tokens = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        num_slots = total_tokens + num_draft_tokens
        num_needed = cdiv(num_slots, self.block_size) - len(blocks) - len(hits)
        # Hits that sit in the free queue stop being free once touched.
        num_hits_now_free = sum(1 for block in hits if block.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_hits_now_free:
            if not blocks:
                del self.req_blocks[request.request_id]
            return False
        self.pool.touch(hits)
        if hits and self.hit_listener is not None:
            self.hit_listener(request, hits)
        blocks.extend(hits)
        if num_needed > 0:
            blocks.extend(self.pool.get_new_blocks(num_needed))
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, total_tokens)
        return True

    def _cache_full_blocks(
        self, request: Request, blocks: list[KVCacheBlock], num_tokens: int
    ) -> None:
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
            self.pool.cache_block(
                blocks[index], request.block_hashes[index], self._block_tokens(request, index)
            )
        self.req_num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request, uncache: bool = False) -> None:
        """Release a request's blocks, tail first, so its prefix stays cached longest.

        uncache: also forget the hashes of blocks no one else holds (after a failed step
        their contents were never written).
        """
        blocks = self.req_blocks.pop(request.request_id, [])
        self.req_num_cached_blocks.pop(request.request_id, None)
        if uncache:
            for block in blocks:
                if block.ref_cnt == 1:
                    self.pool.uncache(block)
        self.pool.free_blocks(reversed(blocks))

    def free_unused_slots(self, request: Request) -> None:
        """Give back the blocks past a request's computed tokens (the slots of its rejected
        draft tokens). None of them is hashed: they hold no token of the request yet."""
        blocks = self.req_blocks.get(request.request_id)
        keep = cdiv(request.num_computed_tokens, self.block_size)
        if blocks is None or len(blocks) <= keep:
            return
        unused = blocks[keep:]
        del blocks[keep:]
        self.pool.free_blocks(reversed(unused))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_blocks.get(request_id, ())]

    def num_blocks_of(self, request_id: str) -> int:
        return len(self.req_blocks.get(request_id, ()))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    @property
    def usage(self) -> float:
        return self.pool.usage
