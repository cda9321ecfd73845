"""Building the C++ kernels survives an interrupted build.

A first build is a minute of compiling; users press Ctrl-C, CI kills a timed-out test. The
next process must build again, not wait forever on what the dead one left: torch's
cpp_extension keeps its build lock as a plain file that stays behind when its builder dies.
pagedllm builds in a private scratch folder under an OS file lock (released with its
holder) and renames the result into place.

To keep this fast, the child builds only thread_pool.cpp: the locking and the folder
handling are what is under test, not the kernels (test_cpu_kernels*.py cover those).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("ninja")

CHILD = textwrap.dedent(
    """
    import sys
    from pagedllm_integrations.kernels import cpu_ext
    cpu_ext._SOURCES = ("thread_pool.cpp",)
    if sys.argv[1] == "where":
        print(cpu_ext.build_dir())
    elif sys.argv[1] == "hold-lock-and-hang":
        import fcntl, time
        folder = cpu_ext.build_dir()
        folder.parent.mkdir(parents=True, exist_ok=True)
        handle = open(folder.parent / (folder.name + ".lock"), "w")
        fcntl.flock(handle, fcntl.LOCK_EX)
        print("locked", flush=True)
        time.sleep(600)
    else:
        print(cpu_ext.load(), cpu_ext.load_error())
    """
)


def run_child(mode: str, env: dict[str, str], timeout: float = 300) -> str:
    result = subprocess.run(
        [sys.executable, "-P", "-c", CHILD, mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_a_build_killed_midway_does_not_block_the_next(tmp_path: Path) -> None:
    env = {**os.environ, "PAGEDLLM_CACHE_DIR": str(tmp_path)}
    env.pop("PAGEDLLM_DISABLE_CPU_KERNELS", None)
    folder = Path(run_child("where", env))

    # What an interrupted torch build leaves: its lock file and half the objects.
    folder.mkdir(parents=True)
    (folder / "lock").touch()
    (folder / "thread_pool.o").write_bytes(b"truncated")

    # And a builder killed while it held pagedllm's own lock.
    holder = subprocess.Popen(
        [sys.executable, "-P", "-c", CHILD, "hold-lock-and-hang"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()

    assert run_child("load", env) == "True None"
    assert (folder / "pagedllm_cpu_ops.so").is_file()
    assert not (folder / "lock").exists()
    # No scratch folder is left next to the finished one.
    assert sorted(p.name for p in folder.parent.iterdir() if p.is_dir()) == [folder.name]
    # A later process loads what is there without building.
    assert run_child("load", env, timeout=60) == "True None"
