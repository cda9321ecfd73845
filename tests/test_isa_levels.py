"""The prebuilt kernels of the wheel (issue 44): which level a CPU loads, when the engine
compiles instead, and that every level gives this process's bits.

The levels are compiled into the cache by `make install` (isa_levels.compile_levels), so
these tests load them without compiling.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pagedllm_integrations.kernels import cpu_ext, isa_levels

V3 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave", "cx16", "lahf_lm",
      "popcnt", "pni", "ssse3", "sse4_1", "sse4_2"}  # fmt: skip
V4 = V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
CPUS = {  # flags -> (level, fits fully)
    "Haswell": (V3, "avx2", True),
    "Zen 3": (V3 | {"sha_ni", "vaes"}, "avx2", True),
    "Skylake-SP (no VNNI)": (V4, "avx2", False),
    "Ice Lake (VNNI, no BF16)": (V4 | {"avx512_vnni"}, "avx2", False),
    "Zen 4": (V4 | {"avx512_vnni", "avx512_bf16", "avx512_vbmi"}, "avx512", True),
    "Sapphire Rapids": (
        V4 | {"avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"},
        "amx",
        True,
    ),
    "Sandy Bridge (no AVX2)": ({"avx", "sse4_2", "popcnt"}, None, False),
}


@pytest.mark.parametrize("cpu", list(CPUS))
def test_each_cpu_gets_the_highest_level_it_runs(cpu):
    flags, name, full = CPUS[cpu]
    level, fits = isa_levels.best_level(set(flags))
    assert (level.name if level else None, fits) == (name, full)


def test_a_prebuilt_level_is_refused_for_another_torch_or_other_sources():
    flags = CPUS["Zen 4"][0]
    manifest = {**isa_levels.torch_abi(), "sources": isa_levels.sources_digest(),
                "levels": {level.name: {} for level in isa_levels.LEVELS}}  # fmt: skip
    level, full, why = cpu_ext.prebuilt_choice(manifest, flags)
    assert (level.name, full, why) == ("avx512", True, "")
    other_torch = {**manifest, "torch": "2.4.0"}
    assert cpu_ext.prebuilt_choice(other_torch, flags)[0] is None
    assert "torch" in cpu_ext.prebuilt_choice(other_torch, flags)[2]
    assert cpu_ext.prebuilt_choice({**manifest, "sources": "0" * 16}, flags)[0] is None
    assert cpu_ext.prebuilt_choice(None, flags)[2] == "no prebuilt kernels (a source install)"
    assert cpu_ext.prebuilt_choice(manifest, CPUS["Sandy Bridge (no AVX2)"][0])[0] is None


# A process with the level's library only, checked against this process's native build.
CHILD = textwrap.dedent(
    """
    import sys, torch
    torch.ops.load_library(sys.argv[1])
    ops = torch.ops.pagedllm
    ops.set_amx_enabled(False)  # AMX is compared where a CPU has it (the amx level's own sums)
    out = []
    for name, args, written in torch.load(sys.argv[2] + "/in.pt"):
        result = getattr(ops, name)(*args)
        out.append(args[written] if written is not None else result)
    torch.save(out, sys.argv[2] + "/out.pt")
    """
)


def kernel_cases() -> list[tuple[str, list, int | None]]:
    """The vector kernels' cases of test_cpu_kernels_isa, and its packed linears as ops."""
    from test_cpu_kernels_isa import cases, vector_kernel_cases

    ops = torch.ops.pagedllm
    linears = []
    for kind, q, scales, mins, group, n, x in cases():
        if kind == "u4":
            linears.append(("u4_tiled_linear", [x, ops.tile_u4(q), scales, mins, n], None))
        else:
            tiles = ops.tile_i6(q) if kind == "i6" else ops.tile_i8(q)
            linears.append(("i8_tiled_linear", [x, tiles, scales, mins, group, n], None))
    return vector_kernel_cases() + linears


