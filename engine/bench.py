"""Throughput benchmark: pagedllm against Hugging Face transformers in the same run.

Workloads (random token ids, EOS ignored, so every request produces exactly its length):
  uniform  64 requests, 256 prompt tokens, 64 output tokens each
  mixed    64 requests, prompts uniform in 32..1024, outputs uniform in 16..256

Baselines, same model and dtype, same process:
  hf-solo    `generate` one request at a time (timed on a sample, extrapolated to all
             by a fit of prompt and output lengths)
  hf-static  padded static batches of 16: a batch runs until its longest request is done

Used by `pagedllm bench` and `benchmarks/throughput.py`; prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .async_engine import AsyncEngine
from .metrics import IterationStats, SchedulerStats
from .sampling_params import SamplingParams

BENCH_CPU_KV_BYTES = 4 * 2**30


@dataclass(slots=True)
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass(slots=True)
class RunResult:
    system: str
    workload: str
    seconds: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_mean_s: float | None = None
    ttft_p90_s: float | None = None
    kv_usage_max: float | None = None
    kv_waste_mean: float | None = None  # reserved-but-empty slots / reserved slots, step mean
    kv_waste_max: float | None = None  # the same, worst step
    extrapolated_from: int | None = None
    extra: dict = field(default_factory=dict)


def make_workload(name: str, num_requests: int, vocab_size: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    if name == "uniform":
        prompt_lens, output_lens = [256] * num_requests, [64] * num_requests
    elif name == "mixed":
        prompt_lens = [rng.randint(32, 1024) for _ in range(num_requests)]
        output_lens = [rng.randint(16, 256) for _ in range(num_requests)]
    else:
        raise ValueError(f"unknown workload {name!r} (uniform or mixed)")
    # Ids from the middle of the vocabulary: ordinary tokens, no special ones.
    prompts = [[rng.randint(1000, vocab_size - 1000) for _ in range(n)] for n in prompt_lens]
    return Workload(name, prompts, output_lens)


class _KVWatcher:
    """A stat logger that keeps the worst KV-cache usage and waste seen during a run, and
    splits the run's time between steps that carry prompt tokens and decode-only steps."""

    def __init__(self) -> None:
        self.usage_max = 0.0
        self.waste_max = 0.0
        self.waste_sum = 0.0
        self.steps = 0
        self.last_step_end = time.perf_counter()
        self.seconds = {"prefill_steps": 0.0, "decode_steps": 0.0}
        self.counts = {"prefill_steps": 0, "decode_steps": 0}

    def record(self, scheduler: SchedulerStats, iteration: IterationStats) -> None:
        now = time.perf_counter()
        # More tokens than sequences: some sequence fed (part of) its prompt this step.
        kind = (
            "prefill_steps" if iteration.num_batched_tokens > iteration.num_seqs else "decode_steps"
        )
        self.seconds[kind] += now - self.last_step_end
        self.counts[kind] += 1
        self.last_step_end = now
        self.usage_max = max(self.usage_max, scheduler.kv_cache_usage)
        if scheduler.kv_slots_reserved:
            waste = 1.0 - scheduler.kv_tokens_held / scheduler.kv_slots_reserved
            self.waste_max = max(self.waste_max, waste)
            self.waste_sum += waste
            self.steps += 1


def run_pagedllm(engine: AsyncEngine, workload: Workload) -> RunResult:
    engine.reset_prefix_cache()
    watcher = _KVWatcher()
    engine.add_stat_logger(watcher)
    started = time.perf_counter()
    streams = [
        engine.add_request(
            {"prompt_token_ids": prompt},
            SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
        )
        for prompt, n in zip(workload.prompts, workload.output_lens)
    ]
    outputs = [s.result() for s in streams]
    seconds = time.perf_counter() - started
    engine.remove_stat_logger(watcher)
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == workload.output_tokens, (produced, workload.output_tokens)
    # Every finished output carries its metrics.
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs]  # type: ignore[union-attr,operator]
    return RunResult(
        "pagedllm",
        workload.name,
        seconds,
        len(outputs) / seconds,
        produced / seconds,
        ttft_mean_s=statistics.mean(ttfts),
        ttft_p90_s=statistics.quantiles(ttfts, n=10)[-1],
        kv_usage_max=watcher.usage_max,
        kv_waste_mean=watcher.waste_sum / max(watcher.steps, 1),
        kv_waste_max=watcher.waste_max,
        extra={
            "seconds": {k: round(v, 2) for k, v in watcher.seconds.items()},
            "steps": watcher.counts,
        },
    )


