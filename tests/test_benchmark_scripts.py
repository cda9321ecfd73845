"""Benchmark scripts that reach into the engine's internals still run against them.

`benchmarks/cpu_decode_step.py` times the decoder stack's kernels one by one through the
model's modules; when the stack's interface changed (named fields instead of positional
lists) it broke without any test noticing. One tiny run of it here keeps it honest, and
so does one of `benchmarks/fair_admission.py` (a server, HTTP clients, the engine's pool).
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


def _model_sweep():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "model_sweep", ROOT / "benchmarks" / "model_sweep.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "benchmarks"))  # it imports model_shapes beside it
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


def test_model_sweep_merges_a_rerun_into_the_kept_report():
    merge = _model_sweep().merge_reports
    first = {
        "npl": [1, 16], "rounds": [{"a": 1}], "read_gb_per_s": 28.8,
        "llama.cpp": {"1": {"all_tokens_per_s": 5.0}, "16": {"all_tokens_per_s": 16.7},
                      "prefill": {"tokens_per_s": 18.8}, "peak_rss_mib": 8540},
        "pagedllm": {"1": {"all_tokens_per_s": 9.3}, "peak_rss_mib": 6112},
    }  # fmt: skip
    rerun = {
        "npl": [64], "rounds": [{"b": 2}], "read_gb_per_s": 29.9,
        "llama.cpp": {"64": {"all_tokens_per_s": 17.9}, "peak_rss_mib": 10103},
        "pagedllm": {"64": {"all_tokens_per_s": 55.3}, "peak_rss_mib": 7626},
    }  # fmt: skip
    merged = merge(first, rerun)
    assert merged["npl"] == [1, 16, 64] and merged["rounds"] == [{"a": 1}, {"b": 2}]
    assert set(merged["llama.cpp"]) == {"1", "16", "64", "prefill", "peak_rss_mib"}
    assert merged["llama.cpp"]["peak_rss_mib"] == 10103  # the larger run's peak
    assert merged["pagedllm"]["64"] == {"all_tokens_per_s": 55.3}
    assert merged["merged_runs"] == 2 and merge(merged, rerun)["merged_runs"] == 3
    # The bound's read rate stays that of the run that measured one stream.
    assert merged["read_gb_per_s"] == 28.8
    assert merge(rerun, first)["read_gb_per_s"] == 28.8
    # A failed rerun does not mix with what was kept.
    assert merge(first, {"error": "boom"}) == {"error": "boom"}


def test_fair_admission_runs_both_cases_end_to_end(tmp_path):
    """Issue 42's two cases with short prompts (the full run's 7k-token ones take minutes):
    the whole-queue request and twice the share are 400s, the share runs, another client's
    chat is served meanwhile, and closing the bulk stream frees every KV block."""
    report_path = tmp_path / "fair.json"
    command = [
        sys.executable, str(ROOT / "benchmarks" / "fair_admission.py"), "--words", "24",
        "--json", str(report_path),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(report_path.read_text())
    whole, burst = report["whole_queue_request"], report["long_burst"]
    assert (whole["status"], whole["code"]) == (400, "client_limit_exceeded")
    assert whole["other_client_chat"]["status"] == 200
    assert burst["twice_the_share_status"] == 400 and burst["bulk_status"] == 200
    assert burst["chat_while_bulk_runs"]["status"] == 200
    assert burst["chat_while_bulk_runs"]["first_token_s"] is not None
    assert burst["all_kv_blocks_free_after_close"]


# The standalone AMX programs BENCHMARKS.md cites (`g++ ... benchmarks/X.cpp`): they build
# on any x86 compiler that knows the instructions, whatever this CPU has, so bit rot shows
# here even where they cannot run.
AMX_FLAGS = ["-mamx-tile", "-mamx-int8", "-mamx-bf16", "-mavx512f", "-mavx512bw",
             "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mfma"]  # fmt: skip


@pytest.mark.parametrize("program", ["amx_group_floor", "amx_folded_loads", "amx_bf16_sums"])
def test_amx_benchmark_programs_compile(program, tmp_path):
    import platform
    import shutil

    if shutil.which("g++") is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs g++ for x86-64")
    source = ROOT / "benchmarks" / f"{program}.cpp"
    done = subprocess.run(
        ["g++", "-O2", *AMX_FLAGS, str(source), "-o", str(tmp_path / program)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
