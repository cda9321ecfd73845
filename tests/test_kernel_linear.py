"""The fast path's C++ Linear (kernels/csrc/linear.h): segments of output rows in their own
formats give, column for column, the bits each weight's own linear gives."""

from __future__ import annotations

import pytest
import torch
from test_cpu_kernels import random_i8, weights

from pagedllm_integrations.engine.compute_plan import cpu_fast_path_isa
from pagedllm_integrations.kernels import cpu_ext
from pagedllm_integrations.quant.packed import cat_rows
from pagedllm_integrations.quant.packed_linear import (
    build_kernel_linear,
    kernel_weight,
    packed_matmul,
    stack_by_format,
)

pytestmark = pytest.mark.skipif(
    not (cpu_fast_path_isa() is not None and cpu_ext.load()),
    reason="the C++ kernels need AVX-512 or AVX2",
)


def ops():
    return torch.ops.pagedllm


@pytest.mark.parametrize("k", [64, 512])
def test_segments_of_every_format_give_each_weights_own_bits(k):
    u4, u4_fp16, i8_32, i8_16_mins = weights(48, k)[:4]  # (K-quants too from k = 512)
    dense = torch.randn(24, k, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    i8_32_mins = random_i8(40, k, 32, True, 11)
    parts = [u4, i8_16_mins, dense, i8_32, u4_fp16, i8_32_mins]
    segments = [kernel_weight(p) for p in parts]
    bias = torch.randn(sum(int(s.shape[0]) for s in segments))
    linear = build_kernel_linear(k, segments, bias)
    assert linear.out_features() == bias.numel() and linear.num_segments() == len(parts)
    assert linear.segment_formats() == ["u4/32", "i8/16", "bf16", "i8/32", "u4/32", "i8/32"]
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(4))
    expected = torch.cat([packed_matmul(x, s) for s in segments], dim=1) + bias
    out = ops().linear(linear, x)
    assert torch.equal(out, expected)
    for m in (1, 2, 5, 7, 17):  # every row count: a row's bits do not depend on its batch
        assert torch.equal(ops().linear(linear, x[:m]), expected[:m])
    given = torch.empty_like(expected)
    ops().linear_out(linear, x, given)
    assert torch.equal(given, expected)


def test_shards_stack_by_format_without_converting_any():
    """q, k in one format and v in another (Q4_K_M's layers): two segments; consecutive
    shards of one format: one weight, stacked exactly."""
    u4, _, i8_32, i8_16_mins = weights(32, 64)
    segments = stack_by_format([u4, u4, i8_16_mins])
    assert [s.kind for s in segments] == ["u4", "i8"]
    assert torch.equal(segments[0].dequantize(), cat_rows([u4, u4]).dequantize())
    assert segments[1] is i8_16_mins
    # mins or none make different formats: I8 groups of 32 without and with mins
    with_mins = random_i8(32, 64, 32, True, 5)
    assert len(stack_by_format([i8_32, with_mins, i8_32])) == 3


@pytest.mark.parametrize("gelu", [False, True])
def test_a_gate_up_of_two_formats_runs_the_activation_after_the_linear(gelu):
    """A single tiled gate_up fuses its activation; one of two formats (or with a bias)
    runs the linear, then the activation: the bits of gated_act(linear(x))."""
    k = 96
    gate = kernel_weight(weights(32, k)[0])
    up = kernel_weight(random_i8(32, k, 16, True, 8))
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(2))
    mixed = build_kernel_linear(k, [gate, up], None)
    expected = ops().gated_act(ops().linear(mixed, x), gelu)
    assert torch.equal(ops().gated_linear(mixed, x, gelu), expected)
    fused = build_kernel_linear(k, [kernel_weight(cat_rows([weights(32, k)[0]] * 2))], None)
    assert torch.equal(
        ops().gated_linear(fused, x, gelu), ops().gated_act(ops().linear(fused, x), gelu)
    )


def test_bad_segments_are_refused():
    linear = torch.classes.pagedllm.Linear(64)
    with pytest.raises(RuntimeError, match="bf16 segment must be bf16"):
        linear.add_bf16(torch.zeros(8, 32, dtype=torch.bfloat16))
    tiled = kernel_weight(weights(32, 64)[0])
    with pytest.raises(RuntimeError, match="do not hold"):
        linear.add_tiled(True, 32, 48, tiled.tiles, tiled.scales, tiled.mins)
    with pytest.raises(RuntimeError, match="before its weights"):
        ops().linear(linear, torch.zeros(2, 64))
    linear.add_tiled(True, 32, 32, tiled.tiles, tiled.scales, tiled.mins)
    with pytest.raises(RuntimeError, match=r"x must be \[M, 64\]"):
        ops().linear(linear, torch.zeros(2, 32))
