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

With a logit soft-cap C (Gemma 2), each score s = scale * q.k becomes C * tanh(s / C)
before the mask and the softmax.
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
    logits_soft_cap: float | None = None,  # scores -> cap * tanh(scores / cap)
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its paged keys and values.

    Decode rows (query_len 1) are sorted by length into a few buckets, each one attention
    call padded to its longest row (one call for all rows would pad every row to the
    longest of the step: half the keys read would be padding when lengths vary); each
    prefill (query_len > 1) is one causal attention call over its gathered context. When the
    step's own keys and values are given, a prompt with no cached context attends to them
    directly instead of gathering the same values back out of the cache.
    """
    block_size = k_cache.shape[1]
    plan = _plan(cu_seqlens_q, seq_lens, block_tables, block_size, sliding_window, q.dtype)
    cu, lens, query_lens = plan.cu, plan.lens, plan.query_lens
    for bucket in plan.decode:
        _decode_attention(q, k_cache, v_cache, out, bucket, scale, logits_soft_cap)
    for i, query_len in enumerate(query_lens):
        if query_len <= 1:
            continue
        seq_len = lens[i]
        if seq_len == query_len and k_new is not None and v_new is not None:
            k, v = k_new[cu[i] : cu[i + 1]], v_new[cu[i] : cu[i + 1]]  # [L, Hkv, D]
        else:
            ids = block_tables[i, : -(seq_len // -block_size)].long()
            k = _gather("k", k_cache, ids).flatten(0, 1)[:seq_len]  # [L, Hkv, D]
            v = _gather("v", v_cache, ids).flatten(0, 1)[:seq_len]
        qi = q[cu[i] : cu[i + 1]]  # [query_len, Hq, D]
        # A prompt with nothing cached before it is plain causal attention (the fast path).
        plain_causal = seq_len == query_len and sliding_window is None
        mask = None if plain_causal else _causal_mask(query_len, seq_len, sliding_window, q.device)
        q4 = qi.transpose(0, 1).unsqueeze(0)  # [1, Hq, query_len, D]
        k4 = k.transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, Hkv, L, D]
        v4 = v.transpose(0, 1).unsqueeze(0).to(q.dtype)
        if logits_soft_cap is None:
            o = F.scaled_dot_product_attention(
                q4, k4, v4, attn_mask=mask, is_causal=plain_causal, scale=scale, enable_gqa=True
            )  # [1, Hq, query_len, D]
        else:
            if mask is None:
                mask = _causal_mask(query_len, seq_len, None, q.device)
            # Query head h uses KV head h // G: fold the G heads into query rows of their KV head.
            num_kv_heads = k4.shape[1]
            grouped = q4.view(num_kv_heads, -1, query_len, q4.shape[-1])  # [Hkv, G, Lq, D]
            bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
            bias.masked_fill_(~mask, float("-inf"))
            o = _soft_capped_attention(
                grouped, k4[0].unsqueeze(1), v4[0].unsqueeze(1), bias, scale, logits_soft_cap
            ).reshape(q4.shape)
        out[cu[i] : cu[i + 1]] = o[0].transpose(0, 1)
    return out


def _soft_capped_attention(
    q: torch.Tensor,  # [..., Lq, D]
    k: torch.Tensor,  # [..., L, D] (broadcast against q's leading dims)
    v: torch.Tensor,  # [..., L, D]
    bias: torch.Tensor | None,  # additive, broadcast to [..., Lq, L]: 0 visible, -inf not
    scale: float,
    soft_cap: float,
) -> torch.Tensor:  # [..., Lq, D]
    """softmax(C * tanh(scale * q k^T / C) + bias) v, the softmax in at least float32 (as
    transformers' eager Gemma 2 attention; torch's fused attention has no soft-cap)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / soft_cap) * soft_cap
    if bias is not None:
        scores = scores + bias
    softmax_dtype = torch.promote_types(q.dtype, torch.float32)  # at least float32
    weights = torch.softmax(scores, dim=-1, dtype=softmax_dtype).to(q.dtype)
    return torch.matmul(weights, v)


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
class _DecodeBucket:
    """Decode rows of similar length, attended in one call padded to the longest of them."""

    q_index: torch.Tensor  # [Br] int64, rows of q (and of out)
    block_ids: torch.Tensor  # [Br * nb] int64, each row's first nb blocks
    num_rows: int
    # [Br, 1, 1, nb * bs] additive: 0 where a key is visible, -inf where not; None: all visible
    mask: torch.Tensor | None


@dataclass(slots=True)
class _Plan:
    cu: list[int]
    lens: list[int]
    query_lens: list[int]
    decode: list[_DecodeBucket]
    key: tuple = ()
    tensors: tuple = ()  # keeps the keyed tensors alive, so their ids stay theirs


# Per thread (each engine thread runs its own steps): the last step's plan, and the gather
# buffers. Gathering into a kept buffer matters on CPU: a fresh tensor of tens of MiB is
# new pages from the kernel every layer, which copies at about a tenth of the speed.
_local = threading.local()

