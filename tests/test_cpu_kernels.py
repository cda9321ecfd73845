"""The C++ CPU kernels (kernels/csrc/) against their torch references.

Packed linears: the tiles hold the PackedWeight's values exactly; a product equals, up to
float32 rounding, float64 math on the int8-quantized activations (blocks of 32, as
llama.cpp's Q8) times the exact weights, and gives bitwise the same rows whatever the batch
size or thread count, with AMX tiles or VNNI computing the integer sums. Dense bf16
linears: bf16(x) @ W^T summed in float64 up to float32 rounding, batch-invariant too. Fused
ops: RMSNorm (with and without the residual add), rotary, gated activations, KV cache
writes and paged attention against the torch code they replace, over grids of shapes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagedllm_integrations.kernels import cpu_ext, reference
from pagedllm_integrations.quant.packed import PackedWeight, quantize_u4

pytestmark = pytest.mark.skipif(
    not cpu_ext.load(), reason=f"C++ CPU kernels unavailable: {cpu_ext.load_error()}"
)


def ops():
    return torch.ops.pagedllm


def random_i8(n: int, k: int, group: int, with_mins: bool, seed: int) -> PackedWeight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    scales = torch.rand(n, k // group, generator=g) * 0.01
    mins = torch.randn(n, k // group, generator=g) * 0.01 if with_mins else None
    return PackedWeight("i8", q, scales, mins, group, (n, k))


def weights(n: int, k: int) -> list[PackedWeight]:
    """U4 with float32 and with float16 scales, I8 in groups of 32 (no mins) and 16 (mins);
    where K allows (K % 256 == 0), the K-quants Q2_K to Q6_K (the folded recipe)."""
    u4 = quantize_u4(torch.randn(n, k, generator=torch.Generator().manual_seed(1)))
    fp16_exact = PackedWeight(
        "u4", u4.qweight, u4.scales.half().float(), u4.mins.half().float(), 32, (n, k)
    ).compact()
    assert fp16_exact.scales.dtype == torch.float16
    made = [u4, fp16_exact, random_i8(n, k, 32, False, 2), random_i8(n, k, 16, True, 3)]
    if k % 256:
        return made
    return made + [k_quant_weight(name, n, k, seed=8 + i) for i, name in enumerate(K_QUANTS)]


# K-quants as the GGUF loader makes them: q, an int8 multiplier per group and float16
# factors per 256 (mins -dmin * m: the min factor carries the sign). name: (tile kind,
# group, q range, scale multiplier range, min multiplier range or None).
K_QUANTS = {
    "Q4_K": ("u4", 32, (0, 16), (0, 64), (0, 64)),
    "Q5_K": ("i8", 32, (0, 32), (0, 64), (0, 64)),
    "Q6_K": ("i8", 16, (-32, 32), (-128, 128), None),
    "Q3_K": ("i8", 16, (-4, 4), (-32, 32), None),
    "Q2_K": ("i8", 16, (0, 4), (0, 16), (0, 16)),
}


def k_quant_weight(name: str, n: int, k: int, seed: int) -> PackedWeight:
    from pagedllm_integrations.quant.packed import KFactors, pack_u4

    kind, group, q_range, scale_range, min_range = K_QUANTS[name]
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(*q_range, (n, k), dtype=torch.int16, generator=g)

    def parts(multipliers: tuple[int, int], sign: float) -> KFactors:
        chosen = torch.randint(*multipliers, (n, k // group), dtype=torch.int8, generator=g)
        factors = (torch.rand(n, k // 256, generator=g) * 1e-3).half().float() * sign
        return KFactors(chosen, factors)

    def values(p: KFactors) -> torch.Tensor:
        return p.factors.repeat_interleave(256 // group, dim=1) * p.multipliers.float()

    scales = parts(scale_range, 1.0)
    mins = None if min_range is None else parts(min_range, -1.0)
    qweight = pack_u4(q) if kind == "u4" else q.to(torch.int8)
    weight = PackedWeight(
        kind,
        qweight,
        values(scales),
        None if mins is None else values(mins),
        group,
        (n, k),
        scales,
        mins,
    )
    assert weight.tile_kind == ("u4" if kind == "u4" else "i6")
    assert weight.tiled().scales.dtype == torch.uint8  # the kernels' KScale form
    return weight


def folded(weight: PackedWeight) -> bool:
    """Whether the kernels take the folded recipe (activations in super blocks of 256):
    K-quant values on u4 or i6 tiles."""
    return weight.tiled().scales.dtype == torch.uint8 and weight.tile_kind != "i8"


def quantize_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """llama.cpp's Q8 activations: blocks of 32, d = amax / 127, q = round-half-even(x *
    127 / amax); and the sum of q over each half block (16 values)."""
    m, k = x.shape
    blocks = x.view(m, k // 32, 32)
    amax = blocks.abs().amax(-1)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inverse[..., None]).clamp(-127, 127)  # torch.round: half to even
    return q.view(m, k).to(torch.int8), amax / 127.0, q.view(m, k // 16, 16).sum(-1).int()


# 3 blocks; 16 (one batch of the AVX-512 code's 16); 19 (a batch, then 3, and an odd
# number of blocks, so a half-full last 64 bytes for the half-block sums); 48.
@pytest.mark.parametrize("k", [96, 512, 608, 1536])
def test_activation_quantization_is_llama_cpp_q8(k):
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(5)) * 3
    x[2, :32] = 0.0  # an all-zero block
    x[3, 5] = 1e4  # an outlier owns its block's scale
    x[4, -32:] = 0.0  # an all-zero last block
    x[5, -1] = -1e4
    qx, d, sums = ops().quantize_activations(x)
    ref_q, ref_d, ref_sums = quantize_reference(x)
    assert torch.equal(qx, ref_q) and torch.equal(d, ref_d) and torch.equal(sums, ref_sums)


def quantize_super_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """llama.cpp's Q8_K activations (the folded recipe's): super blocks of 256, d = amax /
    127, q = round-half-even(x * 127 / amax); and the sum of q over each 16 values."""
    m, k = x.shape
    blocks = x.view(m, k // 256, 256)
    amax = blocks.abs().amax(-1)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inverse[..., None]).clamp(-127, 127)
    return q.view(m, k).to(torch.int8), amax / 127.0, q.view(m, k // 16, 16).sum(-1).short()


@pytest.mark.parametrize("k", [256, 512, 2816])
def test_super_block_quantization_is_llama_cpp_q8_k(k):
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(5)) * 3
    x[2, :256] = 0.0  # an all-zero super block
    x[3, 5] = 1e4  # an outlier owns its super block's scale
    x[5, -1] = -1e4
    got = ops().quantize_super_blocks(x)
    want = quantize_super_reference(x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def reference_product(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """float64 (dequantized int8 activations, as the weight's recipe quantizes them) @
    (exact weights)^T."""
    m, k = x.shape
    if folded(weight):
        q, d, _ = quantize_super_reference(x)
        xd = (q.double().view(m, k // 256, 256) * d.double()[..., None]).view(m, k)
    else:
        q, d, _ = quantize_reference(x)
        xd = (q.double().view(m, k // 32, 32) * d.double()[..., None]).view(m, k)
    return xd @ weight.dequantize().double().t()


@pytest.mark.parametrize("n,k", [(40, 64), (37, 96), (130, 512)])
def test_packed_linears_match_int8_recipe_and_are_batch_invariant(n, k):
    from pagedllm_integrations.quant.packed_linear import kernel_weight, packed_matmul

    x = torch.randn(23, k, generator=torch.Generator().manual_seed(4))
    extra = [random_i8(n, k, 32, True, 6), random_i8(n, k, 16, False, 7)]
    for weight in [*weights(n, k), *extra]:
        tiled = kernel_weight(weight)
        assert torch.equal(tiled.dequantize(), weight.dequantize())  # tiling is exact
        full = packed_matmul(x, tiled)
        expected = reference_product(x, weight)
        scale = expected.abs().max().item()
        assert (full.double() - expected).abs().max().item() <= 2e-6 * scale, weight.kind
        for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 17):  # every kernel path: the same bits per row
            assert torch.equal(packed_matmul(x[:m], tiled), full[:m]), (weight.kind, m)
        # ... and a row's result depends neither on the rows around it nor on the threads
        assert torch.equal(packed_matmul(x[5:7], tiled), full[5:7])
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            assert torch.equal(packed_matmul(x, tiled), full)
        finally:
            torch.set_num_threads(threads)


@pytest.mark.parametrize("n,k", [(64, 64), (96, 96), (192, 512), (64, 1280)])
@pytest.mark.parametrize("gelu", [False, True])
def test_fused_gate_up_is_the_gated_act_of_the_linear(n, k, gelu):
    """gated_tiled_linear (a gate_up weight and the gated activation at once, without the
    [M, N] output in between; what the decoder stack runs) gives gated_act(linear(x)) bit
    for bit: every weight format, rows across the kernel's passes and 64-row chunks."""
    from pagedllm_integrations.quant.packed_linear import kernel_weight, packed_matmul

    x = torch.randn(130, k, generator=torch.Generator().manual_seed(n + k))
    for weight in [*weights(n, k), random_i8(n, k, 32, True, 21)]:
        tiled = kernel_weight(weight)
        mins = tiled.mins if tiled.mins is not None else torch.empty(0)
        for m in (1, 5, 8, 64, 65, 130):
            want = ops().gated_act(packed_matmul(x[:m], tiled), gelu)
            got = ops().gated_tiled_linear(
                x[:m], tiled.tiles, tiled.scales, mins, tiled.group, n, tiled.kind == "u4", gelu
            )
            assert torch.equal(got, want), (weight.kind, m)
    odd = kernel_weight(weights(48, k)[0])  # halves of 24 rows: not whole 16-row tiles
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops().gated_tiled_linear(x, odd.tiles, odd.scales, odd.mins, 32, 48, True, gelu)


@pytest.fixture
def amx_switch():
    """Yields torch.ops.pagedllm.set_amx_enabled; AMX is restored afterwards."""
    was = ops().amx_enabled()
    yield ops().set_amx_enabled
    ops().set_amx_enabled(was)


@pytest.mark.parametrize("n,k", [(40, 64), (37, 96), (70, 1024), (40, 1280)])
def test_amx_and_vnni_give_the_same_bits(n, k, amx_switch):
    # (70, 1024): the Q4_K weight too, the folded recipe on AMX (4 super blocks: both
    # halves of its software pipeline, two slices of K); (40, 1280): slices of 2, 2 and 1
    """Batches take AMX tiles on CPUs that have them, few rows VNNI; a row's result must
    not depend on which (every batch size from 1 to 40 rows, partial 16-row chunks)."""
    from pagedllm_integrations.quant.packed_linear import kernel_weight, packed_matmul

    if not amx_switch(True):
        pytest.skip("this CPU (or Linux) gives no AMX int8 tiles")
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(12)) * 2
    x[3, :32] = 0.0  # an all-zero activation block
    extra = [random_i8(n, k, 32, True, 13), random_i8(n, k, 16, False, 14)]
    for weight in [*weights(n, k), *extra]:
        tiled = kernel_weight(weight)
        amx_switch(False)
        rows = [packed_matmul(x[i : i + 1], tiled) for i in range(len(x))]
        want = torch.cat(rows)
        amx_switch(True)
        for m in (8, 9, 15, 16, 17, 31, 32, 40):
            assert torch.equal(packed_matmul(x[:m], tiled), want[:m]), (weight.kind, m)


