"""The x86 instruction-set levels the C++ kernels are prebuilt for, and how one is compiled.

A wheel carries the kernels (kernels/csrc) compiled once per level, so that a machine
without a C++ compiler gets the fast path and the first request does not wait for a build.
At run time `cpu_ext.load()` picks the level that fits the CPU (see `best_level`); a source
install, and a CPU or torch that no prebuilt level fits, compile with `-march=native`.

Every level compiles the same source with the same `-ffp-contract=off`; what changes is
which code paths the preprocessor keeps (common.h: AVX-512 or AVX2; AVX512-BF16, VNNI,
AMX). tests/test_cpu_kernels_isa.py shows that those paths give the same bits, so the
level a process loads changes its speed, never its results.

The library is not a Python extension module (it registers `torch.ops.pagedllm` and is
loaded with `torch.ops.load_library`), so one build serves every Python version; it is
bound to the torch release it was compiled against, which the wheel's manifest records.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .cache_dir import cache_dir

CSRC = Path(__file__).parent / "csrc"
SOURCES = (
    "ops.cpp",
    "linear_bf16.cpp",
    "linear_amx_bf16.cpp",
    "linear_packed.cpp",
    "linear.cpp",
    "attention.cpp",
    "encoder.cpp",
    "encoder_layer.cpp",
    "decoder.cpp",
    "thread_pool.cpp",
    "amx.cpp",
)
LIBRARY = "pagedllm_cpu_ops.so"
# The wheel's copy: prebuilt/<level>/pagedllm_cpu_ops.so and the manifest beside them.
PREBUILT = Path(__file__).parent / "prebuilt"
MANIFEST = "manifest.json"
# Flags every build shares; the level (or -march=native) adds the instruction sets.
COMMON_FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-std=c++17")

_X86_64_V3 = frozenset(
    # x86-64-v2, as /proc/cpuinfo spells it (pni is SSE3) ...
    {"cx16", "lahf_lm", "popcnt", "pni", "ssse3", "sse4_1", "sse4_2"}
    # ... and v3 (abm is LZCNT)
    | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
)
_X86_64_V4 = _X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@dataclass(frozen=True, slots=True)
class IsaLevel:
    name: str
    cflags: tuple[str, ...]  # the instruction sets the compiler may use (instead of -march)
    cpu_flags: frozenset[str]  # what the CPU must report in /proc/cpuinfo to run it


LEVELS = (
    IsaLevel("avx2", ("-march=x86-64-v3",), _X86_64_V3),
    IsaLevel(
        "avx512",
        ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"),
        _X86_64_V4 | {"avx512_vnni", "avx512_bf16"},
    ),
    IsaLevel(
        "amx",
        ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-int8",
         "-mamx-bf16"),
        _X86_64_V4 | {"avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"},
    ),
)  # fmt: skip

# What changes the code the kernels compile to (common.h, linear_packed.cpp, amx.h): a CPU
# with one of these that a level leaves out runs slower code on that level than a native
# build would give it.
_KERNEL_FEATURES = (
    frozenset({"avx512f", "avx512bw"}),
    frozenset({"avx512_vnni"}),
    frozenset({"avx512_bf16"}),
    frozenset({"amx_tile", "amx_int8"}),
    frozenset({"amx_bf16"}),
)


def cpu_flags_line() -> str:
    """The CPU's instruction-set flags as /proc/cpuinfo lists them (else the processor)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def cpu_flags() -> set[str]:
    return set(cpu_flags_line().split())


def runs_on(level: IsaLevel, flags: set[str]) -> bool:
    return level.cpu_flags <= flags


def fits_fully(level: IsaLevel, flags: set[str]) -> bool:
    """The level runs here and uses every instruction set the kernels know that the CPU
    has: a native build would compile the same code paths."""
    return runs_on(level, flags) and all(
        feature <= level.cpu_flags for feature in _KERNEL_FEATURES if feature <= flags
    )


