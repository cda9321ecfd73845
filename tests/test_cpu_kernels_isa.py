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
            tiles = ops.tile_i6(q) if kind == "i6" else ops.tile_i8(q)
            out.append(ops.i8_tiled_linear(x, tiles, scales, mins, group, n))
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
        # The same in 6 bits (i6 tiles: Q5_0 to Q6_K)
        weights.append(PackedWeight("i8", q // 4, scales, mins, group, (n, k)))
    x = torch.randn(7, k, generator=g) * 2  # AVX2: u4 passes of 6 + 1 rows, i8 of 4 + 3
    out = []
    for w in weights + k_factor_weights(n, g):
        tiled = w.tiled()
        mins = tiled.mins if tiled.mins is not None else torch.empty(0)
        rows = x if w.shape[1] == k else torch.randn(7, w.shape[1], generator=g) * 2
        out.append((tiled.kind, w.qweight, tiled.scales, mins, w.group, n, rows))
    return out


def k_factor_weights(n: int, g: torch.Generator) -> list[PackedWeight]:
    """Weights whose scales (and mins) are a K-quant's two levels, K = 512: u4 with mins
    (Q4_K), i8 in groups of 16 (signed multipliers) and of 32 with mins, and i6 in groups of
    16 (Q6_K)."""
    from pagedllm_integrations.quant.packed import KFactors

    k = 512

    def factors(group: int, signed: bool) -> KFactors:
        low = -128 if signed else 0
        multipliers = torch.randint(low, 64, (n, k // group), dtype=torch.int8, generator=g)
        return KFactors(multipliers, (torch.rand(n, k // 256, generator=g) * 1e-3).half().float())

    def values(parts: KFactors, group: int) -> torch.Tensor:
        return parts.factors.repeat_interleave(256 // group, dim=1) * parts.multipliers.float()

    weights = []
    for kind, group, with_mins in (
        ("u4", 32, True),
        ("i8", 16, False),
        ("i8", 32, True),
        ("i6", 16, False),
    ):
        if kind == "u4":
            q = quantize_u4(torch.randn(n, k, generator=g)).qweight
        else:  # i6: Q6_K's q in -32..31
            low = -32 if kind == "i6" else -128
            q = torch.randint(low, -low, (n, k), dtype=torch.int8, generator=g)
        scale_parts = factors(group, signed=kind != "u4" and group == 16)
        min_parts = factors(group, signed=False) if with_mins else None
        mins = None if min_parts is None else -values(min_parts, group)
        if min_parts is not None:  # mins are -dmin * m: the factor carries the sign
            min_parts = KFactors(min_parts.multipliers, -min_parts.factors)
        weight = PackedWeight(
            "u4" if kind == "u4" else "i8",
            q,
            values(scale_parts, group),
            mins,
            group,
            (n, k),
            scale_parts,
            min_parts,
        )
        assert weight.tile_kind == kind
        assert weight.tiled().scales.dtype == torch.uint8  # the kernels' KScale form
        weights.append(weight)
    return weights


# -mno-avx2 switches AVX-512 off too (it builds on AVX2).
@pytest.mark.parametrize("flags", ["-mno-avx512vnni", "-mno-avx512f", "-mno-avx2"])
def test_packed_linears_give_the_same_bits_on_every_instruction_set(flags, tmp_path):
    inputs = cases()
    torch.save(inputs, tmp_path / "in.pt")
    build = tmp_path / "build"
    build.mkdir()
    done = subprocess.run(
        [sys.executable, "-P", "-c", CHILD, str(CSRC), str(build), flags, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = torch.load(tmp_path / "out.pt")
    for (kind, q, scales, mins, group, n, x), other in zip(inputs, theirs):
        tile = {"u4": "tile_u4", "i6": "tile_i6", "i8": "tile_i8"}[kind]
        tiles = getattr(torch.ops.pagedllm, tile)(q)
        if kind == "u4":
            ours = torch.ops.pagedllm.u4_tiled_linear(x, tiles, scales, mins, n)
        else:
            ours = torch.ops.pagedllm.i8_tiled_linear(x, tiles, scales, mins, group, n)
        assert torch.equal(ours, other), (flags, kind, group, mins.numel() > 0)


# The other vector kernels (attention, norms, activations, argmax, sampling, dense bf16 linears) have
# AVX-512 and AVX2 forms that run the same float32 operations per element in the same order
# (their plain C++ fallback uses std::exp, so it is not compared). On an AVX-512 CPU the whole
# library is built again without AVX-512, i.e. its AVX2 kernels, and every output must equal
# this process's bit for bit. An AVX2 CPU runs that build itself; there the attention's bits
# are checked against its recipe written out in numpy (tests/test_cpu_kernels.py). A CPU
# with AVX512-BF16 (vdpbf16ps in the dense bf16 linears and in attention over a bf16 cache)
# is also compared with its build without it (the FMA emulation of AVX-512 CPUs such as
# Skylake-SP and Cascade Lake).
CHILD_ALL = textwrap.dedent(
    """
    import sys, torch
    from torch.utils import cpp_extension
    csrc, build, flags, io = sys.argv[1], sys.argv[2], sys.argv[3].split(), sys.argv[4]
    sources = sys.argv[5].split(",")
    cpp_extension.load(
        name="pagedllm_isa_check_all",
        sources=[csrc + "/" + name for name in sources],
        extra_cflags=["-O2", "-march=native", *flags, "-ffp-contract=off", "-fopenmp",
                      "-std=c++17"],
        extra_ldflags=["-fopenmp"], extra_include_paths=[csrc], build_directory=build,
        is_python_module=False,
    )
    ops = torch.ops.pagedllm
    out = []
    for name, args, written in torch.load(io + "/in.pt"):
        result = getattr(ops, name)(*args)
        out.append(args[written] if written is not None else result)
    torch.save(out, io + "/out.pt")
    """
)


def vector_kernel_cases() -> list[tuple[str, list, int | None]]:
    """(op name, arguments, index of the argument it writes or None for its result)."""
    g = torch.Generator().manual_seed(5)
    hidden, inter = 96, 160
    x = torch.randn(5, hidden, generator=g) * 3
    cases: list[tuple[str, list, int | None]] = [
        ("rms_norm", [x, torch.rand(hidden, generator=g) + 0.5, 1e-5], None),
        ("add_rms_norm", [x, torch.randn(5, hidden, generator=g), torch.rand(hidden), 1e-6], None),
        ("argmax_rows", [torch.randn(4, 1003, generator=g)], None),
        # an MoE router: 7 experts (a partial pass of 4), 100 values (a tail past 6 x 16)
        (
            "router_logits",
            [torch.randn(5, 100, generator=g), torch.randn(7, 100, generator=g)],
            None,
        ),
    ]
    logits = torch.randn(6, 1003, generator=g) * 4
    logits[1, 100:] = float("-inf")
    uniforms = torch.tensor([0.0, 0.3, 0.5, 0.7, 0.9, 0.99999994])
    cases.append(
        ("sample_rows", [logits, torch.tensor([0.5, 1.0, 1.0, 0.8, 2.0, 1.0]), uniforms], None)
    )
    gate_up = torch.randn(5, 2 * inter, generator=g) * 4
    gate_up[0, :8] = torch.tensor([-100.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 88.0, 100.0])
    cases += [("gated_act", [gate_up, False], None), ("gated_act", [gate_up, True], None)]
    weight = (torch.randn(37, hidden, generator=g) * 0.1).to(torch.bfloat16)
    for rows in (1, 2, 5):  # the direct kernel (few rows) and the tiled one
        cases.append(("bf16_linear", [torch.randn(rows, hidden, generator=g), weight], None))
    # Attention over a bf16 cache [blocks, Hkv, D, bs] / [blocks, Hkv, bs, D]: decode rows
    # and short rows read in place, a 20-row prompt chunk through scratch.
    heads, kv_heads, d, bs = 6, 2, 32, 16
    lens, query_lens = [1, 9, 40, 70, 130], [1, 1, 3, 1, 20]
    tables, next_block = [], 0
    for length in lens:
        count = -(-length // bs)
        tables.append(list(range(next_block, next_block + count)) + [0] * (9 - count))
        next_block += count
    order = torch.randperm(next_block, generator=g)  # scattered blocks
    tables = [[int(order[b]) for b in row] for row in tables]
    k_cache = torch.randn(next_block, kv_heads, d, bs, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(next_block, kv_heads, bs, d, generator=g).to(torch.bfloat16)
    cu = [0]
    for n in query_lens:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], heads, d, generator=g)
    for window, soft_cap in ((0, 0.0), (0, 5.0), (33, 0.0)):
        args = [q, k_cache, v_cache, torch.zeros_like(q), torch.arange(len(lens)),
                torch.tensor(cu, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
                torch.tensor(tables, dtype=torch.int32), d**-0.5, window, soft_cap]  # fmt: skip
        cases.append(("paged_attention_rows_", args, 3))
    return cases


@pytest.mark.parametrize("flags", ["-mno-avx512f", "-mno-avx512bf16"])
def test_vector_kernels_give_the_same_bits_without_avx512(flags, tmp_path):
    cpu = cpu_ext._cpu_flags().split()
    if "avx512f" not in cpu:
        pytest.skip("this CPU builds the AVX2 kernels itself: there is no other build to compare")
    if flags == "-mno-avx512bf16" and "avx512_bf16" not in cpu:
        pytest.skip("this CPU builds the AVX-512 kernels without BF16 itself")
    inputs = vector_kernel_cases()
    torch.save(inputs, tmp_path / "in.pt")
    build = tmp_path / "build"
    build.mkdir()
    done = subprocess.run(
        [sys.executable, "-P", "-c", CHILD_ALL, str(CSRC), str(build), flags, str(tmp_path),
         ",".join(cpu_ext._SOURCES)],
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = torch.load(tmp_path / "out.pt")
    ops = torch.ops.pagedllm
    for (name, args, written), other in zip(inputs, theirs):
        args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        result = getattr(ops, name)(*args)
        ours = args[written] if written is not None else result
        assert torch.equal(ours, other), (flags, name)