def test_amx_folded_rows_past_the_slicing_limit_keep_their_bits(amx_switch):
    """The folded AMX kernel walks K in slices of 2 super blocks while x's int8 rows (M x K
    bytes) fit in 1 MiB, K whole beyond that: both orders give every row its bits alone."""
    from pagedllm_integrations.quant.packed_linear import kernel_weight, packed_matmul

    if not amx_switch(True):
        pytest.skip("this CPU (or Linux) gives no AMX int8 tiles")
    n, k = 32, 2304  # 9 super blocks; 455 rows are 1 MiB
    x = torch.randn(470, k, generator=torch.Generator().manual_seed(31))
    for name in ("Q4_K", "Q6_K"):
        tiled = kernel_weight(k_quant_weight(name, n, k, 5))
        amx_switch(False)
        want = torch.cat([packed_matmul(x[i : i + 1], tiled) for i in range(len(x))])
        amx_switch(True)
        for m in (40, 455, 470):
            assert torch.equal(packed_matmul(x[:m], tiled), want[:m]), (name, m)


@pytest.mark.parametrize("n,k", [(40, 64), (37, 96)])
def test_dense_bf16_linear_matches_bf16_math_and_is_batch_invariant(n, k):
    from pagedllm_integrations.quant.packed_linear import packed_matmul

    x = torch.randn(23, k, generator=torch.Generator().manual_seed(8))
    dense = torch.randn(n, k, generator=torch.Generator().manual_seed(9)).bfloat16()
    full = packed_matmul(x, dense)
    expected = x.bfloat16().double() @ dense.double().t()
    assert (full.double() - expected).abs().max().item() <= 2e-6 * expected.abs().max().item()
    for m in (1, 2, 3, 4, 5, 17):
        assert torch.equal(packed_matmul(x[:m], dense), full[:m]), m


