"""Torch references of the attention kernels: what runs on CPU, and what tests compare to.

Shapes (T = tokens in the step, B = sequences, Hq/Hkv = query/KV heads, D = head dim):

    q             [T, Hq, D]          queries of every scheduled token, sequences back to back
    k, v          [T, Hkv, D]         new keys/values of those tokens
    k_cache       [num_blocks, block_size, Hkv, D]
    v_cache       [num_blocks, block_size, Hkv, D]
    slot_mapping  [T] int64           flat slot (block_id * block_size + offset) of each token; -1 = skip
    cu_seqlens_q  [B + 1] int32       sequence i owns q rows cu_seqlens_q[i] : cu_seqlens_q[i + 1]
    seq_lens      [B] int32           tokens of sequence i in the cache, its new ones included
    block_tables  [B, max_blocks] int32  block ids of sequence i, in order (padding unused)

Sequence i, with query_len = cu_seqlens_q[i+1] - cu_seqlens_q[i] and
context_len = seq_lens[i] - query_len (tokens already cached before this step):

    keys:    | 0 ........ context_len-1 | context_len ..... seq_len-1 |
    queries:                            | q_0 ............ q_{query_len-1} |
    query j sits at position context_len + j and sees keys 0 .. context_len + j
    (and, with a sliding window W, only the last W of them).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def reshape_and_cache(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = padding, not written
) -> None:
    num_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    flat_k = k_cache.view(-1, num_heads, head_dim)
    flat_v = v_cache.view(-1, num_heads, head_dim)
    valid = slot_mapping >= 0
    if bool(valid.all()):
        flat_k.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        flat_v.index_copy_(0, slot_mapping, v.to(v_cache.dtype))
    else:
        slots = slot_mapping[valid]
        flat_k.index_copy_(0, slots, k[valid].to(k_cache.dtype))
        flat_v.index_copy_(0, slots, v[valid].to(v_cache.dtype))


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_table: torch.Tensor,  # [num_used_blocks] or [B, num_used_blocks]
) -> torch.Tensor:
    """The cache rows of one (or B) sequences in order: [..., num_used_blocks * block_size, Hkv, D]."""
    flat = block_table.reshape(-1).long()
    gathered = cache.index_select(0, flat)  # cheaper than advanced indexing on CPU
    return gathered.view(*block_table.shape[:-1], -1, *cache.shape[2:])


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    out: torch.Tensor,  # [T, Hq, D], written
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    scale: float,
    sliding_window: int | None = None,
    k_new: torch.Tensor | None = None,  # [T, Hkv, D], this step's keys (optional)
    v_new: torch.Tensor | None = None,  # [T, Hkv, D], this step's values (optional)
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its paged keys and values.

    Decode rows (query_len 1) are batched into one padded attention call; each prefill
    (query_len > 1) is one causal attention call over its gathered context. When the
    step's own keys and values are given, a prompt with no cached context attends to them
    directly instead of gathering the same values back out of the cache.
    """
    block_size = k_cache.shape[1]
    plan = _plan(cu_seqlens_q, seq_lens, block_tables, block_size, sliding_window, q.dtype)
    cu, lens, query_lens = plan.cu, plan.lens, plan.query_lens
    if plan.decode is not None:
        _decode_attention(q, k_cache, v_cache, out, plan.decode, scale)
    for i, query_len in enumerate(query_lens):
        if query_len <= 1:
            continue
        seq_len = lens[i]
        if seq_len == query_len and k_new is not None and v_new is not None:
            k, v = k_new[cu[i] : cu[i + 1]], v_new[cu[i] : cu[i + 1]]  # [L, Hkv, D]
        else:
            num_blocks = -(seq_len // -block_size)
            k = gather_kv(k_cache, block_tables[i, :num_blocks])[:seq_len]  # [L, Hkv, D]
            v = gather_kv(v_cache, block_tables[i, :num_blocks])[:seq_len]
        qi = q[cu[i] : cu[i + 1]]  # [query_len, Hq, D]
        # A prompt with nothing cached before it is plain causal attention (the fast path).
        plain_causal = seq_len == query_len and sliding_window is None
        mask = None if plain_causal else _causal_mask(query_len, seq_len, sliding_window, q.device)
        o = F.scaled_dot_product_attention(
            qi.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0).to(q.dtype),
            v.transpose(0, 1).unsqueeze(0).to(q.dtype),
            attn_mask=mask,
            is_causal=plain_causal,
            scale=scale,
            enable_gqa=True,
        )  # [1, Hq, query_len, D]
        out[cu[i] : cu[i + 1]] = o[0].transpose(0, 1)
    return out


