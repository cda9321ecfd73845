"""The C++ ops check the indices they are given: an out-of-range slot, position, block
table entry or sequence is an error naming it, not a write outside a cache (the engine
computes them; a fault of its own must stop there). The torch path raises on the same."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from pagedllm_integrations.engine.white_box import core_of
from pagedllm_integrations.kernels import cpu_ext

pytestmark = pytest.mark.skipif(not cpu_ext.load(), reason="needs the C++ CPU kernels")

HEADS, KV_HEADS, D, BS, BLOCKS = 4, 2, 32, 16, 6


def ops():
    return torch.ops.pagedllm


def caches() -> tuple[torch.Tensor, torch.Tensor]:
    """The fast path's layout: k [blocks, Hkv, D, bs], v [blocks, Hkv, bs, D]."""
    k = torch.zeros(BLOCKS, KV_HEADS, D, BS, dtype=torch.bfloat16)
    v = torch.zeros(BLOCKS, KV_HEADS, BS, D, dtype=torch.bfloat16)
    return k, v


def test_kv_cache_writes_refuse_slots_outside_the_cache():
    k_cache, v_cache = caches()
    k = torch.randn(3, KV_HEADS, D)
    good = torch.tensor([0, -1, BLOCKS * BS - 1])  # -1: a padding row, skipped
    ops().write_kv_cache_(k, k, k_cache, v_cache, good)
    for bad in ([0, 1, BLOCKS * BS], [0, -2, 5], [2**40, 0, 1]):
        before = k_cache.clone()
        with pytest.raises(RuntimeError, match="outside the cache's 96 slots"):
            ops().write_kv_cache_(k, k, k_cache, v_cache, torch.tensor(bad))
        assert torch.equal(k_cache, before)  # checked before anything is written
    with pytest.raises(RuntimeError, match="slot_mapping has 2 slots for 3 rows"):
        ops().write_kv_cache_(k, k, k_cache, v_cache, torch.tensor([0, 1]))


def test_rotary_refuses_positions_outside_its_tables():
    q, k = torch.randn(2, HEADS, D), torch.randn(2, KV_HEADS, D)
    cos, sin = torch.randn(10, D // 2), torch.randn(10, D // 2)
    ops().rotary_neox_(q, k, torch.tensor([0, 9]), cos, sin)
    for bad in ([0, 10], [-1, 3]):
        with pytest.raises(RuntimeError, match="outside the tables' 10 positions"):
            ops().rotary_neox_(q, k, torch.tensor(bad), cos, sin)
    with pytest.raises(RuntimeError, match="3 positions for 2 rows"):
        ops().rotary_neox_(q, k, torch.tensor([0, 1, 2]), cos, sin)


def attention(seq_ids, cu, lens, tables, rows: int = 3):
    k_cache, v_cache = caches()
    q = torch.randn(rows, HEADS, D)
    args = [torch.tensor(seq_ids), torch.tensor(cu, dtype=torch.int32),
            torch.tensor(lens, dtype=torch.int32), torch.tensor(tables, dtype=torch.int32)]  # fmt: skip
    ops().paged_attention_rows_(q, k_cache, v_cache, torch.zeros_like(q), *args, 0.2, 0, 0.0)


def test_attention_refuses_block_tables_and_sequences_that_do_not_fit():
    # two sequences: 1 decode row over 20 keys (blocks 4, 5), 2 prompt rows over 2 keys
    attention([0, 1], [0, 1, 3], [20, 2], [[4, 5], [0, 99]])  # 99: past its keys, unread
    cases = [
        (([0, 1], [0, 1, 3], [20, 2], [[4, BLOCKS], [0, 0]]), "block 1 is 6, outside"),
        (([0, 1], [0, 1, 3], [20, 2], [[-1, 5], [0, 0]]), "block 0 is -1, outside"),
        (([0, 1], [0, 1, 3], [40, 2], [[4, 5], [0, 0]]), "40 keys for 1 rows and 2 blocks"),
        (([0, 1], [0, 1, 3], [20, 1], [[4, 5], [0, 0]]), "1 keys for 2 rows"),
        (([0, 2], [0, 1, 3], [20, 2], [[4, 5], [0, 0]]), "sequence 2 of 2"),
        (([0, 1], [0, 1, 4], [20, 3], [[4, 5], [0, 0]]), "are not within the 3 rows of q"),
        (([0, 1], [0, 1], [20, 2], [[4, 5], [0, 0]]), "need 3 cu_seqlens_q"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            attention(*args)


def test_embedding_lookups_refuse_ids_outside_the_table():
    from pagedllm_integrations.quant.packed import quantize_u4

    table = quantize_u4(torch.randn(40, 64)).tiled()
    assert table.rows(torch.tensor([0, 39])).shape == (2, 64)
    with pytest.raises(RuntimeError, match="token id 40 is outside the table of 40"):
        table.rows(torch.tensor([3, 40]))


def test_an_engine_fault_in_the_decoder_stack_is_an_error_and_the_engine_serves_on(default_llm):
    """A corrupted block table reaches the C++ stack: the step fails with the ops' error,
    no memory is written outside the cache, and the next request is served."""
    from pagedllm_integrations import SamplingParams

    model = core_of(default_llm).model
    stack = model.fused_stack()
    assert stack is not None
    kv = [cache for pair in core_of(default_llm).executor.kv_caches for cache in pair]
    hidden = model.config.hidden_size
    x = torch.randn(1, hidden)
    num_blocks = kv[0].shape[0]
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.pagedllm.decoder_stack(
            stack.stack, x, torch.tensor([0]), kv, torch.tensor([num_blocks * 16 + 5]),
            torch.tensor([0]), torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([1], dtype=torch.int32), torch.tensor([[0]], dtype=torch.int32),
        )  # fmt: skip
    out = default_llm.generate("The capital of France is", SamplingParams(max_tokens=3))
    assert len(out[0].outputs[0].token_ids) == 3


DEBUG_CHILD = textwrap.dedent(
    """
    import os, torch
    os.environ["PAGEDLLM_DEBUG_KERNELS"] = "1"
    from pagedllm_integrations.kernels import cpu_ext
    assert cpu_ext.load(), cpu_ext.load_error()
    assert "compiled" in cpu_ext.loaded_from()
    from pagedllm_integrations import LLM, SamplingParams
    with LLM(disable_log_stats=True) as llm:
        prompts = ["The capital of France is", "def fibonacci(n):"] * 3
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
        print("tokens", [o.outputs[0].token_ids for o in outs])
    """
)


@pytest.mark.slow
def test_the_debug_build_checks_every_access_and_serves_as_the_normal_one(default_llm):
    """PAGEDLLM_DEBUG_KERNELS=1 compiles the kernels with their inner-loop checks: the
    engine runs on it (no check fires on correct indices) with the same tokens."""
    from pagedllm_integrations import SamplingParams

    done = subprocess.run(
        [sys.executable, "-P", "-c", DEBUG_CHILD], capture_output=True, text=True, timeout=1800
    )
    assert done.returncode == 0, done.stderr[-3000:]
    prompts = ["The capital of France is", "def fibonacci(n):"] * 3
    outs = default_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    assert f"tokens {[o.outputs[0].token_ids for o in outs]}" in done.stdout
