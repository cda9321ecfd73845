"""`pagedllm bench` (benchmarks/throughput.py): its workloads, its extrapolation of the
one-at-a-time baseline, and one small run end to end against transformers."""

from __future__ import annotations

import json

import pytest

from pagedllm_integrations.cli import main
from pagedllm_integrations.engine.bench import Workload, _extrapolate, make_workload


def test_workloads_have_the_issue_shapes():
    uniform = make_workload("uniform", 64, 49152)
    assert {len(p) for p in uniform.prompts} == {256} and set(uniform.output_lens) == {64}
    mixed = make_workload("mixed", 64, 49152)
    assert all(32 <= len(p) <= 1024 for p in mixed.prompts)
    assert all(16 <= n <= 256 for n in mixed.output_lens)
    assert len({len(p) for p in mixed.prompts}) > 32  # lengths really vary
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("bursty", 4, 100)


def test_extrapolation_fits_prompt_and_output_costs():
    workload = Workload("w", [[1] * 100, [1] * 400, [1] * 50, [1] * 800], [10, 40, 200, 30])
    cost = lambda p, o: 0.002 * p + 0.06 * o  # noqa: E731 - a made-up linear cost
    sample = [(len(workload.prompts[i]), workload.output_lens[i]) for i in (0, 2)]
    timed = [(p, o, cost(p, o)) for p, o in sample]
    want = sum(cost(len(p), o) for p, o in zip(workload.prompts, workload.output_lens))
    assert _extrapolate(timed, workload) == pytest.approx(want)
    # One sample: time scales with output tokens.
    assert _extrapolate(timed[:1], workload) == pytest.approx(cost(100, 10) * 280 / 10)
    # Every request timed: no extrapolation at all.
    everything = [(len(p), o, 1.5) for p, o in zip(workload.prompts, workload.output_lens)]
    assert _extrapolate(everything, workload) == pytest.approx(6.0)


def test_bench_runs_against_transformers(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["bench", "--workloads", "uniform", "--num-requests", "3", "--hf-solo-sample", "2"]
    args += ["--hf-batch-size", "2", "--kv-cache-memory", str(512 * 2**20)]  # 8,192 tokens fit
    assert main([*args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    systems = {r["system"]: r for r in report["results"]}
    assert set(systems) == {"pagedllm", "hf-static-2", "hf-solo"}
    assert all(r["output_tokens_per_s"] > 0 for r in systems.values())
    ours = systems["pagedllm"]
    assert 0 < ours["kv_usage_max"] <= 1 and 0 <= ours["kv_waste_mean"] < 0.04
    assert systems["hf-solo"]["extrapolated_from"] == 2
    assert set(ours["extra"]["seconds"]) == {"prefill_steps", "decode_steps"}
    assert ours["extra"]["steps"]["prefill_steps"] >= 1
    assert "workload: uniform" in capsys.readouterr().out
