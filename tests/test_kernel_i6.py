"""i6 tiles (kernels/csrc/linear_packed.cpp): weights whose q fit in -32..31 (Q2_K to Q6_K)
held in 6 bits a value give the bits of the same weights in i8 tiles on every kernel that
reads tiles, at every row count (the one-row decode, the passes of 2-7 rows, the AMX
batches from 8 rows where the CPU has AMX), and the loader picks them for GGUF K-quants.
K-quant values on i6 tiles take the folded recipe instead (i8 tiles do not), so theirs are
checked for batch invariance here and for the recipe in test_cpu_kernels.py."""

from __future__ import annotations

import pytest
import torch

from pagedllm_integrations.engine.compute_plan import cpu_fast_path_isa
from pagedllm_integrations.kernels import cpu_ext
from pagedllm_integrations.quant.packed import KFactors, PackedWeight
from pagedllm_integrations.quant.packed_linear import build_kernel_linear, kernel_weight

pytestmark = pytest.mark.skipif(
    not (cpu_fast_path_isa() is not None and cpu_ext.load()),
    reason="the C++ kernels need AVX-512 or AVX2",
)

ROWS = [1, 2, 3, 5, 7, 8, 16, 19, 70]  # decode, the pass sizes, AMX chunks, a partial chunk


def ops():
    return torch.ops.pagedllm


def six_bit_weight(n: int, k: int, group: int, with_mins: bool, seed: int) -> PackedWeight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=g)
    q[0, :4] = torch.tensor([-32, 31, 0, -1], dtype=torch.int8)  # both ends of the range
    scales = torch.rand(n, k // group, generator=g) * 0.01
    mins = torch.randn(n, k // group, generator=g) * 0.01 if with_mins else None
    return PackedWeight("i8", q, scales, mins, group, (n, k))


def k_quant_weight(n: int, k: int, seed: int) -> PackedWeight:
    """A Q6_K-like weight: groups of 16, scales as the K-quant's two levels."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=g)
    multipliers = torch.randint(-128, 128, (n, k // 16), dtype=torch.int8, generator=g)
    factors = (torch.rand(n, k // 256, generator=g) * 1e-3).half().float()
    scales = factors.repeat_interleave(16, dim=1) * multipliers.float()
    return PackedWeight("i8", q, scales, None, 16, (n, k), KFactors(multipliers, factors), None)


def both_tilings(weight: PackedWeight) -> tuple:
    """(i6 tiled weight, the same with i8 tiles)."""
    six = weight.tiled()
    assert six.kind == "i6" and six.tiles.shape[-1] == 192
    eight = type(six)(
        "i8", ops().tile_i8(weight.qweight), six.scales, six.mins, six.group, six.shape
    )
    return six, eight


@pytest.mark.parametrize(
    "make",
    [
        lambda: six_bit_weight(37, 96, 32, False, 1),  # Q5_0: partial last tile
        lambda: six_bit_weight(48, 64, 16, True, 2),  # Q2_K-like: mins, groups of 16
        lambda: six_bit_weight(40, 128, 32, True, 3),  # Q5_1 / Q5_K
    ],
)
def test_i6_tiles_give_the_bits_of_i8_tiles(make):
    six, eight = both_tilings(make())
    assert six.nbytes < eight.nbytes
    g = torch.Generator().manual_seed(5)
    n, k = six.shape
    for rows in ROWS:
        x = torch.randn(rows, k, generator=g) * 2
        assert torch.equal(six.matmul(x), eight.matmul(x)), rows
    ids = torch.tensor([0, n - 1, n // 2, 0])
    assert torch.equal(six.rows(ids), eight.rows(ids))  # an embedding lookup of a tied head


def test_a_k_quant_on_i6_tiles_takes_the_folded_recipe_at_every_row_count():
    """Q6_K with its K factors: i6 tiles meet Q8_K activations (the folded recipe, which
    i8 tiles with K factors do not take; tests/test_cpu_kernels.py checks the recipe), so
    the products differ from the i8 tiles' while a row's bits stay the same at every row
    count; an embedding lookup reads the i8 tiles' exact values."""
    six, eight = both_tilings(k_quant_weight(45, 512, 4))
    n, k = six.shape
    x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(5)) * 2
    full = six.matmul(x)
    assert not torch.equal(full, eight.matmul(x))
    for rows in ROWS:
        assert torch.equal(six.matmul(x[:rows]), full[:rows]), rows
    ids = torch.tensor([0, n - 1, n // 2, 0])
    assert torch.equal(six.rows(ids), eight.rows(ids))


@pytest.mark.parametrize("gelu", [False, True])
def test_a_fused_gate_up_over_i6_tiles_gives_the_bits_of_i8(gelu):
    six, eight = both_tilings(six_bit_weight(64, 96, 16, False, 6))
    mins = torch.empty(0)
    g = torch.Generator().manual_seed(7)
    for rows in (1, 4, 9):
        x = torch.randn(rows, 96, generator=g)
        a = ops().gated_tiled_linear(x, six.tiles, six.scales, mins, 16, 64, False, gelu)
        b = ops().gated_tiled_linear(x, eight.tiles, eight.scales, mins, 16, 64, False, gelu)
        assert torch.equal(a, b), rows


def test_a_linear_names_its_i6_segment_and_gives_the_same_bits():
    v = six_bit_weight(32, 64, 16, False, 8)
    q8 = PackedWeight(
        "i8",
        torch.full((16, 64), -100, dtype=torch.int8),
        torch.rand(16, 2) * 0.01,
        None,
        32,
        (16, 64),
    )
    assert q8.tile_kind == "i8" and v.tile_kind == "i6"  # -100 does not fit in 6 bits
    linear = build_kernel_linear(64, [kernel_weight(q8), kernel_weight(v)], None)
    assert linear.segment_formats() == ["i8/32", "i6/16"]
    _, eight = both_tilings(v)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(9))
    assert torch.equal(ops().linear(linear, x)[:, 16:], eight.matmul(x))


def test_tile_i6_refuses_values_outside_six_bits():
    q = torch.zeros(16, 32, dtype=torch.int8)
    q[3, 5] = 32
    with pytest.raises(RuntimeError, match=r"-32\.\.31"):
        ops().tile_i6(q)


@pytest.mark.parametrize("type_name", ["Q2_K", "Q3_K", "Q5_0", "Q5_K", "Q6_K", "Q8_0"])
def test_gguf_k_quants_load_as_i6_tiles_and_q8_0_as_i8(type_name):
    """The loader's path: GGUF blocks (llama-quantize's encodings, tests/gguf_mixes.py) ->
    PackedWeight -> tiles, whose values equal gguf's own dequantization of the blocks."""
    import gguf
    import numpy as np
    from gguf_mixes import quantize

    from pagedllm_integrations.quant.gguf_blocks import to_packed

    values = np.random.default_rng(0).standard_normal((32, 512)).astype(np.float32)
    blocks = quantize(values, type_name)
    kind = gguf.GGMLQuantizationType[type_name]
    expected = torch.from_numpy(np.array(gguf.quants.dequantize(blocks, kind), dtype=np.float32))
    tiled = kernel_weight(to_packed(type_name, blocks, (32, 512)).compact())
    assert tiled.kind == ("i8" if type_name == "Q8_0" else "i6")
    assert torch.equal(tiled.dequantize(), expected)