def test_linears_write_into_a_given_output_and_the_step_workspace():
    """The LM head writes its logits into the step workspace (kernels/csrc/decoder.cpp):
    the `_out` forms give the allocating forms' bits; the workspace grows and keeps its
    pages; an output of the wrong shape is refused."""
    from pagedllm_integrations.quant.packed_linear import kernel_weight, packed_matmul

    n, k = 37, 96
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(15))
    dense = torch.randn(n, k, generator=torch.Generator().manual_seed(16)).bfloat16()
    for weight in [*(kernel_weight(w) for w in weights(n, k)), dense]:
        want = packed_matmul(x, weight)
        out = ops().step_workspace(5 * n).view(5, n)
        assert packed_matmul(x, weight, out=out) is out
        assert torch.equal(out, want)
        with pytest.raises(RuntimeError, match="out must be contiguous float32"):
            packed_matmul(x, weight, out=torch.empty(4, n))
    small = ops().step_workspace(16)
    large = ops().step_workspace(1 << 20)  # grows: a new mapping
    assert large.numel() == 1 << 20 and small.numel() == 16  # the old view stays valid
    again = ops().step_workspace(64)
    assert again.data_ptr() == large.data_ptr()  # kept, not mapped per call


def test_compact_scales_are_float16_only_when_exact():
    w = quantize_u4(torch.randn(8, 64))
    assert w.compact().scales.dtype == torch.float32  # arbitrary float32 scales stay
    exact = PackedWeight(
        "u4", w.qweight, w.scales.half().float(), w.mins.half().float(), 32, w.shape
    )
    small = exact.compact()
    assert small.scales.dtype == torch.float16
    assert torch.equal(small.dequantize(), exact.dequantize())


def test_tiled_rows_are_exact():
    for weight in weights(50, 64):
        tiled = weight.tiled()
        ids = torch.tensor([[0, 7], [49, 7]])
        assert torch.equal(tiled.rows(ids), weight.dequantize()[ids])
    with pytest.raises(RuntimeError, match="outside the table"):
        tiled.rows(torch.tensor([50]))


