"""Benchmark scripts that reach into the engine's internals still run against them.

`benchmarks/cpu_decode_step.py` times the decoder stack's kernels one by one through the
model's modules; when the stack's interface changed (named fields instead of positional
lists) it broke without any test noticing. One tiny run of it here keeps it honest.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_decode_step_times_every_part_of_a_step(tmp_path):
    report_path = tmp_path / "step.json"
    command = [
        sys.executable, str(ROOT / "benchmarks" / "cpu_decode_step.py"), "--rows", "1,3",
        "--keys", "40", "--repeat", "1", "--json", str(report_path),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if "fused CPU stack is off" in done.stdout + done.stderr:
        pytest.skip("no C++ decoder stack on this CPU")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(report_path.read_text())
    for rows in ("1", "3"):
        timings = report["rows"][rows]
        for part in ("qkv", "o", "gate_up + act", "down", "attention", "whole stack", "lm head"):
            assert timings[part] > 0, (rows, part)
        assert set(timings["weights GB/s"]) == {"qkv", "o", "gate_up + act", "down", "lm head"}
        assert all(rate > 0 for rate in timings["weights GB/s"].values())
    assert "weights read, GB/s" in done.stdout