def _causal_mask(
    query_len: int, seq_len: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor:
    """[query_len, seq_len] bool, True where query j may attend key p."""
    context_len = seq_len - query_len
    query_pos = torch.arange(context_len, seq_len, device=device)[:, None]
    key_pos = torch.arange(seq_len, device=device)[None, :]
    mask = key_pos <= query_pos
    if sliding_window is not None:
        mask &= key_pos > query_pos - sliding_window
    return mask


@dataclass(slots=True)
class _DecodePlan:
    """What every layer of one step needs for its decode rows (built once per step)."""

    q_index: torch.Tensor | None  # [Bd] rows of q, or None when every row decodes
    block_ids: torch.Tensor  # [Bd * nb] int64, each row's blocks padded to the longest
    num_rows: int
    mask: torch.Tensor  # [Bd, 1, 1, nb * bs] additive: 0 where a key is visible, -inf after


@dataclass(slots=True)
class _Plan:
    cu: list[int]
    lens: list[int]
    query_lens: list[int]
    decode: _DecodePlan | None
    key: tuple = ()
    tensors: tuple = ()  # keeps the keyed tensors alive, so their ids stay theirs


# One cached plan per thread: each engine thread runs its own steps.
_plans = threading.local()


def _plan(
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    sliding_window: int | None,
    dtype: torch.dtype,
) -> _Plan:
    """Host-side bookkeeping of a step, shared by all its layers: the metadata tensors
    are the same objects in every layer of one forward pass, so this runs once a step."""
    key = (id(cu_seqlens_q), id(seq_lens), id(block_tables), block_size, sliding_window, dtype)
    cached = getattr(_plans, "last", None)
    if cached is not None and cached.key == key:
        return cached
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    query_lens = [cu[i + 1] - cu[i] for i in range(len(lens))]
    rows = [i for i, n in enumerate(query_lens) if n == 1]
    decode = None
    if rows:
        device = cu_seqlens_q.device
        num_blocks = -(max(lens[i] for i in rows) // -block_size)
        every_row = len(rows) == len(lens)
        row_index = torch.tensor(rows, device=device)
        tables = block_tables[:, :num_blocks] if every_row else block_tables[row_index, :num_blocks]
        row_lens = seq_lens[row_index].long()
        key_pos = torch.arange(num_blocks * block_size, device=device)[None, :]
        visible = key_pos < row_lens[:, None]  # [Bd, L]
        if sliding_window is not None:
            visible &= key_pos >= (row_lens[:, None] - sliding_window)
        mask = torch.zeros(visible.shape, dtype=dtype, device=device)
        mask.masked_fill_(~visible, float("-inf"))
        decode = _DecodePlan(
            q_index=None if every_row else torch.tensor([cu[i] for i in rows], device=device),
            block_ids=tables.reshape(-1).long(),
            num_rows=len(rows),
            mask=mask[:, None, None, :],
        )
    plan = _Plan(cu, lens, query_lens, decode, key, (cu_seqlens_q, seq_lens, block_tables))
    _plans.last = plan
    return plan


def _decode_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    plan: _DecodePlan,
    scale: float,
) -> None:
    """All query_len == 1 sequences in one attention call, padded to the longest:
    q [Bd, Hq, 1, D] over keys [Bd, Hkv, L, D], with a mask for each row's length."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    shape = (plan.num_rows, -1, num_kv_heads, head_dim)
    # [Bd, Hkv, L, D] views of the gathered blocks
    k = k_cache.index_select(0, plan.block_ids).view(shape).transpose(1, 2)
    v = v_cache.index_select(0, plan.block_ids).view(shape).transpose(1, 2)
    q_rows = q if plan.q_index is None else q[plan.q_index]
    o = F.scaled_dot_product_attention(
        q_rows.unsqueeze(2),  # [Bd, Hq, 1, D]
        k.to(q.dtype),
        v.to(q.dtype),
        attn_mask=plan.mask,
        scale=scale,
        enable_gqa=True,
    ).squeeze(2)  # [Bd, Hq, D]
    if plan.q_index is None:
        out.copy_(o)
    else:
        out[plan.q_index] = o.to(out.dtype)
