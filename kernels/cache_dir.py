"""pagedllm's cache folder, defined once at the bottom layer: the kernels keep their
compiled libraries there, and the loaders above (GGUF folders, prefix caches) use it too."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """pagedllm's cache: `$PAGEDLLM_CACHE_DIR`, else `$XDG_CACHE_HOME/pagedllm`, else
    `~/.cache/pagedllm` (compiled kernels, converted GGUF folders, prefix caches)."""
    if os.environ.get("PAGEDLLM_CACHE_DIR"):
        return Path(os.environ["PAGEDLLM_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagedllm"
