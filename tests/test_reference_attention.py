"""The CPU attention path (kernels/reference.py) against attention written out by hand.

The Triton tests compare the kernels to this reference; here the reference itself meets a
per-query loop with an explicit softmax, in float64, on batches built to exercise its
shortcuts: decode rows of very different lengths (several length buckets, each padded to
its longest row and masked), prefills with and without cached context, GQA, sliding windows,
Gemma's attention-logit soft-cap and query_pre_attn_scalar scale, and layers of one step
that differ in window (Gemma's sliding and global layers share a step's metadata).
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm_integrations.kernels import reference


def by_hand(q, keys, values, context_len, scale, window, soft_cap=None):
    """q [n, Hq, D] at positions context_len.., keys/values [L, Hkv, D] -> [n, Hq, D]."""
    group = q.shape[1] // keys.shape[1]
    out = torch.empty_like(q)
    for j in range(q.shape[0]):
        pos = context_len + j
        first = 0 if window is None else max(0, pos - window + 1)
        for h in range(q.shape[1]):
            k = keys[first : pos + 1, h // group]  # [visible, D]
            v = values[first : pos + 1, h // group]
            scores = k @ q[j, h] * scale
            if soft_cap is not None:
                scores = soft_cap * torch.tanh(scores / soft_cap)
            weights = torch.softmax(scores, dim=0)
            out[j, h] = weights @ v
    return out


def check(
    cases, num_q_heads, num_kv_heads, block_size, window=None, seed=0, soft_cap=None, scale=None
):
    """cases: (query_len, context_len) per sequence; blocks scattered over the pool.

    `window` may be a list: one attention call per window over the same step tensors, as the
    layers of one forward pass make them."""
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
    scale = head_dim**-0.5 if scale is None else scale
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    for layer_window in window if isinstance(window, list) else [window]:
        out = torch.full_like(q, float("nan"))
        reference.paged_attention(
            q, k_cache, v_cache, out, cu, lens, tables, scale, layer_window,
            logits_soft_cap=soft_cap,
        )  # fmt: skip
        for i, (_, context_len) in enumerate(cases):
            ids = tables[i, : blocks[i]].long()
            keys = k_cache[ids].flatten(0, 1)[: seq_lens[i]]
            values = v_cache[ids].flatten(0, 1)[: seq_lens[i]]
            rows = slice(int(cu[i]), int(cu[i + 1]))
            want = by_hand(q[rows], keys, values, context_len, scale, layer_window, soft_cap)
            err = (out[rows] - want).abs().max().item()
            assert err < 1e-12, f"sequence {i} {cases[i]} window {layer_window}: error {err:.3g}"


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


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("soft_cap", [0.5, 50.0])
def test_logit_soft_cap(soft_cap, window):
    # 0.5 bends every score; 50 (Gemma 2's value) only the largest. Decode buckets, prefills
    # with and without context, GQA; the scale is Gemma's query_pre_attn_scalar^-1/2.
    cases = [(1, 150), (1, 3), (30, 40), (12, 0), (1, 90), (5, 200)]
    check(cases, 6, 2, block_size=8, window=window, soft_cap=soft_cap, scale=24**-0.5)


def test_layers_of_one_step_with_different_windows():
    """Gemma alternates sliding and global layers over one step's metadata: each layer gets
    the plan of its own window, however they interleave."""
    cases = [(1, 150), (1, 3), (30, 40), (1, 64), (12, 0), (1, 90)]
    check(cases, 4, 2, block_size=8, window=[None, 8, None, 8, 33, None])
