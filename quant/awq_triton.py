"""Triton kernels for AWQ gemm checkpoints: dequantize, and a fused dequantize-GEMM with split-K.

Layout (see awq_format.py): qweight int32 [K, N/8], qzeros int32 [K/G, N/8], scales [K/G, N].
Output column n of packed column n // 8 sits in nibble AWQ_REVERSE_ORDER[n % 8], i.e.

    shift(n) = 4 * ((n % 8) // 2 + 4 * (n % 2))        j = n % 8:  0 1 2 3 4 5 6 7
                                                        nibble:    0 4 1 5 2 6 3 7

The kernels load the int32 of every output column (8 columns read the same word, which the
cache serves) and shift it by shift(n); no interleave instruction is needed.

Fused GEMM tiling, for one program (pid_mn, pid_k):

            K ->  tile 0   tile 1   tile 2   tile 3   ...      (BLOCK_K rows each, BLOCK_K | G)
    split 0       x                 x                          pid_k = 0 takes tiles 0, S, 2S..
    split 1                x                 x                pid_k = 1 takes tiles 1, S+1..

Each split writes its partial [BLOCK_M, BLOCK_N] sum to partial[pid_k]; the S partial sums
are added by torch afterwards (deterministic, unlike atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FUSED_MAX_TOKENS = 256  # from here on dequantize once + cuBLAS beats the fused kernel


@triton.jit
def _nibble_shift(offs_n):
    j = offs_n % 8
    return ((j // 2) + (j % 2) * 4) * 4


@triton.jit
def _awq_dequantize_kernel(
    qweight_ptr,  # int32 [K, N/8]
    qzeros_ptr,  # int32 [K/G, N/8]
    scales_ptr,  # [K/G, N]
    out_ptr,  # [K, N]
    K,
    N,
    G: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
    packed_cols = N // 8
    shift = _nibble_shift(offs_n)[None, :]
    q = tl.load(qweight_ptr + offs_k[:, None] * packed_cols + (offs_n // 8)[None, :], mask=mask)
    q = (q >> shift) & 0xF
    group = offs_k // G
    z = tl.load(qzeros_ptr + group[:, None] * packed_cols + (offs_n // 8)[None, :], mask=mask)
    z = (z >> shift) & 0xF
    s = tl.load(scales_ptr + group[:, None] * N + offs_n[None, :], mask=mask).to(tl.float32)
    w = (q - z).to(tl.float32) * s
    tl.store(out_ptr + offs_k[:, None] * N + offs_n[None, :], w.to(out_ptr.dtype.element_ty), mask)


@triton.jit
def _awq_gemm_kernel(
    x_ptr,  # [M, K]
    qweight_ptr,  # int32 [K, N/8]
    qzeros_ptr,  # int32 [K/G, N/8]
    scales_ptr,  # [K/G, N]
    partial_ptr,  # float32 [SPLIT_K, M, N]
    M,
    N,
    K,
    stride_xm,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kk = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    packed_cols = N // 8
    shift = _nibble_shift(offs_n)[None, :]  # [1, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    num_tiles = K // BLOCK_K  # K % G == 0 and G % BLOCK_K == 0: no ragged tile
    for i in range(0, tl.cdiv(num_tiles - pid_k, SPLIT_K)):
        k0 = (pid_k + i * SPLIT_K) * BLOCK_K
        offs_k = k0 + offs_kk
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None], other=0.0
        )  # [BLOCK_M, BLOCK_K]
        q = tl.load(
            qweight_ptr + offs_k[:, None] * packed_cols + (offs_n // 8)[None, :],
            mask=mask_n[None, :],
            other=0,
        )  # [BLOCK_K, BLOCK_N] int32, 8 columns per word
        q = (q >> shift) & 0xF
        group = k0 // G  # the whole tile lies in one group
        z = tl.load(qzeros_ptr + group * packed_cols + offs_n // 8, mask=mask_n, other=0)
        z = (z[None, :] >> shift) & 0xF  # [1, BLOCK_N]
        s = tl.load(scales_ptr + group * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        w = ((q - z).to(tl.float32) * s[None, :]).to(x.dtype)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(x, w, input_precision=INPUT_PRECISION, out_dtype=tl.float32)
    out = partial_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :]
    tl.store(out, acc, mask=mask_m[:, None] & mask_n[None, :])


def _check(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int):
    K, packed = qweight.shape
    N = packed * 8
    if K % group_size or qzeros.shape != (K // group_size, packed):
        raise ValueError(
            f"qzeros {tuple(qzeros.shape)} does not fit qweight {tuple(qweight.shape)} "
            f"with group size {group_size}"
        )
    if scales.shape != (K // group_size, N):
        raise ValueError(f"scales {tuple(scales.shape)} != ({K // group_size}, {N})")
    return K, N


def awq_dequantize_triton(
    qweight: torch.Tensor,  # int32 [K, N/8]
    qzeros: torch.Tensor,  # int32 [K/G, N/8]
    scales: torch.Tensor,  # [K/G, N]
    group_size: int,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """-> Wᵀ [K, N] in `dtype` (default: scales' dtype)."""
    K, N = _check(qweight, qzeros, scales, group_size)
    out = torch.empty(K, N, dtype=dtype or scales.dtype, device=qweight.device)
    block_k, block_n = 32, 64
    grid = (triton.cdiv(K, block_k), triton.cdiv(N, block_n))
    _awq_dequantize_kernel[grid](
        qweight.contiguous(),
        qzeros.contiguous(),
        scales.contiguous(),
        out,
        K,
        N,
        G=group_size,
        BLOCK_K=block_k,
        BLOCK_N=block_n,
    )
    return out


def _block_k(group_size: int) -> int:
    for block in (64, 32, 16):
        if group_size % block == 0:
            return block
    raise ValueError(
        f"the Triton AWQ GEMM needs a group size that is a multiple of 16, got {group_size}"
    )


def awq_gemm_triton(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # int32 [K, N/8]
    qzeros: torch.Tensor,  # int32 [K/G, N/8]
    scales: torch.Tensor,  # [K/G, N]
    group_size: int,
    split_k: int | None = None,
    block_m: int | None = None,
    block_n: int = 64,
) -> torch.Tensor:
    """Fused dequantize + matmul: -> x Wᵀ [M, N] in x's dtype (fp32 accumulation)."""
    K, N = _check(qweight, qzeros, scales, group_size)
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"x must be [M, {K}], got {tuple(x.shape)}")
    M = x.shape[0]
    block_k = _block_k(group_size)
    if block_m is None:
        block_m = 16 if M <= 16 else (32 if M <= 32 else 64)
    num_tiles = K // block_k
    if split_k is None:  # few output tiles (decode): spread K over more programs
        tiles_mn = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
        split_k = max(1, min(8, num_tiles // 4, 256 // max(tiles_mn, 1)))
    split_k = max(1, min(split_k, num_tiles))
    x = x.contiguous()
    partial = torch.empty(split_k, M, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n), split_k)
    _awq_gemm_kernel[grid](
        x,
        qweight.contiguous(),
        qzeros.contiguous(),
        scales.contiguous(),
        partial,
        M,
        N,
        K,
        x.stride(0),
        G=group_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        # fp32 activations (tests, CPU interpreter) get exact fp32 products, not TF32.
        INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )
    out = partial[0] if split_k == 1 else partial.sum(0)
    return out.to(x.dtype)


def awq_linear_triton(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """Dispatch by token count: fused kernel for small M, dequantize + torch matmul for large."""
    if x.shape[0] < FUSED_MAX_TOKENS:
        return awq_gemm_triton(x, qweight, qzeros, scales, group_size)
    w = awq_dequantize_triton(qweight, qzeros, scales, group_size, dtype=x.dtype)
    return x @ w
