"""The packed linears on CPUs with less than this one: the same bits everywhere.

`kernels/csrc/linear_packed.cpp` has four code paths: AVX-512 with VNNI (vpdpbusd), AVX-512
without VNNI (vpmaddubsw sums, e.g. Skylake-SP), AVX2 (8-lane vpmaddubsw sums, most laptops)
and plain C++. The file is compiled again with instruction sets switched off, each build in
a process of its own (the ops register under the same names), and every product must equal
this process's bit for bit: the integer sums are exact on every path, and the float32 steps
after them are the same operations in the same order. On an AVX2 machine the first two
builds are its own AVX2 path again; the last is plain C++ everywhere.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pagedllm_integrations.kernels import cpu_ext
from pagedllm_integrations.quant.packed import PackedWeight, quantize_u4

pytestmark = pytest.mark.skipif(
    not cpu_ext.load(), reason=f"C++ CPU kernels unavailable: {cpu_ext.load_error()}"
)

CSRC = Path(cpu_ext.__file__).parent / "csrc"

CHILD = textwrap.dedent(
    """
    import sys, torch
    from torch.utils import cpp_extension
    csrc, build, flags, io = sys.argv[1], sys.argv[2], sys.argv[3].split(), sys.argv[4]
    cpp_extension.load(
        name="pagedllm_isa_check",
        sources=[csrc + "/linear_packed.cpp", csrc + "/thread_pool.cpp", csrc + "/amx.cpp"],
        extra_cflags=["-O2", "-march=native", *flags, "-ffp-contract=off", "-fopenmp",
                      "-std=c++17"],
        extra_ldflags=["-fopenmp"], extra_include_paths=[csrc], build_directory=build,
        is_python_module=False,
    )
    ops = torch.ops.pagedllm
    ops.set_amx_enabled(False)  # the instruction set under test computes every sum
    cases = torch.load(io + "/in.pt")
    out = []
    for kind, q, scales, mins, group, n, x in cases:
        if kind == "u4":
            out.append(ops.u4_tiled_linear(x, ops.tile_u4(q), scales, mins, n))
        else:
            out.append(ops.i8_tiled_linear(x, ops.tile_i8(q), scales, mins, group, n))
    torch.save(out, io + "/out.pt")
    """
)


def cases() -> list[tuple]:
    """(kind, row-major qweight, tiled scales, tiled mins, group, N, x) of every format."""
    g = torch.Generator().manual_seed(11)
    n, k = 37, 96  # a partial last tile
    u4 = quantize_u4(torch.randn(n, k, generator=g))
    half = PackedWeight(
        "u4", u4.qweight, u4.scales.half().float(), u4.mins.half().float(), 32, (n, k)
    ).compact()
    weights = [u4, half]
    for group, with_mins in ((32, False), (16, True), (32, True), (16, False)):
        q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
        scales = torch.rand(n, k // group, generator=g) * 0.01
        mins = torch.randn(n, k // group, generator=g) * 0.01 if with_mins else None
        weights.append(PackedWeight("i8", q, scales, mins, group, (n, k)))
    x = torch.randn(6, k, generator=g) * 2
    out = []
    for w in weights:
        tiled = w.tiled()
        mins = tiled.mins if tiled.mins is not None else torch.empty(0)
        out.append((w.kind, w.qweight, tiled.scales, mins, w.group, n, x))
    return out


# -mno-avx2 switches AVX-512 off too (it builds on AVX2).
@pytest.mark.parametrize("flags", ["-mno-avx512vnni", "-mno-avx512f", "-mno-avx2"])
def test_packed_linears_give_the_same_bits_on_every_instruction_set(flags, tmp_path):
    inputs = cases()
    torch.save(inputs, tmp_path / "in.pt")
    build = tmp_path / "build"
    build.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(CSRC), str(build), flags, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = torch.load(tmp_path / "out.pt")
    for (kind, q, scales, mins, group, n, x), other in zip(inputs, theirs):
        tiles = torch.ops.pagedllm.tile_u4(q) if kind == "u4" else torch.ops.pagedllm.tile_i8(q)
        if kind == "u4":
            ours = torch.ops.pagedllm.u4_tiled_linear(x, tiles, scales, mins, n)
        else:
            ours = torch.ops.pagedllm.i8_tiled_linear(x, tiles, scales, mins, group, n)
        assert torch.equal(ours, other), (flags, kind, group, mins.numel() > 0)
