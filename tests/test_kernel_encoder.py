"""The encoders' C++ kernels (embedding models on the CPU fast path): bidirectional
attention, the residual LayerNorm and gelu against torch (kernels/csrc/encoder.cpp), and the dense
linears on AMX-BF16 tiles (kernels/csrc/linear_amx_bf16.cpp): close to the exact products,
the same bits for a row whatever shares its batch, and refused where the CPU lacks them."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_cpu_kernels import weights

from pagedllm_integrations.engine.compute_plan import cpu_fast_path_isa
from pagedllm_integrations.kernels import cpu_ext
from pagedllm_integrations.quant.packed_linear import (
    amx_bf16_available,
    build_kernel_linear,
    kernel_weight,
    packed_matmul,
)

pytestmark = pytest.mark.skipif(
    not (cpu_fast_path_isa() is not None and cpu_ext.load()),
    reason="the C++ kernels need AVX-512 or AVX2",
)
needs_amx_bf16 = pytest.mark.skipif(
    not (cpu_ext.is_loaded() and amx_bf16_available()), reason="the CPU has no AMX-BF16"
)


def ops():
    return torch.ops.pagedllm


def reference_attention(qkv: torch.Tensor, bounds: list[int], scale: float) -> torch.Tensor:
    out = torch.empty(qkv.shape[0], qkv.shape[2], qkv.shape[3])
    for start, end in itertools.pairwise(bounds):
        q, k, v = qkv[start:end].permute(1, 2, 0, 3).double()
        scores = torch.bmm(q * scale, k.transpose(1, 2)).softmax(dim=-1)
        out[start:end] = torch.bmm(scores, v).transpose(0, 1).float()
    return out


@pytest.mark.parametrize(
    "heads, head_dim, lengths",
    [(12, 32, [1, 5, 17, 200, 33]), (2, 16, [3, 40]), (4, 64, [100, 300]), (3, 8, [7, 19]),
     (2, 48, [21]), (1, 32, [])],
)  # fmt: skip
def test_encoder_attention_matches_torch(heads, head_dim, lengths):
    """Head sizes on the vector path (multiples of 16) and off it (8); a sequence of one
    row, lengths off every block size; no sequence at all."""
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    gen = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(bounds[-1], 3, heads, head_dim, generator=gen) * 2
    scale = head_dim**-0.5
    got = ops().encoder_attention(qkv, torch.tensor(bounds), scale)
    assert got.shape == (bounds[-1], heads, head_dim)
    torch.testing.assert_close(got, reference_attention(qkv, bounds, scale), rtol=1e-5, atol=2e-5)
    # each sequence alone gives the same bits
    for start, end in itertools.pairwise(bounds):
        alone = ops().encoder_attention(
            qkv[start:end].contiguous(), torch.tensor([0, end - start]), scale
        )
        assert torch.equal(alone, got[start:end])


def test_encoder_attention_refuses_bad_bounds():
    qkv = torch.randn(10, 3, 2, 16)
    with pytest.raises(RuntimeError, match="cu_seqlens must run from 0 to 10"):
        ops().encoder_attention(qkv, torch.tensor([0, 4, 9]), 0.25)
    with pytest.raises(RuntimeError, match="must not decrease"):
        ops().encoder_attention(qkv, torch.tensor([0, 6, 4, 10]), 0.25)
    with pytest.raises(RuntimeError, match=r"qkv must be float32 \[T, 3, H, D\]"):
        ops().encoder_attention(torch.randn(10, 2, 2, 16), torch.tensor([0, 10]), 0.25)


@pytest.mark.parametrize("hidden", [384, 40])
def test_add_layer_norm_matches_torch(hidden):
    gen = torch.Generator().manual_seed(hidden)
    x, y = (torch.randn(70, hidden, generator=gen) * 3 for _ in range(2))
    weight, bias = torch.randn(hidden, generator=gen), torch.randn(hidden, generator=gen)
    want = F.layer_norm(y + x, (hidden,), weight, bias, 1e-12)
    got = ops().add_layer_norm(x, y, weight, bias, 1e-12)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert torch.equal(ops().add_layer_norm(x[3:4], y[3:4], weight, bias, 1e-12), got[3:4])


def test_gelu_erf_is_the_exact_gelu_within_2e_7():
    x = torch.cat([torch.linspace(-12, 12, 20001), torch.randn(5000) * 3, torch.tensor([0.0])])
    got = x.clone()
    ops().gelu_erf_(got)
    error = (got.double() - F.gelu(x.double())).abs() / x.double().abs().clamp(min=1)
    assert float(error.max()) < 2e-7


@needs_amx_bf16
@pytest.mark.parametrize(
    "m, k, n", [(1, 32, 16), (5, 64, 40), (33, 96, 70), (100, 384, 1152), (70, 1536, 384)]
)
def test_amx_bf16_linear_is_exact_products_summed_in_float32(m, k, n):
    """Within float32 rounding of the exact sum of the bf16 products (each row against the
    size of its terms), and a row's bits the same alone, in any batch, with its bias."""
    gen = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, k, generator=gen) * 3
    weight = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen)
    packed = ops().amx_bf16_pack(weight)
    assert packed.shape == (2 * -(-n // 32), k // 32, 16, 32)
    got = ops().amx_bf16_linear(x, packed, n)
    xb, wd = x.to(torch.bfloat16).double(), weight.double()
    exact = xb @ wd.T
    magnitude = xb.abs() @ wd.abs().T
    assert bool(((got.double() - exact).abs() <= 1e-6 * magnitude + 1e-30).all())
    for rows in (slice(0, 1), slice(m // 2, m), slice(m - 1, m)):
        assert torch.equal(ops().amx_bf16_linear(x[rows], packed, n), got[rows])
    assert torch.equal(ops().amx_bf16_linear(x, packed, n, bias), got + bias)


@needs_amx_bf16
def test_linear_segments_on_amx_tiles_beside_packed_ones():
    """A stacked linear of a dense shard on AMX tiles and a packed one: each segment's
    columns are its own kernel's bits, the bias added once (single and mixed segments)."""
    k = 128
    dense = torch.randn(48, k, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    u4 = kernel_weight(weights(32, k)[0])
    x = torch.randn(21, k, generator=torch.Generator().manual_seed(4))
    bias = torch.randn(80)
    mixed = build_kernel_linear(k, [dense, u4], bias, dense_on_amx=True)
    assert mixed.segment_formats() == ["bf16-amx", "u4/32"]
    packed = ops().amx_bf16_pack(dense)
    expected = torch.cat([ops().amx_bf16_linear(x, packed, 48), packed_matmul(x, u4)], dim=1) + bias
    assert torch.equal(ops().linear(mixed, x), expected)
    alone = build_kernel_linear(k, [dense], bias[:48], dense_on_amx=True)
    assert alone.segment_formats() == ["bf16-amx"]
    assert torch.equal(ops().linear(alone, x), ops().amx_bf16_linear(x, packed, 48, bias[:48]))


@needs_amx_bf16
def test_encoder_linear_holds_its_dense_weight_once():
    """On AMX the kernel's packed copy is the only one: no bf16 tensor kept beside it."""
    from pagedllm_integrations.quant.packed_linear import encoder_linear

    linear = encoder_linear(64, [32, 16], True, ["q", "k"], torch.float32, torch.device("cpu"))
    weights = [torch.randn(32, 64), torch.randn(16, 64)]
    for shard, weight in enumerate(weights):
        linear.load("weight", weight, shard)
    assert linear.kernel.segment_formats() == ["bf16-amx"]
    assert linear.segments == [] and linear.kernel_segments() is None
    assert linear.weight_bytes() == 48 * 64 * 2
    x = torch.randn(5, 64)
    packed = ops().amx_bf16_pack(torch.cat(weights).to(torch.bfloat16))
    assert torch.equal(linear(x), ops().amx_bf16_linear(x, packed, 48, linear.bias))


def test_amx_bf16_is_refused_where_it_is_off():
    """PAGEDLLM_DISABLE_AMX=1 (or a CPU without it): a clear error, and encoder_linear
    falls back to the vdpbf16ps recipe."""
    script = (
        "import torch\n"
        "from pagedllm_integrations.kernels import cpu_ext\n"
        "from pagedllm_integrations.quant.packed_linear import amx_bf16_available, encoder_linear\n"
        "cpu_ext.load()\n"
        "assert not amx_bf16_available()\n"
        "linear = encoder_linear(64, [32], True, ['l'], torch.float32, torch.device('cpu'))\n"
        "linear.load('weight', torch.randn(32, 64), 0)\n"
        "assert linear.kernel.segment_formats() == ['bf16']\n"
        "try:\n"
        "    torch.ops.pagedllm.amx_bf16_linear(torch.randn(2, 64), torch.zeros(2, 2, 16, 32, dtype=torch.bfloat16), 32)\n"
        "except RuntimeError as error:\n"
        "    assert 'needs AMX-BF16' in str(error), error\n"
        "else:\n"
        "    raise AssertionError('not refused')\n"
    )
    env = {**os.environ, "PAGEDLLM_DISABLE_AMX": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


# The encoder ops have AVX-512, AVX2 and plain C++ forms that sum in different orders (they
# are not held to one recipe's bits, as the decoder's kernels are: tests/test_cpu_kernels_isa.py).
# Each form is built in a process of its own and checked against torch.
CHILD = textwrap.dedent(
    """
    import sys, torch
    from torch.utils import cpp_extension
    csrc, build, flags, io = sys.argv[1], sys.argv[2], sys.argv[3].split(), sys.argv[4]
    cpp_extension.load(
        name="pagedllm_encoder_isa_check",
        sources=[csrc + "/encoder.cpp", csrc + "/thread_pool.cpp"],
        extra_cflags=["-O2", "-march=native", *flags, "-ffp-contract=off", "-fopenmp",
                      "-std=c++17"],
        extra_ldflags=["-fopenmp"], extra_include_paths=[csrc], build_directory=build,
        is_python_module=False,
    )
    qkv, cu, scale, x, y, w, b = torch.load(io + "/in.pt")
    ops = torch.ops.pagedllm
    activated = x.clone()
    ops.gelu_erf_(activated)
    torch.save([ops.encoder_attention(qkv, cu, scale), ops.add_layer_norm(x, y, w, b, 1e-12),
                activated], io + "/out.pt")
    """
)


# -mno-avx2 switches AVX-512 off too (it builds on AVX2): the plain C++ form.
@pytest.mark.parametrize("flags", ["-mno-avx512f", "-mno-avx2"])
def test_encoder_ops_without_avx512(flags, tmp_path):
    gen = torch.Generator().manual_seed(2)
    bounds = [0, 1, 30, 47]
    qkv = torch.randn(bounds[-1], 3, 4, 32, generator=gen)
    x, y = torch.randn(20, 96, generator=gen), torch.randn(20, 96, generator=gen)
    w, b = torch.randn(96, generator=gen), torch.randn(96, generator=gen)
    torch.save([qkv, torch.tensor(bounds), 0.2, x, y, w, b], tmp_path / "in.pt")
    build = tmp_path / "build"
    build.mkdir()
    csrc = Path(cpu_ext.__file__).parent / "csrc"
    done = subprocess.run(
        [sys.executable, "-P", "-c", CHILD, str(csrc), str(build), flags, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    attention, normed, activated = torch.load(tmp_path / "out.pt")
    want = reference_attention(qkv, bounds, 0.2)
    torch.testing.assert_close(attention, want, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(normed, F.layer_norm(y + x, (96,), w, b, 1e-12), rtol=0, atol=1e-5)
    torch.testing.assert_close(activated, F.gelu(x), rtol=0, atol=1e-6)