@pytest.mark.parametrize("rows,hidden", [(1, 64), (5, 576), (33, 96)])
def test_rms_norm_and_residual_add(rows, hidden):
    from pagedllm_integrations.engine.models.layers import RMSNorm

    norm = RMSNorm(hidden, 1e-5, torch.float32, torch.device("cpu"))
    norm.weight.data.normal_()
    x, residual = torch.randn(rows, hidden), torch.randn(rows, hidden)
    torch.testing.assert_close(ops().rms_norm(x, norm.weight, 1e-5), norm(x), rtol=1e-5, atol=1e-6)
    expected_residual = x + residual
    expected = norm(expected_residual)
    fused_residual = residual.clone()
    fused = ops().add_rms_norm(x, fused_residual, norm.weight, 1e-5)
    assert torch.equal(fused_residual, expected_residual)  # updated in place
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (9, 3, 64), (2, 2, 128)])
def test_rotary_in_place_on_views_of_a_qkv_row(heads, kv_heads, head_dim):
    from pagedllm_integrations.engine.models.layers import RotaryEmbedding

    rotary = RotaryEmbedding(head_dim, 64, 10000.0, None, torch.float32, torch.device("cpu"))
    tokens = 7
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(tokens, heads, head_dim)
    k = k.view(tokens, kv_heads, head_dim)
    positions = torch.tensor([0, 5, 63, 1, 2, 30, 30])
    want_q, want_k = rotary(positions, q.clone(), k.clone())
    half = head_dim // 2
    cos = rotary.cos[:, :half].contiguous()
    sin = rotary.sin[:, :half].contiguous()
    ops().rotary_neox_(q, k, positions, cos, sin)
    torch.testing.assert_close(q, want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k, want_k, rtol=1e-6, atol=1e-6)


def test_argmax_rows_is_torch_max_indices():
    """The sampler's greedy pick: the first maximum, a NaN counting as the maximum."""
    x = torch.randn(9, 1000, generator=torch.Generator().manual_seed(3))
    x[1, 10] = x[1, 700] = 50.0  # a tie: the first one
    x[2, 999] = float("inf")
    x[3, 500] = x[3, 20] = float("nan")
    x[4] = 0.0
    x[5, 3] = float("nan")
    for rows in (x, x[:, :17], x[:, :1]):
        assert torch.equal(ops().argmax_rows(rows), rows.max(dim=-1).indices)


def test_sample_rows_edge_rows():
    """u = 0 draws the first token of positive mass and u just below 1 the last; a token
    of +inf logit takes all the mass (the first such); a row of -inf draws token 0."""
    x = torch.full((4, 100), float("-inf"))
    x[0, [5, 70]] = torch.tensor([1.0, 2.0])
    x[1, 99] = 0.0
    x[2] = torch.randn(100, generator=torch.Generator().manual_seed(2))
    x[2, [30, 60]] = float("inf")
    ones = torch.ones(4)
    assert ops().sample_rows(x, ones, torch.zeros(4)).tolist() == [5, 99, 30, 0]
    just_below_one = torch.full((4,), 0.99999994)
    assert ops().sample_rows(x, ones, just_below_one).tolist() == [70, 99, 30, 0]
    with pytest.raises(RuntimeError, match="temperatures must be positive"):
        ops().sample_rows(x, torch.zeros(4), torch.zeros(4))


def test_gated_activations():
    x = torch.randn(6, 2 * 40, generator=torch.Generator().manual_seed(2)) * 3
    x[0, :8] = torch.tensor([-30.0, -12.0, -6.0, -4.5, 0.0, 4.5, 12.0, 90.0])  # both tails
    # Finite gates past the exp kernel's range (e^-g overflows): -0 * up and g * up as in
    # torch, never NaN (the AVX-512 exp once gave NaN from about -2.4e38 down).
    x[1, :8] = torch.tensor([-3.4e38, -3e38, -1e30, -1e14, 1e14, 1e30, 3e38, 1e3])
    x[1, 40:48] = 0.5  # their ups: g * up stays finite in float32
    gate, up = x.chunk(2, dim=-1)
    silu = torch.nn.functional.silu(gate) * up
    gelu = torch.nn.functional.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(ops().gated_act(x, False), silu, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ops().gated_act(x, True), gelu, rtol=1e-5, atol=1e-6)
    # ... and closer to float64 than float32 torch in the negative tail, where torch's
    # 1 + tanh(z) cancels: a few ulp everywhere.
    g64, u64 = gate.double(), up.double()
    gelu64 = torch.nn.functional.gelu(g64, approximate="tanh") * u64
    torch.testing.assert_close(ops().gated_act(x, True).double(), gelu64, rtol=2e-6, atol=1e-12)


def fast_layout(k_cache: torch.Tensor, v_cache: torch.Tensor):
    """[blocks, block_size, Hkv, D] caches in the fast path's layout: k [blocks, Hkv, D,
    block_size], v [blocks, Hkv, block_size, D]."""
    return k_cache.permute(0, 2, 3, 1).contiguous(), v_cache.permute(0, 2, 1, 3).contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [5, 100])
