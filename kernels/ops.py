"""Dispatch: CUDA tensors go to the Triton kernels, CPU tensors to the torch references.

`backend="triton"` forces Triton on any device; with TRITON_INTERPRET=1 set before
triton is imported, that runs the kernels on CPU through Triton's interpreter (tests).
`backend="cpu"` is the CPU fast path: the C++ kernels of kernels/csrc/ for the cache writes
and for attention (every row reads the paged cache in place).
"""

from __future__ import annotations

import torch

from . import reference

BACKENDS = ("auto", "torch", "triton", "cpu")


def resolve_backend(backend: str, device: torch.device) -> str:
    """'auto' means Triton for CUDA tensors and the torch reference for everything else."""
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def reshape_and_cache(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    backend: str = "auto",
) -> None:
    """Write the new keys and values of a step into their cache slots (slot -1 is skipped)."""
    resolved = resolve_backend(backend, k.device)
    if resolved == "triton":
        from .reshape_and_cache_triton import reshape_and_cache_triton

        reshape_and_cache_triton(k, v, k_cache, v_cache, slot_mapping)
    elif resolved == "cpu":
        torch.ops.pagedllm.write_kv_cache_(k, v, k_cache, v_cache, slot_mapping)
    else:
        reference.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)


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
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    backend: str = "auto",
    k_new: torch.Tensor | None = None,  # [T, Hkv, D]: lets the CPU path skip a gather
    v_new: torch.Tensor | None = None,  # [T, Hkv, D]
    logits_soft_cap: float | None = None,  # Gemma 2: scores -> cap * tanh(scores / cap)
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its paged keys and values.

    One call serves a whole flat batch: prefills with a cached prefix and decodes mixed.
    See `kernels/reference.py` for the index picture. Writes and returns `out`.
    `scale` is the family's (head_dim^-1/2, or Gemma's query_pre_attn_scalar^-1/2);
    `sliding_window` and `logits_soft_cap` are per layer (None: none).
    """
    resolved = resolve_backend(backend, q.device)
    if resolved == "cpu":
        return _cpu_paged_attention(
            q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables, scale,
            sliding_window, logits_soft_cap,
        )  # fmt: skip
    if resolved == "triton":
        from .paged_attention_triton import paged_attention_triton

        return paged_attention_triton(
            q,
            k_cache,
            v_cache,
            out,
            cu_seqlens_q,
            seq_lens,
            block_tables,
            scale,
            sliding_window=sliding_window,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            logits_soft_cap=logits_soft_cap,
        )
    return reference.paged_attention(
        q,
        k_cache,
        v_cache,
        out,
        cu_seqlens_q,
        seq_lens,
        block_tables,
        scale,
        sliding_window,
        k_new=k_new,
        v_new=v_new,
        logits_soft_cap=logits_soft_cap,
    )


def _cpu_paged_attention(
    q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables, scale, sliding_window,
    soft_cap=None,
) -> torch.Tensor:  # fmt: skip
    """Every row through the C++ kernel, which reads the paged cache in place (and computes
    a row the same way whatever shares its step: see kernels/csrc/attention.cpp)."""
    seq_ids = torch.arange(seq_lens.shape[0])
    torch.ops.pagedllm.paged_attention_rows_(
        q, k_cache, v_cache, out, seq_ids, cu_seqlens_q, seq_lens, block_tables, scale,
        sliding_window or 0, soft_cap or 0.0,
    )  # fmt: skip
    return out
