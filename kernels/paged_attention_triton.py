"""Triton paged attention over the block-table KV cache: one unified kernel for a flat varlen
batch (prefill with a cached prefix and decode in the same launch), plus a split-KV
(flash-decoding) path for decode-only batches with few sequences and long contexts.

Semantics are those of `reference.paged_attention` (see its docstring for the
context_len / query_len picture). Works on CUDA and, with TRITON_INTERPRET=1 set before
triton is imported, on CPU tensors (tests).

Index arithmetic of the unified kernel (grid = (query tiles, kv heads)):

    GROUP = Hq // Hkv query heads share one KV head; BLOCK_Q = BLOCK_M // GROUP tokens.
    A program owns BLOCK_M rows = BLOCK_Q tokens x GROUP heads of one sequence:

        row r  ->  token  tile * BLOCK_Q + r // GROUP   (of its sequence)
               ->  head   kv_head * GROUP + r % GROUP

    Tiles are numbered so that sequence i starts at tile  cu_seqlens_q[i] // BLOCK_Q + i
    (an upper bound that never overlaps the next sequence, so the grid needs no device
    sync: T // BLOCK_Q + B tiles); a program finds its sequence by binary search over
    cu_seqlens_q and returns at once if its tile lies past the sequence's end:

        cu_seqlens_q = [0, 5, 7, 27], BLOCK_Q = 4  ->  27 // 4 + 3 = 9 tiles
        tile        0     1     2     3     4      5      6      7      8
        sequence    0     0     1     2     2      2      2      2      2
        q rows      0-3   4     5-6   7-10  11-14  15-18  19-22  23-26  (none: returns)

    Key position p of sequence s (0 <= p < seq_len) is read from
        block = block_tables[s, p // block_size]     (physical block id)
        slot  = block * block_size + p % block_size  (row of k_cache viewed flat)
    one key at a time within a TILE_N tile, so block_size need not divide TILE_N.

    Scores live in the log2 domain (s = scale * log2(e) * q.k, then exp2). A logit soft-cap
    C (Gemma 2) is C * tanh(scale * q.k / C); in that domain it is C' * tanh(s / C') with
    C' = C * log2(e), so the kernels take one constant, soft_cap_log2 = C'.

    Query token j of the sequence sits at position context_len + j and sees keys
    max(0, pos - window + 1) .. pos; a program loops only over the key tiles that some
    of its rows can see (the causal and window bounds of its first and last token).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
# Running max before any key is seen: finite, so a row that sees no key in a tile gives
# exp2(-inf - (-1e30)) = 0 instead of exp2(-inf - (-inf)) = NaN.
_NEG_BIG: tl.constexpr = tl.constexpr(-1.0e30)


@triton.jit
def _find_seq(cu_seqlens_q_ptr, num_seqs, tile_idx, BLOCK_Q: tl.constexpr):
    """Largest i < num_seqs with cu_seqlens_q[i] // BLOCK_Q + i <= tile_idx."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tile(
    q,  # [BLOCK_M, D_PAD] queries of the program (zeros where masked)
    acc,  # [BLOCK_M, D_PAD] float32 running sum of p * v
    m_i,  # [BLOCK_M] float32 running max (log2 domain)
    l_i,  # [BLOCK_M] float32 running sum of p
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,  # row of block_tables for this sequence
    k_head_off,  # kv_head * stride_kh (int64)
    v_head_off,  # kv_head * stride_vh (int64)
    start_n,  # first key position of the tile
    kv_end,  # keys >= kv_end are not read
    qpos,  # [BLOCK_M] absolute position of each row's token
    row_ok,  # [BLOCK_M] row is a real (token, head)
    window,
    qk_scale,
    soft_cap_log2,  # logit soft-cap times log2(e), used when USE_SOFT_CAP
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    offs_d,  # [D_PAD]
    d_ok,  # [D_PAD]
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    offs_n = start_n + tl.arange(0, TILE_N)  # [TILE_N] key positions
    n_ok = offs_n < kv_end
    block = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
    in_block = (offs_n % BLOCK_SIZE).to(tl.int64)
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k_off = block * stride_kb + in_block * stride_ks + k_head_off  # [TILE_N]
    k = tl.load(k_cache_ptr + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    v_off = block * stride_vb + in_block * stride_vs + v_head_off
    v = tl.load(v_cache_ptr + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)

    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
    if USE_SOFT_CAP:  # C' tanh(s / C'), tanh(x) = 1 - 2 / (e^2x + 1): finite at both ends
        s = soft_cap_log2 * (
            1.0 - 2.0 / (tl.exp2(s * (2.0 * 1.4426950408889634) / soft_cap_log2) + 1.0)
        )
    visible = row_ok[:, None] & (offs_n[None, :] <= qpos[:, None]) & n_ok[None, :]
    if USE_WINDOW:
        visible = visible & (offs_n[None, :] > qpos[:, None] - window)
    s = tl.where(visible, s, float("-inf"))  # [BLOCK_M, TILE_N]

    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc=acc, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _unified_attention_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    out_ptr,  # [T, Hq, D]
    cu_seqlens_q_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    block_tables_ptr,  # [B, max_blocks] int32
    num_seqs,
    qk_scale,  # softmax scale * log2(e)
    window,  # sliding window (keys), used when USE_WINDOW
    soft_cap_log2,  # logit soft-cap * log2(e), used when USE_SOFT_CAP
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    tile_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(cu_seqlens_q_ptr, num_seqs, tile_idx, BLOCK_Q)
    q_begin = tl.load(cu_seqlens_q_ptr + seq)
    query_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_begin
    tile = tile_idx - (q_begin // BLOCK_Q + seq)
    if tile * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    token = tile * BLOCK_Q + offs_m // GROUP  # [BLOCK_M] token within the sequence
    head = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M] query head
    row_ok = (offs_m < BLOCK_Q * GROUP) & (token < query_len)
    qpos = context_len + token

    row = (q_begin + token).to(tl.int64)
    q_off = row * stride_qt + head.to(tl.int64) * stride_qh
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=q_mask, other=0.0)
    if UPCAST_DOT:  # the dots take q's dtype: K, V and P follow it
        q = q.to(tl.float32)

    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    # Keys any row of this tile can see: causal end of the last token, window start of the first.
    last_token = tl.minimum(tile * BLOCK_Q + BLOCK_Q, query_len) - 1
    kv_end = context_len + last_token + 1
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(context_len + tile * BLOCK_Q - window + 1, 0)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head_off = kv_head.to(tl.int64) * stride_kh
    v_head_off = kv_head.to(tl.int64) * stride_vh
    for start_n in range(kv_start, kv_end, TILE_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, block_table_ptr, k_head_off, v_head_off,
            start_n, kv_end, qpos, row_ok, window, qk_scale, soft_cap_log2,
            stride_kb, stride_ks, stride_vb, stride_vs, offs_d, d_ok,
            BLOCK_SIZE, TILE_N, USE_WINDOW, USE_SOFT_CAP, DOT_PRECISION,
        )  # fmt: skip

    # Every real row saw at least its own key, so l_i > 0 there; the guard is for pad rows.
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_off = row * stride_ot + head.to(tl.int64) * stride_oh
    tl.store(out_ptr + o_off[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty), q_mask)


