"""Time to first token in a fresh process: the disk prefix cache warm against cold.

    python benchmarks/rag_disk_cache.py [--model PATH] [--system-tokens 2000] [--repeats 3]

A RAG app restarts with the same long system prompt every time. Every measurement here is
a new Python process that loads the engine (not timed) and asks one question after a
2,000-token system prompt (the shop assistant's prompt of examples/rag_langchain.py
followed by the handbook of examples/data, as many times as it takes), timed from
submission to the first streamed token:

- cold: `prefix_cache_dir` is a new, empty directory;
- warm: the directory an earlier process left after `save_prefix(system prompt)`.

Cold and warm runs alternate, so load on shared cores falls on both alike. Greedy outputs
must be identical in every run; the script checks it. `--threads N` runs both with N torch
threads (OMP_NUM_THREADS): on a machine whose cores are busy with other work, every
OpenMP region of a forward pass waits for a core, a fixed cost per step that weighs on
the warm run's short step far more than on the cold run's long one. Prints a table and the ratio, and
writes benchmarks/results/rag_disk_cache.json.

`measure_disk_cache_ttft(...)` returns the results as a dict (for benchmarks/rag_fast_path.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "rag_disk_cache.json"
QUESTION = "How much does it cost to rent an electric bike for a day?"


# --------------------------------------------------------------- the child process
def _system_text(tokenizer: Any, system_tokens: int) -> str:
    """The example's system prompt, then the handbook until `system_tokens` tokens."""
    spec = importlib.util.spec_from_file_location(
        "rag_example", ROOT / "examples" / "rag_langchain.py"
    )
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    handbook = "\n\n".join(d.page_content for d in example.load_documents())
    text = example.SYSTEM_PROMPT + "\n\nThe shop's handbook:\n\n"
    while len(tokenizer(text, add_special_tokens=False).input_ids) < system_tokens:
        text += handbook + "\n\n"
    ids = tokenizer(text, add_special_tokens=False).input_ids[:system_tokens]
    return tokenizer.decode(ids)


def _prompts(engine: Any, system_tokens: int) -> tuple[list[int], list[int]]:
    """(the system prompt's tokens, the whole prompt's), through the chat template."""
    tokenizer = engine.tokenizer
    system = {"role": "system", "content": _system_text(tokenizer, system_tokens)}
    head = engine.apply_chat_template([system], add_generation_prompt=False)
    full = engine.apply_chat_template([system, {"role": "user", "content": QUESTION}])
    assert full.startswith(head), "the chat template does not render the system part first"
    system_ids = tokenizer(head, add_special_tokens=False).input_ids
    rest = tokenizer(full[len(head) :], add_special_tokens=False).input_ids
    return system_ids, system_ids + rest


def child(
    mode: str, directory: str, model: str | None, system_tokens: int, max_tokens: int
) -> dict:
    """One fresh process's run: 'save' writes the system prompt, 'ask' times the question."""
    from pagedllm_integrations import AsyncEngine, RequestOutputKind, SamplingParams

    started = time.perf_counter()
    engine = AsyncEngine(model=model, prefix_cache_dir=directory, disable_log_stats=True)
    load_s = time.perf_counter() - started
    system_ids, prompt_ids = _prompts(engine, system_tokens)
    result: dict[str, Any] = {"load_s": load_s, "system_tokens": len(system_ids)}
    if mode == "save":
        started = time.perf_counter()
        result["saved_tokens"] = engine.save_prefix({"prompt_token_ids": system_ids})
        result["save_s"] = time.perf_counter() - started
    else:
        params = SamplingParams(
            temperature=0, max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA
        )
        tokens: list[int] = []
        ttft = None
        started = time.perf_counter()
        for output in engine.generate_sync({"prompt_token_ids": prompt_ids}, params):
            if ttft is None and output.outputs[0].token_ids:
                ttft = time.perf_counter() - started
            tokens.extend(output.outputs[0].token_ids)
            cached = output.num_cached_tokens
        stats = engine.scheduler_stats()
        result.update(
            prompt_tokens=len(prompt_ids),
            ttft_s=ttft,
            tokens=tokens,
            cached_tokens=cached,
            disk_loaded_tokens=stats.prefix_cache_disk_loaded,
        )
    engine.shutdown()
    return result


