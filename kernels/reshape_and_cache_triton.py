"""Triton kernel that writes a step's new keys and values into the paged KV cache.

Same semantics as `reference.reshape_and_cache`: token t goes to flat slot
slot_mapping[t]; a slot of -1 (padding) is skipped.

    slot = block_id * block_size + offset
    k_cache[block_id, offset, h, :] = k[t, h, :]     for every KV head h
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements one program copies per tensor: heads are chunked so that large models
# (many KV heads x head dim 256) do not blow the register budget.
_MAX_ELEMENTS = 4096


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    slot_mapping_ptr,  # [T] int64, -1 = skip
    num_kv_heads,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """Grid (T, cdiv(Hkv, BLOCK_H)): one token, BLOCK_H of its KV heads."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D_PAD)
    mask = (heads < num_kv_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
    heads = heads.to(tl.int64)
    src = token.to(tl.int64) * stride_kt + heads * stride_kh
    k = tl.load(k_ptr + src[:, None] + offs_d[None, :], mask=mask)
    src = token.to(tl.int64) * stride_vt + heads * stride_vh
    v = tl.load(v_ptr + src[:, None] + offs_d[None, :], mask=mask)
    dst = block * stride_kcb + offset * stride_kcs + heads * stride_kch
    tl.store(k_cache_ptr + dst[:, None] + offs_d[None, :], k.to(k_cache_ptr.dtype.element_ty), mask)
    dst = block * stride_vcb + offset * stride_vcs + heads * stride_vch
    tl.store(v_cache_ptr + dst[:, None] + offs_d[None, :], v.to(v_cache_ptr.dtype.element_ty), mask)


def reshape_and_cache_triton(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64 (or int32), -1 = skip
) -> None:
    """Write k, v into their cache slots in place; slots of -1 are left untouched."""
    if k.dim() != 3 or k.shape != v.shape or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"expected k, v [T, Hkv, D] and caches [num_blocks, block_size, Hkv, D], got "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}, k_cache {tuple(k_cache.shape)}"
        )
    num_tokens, num_kv_heads, head_dim = k.shape
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"cache heads/head dim {tuple(k_cache.shape[2:])} do not match k's "
            f"{(num_kv_heads, head_dim)}"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [T={num_tokens}], got {tuple(slot_mapping.shape)}")
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head) dimension")
    if num_tokens == 0:
        return
    d_pad = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, _MAX_ELEMENTS // d_pad))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _reshape_and_cache_kernel[grid](
        k, v, k_cache, v_cache, slot_mapping.contiguous(), num_kv_heads,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_H=block_h, BLOCK_SIZE=k_cache.shape[1],
    )  # fmt: skip
