"""The grammar compiler's processes, seen from outside (Linux /proc): for tests that show a
compile nobody waits for is killed, not left running."""

from __future__ import annotations

import os
import time

# Compiles for minutes (each repetition count is within the request limits); tests stop it.
SLOW_REGEX = "([a-z0-9 ]{0,1000}y){1,1000}"


def compile_children(service) -> set[int]:
    """Pids of the compiles running now: the children of the compiler process."""
    parent = service.pid
    if parent is None:
        return set()
    children = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        if int(fields[1]) == parent and fields[0] != "Z":
            children.add(int(entry))
    return children


def wait_for(condition, seconds: float = 60.0) -> bool:
    """Poll `condition` until it holds or `seconds` pass (a generous bound, not a timing)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
