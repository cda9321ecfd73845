"""Contexts past the KV memory: `kv_disk_space` puts the KV cache's last blocks in a file
the kernel pages (engine/kv_disk_tier.py). A 32k-token prompt runs with KV memory for 8k
tokens, its greedy tokens equal a run with memory for all of it, the blocks spilled to the
file and read back are counted, and a prefix held only in the file (its pages pushed out
of memory) still gives the same tokens."""

from __future__ import annotations

import ctypes
import mmap

import pytest
import torch

from pagedllm_integrations.engine.block_pool import BlockPool
from pagedllm_integrations.engine.config import GiB
from pagedllm_integrations.engine.kv_disk_tier import KVDiskFile, KVDiskPlan, kv_block_copier
from pagedllm_integrations.engine.kv_sizing import kv_bytes_per_block
from pagedllm_integrations.engine.llm import LLM
from pagedllm_integrations.engine.sampling_params import SamplingParams
from pagedllm_integrations.engine.white_box import core_of

_MADV_PAGEOUT = 21  # Linux 5.4+: reclaim these pages now (dirty file pages written first)


def _deleted_mappings() -> list[str]:
    with open("/proc/self/maps") as maps:
        return [line for line in maps if "(deleted)" in line]


def _page_out(tensor: torch.Tensor, first_block: int) -> None:
    """Push the file pages of a KV tensor's blocks from first_block on out of memory."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = -(-tensor[first_block].data_ptr() // mmap.PAGESIZE) * mmap.PAGESIZE
    end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    assert libc.madvise(start, end - start, _MADV_PAGEOUT) == 0, ctypes.get_errno()


def test_a_tiered_tensor_is_memory_then_an_unnamed_file_and_is_unmapped_with_it(tmp_path):
    plan = KVDiskPlan(blocks=5, folder=str(tmp_path))
    shapes = [(12, 3, 64, 16), (12, 3, 16, 64)]  # blocks of 6 KiB: the boundary is mid-page
    before = len(_deleted_mappings())
    disk = KVDiskFile(plan, shapes, torch.bfloat16)
    k, v = disk.zeros(shapes[0]), disk.zeros(shapes[1])
    assert k.shape == shapes[0] and v.shape == shapes[1]
    assert not k.any() and not v.any()
    for block in range(12):  # every block, on both sides of the boundary, holds its own
        k[block] = block
        v[block] = -block
    assert all(k[b].eq(b).all() and v[b].eq(-b).all() for b in range(12))
    _page_out(k, 7)  # read back from the file
    assert all(k[b].eq(b).all() for b in range(12))
    assert list(tmp_path.iterdir()) == []  # no name, even while mapped
    assert len(_deleted_mappings()) == before + 2
    del k, v
    assert len(_deleted_mappings()) == before  # unmapped (and the file freed) with the tensors


def test_the_pool_hands_out_memory_blocks_first_and_the_file_only_past_them():
    pool = BlockPool(10, memory_blocks=6)
    first = pool.get_new_blocks(6)
    assert sorted(b.block_id for b in first) == list(range(6))
    assert pool.num_disk_blocks_taken == 0 and pool.num_disk_blocks_in_use == 0
    spilled = pool.get_new_blocks(3)
    assert sorted(b.block_id for b in spilled) == [6, 7, 8]
    assert pool.num_disk_blocks_taken == 3 and pool.num_disk_blocks_in_use == 3
    pool.free_blocks(first[:2])
    again = pool.get_new_blocks(2)  # memory freed: taken before the file's last block
    assert {b.block_id for b in again} == {first[0].block_id, first[1].block_id}
    pool.free_blocks([*first[2:], *again, *spilled])
    pool.check_consistency()
    assert pool.num_free_blocks == 10 and pool.num_disk_blocks_in_use == 0


@pytest.fixture(scope="module")
def long_context_model(tiny_llama_factory):
    """A tiny random checkpoint whose own context is 32,768 positions."""
    return tiny_llama_factory("kv-disk-32k", max_position_embeddings=32768)


PROMPT = [(7 * i) % 40000 + 100 for i in range(32760)]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def test_a_32k_prompt_with_kv_memory_for_8k_tokens_spills_to_disk_and_matches(
    long_context_model, tmp_path
):
    with LLM(str(long_context_model), disable_log_stats=True) as roomy:
        assert core_of(roomy).max_model_len == 32768
        [full] = roomy.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)
        [longer] = roomy.generate(
            [{"prompt_token_ids": PROMPT[:-16] + [5] * 16}], GREEDY, use_tqdm=False
        )
    memory_blocks = 8192 // 16
    with LLM(
        str(long_context_model),
        num_kv_blocks=memory_blocks,  # KV memory for 8k tokens
        kv_disk_space=0.01,  # 2621 more blocks in the file: 41k tokens
        swap_dir=str(tmp_path),
        disable_log_stats=True,
    ) as tight:
        core = core_of(tight)
        assert core.max_model_len == 32768  # the model's own context: memory and disk hold it
        per_block = kv_bytes_per_block(core.model_config, 16, core.plan.kv_cache_dtype)
        assert core.num_blocks == memory_blocks + int(0.01 * GiB) // per_block
        assert core.kv_cache_bytes == memory_blocks * per_block  # the memory the KV holds
        [out] = tight.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)
        assert out.outputs[0].token_ids == full.outputs[0].token_ids
        stats = core.counters.snapshot()
        spilled = stats["kv_disk_blocks_taken"]
        assert spilled >= (len(PROMPT) + 8) // 16 - memory_blocks
        assert stats["kv_disk_block_reads"] > spilled  # every later step read them again
        assert stats["kv_disk_blocks"] == 0 and stats["num_preemptions"] == 0
        assert tight.engine.num_free_blocks() == core.num_blocks  # nothing leaked

        # The prompt's blocks stay in the prefix cache, most of them in the file. Push the
        # file's pages out of memory: a prompt sharing all but its last block hits them,
        # and its tokens still match, read back from disk.
        first_disk = core.executor.runner.first_disk_block
        for k, v in core.executor.runner.kv_caches:
            _page_out(k, first_disk)
            _page_out(v, first_disk)
        prompt = PROMPT[:-16] + [5] * 16
        [hit] = tight.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
        assert core.kv_manager.prefix_cache_hits >= len(PROMPT) - 32
        assert hit.outputs[0].token_ids == longer.outputs[0].token_ids
        assert list(tmp_path.iterdir()) == []


def test_kv_disk_settings_that_cannot_work_are_refused(long_context_model, tiny_llama_dir):
    with pytest.raises(ValueError, match="kv_disk_space must be >= 0"):
        LLM(str(tiny_llama_dir), kv_disk_space=-1)
    with pytest.raises(ValueError, match="kv_disk_space is not supported with tensor_parallel"):
        LLM(str(tiny_llama_dir), kv_disk_space=1, tensor_parallel_size=2)
    # An explicit length that memory and the disk tier together cannot hold.
    with pytest.raises(ValueError, match="max_model_len 32768 needs 2048"):
        LLM(str(long_context_model), num_kv_blocks=512, kv_disk_space=0.001, max_model_len=32768)


def _cached_and_freed(pool: BlockPool, count: int, first_hash: int) -> list:
    """`count` blocks taken, registered under hashes first_hash.., and freed (cached)."""
    blocks = pool.get_new_blocks(count)
    for offset, block in enumerate(blocks):
        pool.cache_block(block, first_hash + offset, (first_hash + offset,))
    pool.free_blocks(blocks)
    return blocks


def test_cold_cached_memory_blocks_move_into_the_file_instead_of_being_dropped():
    pool = BlockPool(8, memory_blocks=4)
    copies: list[list[tuple[int, int]]] = []
    pool.copy_blocks = copies.append  # the engine's copier: kv_block_copier
    cold = _cached_and_freed(pool, 4, first_hash=100)  # memory full of cached blocks
    taken = pool.get_new_blocks(2)  # reuses the two least recently used ones
    assert [b.block_id for b in taken] == [cold[0].block_id, cold[1].block_id]
    [moves] = copies  # one call, before get_new_blocks returned
    assert [source for source, _ in moves] == [cold[0].block_id, cold[1].block_id]
    assert all(destination >= 4 for _, destination in moves)  # into the file
    for offset, (_, destination) in enumerate(moves):  # the hashes moved with them
        assert pool.lookup(100 + offset, (100 + offset,)).block_id == destination
    assert pool.lookup(102, (102,)) is cold[2]  # the warmer ones stay in memory
    assert pool.num_blocks_demoted == 2 and pool.num_disk_blocks_in_use == 0
    pool.check_consistency()

    # The file full of cached blocks too: its least recently used one makes room.
    pool.free_blocks(taken)  # unhashed: reused first, nothing to move
    _cached_and_freed(pool, 2, first_hash=200)  # memory: 102, 103, 200, 201 cached
    pool.get_new_blocks(4)  # all four move to the file, which drops 100 and 101 for them
    assert pool.lookup(100, (100,)) is None and pool.lookup(101, (101,)) is None
    assert all(pool.lookup(h, (h,)) is not None for h in (102, 103, 200, 201))
    assert pool.num_blocks_demoted == 6
    pool.check_consistency()


def test_without_a_copier_cold_blocks_are_dropped_as_before():
    pool = BlockPool(8, memory_blocks=4)
    _cached_and_freed(pool, 4, first_hash=100)
    pool.get_new_blocks(2)
    assert pool.lookup(100, (100,)) is None and pool.num_blocks_demoted == 0


def test_the_copier_moves_every_layers_keys_and_values_of_each_pair():
    kv_caches = [
        (torch.arange(8 * 6, dtype=torch.bfloat16).view(8, 2, 3) + 1000 * layer,
         -torch.arange(8 * 6, dtype=torch.bfloat16).view(8, 2, 3) - 1000 * layer)
        for layer in range(3)
    ]  # fmt: skip
    expected = [(k.clone(), v.clone()) for k, v in kv_caches]
    moves = [(0, 5), (1, 6), (3, 7)]  # a run of two, then one on its own
    kv_block_copier(kv_caches)(moves)
    for (k, v), (k0, v0) in zip(kv_caches, expected):
        for source, destination in moves:
            assert k[destination].equal(k0[source]) and v[destination].equal(v0[source])
        assert k[:5].equal(k0[:5]) and v[:5].equal(v0[:5])  # sources untouched


def test_a_prefix_memory_dropped_is_still_a_hit_from_the_file(tiny_llama_dir, tmp_path):
    """KV memory for 64 blocks: a second prompt reuses the first one's blocks, which move
    into the file; the first prompt again hits them there and gets the same tokens."""
    rng = torch.Generator().manual_seed(0)
    first, second = (torch.randint(100, 900, (960,), generator=rng).tolist() for _ in range(2))
    with LLM(
        str(tiny_llama_dir),
        num_kv_blocks=64,
        kv_disk_space=0.002,
        swap_dir=str(tmp_path),
        max_model_len=1024,
        disable_log_stats=True,
    ) as llm:
        core = core_of(llm)
        [before] = llm.generate([{"prompt_token_ids": first}], GREEDY, use_tqdm=False)
        llm.generate([{"prompt_token_ids": second}], GREEDY, use_tqdm=False)
        stats = core.counters.snapshot()
        assert stats["kv_disk_blocks_demoted"] >= 960 // 16 - 8  # memory had 64 blocks
        assert stats["kv_disk_blocks_taken"] == 0  # no request ran in the file
        hits = core.kv_manager.prefix_cache_hits
        [again] = llm.generate([{"prompt_token_ids": first}], GREEDY, use_tqdm=False)
        assert core.kv_manager.prefix_cache_hits - hits >= 960 - 16 * 9
        assert again.outputs[0].token_ids == before.outputs[0].token_ids
        assert llm.engine.num_free_blocks() == core.num_blocks  # nothing leaked