def _hf_generate(model, prompts: list[list[int]], max_new: int, pad_id: int) -> float:
    """One padded batch through transformers.generate; returns seconds."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):  # left padding, as generation needs
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    started = time.perf_counter()
    with torch.no_grad():
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            min_new_tokens=max_new,  # EOS ignored, like the engine's ignore_eos
            do_sample=False,
            pad_token_id=pad_id,
        )
    return time.perf_counter() - started


def run_hf_solo(model, workload: Workload, sample: int, pad_id: int, label: str = "") -> RunResult:
    """One request at a time, timed on `sample` requests and extrapolated to the workload.

    A request alone costs its prefill (about proportional to its prompt) plus one decode
    step per output token, so the sample's times are fitted as a * prompt + b * output and
    the fit is summed over every request; with one sample, or a fit that is not positive,
    the time scales with output tokens alone.
    """
    step = max(len(workload.prompts) // sample, 1)
    indexes = list(range(0, len(workload.prompts), step))[:sample]
    timed = [
        (len(workload.prompts[i]), workload.output_lens[i],
         _hf_generate(model, [workload.prompts[i]], workload.output_lens[i], pad_id))
        for i in indexes
    ]  # fmt: skip
    total_seconds = _extrapolate(timed, workload)
    n = len(workload.prompts)
    return RunResult(
        f"hf-solo{label}",
        workload.name,
        total_seconds,
        n / total_seconds,
        workload.output_tokens / total_seconds,
        extrapolated_from=len(indexes) if len(indexes) < n else None,
        extra={"timed": [list(t) for t in timed]},
    )


def _extrapolate(timed: list[tuple[int, int, float]], workload: Workload) -> float:
    """Seconds for the whole workload from (prompt_len, output_len, seconds) samples."""
    if len(timed) == len(workload.prompts):
        return sum(t for _, _, t in timed)
    if len(timed) >= 2:
        x = torch.tensor([[p, o] for p, o, _ in timed], dtype=torch.float64)
        y = torch.tensor([t for _, _, t in timed], dtype=torch.float64)
        a, b = torch.linalg.lstsq(x, y[:, None]).solution[:, 0].tolist()
        if a > 0 and b > 0:
            return a * sum(len(p) for p in workload.prompts) + b * workload.output_tokens
    sampled_output = sum(o for _, o, _ in timed)
    return sum(t for _, _, t in timed) * workload.output_tokens / sampled_output


def run_hf_static(
    model, workload: Workload, batch_size: int, pad_id: int, label: str = ""
) -> RunResult:
    seconds = 0.0
    for start in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[start : start + batch_size]
        longest = max(workload.output_lens[start : start + batch_size])
        seconds += _hf_generate(model, prompts, longest, pad_id)
    n = len(workload.prompts)
    return RunResult(
        f"hf-static-{batch_size}{label}",
        workload.name,
        seconds,
        n / seconds,
        workload.output_tokens / seconds,  # useful tokens only: padding steps are waste
    )


@dataclass(slots=True)
class LoadedModel:
    """Where the engine's model came from, kept to load it in transformers once the engine
    is shut down (and its weights freed)."""

    folder: Path
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, engine: AsyncEngine) -> LoadedModel:
        return cls(engine.engine.model_folder, engine.engine.dtype, engine.engine.device)


def load_hf_model(model: LoadedModel | AsyncEngine, dtype: torch.dtype | None = None):
    """The same weights in transformers (from a running engine or its LoadedModel), in
    `dtype` (default: the engine's activation dtype)."""
    from .gguf_loader import load_with_transformers

    if isinstance(model, AsyncEngine):
        model = LoadedModel.of(model)
    return load_with_transformers(model.folder, dtype=dtype or model.dtype).eval()


def add_arguments(parser: argparse.ArgumentParser, command: str = "bench") -> None:
    from ..cli_generate import add_engine_arguments

    add_engine_arguments(parser)
    parser.add_argument("--workloads", default="uniform,mixed")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument(
        "--hf-solo-sample",
        type=int,
        default=8,
        help="requests timed one at a time, the rest extrapolated (= --num-requests: all)",
    )
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument(
        "--hf-dtypes",
        default="float32",
        help="time transformers in each of these dtypes, e.g. float32,bfloat16 (for a GGUF "
        "file transformers keeps the weights packed and computes in float32, its fastest: "
        "bf16 measured 1.7x slower on the default model)",
    )
    parser.add_argument("--skip-hf", action="store_true", help="time pagedllm only")
    parser.add_argument("--json", default="benchmarks/results/throughput.json")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    from ..cli_generate import engine_kwargs

    kwargs = engine_kwargs(args)
    kwargs["disable_log_stats"] = True
    if kwargs["kv_cache_memory"] is None:
        # The mixed workload's 64 requests hold up to 46k tokens (2.0 GiB in float32): give the
        # engine room for all 64 requests, as a GPU engine gets 90% of its card (only used on
        # CPU; a GPU sizes its cache by gpu_memory_utilization).
        kwargs["kv_cache_memory"] = BENCH_CPU_KV_BYTES
    engine = AsyncEngine(**kwargs)
    results: list[RunResult] = []
    # pagedllm first, then transformers with the engine shut down: each system runs with no
    # OpenMP pool of the other's alive (two pools on a small machine throttle each other).
    loaded = LoadedModel.of(engine)
    try:
        pad_id = engine.tokenizer.pad_token_id or engine.tokenizer.eos_token_id or 0
        vocab_size = engine.model_info.vocab_size
        workloads = [
            make_workload(name, args.num_requests, vocab_size, args.seed)
            for name in args.workloads.split(",")
        ]
        warm = make_workload("uniform", 2, vocab_size, seed=99)
        run_pagedllm(engine, Workload("warmup", warm.prompts, [4, 4]))
        for workload in workloads:
            results.append(run_pagedllm(engine, workload))
    finally:
        engine.shutdown()
    if not args.skip_hf:
        for name in args.hf_dtypes.split(","):
            dtype = getattr(torch, name)
            hf_model = load_hf_model(loaded, dtype)
            label = "" if dtype == torch.float32 else f" ({name})"
            for workload in workloads:
                results.append(run_hf_static(hf_model, workload, args.hf_batch_size, pad_id, label))
                results.append(run_hf_solo(hf_model, workload, args.hf_solo_sample, pad_id, label))
            del hf_model
    for workload in workloads:
        _print_table([r for r in results if r.workload == workload.name])
    report = {
        "model": engine.model_name,
        "dtype": str(loaded.dtype),
        "device": str(loaded.device),
        "threads": torch.get_num_threads(),
        "results": [asdict(r) for r in results],
    }
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")
    return 0


def _print_table(results: list[RunResult]) -> None:
    ours = next(r for r in results if r.system == "pagedllm")
    print(f"\nworkload: {ours.workload}")
    print(f"{'system':<14}{'seconds':>9}{'req/s':>8}{'out tok/s':>11}{'vs pagedllm':>13}  notes")
    for r in results:
        ratio = ours.output_tokens_per_s / r.output_tokens_per_s
        notes = []
        if r.ttft_mean_s is not None:
            notes.append(f"TTFT mean {r.ttft_mean_s:.2f}s p90 {r.ttft_p90_s:.2f}s")
        if r.kv_usage_max is not None:
            notes.append(f"KV use max {100 * r.kv_usage_max:.1f}%")
            notes.append(
                f"KV waste mean {100 * (r.kv_waste_mean or 0):.2f}% "
                f"max {100 * (r.kv_waste_max or 0):.2f}%"
            )
        if "seconds" in r.extra:
            split = r.extra["seconds"]
            notes.append(
                f"steps with prompt tokens {split['prefill_steps']:.1f}s, "
                f"decode-only {split['decode_steps']:.1f}s"
            )
        if r.extrapolated_from:
            notes.append(f"timed on {r.extrapolated_from} requests")
        print(
            f"{r.system:<14}{r.seconds:>9.1f}{r.requests_per_s:>8.2f}"
            f"{r.output_tokens_per_s:>11.1f}{ratio:>12.2f}x  {'; '.join(notes)}"
        )