@triton.jit
def _split_kv_decode_kernel(
    q_ptr,  # [T, Hq, D], T == B (one query token per sequence)
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    part_m_ptr,  # [T, Hq, NUM_SPLITS] float32, running max (log2 domain)
    part_l_ptr,  # [T, Hq, NUM_SPLITS] float32, sum of exp2
    part_acc_ptr,  # [T, Hq, NUM_SPLITS, D_PAD] float32, unnormalized sum of p * v
    cu_seqlens_q_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    block_tables_ptr,  # [B, max_blocks] int32
    qk_scale,
    window,
    soft_cap_log2,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """Grid (B, Hkv, NUM_SPLITS): split `split` of the keys of one sequence and KV head.

    visible keys  | kv_start ...................................... seq_len-1 |
    splits        | split 0     | split 1     | ...     | split S-1 (maybe empty) |
                  each split_len keys, rounded up to whole TILE_N tiles
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    token = tl.load(cu_seqlens_q_ptr + seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(seq_len - window, 0)
    split_len = tl.cdiv(tl.cdiv(seq_len - kv_start, NUM_SPLITS), TILE_N) * TILE_N
    split_start = kv_start + split * split_len
    split_end = tl.minimum(split_start + split_len, seq_len)

    offs_m = tl.arange(0, BLOCK_M)  # one row per query head of the group
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    row_ok = offs_m < GROUP
    head = kv_head * GROUP + offs_m
    qpos = tl.zeros([BLOCK_M], dtype=tl.int32) + (seq_len - 1)
    q_off = token.to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=q_mask, other=0.0)
    if UPCAST_DOT:  # the dots take q's dtype: K, V and P follow it
        q = q.to(tl.float32)

    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head_off = kv_head.to(tl.int64) * stride_kh
    v_head_off = kv_head.to(tl.int64) * stride_vh
    for start_n in range(split_start, split_end, TILE_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, block_table_ptr, k_head_off, v_head_off,
            start_n, split_end, qpos, row_ok, window, qk_scale, soft_cap_log2,
            stride_kb, stride_ks, stride_vb, stride_vs, offs_d, d_ok,
            BLOCK_SIZE, TILE_N, USE_WINDOW, USE_SOFT_CAP, DOT_PRECISION,
        )  # fmt: skip

    # An empty split leaves m = -1e30, l = 0, acc = 0: weight 0 in the reduction.
    part = (token.to(tl.int64) * tl.num_programs(1) * GROUP + head) * NUM_SPLITS + split
    tl.store(part_m_ptr + part, m_i, mask=row_ok)
    tl.store(part_l_ptr + part, l_i, mask=row_ok)
    tl.store(part_acc_ptr + part[:, None] * D_PAD + offs_d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _reduce_splits_kernel(
    part_m_ptr,  # [T, Hq, NUM_SPLITS] float32
    part_l_ptr,  # [T, Hq, NUM_SPLITS] float32
    part_acc_ptr,  # [T, Hq, NUM_SPLITS, D_PAD] float32
    out_ptr,  # [T, Hq, D]
    num_q_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """Grid (T, Hq): out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s, M = max_s m_s."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    base = (token.to(tl.int64) * num_q_heads + head) * NUM_SPLITS
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, D_PAD)
    m = tl.load(part_m_ptr + base + offs_s)
    l = tl.load(part_l_ptr + base + offs_s)
    acc = tl.load(part_acc_ptr + (base + offs_s)[:, None] * D_PAD + offs_d[None, :])
    w = tl.exp2(m - tl.max(m, axis=0))  # [NUM_SPLITS]
    o = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    o_off = token.to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
    tl.store(out_ptr + o_off + offs_d, o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


# --------------------------------------------------------------------------- launch
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Fewest keys worth a split of their own: below this the reduction costs more than it saves.
_MIN_KEYS_PER_SPLIT = 256
_MAX_SPLITS = 64


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 64  # the interpreter has no SMs; a mid-size GPU's count keeps the choice testable


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_seqlen_k: int, device: torch.device
) -> int:
    """KV splits for a decode-only batch: 1 (no split) when the batch alone fills the GPU.

    Without splitting there are num_seqs * num_kv_heads programs; with few of them most SMs
    idle while each program walks a long context. Splits bring the program count to about
    two per SM, with at least _MIN_KEYS_PER_SPLIT keys each; a power of two, for the reduction.
    """
    programs = num_seqs * num_kv_heads
    sms = _num_sms(device)
    if programs >= sms:
        return 1
    splits = min(
        triton.cdiv(max_seqlen_k, _MIN_KEYS_PER_SPLIT), triton.cdiv(2 * sms, programs), _MAX_SPLITS
    )
    return 1 if splits < 2 else 1 << (splits.bit_length() - 1)


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"expected q [T, Hq, D] and caches [num_blocks, block_size, Hkv, D], got "
            f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    if out.shape != q.shape:
        raise ValueError(f"out {tuple(out.shape)} must have q's shape {tuple(q.shape)}")
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(
            f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads}) and "
            f"head dims must match (q {head_dim}, cache {k_cache.shape[3]})"
        )
    if q.dtype not in _SUPPORTED_DTYPES or k_cache.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"dtypes must be float16, bfloat16 or float32, got q {q.dtype}")
    for name, t in (("q", q), ("out", out), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head) dimension")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens)):
        if t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int32 tensor, got {t.dtype}")
    if block_tables.dtype != torch.int32 or block_tables.stride(-1) != 1:
        raise ValueError("block_tables must be int32 with contiguous rows")
    if cu_seqlens_q.shape[0] != seq_lens.shape[0] + 1 or block_tables.shape[0] < seq_lens.shape[0]:
        raise ValueError("cu_seqlens_q must have B + 1 entries and block_tables B rows")