def _run_child(
    mode: str,
    directory: Path,
    model: str | None,
    system_tokens: int,
    max_tokens: int,
    threads: int | None,
) -> dict:
    command = [sys.executable, __file__, "--child", mode, "--dir", str(directory)]
    command += ["--system-tokens", str(system_tokens), "--max-tokens", str(max_tokens)]
    if model is not None:
        command += ["--model", model]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{mode} process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- the measurement
def measure_disk_cache_ttft(
    model: str | None = None,
    system_tokens: int = 2000,
    repeats: int = 3,
    max_tokens: int = 32,
    threads: int | None = None,
) -> dict[str, Any]:
    """Cold and warm fresh-process TTFT (medians over `repeats` each); raises if any run's
    greedy tokens differ."""
    work = Path(tempfile.mkdtemp(prefix="pagedllm-disk-cache-"))
    try:
        warm_dir = work / "warm"
        saved = _run_child("save", warm_dir, model, system_tokens, max_tokens, threads)
        files = [f.stat().st_size for f in warm_dir.rglob("*.kv")]
        cold_runs, warm_runs = [], []
        for index in range(repeats):
            cold_dir = work / f"cold{index}"
            cold_runs.append(_run_child("ask", cold_dir, model, system_tokens, max_tokens, threads))
            warm_runs.append(_run_child("ask", warm_dir, model, system_tokens, max_tokens, threads))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    reference = cold_runs[0]["tokens"]
    same = all(run["tokens"] == reference for run in cold_runs + warm_runs)
    if not same:
        raise AssertionError("greedy outputs differ between cold and warm runs")
    cold = statistics.median(run["ttft_s"] for run in cold_runs)
    warm = statistics.median(run["ttft_s"] for run in warm_runs)
    return {
        "model": model or "SmolLM2-135M-Instruct (embedded default)",
        "system_tokens": saved["system_tokens"],
        "prompt_tokens": cold_runs[0]["prompt_tokens"],
        "saved_tokens": saved["saved_tokens"],
        "save_s": saved["save_s"],
        "block_files": len(files),
        "block_files_mib": sum(files) / (1 << 20),
        "cold_ttft_s": cold,
        "warm_ttft_s": warm,
        "ttft_ratio": cold / warm,
        "warm_cached_tokens": warm_runs[0]["cached_tokens"],
        "warm_disk_loaded_tokens": warm_runs[0]["disk_loaded_tokens"],
        "cold_cached_tokens": cold_runs[0]["cached_tokens"],
        "load_s_cold": statistics.median(run["load_s"] for run in cold_runs),
        "load_s_warm": statistics.median(run["load_s"] for run in warm_runs),
        "same_outputs": same,
        "repeats": repeats,
        "threads": threads or "default",
        "cold_runs_ttft_s": [run["ttft_s"] for run in cold_runs],
        "warm_runs_ttft_s": [run["ttft_s"] for run in warm_runs],
        "load_average": os.getloadavg()[0],
    }


def print_table(results: dict[str, Any]) -> None:
    print(
        f"fresh process, {results['system_tokens']}-token system prompt "
        f"({results['prompt_tokens']} prompt tokens), median of {results['repeats']}, "
        f"torch threads: {results['threads']}:"
    )
    print(f"{'disk cache':<12}{'TTFT':>10}{'cached':>9}{'from disk':>11}")
    print(f"{'cold':<12}{results['cold_ttft_s']:>9.3f}s{results['cold_cached_tokens']:>9}{0:>11}")
    print(
        f"{'warm':<12}{results['warm_ttft_s']:>9.3f}s{results['warm_cached_tokens']:>9}"
        f"{results['warm_disk_loaded_tokens']:>11}"
    )
    print(
        f"TTFT {results['ttft_ratio']:.1f}x lower with the disk cache warm (target: at least "
        f"10x); identical greedy outputs: {results['same_outputs']}; {results['block_files']} "
        f"block files, {results['block_files_mib']:.1f} MiB; load average "
        f"{results['load_average']:.1f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="torch threads per process")
    parser.add_argument("--json", default=str(RESULTS))
    parser.add_argument("--child", choices=["save", "ask"], help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(
            json.dumps(child(args.child, args.dir, args.model, args.system_tokens, args.max_tokens))
        )
        return 0
    results = measure_disk_cache_ttft(
        args.model, args.system_tokens, args.repeats, args.max_tokens, args.threads
    )
    print_table(results)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