def best_level(flags: set[str]) -> tuple[IsaLevel | None, bool]:
    """(the highest level this CPU runs, whether it fits fully); (None, False) when none."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None, False
    runnable = [level for level in LEVELS if runs_on(level, flags)]
    if not runnable:
        return None, False
    return runnable[-1], fits_fully(runnable[-1], flags)


def torch_abi() -> dict[str, object]:
    """What a compiled library is bound to: torch's release (a CPU and a CUDA build of one
    release export the same ATen symbols, so the local `+cpu` part is not compared) and
    the C++ ABI it was built with."""
    import torch

    return {
        "torch": torch.__version__.split("+")[0],
        "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
    }


def sources_digest(sources_dir: Path = CSRC) -> str:
    digest = hashlib.sha256()
    for path in sorted(sources_dir.iterdir()):
        if path.suffix in (".cpp", ".h"):
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def ensure_built(folder: Path, arch_flags: tuple[str, ...], sources: tuple[str, ...]) -> bool:
    """Compile the kernels into `folder/pagedllm_cpu_ops.so` unless they are there; True when
    this call compiled them (which also loads them into this process).

    One builder at a time per machine. flock is released by the kernel when its holder dies,
    so a build interrupted by Ctrl-C or a killed test never blocks the next one (torch's own
    build lock is a plain file that a dead builder leaves behind forever; here it lives in a
    private folder that is thrown away)."""
    if (folder / LIBRARY).exists():
        return False
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{folder.name}.lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        if (folder / LIBRARY).exists():  # another process built it while we waited
            return False
        _compile_into(folder, arch_flags, sources)
        return True


def _compile_into(folder: Path, arch_flags: tuple[str, ...], sources: tuple[str, ...]) -> None:
    """The build runs in a fresh temporary folder renamed to `folder` in one step, so a
    folder named by its key always holds a complete library."""
    from torch.utils import cpp_extension

    scratch = Path(tempfile.mkdtemp(prefix=f"{folder.name}.", dir=folder.parent))
    try:
        cpp_extension.load(
            name=LIBRARY.removesuffix(".so"),
            sources=[str(CSRC / name) for name in sources],
            extra_cflags=[*COMMON_FLAGS, *arch_flags],
            extra_ldflags=["-fopenmp"],
            build_directory=str(scratch),
            is_python_module=False,
            verbose=False,
        )
        if folder.exists():  # a partial folder, left by a build that was interrupted
            shutil.rmtree(folder)
        scratch.chmod(0o755)  # mkdtemp makes it private
        scratch.rename(folder)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def level_build_dir(level: IsaLevel) -> Path:
    """Where a level's library is kept between wheel builds (keyed by source, torch, flags)."""
    abi = torch_abi()
    key = hashlib.sha256(
        f"{sources_digest()}|{abi['torch']}|{abi['cxx11_abi']}|{' '.join(level.cflags)}".encode()
    ).hexdigest()[:16]
    return cache_dir() / "ext" / f"level-{level.name}-{key}"


def compile_levels() -> list[Path]:
    """Compile every level into the cache (each in a process of its own: the libraries
    register the same op names, and a process can load only one); `make install` does it,
    so that building a wheel copies them. Returns their folders."""
    folders = []
    for level in LEVELS:
        folder = level_build_dir(level)
        if not (folder / LIBRARY).exists():
            code = f"from {__package__}.isa_levels import _compile_level; _compile_level({level.name!r})"
            done = subprocess.run(
                [sys.executable, "-P", "-c", code], capture_output=True, text=True
            )
            if done.returncode != 0:
                raise RuntimeError(f"building the {level.name} kernels failed:\n{done.stderr}")
        folders.append(folder)
    return folders


def build_levels(out: Path | str) -> dict[str, object]:
    """The wheel's prebuilt/ folder: every level's library and the manifest."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    levels: dict[str, object] = {}
    for level, folder in zip(LEVELS, compile_levels()):
        (out / level.name).mkdir(exist_ok=True)
        shutil.copy2(folder / LIBRARY, out / level.name / LIBRARY)
        levels[level.name] = {
            "library": f"{level.name}/{LIBRARY}",
            "cflags": list(level.cflags),
            "cpu_flags": sorted(level.cpu_flags),
        }
    manifest = {**torch_abi(), "sources": sources_digest(), "levels": levels}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_manifest(folder: Path | None = None) -> dict | None:
    """The manifest of a prebuilt/ folder (the wheel's by default); None when absent."""
    try:
        return json.loads(((folder or PREBUILT) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def _compile_level(name: str) -> None:
    (level,) = [level for level in LEVELS if level.name == name]
    ensure_built(level_build_dir(level), level.cflags, SOURCES)
