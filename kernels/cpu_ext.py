"""Build (once) and load the C++ CPU kernels of kernels/csrc/ (linear_packed.cpp,
linear.cpp, linear_bf16.cpp, attention.cpp, ops.cpp, decoder.cpp, thread_pool.cpp,
amx.cpp; common.h, kernels.h, linear.h, decoder.h, thread_pool.h, amx.h).

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

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = (
    "ops.cpp",
    "linear_bf16.cpp",
    "linear_packed.cpp",
    "linear.cpp",
    "attention.cpp",
    "decoder.cpp",
    "thread_pool.cpp",
    "amx.cpp",
)
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


def is_loaded() -> bool:
    """True when an earlier load() put the kernels in this process (never builds)."""
    return bool(_state.get("loaded", False))


def load_error() -> str | None:
    """Why the kernels are not loaded (None when they are, or were never asked for)."""
    return _state.get("error")  # type: ignore[return-value]


def _build_and_load() -> None:
    folder = build_dir()
    library = folder / "pagedllm_cpu_ops.so"
    if not library.exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        # One builder at a time per machine. flock is released by the kernel when its holder
        # dies, so a build interrupted by Ctrl-C or a killed test never blocks the next one
        # (torch's own build lock is a plain file that a dead builder leaves behind forever;
        # here it lives in a private folder that is thrown away).
        with open(folder.parent / f"{folder.name}.lock", "w") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            if not library.exists():  # another process may have built it while we waited
                _build_into(folder)  # which also loads it into this process
                return
    torch.ops.load_library(str(library))


def _build_into(folder: Path) -> None:
    """Compile into a fresh temporary folder, then rename it to `folder` in one step: a
    folder named by the key always holds a complete library."""
    from torch.utils import cpp_extension

    logger.info("building the C++ CPU kernels once into %s (about a minute)", folder)
    scratch = Path(tempfile.mkdtemp(prefix=f"{folder.name}.", dir=folder.parent))
    try:
        flags = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-std=c++17"]
        cpp_extension.load(
            name="pagedllm_cpu_ops",
            sources=[str(_CSRC / name) for name in _SOURCES],
            extra_cflags=flags,
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
