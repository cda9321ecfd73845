"""The CPU attention path (kernels/reference.py) against attention written out by hand.

The Triton tests compare the kernels to this reference; here the reference itself meets a
per-query loop with an explicit softmax, in float64, on batches built to exercise its
shortcuts: decode rows of very different lengths (several length buckets, each padded to
its longest row and masked), prefills with and without cached context, GQA, sliding windows.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm_integrations.kernels import reference


def by_hand(q, keys, values, context_len, scale, window):
    """q [n, Hq, D] at positions context_len.., keys/values [L, Hkv, D] -> [n, Hq, D]."""
    group = q.shape[1] // keys.shape[1]
    out = torch.empty_like(q)
    for j in range(q.shape[0]):
        pos = context_len + j
        first = 0 if window is None else max(0, pos - window + 1)
        for h in range(q.shape[1]):
            k = keys[first : pos + 1, h // group]  # [visible, D]
            v = values[first : pos + 1, h // group]
            weights = torch.softmax(k @ q[j, h] * scale, dim=0)
            out[j, h] = weights @ v
    return out


def check(cases, num_q_heads, num_kv_heads, block_size, window=None, seed=0):
    """cases: (query_len, context_len) per sequence; blocks scattered over the pool."""
    torch.manual_seed(seed)
    head_dim = 16
    seq_lens = [n + c for n, c in cases]
    blocks = [-(-length // block_size) for length in seq_lens]
    num_blocks = sum(blocks) + 2
    order = torch.randperm(num_blocks)
    tables = torch.zeros(len(cases), max(blocks), dtype=torch.int32)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float64)
    v_cache = torch.randn_like(k_cache)
    used = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = order[used : used + n].to(torch.int32)
        used += n
    cu = torch.zeros(len(cases) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor([n for n, _ in cases]).cumsum(0)
    q = torch.randn(int(cu[-1]), num_q_heads, head_dim, dtype=torch.float64)
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    reference.paged_attention(q, k_cache, v_cache, out, cu, lens, tables, scale, window)
    for i, (_, context_len) in enumerate(cases):
        ids = tables[i, : blocks[i]].long()
        keys = k_cache[ids].flatten(0, 1)[: seq_lens[i]]
        values = v_cache[ids].flatten(0, 1)[: seq_lens[i]]
        rows = slice(int(cu[i]), int(cu[i + 1]))
        want = by_hand(q[rows], keys, values, context_len, scale, window)
        err = (out[rows] - want).abs().max().item()
        assert err < 1e-12, f"sequence {i} {cases[i]}: max abs error {err:.3g}"


@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (3, 1)])
def test_decode_rows_of_many_lengths(heads):
    # 1..400 keys with block_size 8: rows fall into several length buckets.
    rng = random.Random(1)
    cases = [(1, rng.randint(0, 400)) for _ in range(24)] + [(1, 0), (1, 7), (1, 8)]
    check(cases, *heads, block_size=8)


def test_prefills_and_decodes_mixed():
    cases = [(1, 300), (37, 0), (1, 5), (20, 45), (1, 130), (16, 16), (1, 0), (5, 200)]
    check(cases, 6, 2, block_size=16)


@pytest.mark.parametrize("window", [1, 9, 64])
def test_sliding_window(window):
    cases = [(1, 150), (1, 3), (30, 40), (1, 64), (12, 0), (1, 90)]
    check(cases, 4, 2, block_size=8, window=window)


def test_consecutive_steps_of_different_shapes():
    """The kept gather buffers and the per-step plan carry nothing from one step to the next."""
    for seed, cases in enumerate([[(1, 500)] * 6, [(1, 3), (1, 9)], [(4, 100), (1, 600)]]):
        check(cases, 4, 2, block_size=16, seed=seed)
