"""AWQLinear on CPU (torch's native int4 matmul and the tile-wise path) and its factory."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from pagedllm_integrations.engine.models.layers import StackedLinear, dense_linear
from pagedllm_integrations.quant.awq_format import quantize_weight
from pagedllm_integrations.quant.awq_linear import (
    AWQLinear,
    MixedStackedLinear,
    awq_linear_factory,
)

CPU = torch.device("cpu")
CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"}


def _shards(sizes: list[int], in_features: int, group: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(n, in_features, generator=gen) for n in sizes]
    return [quantize_weight(w, group) for w in weights]


@pytest.mark.parametrize("kernel", ["int4pack", "tiles"])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_awq_linear_equals_dequantized_reference(kernel, group, dtype):
    sizes, k = [128, 64, 64], 256
    shards = _shards(sizes, k, group)
    bias = torch.randn(sum(sizes))
    layer = AWQLinear(k, sizes, True, group, dtype, CPU, cpu_kernel=kernel)
    for index, q in enumerate(shards):
        for suffix, tensor in q.pack().items():
            layer.load(suffix, tensor, index)
        layer.load("bias", bias[layer.offsets[index] : layer.offsets[index + 1]], index)
    x = torch.randn(7, k).to(dtype)
    reference = x.float() @ torch.cat([q.dequantize() for q in shards]).t() + bias.to(dtype).float()
    out = layer(x)
    assert out.dtype == dtype and out.shape == (7, 256)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(out.float(), reference, rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_path_memory_and_both_token_regimes(dtype):
    sizes, k = [256], 512
    (q,) = _shards(sizes, k, 64)
    layer = AWQLinear(k, sizes, False, 64, dtype, CPU)
    assert layer.cpu_kernel == "int4pack"
    for suffix, tensor in q.pack().items():
        layer.load(suffix, tensor, 0)
    dense_bytes = 256 * 512 * 4
    if dtype == torch.bfloat16:
        assert layer.qweight is None  # only the repacked copy is held
        assert layer.weight_bytes() < dense_bytes / 6
    else:  # AWQ copy (exact prefill tiles) + native copy (decode)
        assert layer.weight_bytes() < dense_bytes / 3
    for m in (1, 4, 5, 40):  # decode-sized and prefill-sized batches
        x = torch.randn(m, k).to(dtype)
        reference = x.float() @ q.dequantize().t()
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(layer(x).float(), reference, rtol=tol, atol=tol * 10)


def test_shapes_torch_int4_cannot_take_fall_back_to_tiles():
    layer = AWQLinear(96, [24], False, 32, torch.float32, CPU)  # N = 24 is not a multiple of 16
    assert layer.cpu_kernel == "tiles"
    with pytest.raises(ValueError, match="N % 16"):
        AWQLinear(96, [24], False, 32, torch.float32, CPU, cpu_kernel="int4pack")


def test_errors_a_user_can_cause():
    with pytest.raises(ValueError, match="does not divide in_features"):
        AWQLinear(100, [64], False, 64, torch.float32, CPU)
    with pytest.raises(ValueError, match="multiples of 8"):
        AWQLinear(128, [60], False, 64, torch.float32, CPU)
    layer = AWQLinear(128, [64], False, 64, torch.float32, CPU)
    with pytest.raises(ValueError, match="used before"):
        layer(torch.randn(1, 128))
    with pytest.raises(ValueError, match="checkpoint shape"):
        layer.load("qweight", torch.zeros(128, 4, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match="unexpected tensor 'weight'"):
        layer.load("weight", torch.zeros(64, 128), 0)


def test_factory_routes_by_qweight_presence(tmp_path):
    """v_proj kept dense (modules_to_not_convert): the qkv stack mixes AWQ and dense shards."""
    k, sizes = 128, [128, 64, 64]
    shards = _shards(sizes, k, 64, seed=3)
    dense_v = torch.randn(64, k)
    prefix = "model.layers.0.self_attn"
    tensors = {}
    for name, q in zip(("q_proj", "k_proj"), shards[:2]):
        for suffix, tensor in q.pack().items():
            tensors[f"{prefix}.{name}.{suffix}"] = tensor
    tensors[f"{prefix}.v_proj.weight"] = dense_v.half()
    for suffix, tensor in shards[0].pack().items():  # o_proj: 128 -> 128, quantized
        tensors[f"{prefix}.o_proj.{suffix}"] = tensor
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.randn(128, 256).half()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    make = awq_linear_factory(
        {**CONFIG, "modules_to_not_convert": ["v_proj"]}, tmp_path, dense_linear=dense_linear
    )
    names = [f"{prefix}.{n}" for n in ("q_proj", "k_proj", "v_proj")]
    qkv = make(k, sizes, False, names, torch.float32, CPU)
    assert isinstance(qkv, MixedStackedLinear)
    assert isinstance(make(k, [128], False, [f"{prefix}.o_proj"], torch.float32, CPU), AWQLinear)
    down = make(256, [128], False, ["model.layers.0.mlp.down_proj"], torch.float32, CPU)
    assert isinstance(down, StackedLinear)
    for index, name in enumerate(names):
        for key, tensor in tensors.items():
            if key.startswith(name + "."):
                qkv.load(key.rsplit(".", 1)[1], tensor, index)
    x = torch.randn(5, k)
    w = torch.cat([shards[0].dequantize(), shards[1].dequantize(), dense_v.half().float()])
    torch.testing.assert_close(qkv(x), x @ w.t(), rtol=1e-4, atol=1e-4)


def test_factory_rejects_folder_without_awq_tensors(tmp_path):
    save_file({"model.norm.weight": torch.ones(4)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"holds no '\.qweight'"):
        awq_linear_factory(CONFIG, tmp_path, dense_linear=dense_linear)
