"""Triton AWQ kernels against the torch reference (TRITON_INTERPRET=1 on CPU, small sizes)."""

from __future__ import annotations

import pytest
import torch

from pagedllm_integrations.quant.awq_format import dequantize, pack_int4

pytestmark = pytest.mark.triton
triton_kernels = pytest.importorskip("pagedllm_integrations.quant.awq_triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _random_awq(k: int, n: int, group: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    qweight = pack_int4(torch.randint(0, 16, (k, n), generator=gen))
    qzeros = pack_int4(torch.randint(0, 16, (k // group, n), generator=gen))
    scales = (torch.rand(k // group, n, generator=gen) * 0.02 + 0.001).half()
    return qweight.to(DEVICE), qzeros.to(DEVICE), scales.to(DEVICE)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_dequantize_kernel_equals_reference(group):
    k, n = 2 * group, 72  # N = 72: the last 64-column block is ragged
    qweight, qzeros, scales = _random_awq(k, n, group, seed=group)
    ours = triton_kernels.awq_dequantize_triton(qweight, qzeros, scales, group)
    assert ours.dtype == torch.float16 and ours.shape == (k, n)
    assert torch.equal(ours, dequantize(qweight, qzeros, scales, group))
    as_fp32 = triton_kernels.awq_dequantize_triton(qweight, qzeros, scales, group, torch.float32)
    assert torch.equal(as_fp32, dequantize(qweight, qzeros, scales, group, torch.float32))


@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 3, 16, 33])
def test_fused_gemm_equals_reference(m, group, split_k):
    k = 128 if group == 32 else 2 * group  # at least 4 K tiles, so split-K 4 has work
    n = 80  # two 64-column blocks, the second ragged
    qweight, qzeros, scales = _random_awq(k, n, group, seed=m * 1000 + group)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE)
    out = triton_kernels.awq_gemm_triton(x, qweight, qzeros, scales, group, split_k=split_k)
    reference = x @ dequantize(qweight, qzeros, scales, group, torch.float32)
    assert out.shape == (m, n) and out.dtype == torch.float32
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)


def test_fused_gemm_half_precision_activations():
    group, k, n = 64, 128, 64
    qweight, qzeros, scales = _random_awq(k, n, group, seed=7)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(5)).half().to(DEVICE)
    out = triton_kernels.awq_gemm_triton(x, qweight, qzeros, scales, group, split_k=2)
    reference = x.float() @ dequantize(qweight, qzeros, scales, group, torch.float32)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), reference, rtol=2e-2, atol=2e-2)


def test_dispatch_uses_dequantize_then_matmul_for_many_tokens():
    group, k, n = 32, 64, 32
    qweight, qzeros, scales = _random_awq(k, n, group, seed=9)
    m = triton_kernels.FUSED_MAX_TOKENS
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    out = triton_kernels.awq_linear_triton(x, qweight, qzeros, scales, group)
    reference = x @ dequantize(qweight, qzeros, scales, group, torch.float32)
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)
    small = triton_kernels.awq_linear_triton(x[:3], qweight, qzeros, scales, group)
    torch.testing.assert_close(small, reference[:3], rtol=1e-4, atol=1e-4)


def test_shape_errors():
    qweight, qzeros, scales = _random_awq(64, 32, 32, seed=1)
    with pytest.raises(ValueError, match="x must be"):
        triton_kernels.awq_gemm_triton(torch.randn(2, 48), qweight, qzeros, scales, 32)
    with pytest.raises(ValueError, match="qzeros"):
        triton_kernels.awq_dequantize_triton(qweight, qzeros, scales, 16)