# A decode bucket closes when the next (shorter) row would fill less than this share of its
# padded width; short rows are cheap, so buckets narrower than _MIN_SPLIT_BLOCKS never split.
_BUCKET_FILL = 0.8
_MIN_SPLIT_BLOCKS = 8


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
    # One plan per window of the step: layers with different windows (Gemma's sliding and
    # global layers alternate) each reuse theirs instead of rebuilding it layer after layer.
    plans: dict = getattr(_local, "plans", {})
    cached = plans.get(sliding_window)
    if cached is not None and cached.key == key:
        return cached
    if any(plan.key[:3] != key[:3] for plan in plans.values()):
        plans = {}  # a new step: the previous step's plans are stale
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    query_lens = [cu[i + 1] - cu[i] for i in range(len(lens))]
    rows = sorted((i for i, n in enumerate(query_lens) if n == 1), key=lambda i: -lens[i])
    buckets: list[list[int]] = []
    for i in rows:  # longest first; a row joins the open bucket while it fills enough of it
        width = -(lens[buckets[-1][0]] // -block_size) if buckets else 0
        blocks = -(lens[i] // -block_size)
        if buckets and (width <= _MIN_SPLIT_BLOCKS or blocks >= _BUCKET_FILL * width):
            buckets[-1].append(i)
        else:
            buckets.append([i])
    decode = [
        _decode_bucket(bucket, cu, lens, block_tables, block_size, sliding_window, dtype)
        for bucket in buckets
    ]
    plan = _Plan(cu, lens, query_lens, decode, key, (cu_seqlens_q, seq_lens, block_tables))
    plans[sliding_window] = plan
    _local.plans = plans
    return plan


def _decode_bucket(
    rows: list[int],
    cu: list[int],
    lens: list[int],
    block_tables: torch.Tensor,
    block_size: int,
    sliding_window: int | None,
    dtype: torch.dtype,
) -> _DecodeBucket:
    device = block_tables.device
    num_blocks = -(lens[rows[0]] // -block_size)  # rows[0] is the longest
    row_index = torch.tensor(rows, device=device)
    row_lens = torch.tensor([lens[i] for i in rows], device=device)
    key_pos = torch.arange(num_blocks * block_size, device=device)[None, :]
    visible = key_pos < row_lens[:, None]  # [Br, L]
    if sliding_window is not None:
        visible &= key_pos >= (row_lens[:, None] - sliding_window)
    mask = None
    if not bool(visible.all()):
        mask = torch.zeros(visible.shape, dtype=dtype, device=device)
        mask.masked_fill_(~visible, float("-inf"))
        mask = mask[:, None, None, :]
    return _DecodeBucket(
        q_index=torch.tensor([cu[i] for i in rows], device=device),
        block_ids=block_tables[row_index, :num_blocks].reshape(-1).long(),
        num_rows=len(rows),
        mask=mask,
    )


def _gather_buffer(name: str, like: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """A kept [num_blocks, *like.shape[1:]] buffer of like's dtype (grown, never shrunk)."""
    buffers = getattr(_local, "buffers", None)
    if buffers is None:
        buffers = _local.buffers = {}
    numel = num_blocks * like[0].numel()
    buffer = buffers.get(name)
    if buffer is None or buffer.numel() < numel or buffer.dtype != like.dtype:
        buffer = buffers[name] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buffer[:numel].view(num_blocks, *like.shape[1:])


def _gather(name: str, cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache.index_select(0, block_ids) written into a kept buffer: [len(block_ids), bs, Hkv, D]."""
    return torch.index_select(cache, 0, block_ids, out=_gather_buffer(name, cache, len(block_ids)))


def _decode_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    bucket: _DecodeBucket,
    scale: float,
    logits_soft_cap: float | None = None,
) -> None:
    """One bucket of query_len == 1 rows in one attention call, padded to its longest.

    The G = Hq / Hkv query heads that share a KV head become G query rows of that head:
    q [Br, Hkv, G, D] over keys [Br, Hkv, L, D], so each key is read once, not G times
    (torch's CPU attention is about 1.7x faster this way than with enable_gqa).
    """
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    shape = (bucket.num_rows, -1, num_kv_heads, head_dim)
    # [Br, Hkv, L, D] views of the gathered blocks (strided: the attention reads them as is)
    k = _gather("k", k_cache, bucket.block_ids).view(shape).transpose(1, 2)
    v = _gather("v", v_cache, bucket.block_ids).view(shape).transpose(1, 2)
    rows = q[bucket.q_index]  # [Br, Hq, D]
    grouped = rows.view(bucket.num_rows, num_kv_heads, -1, head_dim)  # [Br, Hkv, G, D]
    if logits_soft_cap is None:
        o = F.scaled_dot_product_attention(
            grouped,
            k.to(q.dtype),
            v.to(q.dtype),
            attn_mask=bucket.mask,  # [Br, 1, 1, L]: one mask row serves all G query rows
            scale=scale,
        )  # [Br, Hkv, G, D]
    else:
        o = _soft_capped_attention(
            grouped, k.to(q.dtype), v.to(q.dtype), bucket.mask, scale, logits_soft_cap
        )
    out.index_copy_(0, bucket.q_index, o.reshape(rows.shape).to(out.dtype))
