"""Handing freed heap memory back to the operating system."""

from __future__ import annotations

import contextlib
import ctypes
import gc


def release_freed_memory() -> None:
    """Collect what was just dropped and hand freed heap pages back to the OS.

    glibc keeps freed small and medium allocations in its arenas, resident; malloc_trim
    returns the free pages, so a peak that has passed (a load's temporaries, an engine
    that is gone) stops counting in the process's resident size and in later peaks.
    """
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