def test_kv_cache_writes_skip_padding(dtype, rows):
    """Rows land in their slots, padding (-1) nowhere; 100 rows are split over the kernel
    threads (each prefetching its next row's lines)."""
    want_k = torch.zeros(24, 8, 2, 16, dtype=dtype)  # 24 blocks of 8 slots
    want_v = torch.zeros_like(want_k)
    kv = torch.randn(rows, 2 * 2 * 16)
    k, v = kv[:, :32].view(rows, 2, 16), kv[:, 32:].view(rows, 2, 16)  # strided rows
    if rows == 5:
        slots = torch.tensor([3, 17, -1, 40, 0])
    else:
        slots = torch.randperm(24 * 8, generator=torch.Generator().manual_seed(rows))[:rows]
        slots[::7] = -1
    reference.reshape_and_cache(k, v, want_k, want_v, slots)
    k_cache, v_cache = fast_layout(torch.zeros_like(want_k), torch.zeros_like(want_v))
    ops().write_kv_cache_(k, v, k_cache, v_cache, slots)
    expected_k, expected_v = fast_layout(want_k, want_v)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def _scattered_block_tables(
    lens: list[int], block_size: int, g: torch.Generator, spare: int = 0
) -> tuple[list[list[int]], int]:
    """Block tables for sequences of these lengths over a shuffled cache of just enough
    blocks (plus `spare`), padded with block 0: (tables, number of blocks)."""
    blocks_needed = [math.ceil(n / block_size) for n in lens]
    perm = torch.randperm(sum(blocks_needed) + spare, generator=g).tolist()
    tables, at = [], 0
    for need in blocks_needed:
        tables.append(perm[at : at + need] + [0] * (max(blocks_needed) - need))
        at += need
    return tables, len(perm)


def _cumulative(counts: list[int]) -> list[int]:
    """[0, c0, c0 + c1, ...]: cu_seqlens of the query rows."""
    cu = [0]
    for n in counts:
        cu.append(cu[-1] + n)
    return cu