def paged_attention_triton(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    out: torch.Tensor,  # [T, Hq, D], written
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    scale: float,
    sliding_window: int | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    num_kv_splits: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal paged attention of a flat varlen batch; same results as `reference.paged_attention`.

    max_seqlen_q / max_seqlen_k are hints (no device sync is made to find them); every
    sequence must have at least one query row. num_kv_splits: None picks the split-KV path
    for decode-only batches when `choose_num_splits` says so, 1 never splits, > 1 forces
    that many splits (power of two; decode-only batches only). logits_soft_cap C turns
    each score s into C * tanh(s / C) (Gemma 2); None or 0 leaves scores as they are.
    """
    _check(q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables)
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_q_heads // num_kv_heads
    d_pad = max(16, triton.next_power_of_2(head_dim))
    tile_n = 64 if d_pad <= 128 else 32
    window = int(sliding_window) if sliding_window is not None and sliding_window > 0 else 0
    use_window = window > 0
    qk_scale = float(scale) * _LOG2E
    use_soft_cap = logits_soft_cap is not None and logits_soft_cap > 0
    soft_cap_log2 = float(logits_soft_cap or 0.0) * _LOG2E if use_soft_cap else 1.0
    # tf32 would cost float32 its 1e-3 accuracy; other dtypes ignore the setting.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    # Triton's interpreter multiplies bfloat16 dot operands as their raw uint16 bits (garbage),
    # so there the dots run in float32; compiled kernels keep bfloat16 for the tensor cores.
    upcast = q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
    decode_only = max_seqlen_q == 1 or (max_seqlen_q is None and num_tokens == num_seqs)
    num_warps = 4 if d_pad <= 128 else 8

    if max_seqlen_k is None:  # an upper bound that needs no device sync
        max_seqlen_k = block_tables.shape[1] * block_size
    keys_seen = min(max_seqlen_k, window) if use_window else max_seqlen_k
    splits = num_kv_splits
    if splits is None:
        splits = (
            choose_num_splits(num_seqs, num_kv_heads, keys_seen, q.device) if decode_only else 1
        )
    if splits > 1:
        if not decode_only:
            raise ValueError("num_kv_splits > 1 needs a decode-only batch (every query_len 1)")
        if splits & (splits - 1):
            raise ValueError(f"num_kv_splits must be a power of two, got {splits}")
        _split_kv_decode(
            q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables, qk_scale, window,
            use_window, soft_cap_log2, use_soft_cap, splits, group, d_pad, tile_n, precision,
            upcast, num_warps,
        )  # fmt: skip
        return out

    block_m = max(16 if decode_only else 64, triton.next_power_of_2(group))
    block_q = block_m // group
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _unified_attention_kernel[grid](
        q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables,
        num_seqs, qk_scale, window, soft_cap_log2,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        HEAD_DIM=head_dim, D_PAD=d_pad, GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q,
        TILE_N=tile_n, BLOCK_SIZE=block_size, USE_WINDOW=use_window, USE_SOFT_CAP=use_soft_cap,
        DOT_PRECISION=precision, UPCAST_DOT=upcast, num_warps=num_warps,
    )  # fmt: skip
    return out


def _split_kv_decode(
    q: torch.Tensor,  # [T, Hq, D], T == B
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    out: torch.Tensor,  # [T, Hq, D]
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    qk_scale: float,
    window: int,
    use_window: bool,
    soft_cap_log2: float,
    use_soft_cap: bool,
    splits: int,
    group: int,
    d_pad: int,
    tile_n: int,
    precision: str,
    upcast: bool,
    num_warps: int,
) -> None:
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs, num_kv_heads = seq_lens.shape[0], k_cache.shape[2]
    part_m = torch.empty(num_tokens, num_q_heads, splits, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(
        num_tokens, num_q_heads, splits, d_pad, dtype=torch.float32, device=q.device
    )
    _split_kv_decode_kernel[(num_seqs, num_kv_heads, splits)](
        q, k_cache, v_cache, part_m, part_l, part_acc, cu_seqlens_q, seq_lens, block_tables,
        qk_scale, window, soft_cap_log2,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        HEAD_DIM=head_dim, D_PAD=d_pad, GROUP=group,
        BLOCK_M=max(16, triton.next_power_of_2(group)), TILE_N=tile_n,
        BLOCK_SIZE=k_cache.shape[1], NUM_SPLITS=splits, USE_WINDOW=use_window,
        USE_SOFT_CAP=use_soft_cap, DOT_PRECISION=precision, UPCAST_DOT=upcast,
        num_warps=num_warps,
    )  # fmt: skip
    _reduce_splits_kernel[(num_tokens, num_q_heads)](
        part_m, part_l, part_acc, out, num_q_heads, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, D_PAD=d_pad, NUM_SPLITS=splits,
    )  # fmt: skip
