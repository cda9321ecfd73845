"""Load the C++ CPU kernels of kernels/csrc/ (linear_packed.cpp, linear.cpp,
linear_bf16.cpp, linear_amx_bf16.cpp, attention.cpp, encoder.cpp, encoder_layer.cpp, ops.cpp,
decoder.cpp, thread_pool.cpp, amx.cpp; common.h, kernels.h, linear.h, decoder.h,
thread_pool.h, amx.h): prebuilt from the wheel, else compiled once for this CPU.

Where they come from, in order:
1. The wheel's prebuilt library of the instruction-set level that fits this CPU fully
   (isa_levels.py: AVX2; AVX-512 with VNNI and BF16; AMX), when it was built against the
   installed torch release and these sources. Nothing is compiled; loading takes
   milliseconds.
2. A library compiled for this CPU (`-O3 -march=native`), through torch.utils.cpp_extension
   and ninja, into the pagedllm cache (`$PAGEDLLM_CACHE_DIR/ext/...`, keyed by the source,
   torch's version and the CPU's instruction sets): found there, or compiled now (a source
   install, another torch, a CPU between the levels such as AVX-512 without VNNI). `make
   install` compiles it, so tests and the demo find it ready. A compile says so in one
   line (a logging WARNING, which Python prints on stderr when no logging is set up).
3. When compiling is impossible (no compiler, no ninja), a prebuilt level that runs here
   without fitting fully (slower code paths, the same results).

When none of these works, `load()` returns False, says why once in the log, and the engine
keeps the torch reference path: slower, same results.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path

import torch

from . import isa_levels
from .cache_dir import cache_dir

logger = logging.getLogger(__name__)

_CSRC = isa_levels.CSRC
_SOURCES = isa_levels.SOURCES
_lock = threading.Lock()
_state: dict[str, object] = {}  # "loaded": bool, "error": str, "origin": str


def _cpu_flags() -> str:
    return isa_levels.cpu_flags_line()


def debug_kernels() -> bool:
    """PAGEDLLM_DEBUG_KERNELS=1: load a build that also checks every cache access in the
    kernels' inner loops (-DPAGEDLLM_DEBUG_BOUNDS; compiled for this CPU, never prebuilt).
    The ops' own checks of their indices are on in every build (common.h)."""
    return os.environ.get("PAGEDLLM_DEBUG_KERNELS", "") not in ("", "0")


def _native_flags() -> tuple[str, ...]:
    return ("-march=native", "-DPAGEDLLM_DEBUG_BOUNDS") if debug_kernels() else ("-march=native",)


def build_dir() -> Path:
    """Where the library compiled for this source, torch, CPU (and debug setting) lives."""
    digest = hashlib.sha256(torch.__version__.encode() + _cpu_flags().encode())
    digest.update(" ".join(_native_flags()).encode())
    for path in sorted(_CSRC.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    key = digest.hexdigest()[:16]
    return cache_dir() / "ext" / f"cpu_ops-{key}"


def load() -> bool:
    """Load (or build) the kernels; True when `torch.ops.pagedllm` holds them."""
    with _lock:
        if "loaded" in _state:
            return bool(_state["loaded"])
        if os.environ.get("PAGEDLLM_DISABLE_CPU_KERNELS", "") not in ("", "0"):
            _state.update(loaded=False, error="PAGEDLLM_DISABLE_CPU_KERNELS is set")
            return False
        try:
            _state["origin"] = _load_best()
            _state["loaded"] = True
        except Exception as error:  # any failure: the torch path serves instead
            _state.update(loaded=False, error=f"{type(error).__name__}: {error}")
            logger.warning(
                "the C++ CPU kernels could not be built (%s); using the slower torch path",
                _state["error"],
            )
        return bool(_state["loaded"])


def is_loaded() -> bool:
    """True when an earlier load() put the kernels in this process (never builds)."""
    return bool(_state.get("loaded", False))


def load_error() -> str | None:
    """Why the kernels are not loaded (None when they are, or were never asked for)."""
    return _state.get("error")  # type: ignore[return-value]


def loaded_from() -> str | None:
    """Which library load() put in this process: 'prebuilt <level>' or 'compiled <path>'."""
    return _state.get("origin")  # type: ignore[return-value]


def prebuilt_choice(
    manifest: dict | None, flags: set[str]
) -> tuple[isa_levels.IsaLevel | None, bool, str]:
    """(the wheel's level to load, whether it fits this CPU fully, why when there is none)."""
    if manifest is None:
        return None, False, "no prebuilt kernels (a source install)"
    if manifest.get("sources") != isa_levels.sources_digest(_CSRC):
        return None, False, "the prebuilt kernels were built from other sources"
    abi = isa_levels.torch_abi()
    built_for = {key: manifest.get(key) for key in abi}
    if built_for != abi:
        return None, False, f"the prebuilt kernels were built for torch {built_for}, not {abi}"
    level, full = isa_levels.best_level(flags)
    if level is None or level.name not in manifest.get("levels", {}):
        return None, False, "no prebuilt level runs on this CPU"
    return level, full, ""


def _load_best() -> str:
    flags = isa_levels.cpu_flags()
    if debug_kernels():
        return _load_native("PAGEDLLM_DEBUG_KERNELS is set")
    level, full, why_not = prebuilt_choice(isa_levels.read_manifest(), flags)
    if level is not None and full:
        try:
            return _load_prebuilt(level)
        except (OSError, RuntimeError) as error:  # e.g. an older libstdc++ than the build's
            why_not = f"the prebuilt {level.name} kernels did not load ({error})"
    elif level is not None:
        why_not = f"the prebuilt {level.name} kernels leave out instruction sets this CPU has"
    try:
        return _load_native(why_not)
    except Exception as error:
        if level is None:
            raise
        logger.warning(
            "compiling the C++ CPU kernels failed (%s); using the prebuilt %s kernels",
            error,
            level.name,
        )
        return _load_prebuilt(level)


def _load_prebuilt(level: isa_levels.IsaLevel) -> str:
    torch.ops.load_library(str(isa_levels.PREBUILT / level.name / isa_levels.LIBRARY))
    logger.info("loaded the prebuilt %s C++ CPU kernels", level.name)
    return f"prebuilt {level.name}"


def _load_native(why_not_prebuilt: str) -> str:
    folder = build_dir()
    if (folder / isa_levels.LIBRARY).exists():
        torch.ops.load_library(str(folder / isa_levels.LIBRARY))
        return f"compiled {folder}"
    started = time.perf_counter()
    # A WARNING: a first request that waits a minute must say why, also in an app that set
    # up no logging (Python then prints warnings on stderr).
    logger.warning(
        "compiling pagedllm's C++ CPU kernels for this CPU once (%s; about 30 s to 2 min; "
        "cached in %s)",
        why_not_prebuilt,
        folder,
    )
    if not isa_levels.ensure_built(folder, _native_flags(), _SOURCES):
        torch.ops.load_library(str(folder / isa_levels.LIBRARY))  # another process built it
    logger.warning("compiled the C++ CPU kernels in %.0f s", time.perf_counter() - started)
    return f"compiled {folder}"
