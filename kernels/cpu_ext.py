"""Build (once) and load the C++ CPU kernels of kernels/csrc/ (linear_packed.cpp,
linear_bf16.cpp, attention.cpp, ops.cpp, decoder.cpp; common.h, kernels.h).

The source ships inside the package and is compiled on first use with the machine's C++
compiler (`-O3 -march=native`), through torch.utils.cpp_extension and ninja, into the
pagedllm cache (`$PAGEDLLM_CACHE_DIR/ext/...`, keyed by the source, torch's version and
the CPU's instruction sets). `make install` builds it, so tests and the demo find it ready;
a later process loads the cached library in milliseconds.

When it cannot be built (no compiler, no ninja, an unusual platform), `load()` returns
False, says why once in the log, and the engine keeps the torch reference path: slower,
same results.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = ("ops.cpp", "linear_bf16.cpp", "linear_packed.cpp", "attention.cpp", "decoder.cpp")
_lock = threading.Lock()
_state: dict[str, object] = {}  # "loaded": bool, "error": str


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def build_dir() -> Path:
    """Where the compiled library of this source, torch and CPU lives."""
    from ..engine.model_loader import cache_dir

    digest = hashlib.sha256(torch.__version__.encode() + _cpu_flags().encode())
    for path in sorted(_CSRC.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    key = digest.hexdigest()[:16]
    return cache_dir() / "ext" / f"cpu_ops-{key}"


def load() -> bool:
    """Build or load the kernels; True when `torch.ops.pagedllm` holds them."""
    with _lock:
        if "loaded" in _state:
            return bool(_state["loaded"])
        if os.environ.get("PAGEDLLM_DISABLE_CPU_KERNELS", "") not in ("", "0"):
            _state.update(loaded=False, error="PAGEDLLM_DISABLE_CPU_KERNELS is set")
            return False
        try:
            _build_and_load()
            _state["loaded"] = True
        except Exception as error:  # any failure: the torch path serves instead
            _state.update(loaded=False, error=f"{type(error).__name__}: {error}")
            logger.warning(
                "the C++ CPU kernels could not be built (%s); using the slower torch path",
                _state["error"],
            )
        return bool(_state["loaded"])


def load_error() -> str | None:
    """Why the kernels are not loaded (None when they are, or were never asked for)."""
    return _state.get("error")  # type: ignore[return-value]


def _build_and_load() -> None:
    from torch.utils import cpp_extension

    folder = build_dir()
    folder.mkdir(parents=True, exist_ok=True)
    library = folder / "pagedllm_cpu_ops.so"
    if library.exists():
        torch.ops.load_library(str(library))
        return
    logger.info("building the C++ CPU kernels once into %s (about a minute)", folder)
    flags = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-std=c++17"]
    cpp_extension.load(
        name="pagedllm_cpu_ops",
        sources=[str(_CSRC / name) for name in _SOURCES],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
        is_python_module=False,
        verbose=False,
    )