@pytest.mark.skipif(not cpu_ext.load(), reason="the C++ kernels are unavailable")
@pytest.mark.parametrize("level", isa_levels.LEVELS, ids=lambda level: level.name)
def test_every_level_gives_this_processs_bits(level, tmp_path):
    # The amx level also runs without AMX: its tile code is used only where the CPU and
    # Linux grant the tiles (amx.cpp asks cpuid), so its other paths are checked here too.
    needs = level.cpu_flags - {"amx_tile", "amx_int8", "amx_bf16"}
    if not needs <= isa_levels.cpu_flags():
        pytest.skip(f"this CPU cannot run the {level.name} level")
    (folder,) = [f for lv, f in zip(isa_levels.LEVELS, isa_levels.compile_levels()) if lv == level]
    inputs = kernel_cases()
    torch.save(inputs, tmp_path / "in.pt")
    done = subprocess.run(
        [sys.executable, "-P", "-c", CHILD, str(folder / isa_levels.LIBRARY), str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    for (name, args, written), theirs in zip(inputs, torch.load(tmp_path / "out.pt")):
        args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        result = getattr(torch.ops.pagedllm, name)(*args)
        ours = args[written] if written is not None else result
        assert torch.equal(ours, theirs), (level.name, name)


# Loads the kernels as an installed wheel would, from a prebuilt/ folder given in argv[1].
LOADER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from pagedllm_integrations.kernels import cpu_ext, isa_levels
    isa_levels.PREBUILT = Path(sys.argv[1])
    if sys.argv[2:] == ["small-compile"]:
        cpu_ext._SOURCES = ("thread_pool.cpp",)  # a compile small enough for a test
    elif sys.argv[2:] == ["skylake-sp"]:  # AVX-512 without VNNI: no level fits fully
        isa_levels.cpu_flags = lambda: {f for f in isa_levels.LEVELS[1].cpu_flags
                                        if f not in ("avx512_vnni", "avx512_bf16")}
    print(cpu_ext.load(), cpu_ext.loaded_from())
    """
)


def run_loader(prebuilt: Path, cache: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PAGEDLLM_CACHE_DIR": str(cache)}
    env.pop("PAGEDLLM_DISABLE_CPU_KERNELS", None)
    return subprocess.run(
        [sys.executable, "-P", "-c", LOADER, str(prebuilt), *extra],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory) -> Path:
    """A wheel's prebuilt/ folder: the cached level builds and their manifest."""
    folder = tmp_path_factory.mktemp("prebuilt")
    isa_levels.build_levels(folder)
    return folder


def test_a_wheel_install_loads_its_level_without_compiling(prebuilt, tmp_path):
    level, full = isa_levels.best_level(isa_levels.cpu_flags())
    if level is None or not full:
        pytest.skip("no prebuilt level fits this CPU fully: it compiles (tested below)")
    done = run_loader(prebuilt, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "prebuilt", level.name]
    assert not (tmp_path / "ext").exists()  # nothing compiled, nothing cached
    assert done.stderr == ""  # and nothing to say


def test_another_torch_compiles_for_this_cpu_and_says_so(prebuilt, tmp_path):
    import json

    other = tmp_path / "prebuilt"
    other.mkdir()
    manifest = json.loads((prebuilt / isa_levels.MANIFEST).read_text())
    (other / isa_levels.MANIFEST).write_text(json.dumps({**manifest, "torch": "2.4.0"}))
    done = run_loader(other, tmp_path / "cache", "small-compile")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[:2] == ["True", "compiled"]
    # No logging set up: the progress line reaches stderr all the same, with the reason.
    line = done.stderr.splitlines()[0]
    assert "compiling pagedllm's C++ CPU kernels for this CPU once" in line
    assert "built for torch" in line and "about 30 s to 2 min" in line


def test_without_a_compiler_a_partly_fitting_level_serves(prebuilt, tmp_path, monkeypatch):
    """An AVX-512 CPU without VNNI (Skylake-SP) compiles for itself; where that fails (no C++
    compiler), the AVX2 level serves instead of the torch path, and says so."""
    skylake = isa_levels.LEVELS[1].cpu_flags - {"avx512_vnni", "avx512_bf16"}
    if not skylake <= isa_levels.cpu_flags():
        pytest.skip("this CPU cannot stand in for an AVX-512 CPU")
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    done = run_loader(prebuilt, tmp_path / "cache", "skylake-sp")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "prebuilt", "avx2"]
    assert "leave out instruction sets this CPU has" in done.stderr  # why it tried to compile
    assert "compiling the C++ CPU kernels failed" in done.stderr
