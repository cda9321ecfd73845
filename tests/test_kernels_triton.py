"""Triton paged attention and reshape_and_cache against the torch references run in float64.

On a machine without CUDA these run through Triton's interpreter (conftest sets
TRITON_INTERPRET=1), so sizes are small except for the one long mixed batch. Every test
draws fresh random inputs; the seed is in the failure message.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from pagedllm_integrations.kernels import reference
from pagedllm_integrations.kernels.paged_attention_triton import (
    choose_num_splits,
    paged_attention_triton,
)
from pagedllm_integrations.kernels.reshape_and_cache_triton import reshape_and_cache_triton

pytestmark = pytest.mark.triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@dataclass(slots=True)
class Batch:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D], NaN outside the sequences
    v_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with a NaN block
    max_seqlen_q: int
    max_seqlen_k: int


def new_seed() -> int:
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    return seed


def make_batch(
    cases: list[tuple[int, int]],  # (query_len, context_len) per sequence
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
) -> Batch:
    """Random inputs in `dtype`; blocks from torch.randperm; every cache row that no
    sequence owns (spare blocks, the tail of each last block, the padding block) is NaN, so a
    kernel that reads past a sequence's keys shows up as NaN in its output."""
    seq_lens = [q + c for q, c in cases]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks, one of them the padding
    order = torch.randperm(num_blocks)
    pad_block = int(order[-1])
    tables = torch.full((len(cases), max(blocks_per_seq)), pad_block, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    used = 0
    for i, (n, seq_len) in enumerate(zip(blocks_per_seq, seq_lens)):
        tables[i, :n] = order[used : used + n].to(torch.int32)
        used += n
        # Keys Gaussian (scores of all sizes); values in [-1, 1) so outputs stay under 1 and a
        # bfloat16 output's own rounding (half an ulp: 2^-9 there) stays well inside 1e-2.
        k_rows = torch.randn(seq_len, num_kv_heads, head_dim)
        v_rows = torch.rand(seq_len, num_kv_heads, head_dim) * 2 - 1
        for cache, rows in ((k_cache, k_rows), (v_cache, v_rows)):
            flat = cache.view(-1, num_kv_heads, head_dim)
            pos = torch.arange(seq_len)
            slots = tables[i, pos // block_size].long() * block_size + pos % block_size
            flat[slots] = rows.to(dtype)
    query_lens = [q for q, _ in cases]
    cu = torch.zeros(len(cases) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(query_lens).cumsum(0)
    q = torch.randn(sum(query_lens), num_q_heads, head_dim).to(dtype)
    return Batch(
        q.to(DEVICE),
        k_cache.to(DEVICE),
        v_cache.to(DEVICE),
        cu.to(DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        tables.to(DEVICE),
        max(query_lens),
        max(seq_lens),
    )


def reference_out(
    b: Batch, scale: float, window: int | None, soft_cap: float | None = None
) -> torch.Tensor:
    """float64 reference on the same (rounded) inputs; NaN rows zeroed, which the torch
    reference needs because its padded decode multiplies masked rows by 0."""
    out = torch.empty(b.q.shape, dtype=torch.float64, device=DEVICE)
    k = torch.nan_to_num(b.k_cache.double())
    v = torch.nan_to_num(b.v_cache.double())
    reference.paged_attention(
        b.q.double(), k, v, out, b.cu_seqlens_q, b.seq_lens, b.block_tables, scale, window,
        logits_soft_cap=soft_cap,
    )  # fmt: skip
    return out


def run_and_compare(
    cases: list[tuple[int, int]],
    heads: tuple[int, int],
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    window: int | None = None,
    num_kv_splits: int | None = None,
    pass_max_lens: bool = True,
    soft_cap: float | None = None,
    scale: float | None = None,
) -> None:
    seed = new_seed()
    b = make_batch(cases, heads[0], heads[1], head_dim, block_size, dtype)
    scale = head_dim**-0.5 if scale is None else scale
    out = torch.full_like(b.q, float("nan"))
    paged_attention_triton(
        b.q, b.k_cache, b.v_cache, out, b.cu_seqlens_q, b.seq_lens, b.block_tables, scale,
        sliding_window=window,
        max_seqlen_q=b.max_seqlen_q if pass_max_lens else None,
        max_seqlen_k=b.max_seqlen_k if pass_max_lens else None,
        num_kv_splits=num_kv_splits, logits_soft_cap=soft_cap,
    )  # fmt: skip
    where = f"seed={seed} cases={cases} heads={heads} D={head_dim} bs={block_size} {dtype}"
    where += f" window={window} soft_cap={soft_cap}"
    assert not out.isnan().any(), f"NaN left in the output ({where})"
    err = (out.double() - reference_out(b, scale, window, soft_cap)).abs().max().item()
    assert err < TOLERANCE[dtype], f"max abs error {err:.3g} ({where})"


# The long mixed batch: decode over a long context, a short prefill with a prefix,
# a 129-token chunk after 463 cached tokens. One head config, both test dtypes.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_mixed_batch(dtype):
    run_and_compare([(1, 1328), (5, 18), (129, 463)], (8, 2), 64, 16, dtype)


SMALL_MIXED = [(1, 37), (5, 18), (19, 13), (7, 0), (1, 1)]
HEADS = [(4, 4), (6, 2), (8, 2), (4, 1), (5, 1), (9, 3)]  # MHA, GQA 3:1, 4:1, MQA, odd


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (32, 80)])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_small_mixed_batches(heads, block_size, head_dim, dtype):
    run_and_compare(SMALL_MIXED, heads, head_dim, block_size, dtype)


@pytest.mark.parametrize("head_dim", [16, 96, 128, 256])
def test_other_head_dims(head_dim):
    run_and_compare([(1, 20), (9, 30)], (4, 2), head_dim, 16, torch.float32)


def test_float16():
    run_and_compare(SMALL_MIXED, (8, 2), 64, 16, torch.float16)


def test_block_size_not_a_tile_multiple():
    # The engine allows any multiple of 8; the kernels look keys up one by one.
    run_and_compare(SMALL_MIXED, (4, 2), 64, 8, torch.float32)


DECODE = [(1, 523), (1, 37), (1, 211)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_splits", [1, 4, None], ids=["unified", "split4", "auto"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (5, 1)], ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_decode_only(heads, num_kv_splits, dtype):
    run_and_compare(DECODE, heads, 64, 16, dtype, num_kv_splits=num_kv_splits)


def test_split_kv_more_splits_than_keys():
    # 16 splits of a 3-key sequence: most splits are empty and must weigh nothing.
    run_and_compare([(1, 2), (1, 40)], (6, 2), 64, 16, torch.float32, num_kv_splits=16)


def test_decode_without_length_hints():
    run_and_compare(DECODE, (8, 2), 80, 32, torch.float32, pass_max_lens=False)
    run_and_compare(SMALL_MIXED, (8, 2), 80, 32, torch.float32, pass_max_lens=False)


@pytest.mark.parametrize("window", [1, 24, 100])
def test_sliding_window_mixed(window):
    run_and_compare([*SMALL_MIXED, (40, 90)], (6, 2), 64, 16, torch.float32, window=window)


@pytest.mark.parametrize("num_kv_splits", [1, 4], ids=["unified", "split4"])
def test_sliding_window_decode(num_kv_splits):
    run_and_compare(DECODE, (8, 2), 64, 16, torch.bfloat16, window=64, num_kv_splits=num_kv_splits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("soft_cap", [0.5, 50.0])
def test_logit_soft_cap_mixed(soft_cap, dtype):
    # Gemma 2: soft-capped scores, query_pre_attn_scalar scale, a sliding window on the side.
    run_and_compare(SMALL_MIXED, (8, 2), 64, 16, dtype, soft_cap=soft_cap, scale=24**-0.5)
    run_and_compare(SMALL_MIXED, (6, 2), 64, 16, dtype, window=8, soft_cap=soft_cap)


@pytest.mark.parametrize("num_kv_splits", [1, 4], ids=["unified", "split4"])
def test_logit_soft_cap_decode(num_kv_splits):
    run_and_compare(
        DECODE, (8, 2), 64, 16, torch.float32, soft_cap=1.0, num_kv_splits=num_kv_splits
    )


def test_auto_split_choice():
    cpu = torch.device("cpu")
    assert choose_num_splits(2, 2, 1328, cpu) > 1  # few sequences, long context: split
    assert choose_num_splits(2, 2, 100, cpu) == 1  # too short to be worth it
    assert choose_num_splits(64, 8, 4096, cpu) == 1  # the batch alone fills the device
    n = choose_num_splits(1, 1, 1 << 20, cpu)
    assert n > 1 and n & (n - 1) == 0


def test_forced_split_needs_decode_only_batch():
    b = make_batch([(3, 5)], 4, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="decode-only"):
        paged_attention_triton(
            b.q, b.k_cache, b.v_cache, torch.empty_like(b.q), b.cu_seqlens_q, b.seq_lens,
            b.block_tables, 0.125, num_kv_splits=2,
        )  # fmt: skip


def test_rejects_int64_metadata():
    b = make_batch([(1, 5)], 4, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="int32"):
        paged_attention_triton(
            b.q, b.k_cache, b.v_cache, torch.empty_like(b.q), b.cu_seqlens_q.long(),
            b.seq_lens, b.block_tables, 0.125,
        )  # fmt: skip


def test_strided_q_view_like_the_model():
    """q as the model hands it over: a view into the fused qkv projection output."""
    seed = new_seed()
    b = make_batch(SMALL_MIXED, 8, 2, 64, 16, torch.float32)
    qkv = torch.randn(b.q.shape[0], 8 * 64 + 2 * 2 * 64, device=DEVICE)
    q = qkv[:, : 8 * 64].view(-1, 8, 64)
    q.copy_(b.q)
    out = torch.full_like(b.q, float("nan"))
    paged_attention_triton(
        q, b.k_cache, b.v_cache, out, b.cu_seqlens_q, b.seq_lens, b.block_tables, 0.125
    )
    err = (out.double() - reference_out(b, 0.125, None)).abs().max().item()
    assert err < 1e-3, f"seed={seed} err={err}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(2, 64), (3, 80)])
def test_reshape_and_cache_skips_padding(num_kv_heads, head_dim, dtype):
    seed = new_seed()
    num_blocks, block_size, num_tokens = 7, 16, 40
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape).to(dtype).to(DEVICE)
    v_cache = torch.randn(shape).to(dtype).to(DEVICE)
    # k, v as the model produces them: strided views into one projection output.
    kv = torch.randn(num_tokens, 2, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    k, v = kv[:, 0], kv[:, 1]
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[torch.rand(num_tokens) < 0.3] = -1
    slots = slots.to(DEVICE)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.reshape_and_cache(k, v, want_k, want_v, slots)
    reshape_and_cache_triton(k, v, k_cache, v_cache, slots)
    assert (slots == -1).any()
    assert torch.equal(k_cache, want_k), f"seed={seed}"
    assert torch.equal(v_cache, want_v), f"seed={seed}"


def test_reshape_and_cache_casts_to_cache_dtype():
    seed = new_seed()
    k_cache = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(5, 2, 64, device=DEVICE)
    v = torch.randn(5, 2, 64, device=DEVICE)
    slots = torch.tensor([3, 17, -1, 63, 0], device=DEVICE)
    reshape_and_cache_triton(k, v, k_cache, v_cache, slots)
    written = slots >= 0
    got_k = k_cache.view(-1, 2, 64)[slots[written]]
    got_v = v_cache.view(-1, 2, 64)[slots[written]]
    assert int((k_cache.view(-1, 2, 64) != 0).any(dim=(1, 2)).sum()) == 4  # -1 wrote nothing
    if DEVICE == "cuda":  # compiled casts round to nearest, as torch does
        assert torch.equal(got_k, k[written].to(torch.bfloat16)), seed
        assert torch.equal(got_v, v[written].to(torch.bfloat16)), seed
    else:  # the interpreter truncates float32 -> bfloat16: within one ulp (2^-7 relative)
        for got, want in ((got_k, k[written]), (got_v, v[written])):
            assert ((got.float() - want).abs() <= want.abs() * 2**-7).all(), seed