def _attention_float64(q, k_cache, v_cache, cu, lens, tables, scale, window, soft_cap):
    """Written out one query at a time in float64: the reference of every row. Over a bf16
    cache the kernels round the scaled query to bf16 (and each probability: the paired
    recipe of kernels/csrc/attention.cpp), so the reference takes the same rounded query,
    and the probabilities' rounding is what _ATOL_BF16 allows for."""
    if k_cache.dtype == torch.bfloat16:
        q, scale = (q * scale).bfloat16().float(), 1.0
    out = torch.zeros(q.shape, dtype=torch.float64)
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kv_heads
    for b in range(len(lens)):
        query_len = cu[b + 1] - cu[b]
        for j in range(query_len):
            position = lens[b] - query_len + j
            first = max(0, position - window + 1) if window else 0
            keys = range(first, position + 1)
            slots = [(tables[b][p // block_size], p % block_size) for p in keys]
            kk = torch.stack([k_cache[blk, off] for blk, off in slots]).double()  # [L, Hkv, D]
            vv = torch.stack([v_cache[blk, off] for blk, off in slots]).double()
            for h in range(q.shape[1]):
                scores = kk[:, h // group] @ q[cu[b] + j, h].double() * scale
                if soft_cap:
                    scores = soft_cap * torch.tanh(scores / soft_cap)
                out[cu[b] + j, h] = torch.softmax(scores, 0) @ vv[:, h // group]
    return out


# Probabilities rounded to bf16 move an output by about 2^-9 of its values' spread (up to
# 2.5e-3 seen over these tests' random caches; a wrong key or order moves it by ~0.1).
_ATOL_BF16 = 5e-3


def _tolerance(kv_dtype: torch.dtype) -> float:
    return _ATOL_BF16 if kv_dtype == torch.bfloat16 else 1e-5


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size,window",
    [
        (4, 4, 16, 8, 0),
        (4, 2, 32, 16, 0),
        (9, 3, 64, 16, 0),
        (6, 2, 16, 8, 11),
        (2, 1, 128, 16, 0),
        (6, 2, 32, 24, 40),
    ],
)
def test_paged_attention_rows_read_the_cache_in_place(
    kv_dtype, heads, kv_heads, head_dim, block_size, window
):
    g = torch.Generator().manual_seed(heads * 100 + head_dim)
    lens = [1, 7, 8, 9, 33, 70, 130]  # across block edges and the 64-key chunks
    query_lens = [1, 1, 3, 1, 2, 1, 5]  # decode rows and short multi-query rows
    tables, num_blocks = _scattered_block_tables(lens, block_size, g, spare=5)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(kv_dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(kv_dtype)
    cu = _cumulative(query_lens)
    q = torch.randn(cu[-1], heads, head_dim, generator=g)
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    fast_k, fast_v = fast_layout(k_cache, v_cache)
    for soft_cap in (0.0, 5.0):
        ops().paged_attention_rows_(
            q, fast_k, fast_v, out, torch.arange(len(lens)),
            torch.tensor(cu, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
            torch.tensor(tables, dtype=torch.int32), scale, window, soft_cap,
        )  # fmt: skip
        want = _attention_float64(q, k_cache, v_cache, cu, lens, tables, scale, window, soft_cap)
        tol = _tolerance(kv_dtype)
        torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
    # Only the sequences asked for are written.
    out.fill_(float("nan"))
    ops().paged_attention_rows_(
        q, fast_k, fast_v, out, torch.tensor([2]), torch.tensor(cu, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32), torch.tensor(tables, dtype=torch.int32),
        scale, window, 0.0,
    )  # fmt: skip
    assert not out[cu[2] : cu[3]].isnan().any() and out[: cu[2]].isnan().all()


@pytest.mark.parametrize("soft_cap", [0.0, 5.0])
def test_attention_rows_do_not_depend_on_how_the_prompt_was_split(soft_cap):
    """A row's output is bitwise the same computed in a 70-row prompt, in chunks of any
    size, or alone as a decode row (few rows read the cache in place, more share a float32
    copy of each chunk): what makes chunked prefill, prefix caching, preemption and
    speculative decoding leave every token unchanged on the fast path."""
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, block_size, length = 6, 2, 64, 16, 70
    blocks = torch.randperm(12, generator=g)[:5].to(torch.int32)
    k_cache, v_cache = fast_layout(
        torch.randn(12, block_size, kv_heads, head_dim, generator=g).to(torch.bfloat16),
        torch.randn(12, block_size, kv_heads, head_dim, generator=g).to(torch.bfloat16),
    )
    q = torch.randn(length, heads, head_dim, generator=g)
    scale = head_dim**-0.5

    def attend(first_row: int, rows: int) -> torch.Tensor:
        """Rows first_row .. first_row + rows as the query rows of one step."""
        out = torch.empty(rows, heads, head_dim)
        ops().paged_attention_rows_(
            q[first_row : first_row + rows], k_cache, v_cache, out, torch.tensor([0]),
            torch.tensor([0, rows], dtype=torch.int32),
            torch.tensor([first_row + rows], dtype=torch.int32), blocks[None], scale, 0,
            soft_cap,
        )  # fmt: skip
        return out

    whole = attend(0, length)
    for cut in (1, 3, 4, 5, 15, 16, 17, 63, 64, 65, 69):
        assert torch.equal(torch.cat([attend(0, cut), attend(cut, length - cut)]), whole)
    for row in (0, 5, 63, 64, 69):
        assert torch.equal(attend(row, 1), whole[row : row + 1])
        if row + 2 <= length:
            assert torch.equal(attend(row, 2), whole[row : row + 2])


def test_the_kernel_thread_pool_serves_several_callers_and_forked_children():
    """kernels/csrc/thread_pool.cpp: loops started from several Python threads at once give
    the same bits as one at a time, and a forked child (a server worker, a DataLoader) has
    a pool of its own instead of waiting for the parent's threads, which it does not have."""
    import os
    import signal
    from concurrent.futures import ThreadPoolExecutor

    from pagedllm_integrations.quant.packed_linear import kernel_weight, packed_matmul

    g = torch.Generator().manual_seed(21)
    tiled = kernel_weight(quantize_u4(torch.randn(256, 128, generator=g)))
    inputs = [torch.randn(m, 128, generator=g) for m in (1, 3, 16, 40) * 4]
    serial = [packed_matmul(x, tiled) for x in inputs]
    with ThreadPoolExecutor(4) as callers:
        concurrent = list(callers.map(lambda x: packed_matmul(x, tiled), inputs))
    assert all(torch.equal(a, b) for a, b in zip(serial, concurrent))

    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child reports through the pipe, and dies if it ever hangs
        signal.alarm(120)
        try:
            ok = all(torch.equal(packed_matmul(x, tiled), y) for x, y in zip(inputs, serial))
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write)
    _, status = os.waitpid(child, 0)
    assert os.read(read, 1) == b"1" and os.WEXITSTATUS(status) == 0
    os.close(read)


@pytest.mark.parametrize("group", [2, 3, 4, 5, 7])
def test_attending_query_heads_together_gives_each_head_alone_bits(group):
    """The G query heads of a KV head are attended together (sharing key and value loads);
    each must still get the bits it gets attended alone. Alone here: G copies of the KV
    head, one query head each (G = 1)."""
    g = torch.Generator().manual_seed(group)
    head_dim, block_size, length, rows = 64, 16, 150, 5
    k1 = torch.randn(12, block_size, 1, head_dim, generator=g).to(torch.bfloat16)
    v1 = torch.randn(12, block_size, 1, head_dim, generator=g).to(torch.bfloat16)
    tables = torch.randperm(12, generator=g)[:10].to(torch.int32)[None]
    q = torch.randn(rows, group, head_dim, generator=g)
    args = (
        torch.tensor([0]), torch.tensor([0, rows], dtype=torch.int32),
        torch.tensor([length], dtype=torch.int32), tables, head_dim**-0.5, 0, 0.0,
    )  # fmt: skip
    together, alone = torch.empty_like(q), torch.empty_like(q)
    ops().paged_attention_rows_(q, *fast_layout(k1, v1), together, *args)
    copies = fast_layout(k1.expand(-1, -1, group, -1), v1.expand(-1, -1, group, -1))
    ops().paged_attention_rows_(q, *copies, alone, *args)
    assert torch.equal(together, alone)


def test_a_batch_of_decode_rows_gets_each_sequences_own_bits():
    """With many sequences in a step, an item of few rows spans all KV heads of its sequence
    (each block's heads read in one pass); alone, a sequence's rows are split by KV head.
    Every row must get the same bits either way, and match the float64 reference."""
    g = torch.Generator().manual_seed(7)
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    sequences = 4 * 4 * max(1, torch.get_num_threads())  # past the kernel's threshold
    lens = [int(n) for n in torch.randint(1, 150, (sequences,), generator=g)]
    query_lens = [min(n, 1 + i % 4) for i, n in enumerate(lens)]  # decode and verify rows
    tables, num_blocks = _scattered_block_tables(lens, block_size, g)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).bfloat16()
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).bfloat16()
    cu = _cumulative(query_lens)
    q = torch.randn(cu[-1], heads, head_dim, generator=g)
    scale = head_dim**-0.5
    fast_k, fast_v = fast_layout(k_cache, v_cache)
    geometry = (
        torch.tensor(cu, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
        torch.tensor(tables, dtype=torch.int32), scale, 0, 0.0,
    )  # fmt: skip
    together = torch.full_like(q, float("nan"))
    ops().paged_attention_rows_(q, fast_k, fast_v, together, torch.arange(sequences), *geometry)
    alone = torch.full_like(q, float("nan"))
    for b in range(sequences):
        ops().paged_attention_rows_(q, fast_k, fast_v, alone, torch.tensor([b]), *geometry)
    assert torch.equal(together, alone)
    want = _attention_float64(q, k_cache, v_cache, cu, lens, tables, scale, 0, 0.0)
    tol = _tolerance(torch.bfloat16)
    torch.testing.assert_close(together.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("block_size,window", [(16, 0), (32, 0), (16, 40), (24, 0)])
def test_prefetching_the_next_chunk_changes_no_output(block_size, window):
    """In-place attention prefetches the lines of the chunk it reads next: the next KV head,
    the next chunk, the next item's first (sliding windows and scattered tables included;
    block size 24 does not divide a chunk, so nothing is prefetched there). Only timing
    may change: the outputs are the same bits with it off."""
    g = torch.Generator().manual_seed(block_size + window)
    heads, kv_heads, head_dim = 9, 3, 64
    sequences = 4 * 4 * max(1, torch.get_num_threads())  # items spanning all KV heads
    lens = [int(n) for n in torch.randint(1, 200, (sequences,), generator=g)]
    query_lens = [min(n, 1 + i % 3) for i, n in enumerate(lens)]
    tables, num_blocks = _scattered_block_tables(lens, block_size, g, spare=3)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).bfloat16()
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).bfloat16()
    cu = _cumulative(query_lens)
    q = torch.randn(cu[-1], heads, head_dim, generator=g)
    fast_k, fast_v = fast_layout(k_cache, v_cache)
    args = (
        torch.arange(sequences), torch.tensor(cu, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32), torch.tensor(tables, dtype=torch.int32),
        head_dim**-0.5, window, 0.0,
    )  # fmt: skip
    outputs = []
    was = ops().set_attention_prefetch(True)
    try:
        for on in (True, False):
            ops().set_attention_prefetch(on)
            out = torch.full_like(q, float("nan"))
            ops().paged_attention_rows_(q, fast_k, fast_v, out, *args)
            outputs.append(out)
    finally:
        ops().set_attention_prefetch(was)
    assert not outputs[0].isnan().any()
    assert torch.equal(outputs[0], outputs[1])


def _vector_attention() -> bool:
    """Whether this CPU runs the vector attention kernels (AVX-512, or AVX2 with the same
    bits); the plain C++ ones (std::exp, sums in key order) give other bits."""
    flags = set(cpu_ext._cpu_flags().split())
    return {"avx512f", "avx512bw"} <= flags or {"avx2", "fma", "f16c"} <= flags


def _fma32(a, b, c):
    """float32 a * b + c, rounded once up to double rounding through float64 (the product is
    exact there; the sum rounds twice in about one case in 2^29: fixed inputs, so no flakes)."""
    return (np.float64(a) * np.float64(b) + np.float64(c)).astype(np.float32)


def _exp512(x):
    """common.h's exp512 (and exp256) lane by lane: p(r) * 2^n, 0 below -87."""
    f = np.float32
    x = np.asarray(x, f)
    under = x < f(-87)
    x = np.maximum(x, f(-87))
    n = np.rint(x * f(1.44269504088896341)).astype(f)
    r = _fma32(-n, f(0.693359375), x)
    r = _fma32(-n, f(-2.12194440e-4), r)
    p = np.full_like(x, f(1) / f(720))
    for c in (f(1) / f(120), f(1) / f(24), f(1) / f(6), f(0.5), f(1), f(1)):
        p = _fma32(p, r, c)
    return np.where(under, f(0), np.ldexp(p, n.astype(np.int32))).astype(f)


def _to_bf16(x):
    """float32 -> the nearest bf16 (ties to even), as float32: the kernels' rounding."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def _paired(n):
    """0..n-1 in the paired order of a bf16 cache's sums: 1, 0, 3, 2, .. (vdpbf16ps adds
    the odd term of a pair first)."""
    return [i ^ 1 for i in range(n)]


def _attend_recipe(q, keys, values, first, last, soft_cap):
    """One query vector as the vector kernels attend it over a bf16 cache (the paired
    recipe), in numpy float32: q [D] (scaled), keys and values [L, D] of positions 0..L-1,
    visible first..last. q rounded to bf16; chunks of 64 keys; scores summed over d in the
    order 1, 0, 3, 2, ..; the probabilities rounded to bf16, the chunk's total as a 16-lane
    vector, reduced in halves, quarters, pairs; values added by pairs of positions, the odd
    one first."""
    f = np.float32
    q = _to_bf16(q)
    run_max, run_sum, acc = f(-np.inf), f(0), np.zeros(q.shape[0], f)
    for start in range(first // 64 * 64, last + 1, 64):
        lo, hi = max(first, start) - start, min(last + 1, start + 64) - start
        k = np.zeros((64, q.shape[0]), f)
        k[: min(64, len(keys) - start)] = keys[start : start + 64]
        s = np.zeros(64, f)
        for x in _paired(q.shape[0]):
            s = _fma32(q[x], k[:, x], s)
        if soft_cap:  # tanh512: 1 - 2 / (e^{2|x|} + 1) through exp512, sign restored
            cap = f(soft_cap)
            e = _exp512(np.abs(s / cap) * f(-2))
            t = (f(1) - e) / (f(1) + e)
            s = cap * np.where(np.signbit(s), -t, t)
        s = np.where((np.arange(64) >= lo) & (np.arange(64) < hi), s, f(-np.inf)).astype(f)
        new_max = max(run_max, s.max())
        corr = f(0) if run_max == -np.inf else _exp512(run_max - new_max)
        p = _to_bf16(_exp512(s - new_max))
        t16 = p[0:16] + p[16:32] + p[32:48] + p[48:64]  # left to right, from 0 + p[0:16]
        t8 = t16[:8] + t16[8:]
        t4 = t8[:4] + t8[4:]
        run_sum = run_sum * corr + ((t4[0] + t4[2]) + (t4[1] + t4[3]))
        run_max = new_max
        acc = acc * corr
        for key in _paired(64):
            if lo <= key < hi:
                acc = _fma32(p[key], values[start + key], acc)
    return acc * (f(1) / run_sum)


@pytest.mark.skipif(not _vector_attention(), reason="plain C++ attention: other bits")
@pytest.mark.parametrize(
    "rows,length,window,soft_cap,head_dim,block_size",
    [
        (1, 150, 0, 0.0, 32, 16),
        (1, 200, 0, 5.0, 32, 16),
        (3, 131, 40, 0.0, 32, 16),
        (20, 90, 0, 5.0, 32, 16),
        (2, 141, 37, 0.0, 96, 32),  # slices of 64 and 32 dimensions; rows bs apart
        (18, 141, 37, 0.0, 96, 32),  # a prompt item whose window starts mid-chunk
        (40, 150, 0, 0.0, 64, 16),  # prompt items whose rows see whole chunks together
    ],
)
def test_attention_is_the_documented_recipe_bit_for_bit(
    rows, length, window, soft_cap, head_dim, block_size
):
    """Every output of the vector kernels (decode rows read in place, prompt rows through
    a scratch copy of each chunk: float32, or vdpbf16ps pairs) equals the recipe written
    out in numpy float32, bit for bit: the AVX-512 kernels, their AVX2 port (8-lane halves)
    and the vdpbf16ps kernels of AVX512-BF16 CPUs run exactly these operations, so a
    machine of any kind checks that its kernels give the others' bits."""
    g = torch.Generator().manual_seed(length)
    heads, kv_heads = 4, 2
    blocks = -(-length // block_size)
    table = torch.randperm(blocks + 3, generator=g)[:blocks].to(torch.int32)
    k_cache = torch.randn(blocks + 3, block_size, kv_heads, head_dim, generator=g).bfloat16()
    v_cache = torch.randn(blocks + 3, block_size, kv_heads, head_dim, generator=g).bfloat16()
    q = torch.randn(rows, heads, head_dim, generator=g)
    out = torch.empty_like(q)
    scale = head_dim**-0.5
    ops().paged_attention_rows_(
        q, *fast_layout(k_cache, v_cache), out, torch.tensor([0]),
        torch.tensor([0, rows], dtype=torch.int32), torch.tensor([length], dtype=torch.int32),
        table[None], scale, window, soft_cap,
    )  # fmt: skip
    keys = k_cache[table.long()].flatten(0, 1)[:length].float().numpy()  # [L, Hkv, D]
    values = v_cache[table.long()].flatten(0, 1)[:length].float().numpy()
    for r in range(rows):
        last = length - rows + r
        first = max(0, last - window + 1) if window else 0
        for h in range(heads):
            kv = h // (heads // kv_heads)
            qs = q[r, h].numpy() * np.float32(scale)  # as the kernel scales q
            want = _attend_recipe(qs, keys[:, kv], values[:, kv], first, last, soft_cap)
            assert torch.equal(out[r, h], torch.from_numpy(want)), (r, h)


@pytest.mark.parametrize("hidden,experts", [(64, 8), (100, 7), (2048, 128)])
def test_router_logits_do_not_depend_on_the_other_rows(hidden, experts):
    """An MoE router's logits (router_logits): a row's are the same bits alone and in any
    batch (torch's float32 matmul gives them otherwise), and as accurate as torch's."""
    g = torch.Generator().manual_seed(hidden)
    weight = torch.randn(experts, hidden, generator=g)
    x = torch.randn(13, hidden, generator=g)
    batched = ops().router_logits(x, weight)
    for i in range(len(x)):
        assert torch.equal(ops().router_logits(x[i : i + 1], weight), batched[i : i + 1])
    assert torch.equal(ops().router_logits(x[3:9], weight), batched[3:9])
    exact = x.double() @ weight.double().t()
    ours = (batched.double() - exact).abs().max().item()
    theirs = ((x @ weight.t()).double() - exact).abs().max().item()
    assert ours <= 4 * theirs + 1e-6
