"""GGUF quantized tensors kept quantized: each block type maps exactly onto a packed format.

Small GGUF files are written with the `gguf` package (llama.cpp's own Python library), read
back through the engine's loader, packed, and compared value for value with gguf's own
dequantization (the reference llama.cpp's numerics are defined by).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from pagedllm_integrations.engine.gguf_loader import GGUFTensor, _tensor_value, read_gguf
from pagedllm_integrations.quant.gguf_blocks import _BLOCK, PACKED_TYPES, to_packed

ROWS, COLS = 24, 512


def _blocks(type_name: str, rng: np.random.Generator) -> np.ndarray:
    """uint8 [ROWS, bytes per row] of valid blocks: quantized by gguf where it can, else
    random bytes with sane fp16 scales (K-quants: gguf-py dequantizes but does not quantize)."""
    qtype = gguf.GGMLQuantizationType[type_name]
    values = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    try:
        return quantize(values, qtype)
    except (NotImplementedError, gguf.quants.QuantError):
        pass
    per_block, nbytes = _BLOCK.get(type_name) or (256, gguf.GGML_QUANT_SIZES[qtype][1])
    raw = rng.integers(0, 256, (ROWS * COLS // per_block, nbytes), dtype=np.uint8)
    fp16 = lambda n: (rng.random(n) * 0.02 + 1e-3).astype(np.float16).view(np.uint8)  # noqa: E731
    count = raw.shape[0]
    if type_name == "Q6_K":
        raw[:, 208:210] = fp16(count).reshape(-1, 2)
    elif type_name in ("Q4_K", "Q5_K"):
        raw[:, 0:4] = fp16(2 * count).reshape(-1, 4)  # d, dmin
    else:  # Q2_K / Q3_K keep d at the end of the block
        raw[:, -2:] = fp16(count).reshape(-1, 2)
        if type_name == "Q2_K":
            raw[:, -4:-2] = fp16(count).reshape(-1, 2)
    return raw.reshape(ROWS, -1)


def _write_and_read(tmp_path, type_name: str, data: np.ndarray):
    path = tmp_path / f"{type_name}.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tensor("blk.0.ffn_up.weight", data, raw_dtype=gguf.GGMLQuantizationType[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tensor,) = read_gguf(path).tensors
    (reference,) = gguf.GGUFReader(str(path)).tensors  # llama.cpp's own reader agrees
    assert tensor.name == reference.name and tensor.type_name == reference.tensor_type.name
    assert np.array_equal(
        np.asarray(tensor.data).reshape(-1), np.asarray(reference.data).reshape(-1)
    )
    return _tensor_value(tensor)


@pytest.mark.parametrize("type_name", PACKED_TYPES)
def test_every_packed_gguf_type_is_exact(tmp_path, type_name):
    rng = np.random.default_rng(sum(map(ord, type_name)))
    data = _blocks(type_name, rng)
    value = _write_and_read(tmp_path, type_name, data)
    assert isinstance(value, GGUFTensor) and value.shape == (ROWS, COLS)
    reference = dequantize(data, gguf.GGMLQuantizationType[type_name]).reshape(ROWS, COLS)
    packed = to_packed(value.type_name, value.data, value.shape)
    expected_kind = "u4" if type_name in ("Q4_0", "Q4_1", "Q4_K") else "i8"
    assert packed.kind == expected_kind
    assert torch.equal(packed.dequantize(), torch.from_numpy(reference))
    compact = packed.compact()  # fp16 scales only where exact: same values either way
    assert torch.equal(compact.dequantize(), torch.from_numpy(reference))
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q8_0"):
        assert compact.scales.dtype == torch.float16
    # the loader's float path dequantizes to the same values
    assert torch.equal(value.dense(), torch.from_numpy(reference))
    # K-quants keep their two levels of scales, which the kernels store as they are
    assert packed.has_k_factors == type_name.endswith("_K")
    # row permutations (llama.cpp's rotary order undone) move whole rows of blocks
    order = np.arange(ROWS)[::-1].copy()
    permuted = to_packed(type_name, value.permute_rows(order).data, value.shape)
    assert torch.equal(permuted.dequantize(), torch.from_numpy(reference[order]))


def test_types_without_a_packed_form_are_dequantized_once_to_bf16(tmp_path):
    from pagedllm_integrations.quant.packed_linear import to_fast_weight

    # IQ4_NL (llama-quantize's fallback for IQ4_XS rows): 32 values per 18-byte block, an
    # fp16 scale first, then 16 bytes of indices into a fixed table of 16 levels.
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, (ROWS * COLS // 32, 18), dtype=np.uint8)
    scales = (rng.random(data.shape[0]) * 0.02 + 1e-3).astype(np.float16)
    data[:, 0:2] = scales.view(np.uint8).reshape(-1, 2)
    data = data.reshape(ROWS, -1)
    value = _write_and_read(tmp_path, "IQ4_NL", data)
    dense = to_fast_weight(value)
    reference = dequantize(data, gguf.GGMLQuantizationType.IQ4_NL).reshape(ROWS, COLS)
    assert isinstance(dense, torch.Tensor) and dense.dtype == torch.bfloat16
    assert torch.equal(dense, torch.from_numpy(reference).to(torch.bfloat16))


@pytest.mark.parametrize("type_name", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_k_quants_tile_their_two_levels_and_take_the_folded_recipe(tmp_path, type_name):
    """The kernels' K form (int8 multipliers and per-256 factors, 1.25 bytes per group and
    row) holds the values of the float32 scales bit for bit, and its products are the
    folded recipe's (llama.cpp's Q8_K activations, kernels/csrc/linear_packed.cpp): within
    float32 rounding of the exact product of those activations, the same bits for every
    batch size."""
    from pagedllm_integrations.kernels import cpu_ext
    from pagedllm_integrations.quant.packed import PackedWeight
    from pagedllm_integrations.quant.packed_linear import packed_matmul

    if not cpu_ext.load():
        pytest.skip("needs the C++ kernels")
    data = _blocks(type_name, np.random.default_rng(3))
    value = _write_and_read(tmp_path, type_name, data)
    packed = to_packed(value.type_name, value.data, value.shape).compact()
    plain = PackedWeight(  # the same weight with its float32 products only
        packed.kind, packed.qweight, packed.scales, packed.mins, packed.group, packed.shape
    )
    k_form, float_form = packed.tiled(), plain.tiled()
    assert k_form.scales.dtype == torch.uint8 and float_form.scales.dtype == torch.float32
    assert k_form.nbytes < float_form.nbytes
    reference = dequantize(data, gguf.GGMLQuantizationType[type_name]).reshape(ROWS, COLS)
    assert torch.equal(k_form.dequantize(), torch.from_numpy(reference))
    x = torch.randn(17, COLS, generator=torch.Generator().manual_seed(1))
    qk, dk, _ = torch.ops.pagedllm.quantize_super_blocks(x)
    activations = (qk.double().view(17, -1, 256) * dk.double()[..., None]).view(17, COLS)
    exact = activations @ torch.from_numpy(reference).double().t()
    full = packed_matmul(x, k_form)
    assert (full.double() - exact).abs().max().item() <= 2e-6 * exact.abs().max().item()
    for rows in (1, 2, 5, 7, 8, 16, 17):
        assert torch.equal(packed_matmul(x[:rows], k_form), full[:rows])


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_0", "Q6_K"])
def test_a_large_tensor_is_decoded_a_slice_of_rows_at_a_time(tmp_path, monkeypatch, type_name):
    """to_packed decodes row slices into the whole weight's tensors (bounded intermediates):
    the same weight, factors included, as decoding all rows at once."""
    from pagedllm_integrations.quant import gguf_blocks

    data = _blocks(type_name, np.random.default_rng(11))
    value = _write_and_read(tmp_path, type_name, data)
    whole = to_packed(value.type_name, value.data, value.shape)
    monkeypatch.setattr(gguf_blocks, "_CHUNK_VALUES", 5 * COLS)  # 5 rows a slice: 24 = 4 x 5 + 4
    sliced = to_packed(value.type_name, value.data, value.shape)
    for a, b in ((whole.qweight, sliced.qweight), (whole.scales, sliced.scales)):
        assert torch.equal(a, b)
    assert (whole.mins is None) == (sliced.mins is None)
    if whole.mins is not None:
        assert torch.equal(whole.mins, sliced.mins)
    for f, g in (
        (whole.scale_factors, sliced.scale_factors),
        (whole.min_factors, sliced.min_factors),
    ):
        assert (f is None) == (g is None)
        if f is not None:
            assert torch.equal(f.multipliers, g.multipliers) and torch.equal(f.factors, g.factors)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K", "Q6_K", "Q5_0"])
def test_a_table_tiled_in_chunks_has_the_whole_weights_bits(tmp_path, type_name):
    """Large tables (embeddings, LM heads) are tiled a chunk of rows at a time straight
    from their blocks (`tile_in_chunks`): the same tiles and scales as the whole weight's,
    the last tile partial; chunks that would choose another tile format fall back."""
    from pagedllm_integrations.kernels import cpu_ext
    from pagedllm_integrations.quant.packed_linear import kernel_weight, tile_in_chunks

    if not cpu_ext.load():
        pytest.skip("needs the C++ kernels")
    data = _blocks(type_name, np.random.default_rng(5))
    value = _write_and_read(tmp_path, type_name, data)
    value = GGUFTensor(value.type_name, value.data[:-4], (ROWS - 4, COLS))  # 20 rows
    whole = kernel_weight(to_packed(value.type_name, value.data, value.shape).compact())
    chunked = tile_in_chunks(value, chunk_rows=16)
    assert chunked is not None and chunked.kind == whole.kind
    for got, want in zip(
        (chunked.tiles, chunked.scales, chunked.mins), (whole.tiles, whole.scales, whole.mins)
    ):
        assert (got is None) == (want is None)
        if got is not None:
            assert got.dtype == want.dtype and torch.equal(got, want)
    assert tile_in_chunks(value, chunk_rows=32) is None  # one chunk: the whole path's job


def test_chunks_that_choose_different_tile_formats_fall_back(tmp_path):
    """An I8 table whose first rows all fit in 6 bits (zeros: Q8_0 maps every other
    block's largest value to 127) and whose last do not: the chunks disagree (i6 against
    i8), so it is tiled whole, as i8."""
    from pagedllm_integrations.kernels import cpu_ext
    from pagedllm_integrations.quant.packed_linear import table_weight, tile_in_chunks

    if not cpu_ext.load():
        pytest.skip("needs the C++ kernels")
    values = np.zeros((32, COLS), dtype=np.float32)
    values[16:] = np.random.default_rng(9).standard_normal((16, COLS))
    data = quantize(values, gguf.GGMLQuantizationType.Q8_0)
    value = _write_and_read(tmp_path, "Q8_0", data)
    assert tile_in_chunks(value, chunk_rows=16) is None
    assert table_weight(value).kind == "i8"
