"""Block pool and KV cache manager: ref counts, LRU eviction order, prefix-cache hits."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm_integrations.engine.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from pagedllm_integrations.engine.kv_cache_manager import KVCacheManager, hash_block
from pagedllm_integrations.engine.request import Request
from pagedllm_integrations.engine.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=8), cache_salt=salt)


def test_free_queue_is_a_linked_list_with_o1_remove():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    queue.appendleft(blocks[2])
    queue.remove(blocks[4])
    assert [b.block_id for b in queue] == [2, 0, 1, 3]
    assert queue.popleft().block_id == 2
    assert len(queue) == 3
    for _ in range(3):
        queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft()
    with pytest.raises(ValueError):
        queue.remove(blocks[0])


def test_freed_hashed_blocks_are_evicted_last_unhashed_first():
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)  # ids 0, 1, 2
    b = pool.get_new_blocks(2)  # ids 3, 4
    pool.cache_block(a[0], 111, (1,))
    pool.cache_block(a[1], 222, (2,))
    pool.free_blocks(reversed(a))  # tail first: 2 (unhashed) then 1, 0 (hashed)
    pool.free_blocks(reversed(b))  # 4, 3 unhashed
    # Unhashed ones are reused first (most recently freed at the head), hashed ones last.
    assert [blk.block_id for blk in pool.free_queue] == [3, 4, 2, 5, 1, 0]
    assert pool.num_free_blocks == 6
    pool.check_consistency()


def test_touch_takes_a_cached_block_out_of_the_free_queue():
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, 7, (5, 6))
    pool.free_blocks([block])
    assert pool.lookup(7, (5, 6)) is block
    assert pool.lookup(7, (5, 9)) is None  # a hash collision never serves other tokens
    pool.touch([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 3
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.check_consistency()


def test_reset_prefix_cache_is_refused_while_blocks_are_in_use():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, 1, (1,))
    assert not pool.reset_prefix_cache()
    pool.free_blocks([block])
    assert pool.reset_prefix_cache()
    assert pool.lookup(1, (1,)) is None


def test_prefix_hits_are_full_blocks_and_never_the_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(100, 112))  # exactly 3 full blocks
    first = make_request("a", prompt)
    assert kv.get_computed_blocks(first) == ([], 0)
    assert kv.allocate_slots(first, len(prompt))
    # Same 12 tokens: at most 11 may be cached, so only 2 full blocks hit.
    second = make_request("b", prompt)
    hits, num_tokens = kv.get_computed_blocks(second)
    assert num_tokens == 8 and [b.block_id for b in hits[0]] == kv.get_block_tables("a")[0][:2]
    assert kv.allocate_slots(second, len(prompt) - num_tokens, hits)
    assert all(b is not None and b.ref_cnt == 2 for b in hits[0])
    # A different salt never shares.
    salted = make_request("c", prompt, salt="tenant-2")
    assert kv.get_computed_blocks(salted) == ([], 0)
    # The hash chain is over the whole prefix.
    assert first.block_hashes[1] == hash_block(first.block_hashes[0], tuple(prompt[4:8]))


def test_allocation_fails_cleanly_and_free_returns_every_block():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    big = make_request("big", list(range(20)))
    assert not kv.allocate_slots(big, 20)  # needs 5 blocks
    assert kv.pool.num_free_blocks == 4 and kv.get_block_tables("big") == [[]]
    small = make_request("small", list(range(7)))
    assert kv.allocate_slots(small, 7)
    assert kv.pool.num_free_blocks == 2
    kv.free(small)
    assert kv.pool.num_free_blocks == 4
    kv.pool.check_consistency()


def test_hits_on_free_cached_blocks_count_against_free_space():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(a, 5)  # 3 blocks, two of them full and cached
    kv.free(a)
    b = make_request("b", [1, 2, 3, 4, 9, 9, 9])
    hits, n = kv.get_computed_blocks(b)
    assert n == 4
    # 7 tokens need 4 blocks: 2 hits (free, cached) + 2 new, but only 3 exist.
    assert not kv.allocate_slots(b, 3, hits)
    assert kv.pool.num_free_blocks == 3
    kv.pool.check_consistency()


@pytest.mark.parametrize("group_windows", [(None,), (None, 6, 6)], ids=["plain", "windowed"])
@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["alloc", "grow", "free"]), st.integers(0, 5), st.integers(1, 9)),
        max_size=60,
    )
)
def test_random_allocations_never_leak_or_double_count(ops, group_windows):
    kv = KVCacheManager(num_blocks=12, block_size=4, group_windows=group_windows)
    live: dict[str, Request] = {}
    for op, slot, size in ops:
        rid = f"r{slot}"
        if op == "alloc" and rid not in live:
            # Shared prefixes so that hits happen.
            request = make_request(rid, [slot % 2] * 4 + list(range(size)))
            hits, n = kv.get_computed_blocks(request)
            if kv.allocate_slots(request, request.num_tokens - n, hits):
                request.num_computed_tokens = request.num_tokens
                live[rid] = request
        elif op == "grow" and rid in live:
            request = live[rid]
            request.append_output_token(size)
            if kv.allocate_slots(request, 1):
                request.num_computed_tokens += 1
        elif op == "free" and rid in live:
            kv.free(live.pop(rid))
        kv.pool.check_consistency()
        for rid_live in live:  # the id tables the runner reads follow the blocks
            assert kv.get_block_tables(rid_live) == [
                [0 if b is None else b.block_id for b in group] for group in kv.req_blocks[rid_live]
            ]
        held = {b.block_id for r in live for group in kv.req_blocks.get(r, []) for b in group if b}
        assert kv.pool.num_free_blocks + len(held) == 12
    for request in list(live.values()):
        kv.free(request)
    assert kv.pool.num_free_blocks == 12
