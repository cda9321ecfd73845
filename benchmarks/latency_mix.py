"""Latency of short chats beside long prompts: fcfs against short_first, and vLLM's CPU build.

    python benchmarks/latency_mix.py [--requests 60] [--loads 0.5,0.8,1.0] [--skip vllm]

The workload (issue 42): 90% short chats (50-token prompts, 32 tokens out) and 10% long ones
(4096-token prompts, 256 out), random distinct token ids (no prefix-cache hits), streamed
through each server's OpenAI `/v1/completions`. Arrivals are Poisson at 50%, 80% and 100% of
the capacity measured first (pagedllm fcfs, every request of a saturating batch at once:
requests finished per second); every system gets the same requests at the same offsets.

Per system and load: P50/P99 time to first token and inter-token latency (gaps between
streamed chunks) of the short requests, P50/P99 TTFT of the long ones, output and total
tokens/s over the run, and for short_first the largest ratio of a request's TTFT to the
same request's under fcfs (issue 42's "no request waits more than 4x its fcfs wait").
Servers run in their own processes on the default model (vLLM: the float32 Hugging Face
folder benchmarks/cpu_peers.py makes of it, in bfloat16 as there). Prints a table, writes
JSON (benchmarks/results/latency_mix.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

import httpx

SHORT = (50, 32)  # prompt tokens, output tokens
LONG = (4096, 256)
LONG_FRACTION = 0.1
MAX_MODEL_LEN = LONG[0] + LONG[1] + 64
MODEL_NAME = "mix"
VOCAB = 49152  # SmolLM2's (the default model)


@dataclass(slots=True)
class Item:
    kind: str  # "short" | "long"
    prompt: list[int]
    max_tokens: int


@dataclass(slots=True)
class Record:
    kind: str
    sent: float = 0.0
    first: float | None = None
    chunks: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent


def workload(count: int, seed: int, vocab: int) -> list[Item]:
    rng = random.Random(seed)
    kinds = ["long" if i % round(1 / LONG_FRACTION) == 0 else "short" for i in range(count)]
    rng.shuffle(kinds)
    items = []
    for kind in kinds:
        length, out = LONG if kind == "long" else SHORT
        items.append(Item(kind, [rng.randint(1000, vocab - 1000) for _ in range(length)], out))
    return items


def poisson_offsets(count: int, rate: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


async def one(client: httpx.AsyncClient, item: Item, at: float, start: float) -> Record:
    record = Record(item.kind)
    await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
    body = {
        "model": MODEL_NAME,
        "prompt": item.prompt,
        "max_tokens": item.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    record.sent = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"{response.status_code}: {(await response.aread())[:200]!r}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    record.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):
                    now = time.perf_counter()
                    record.first = record.first or now
                    record.chunks.append(now)
    except httpx.HTTPError as error:
        record.error = repr(error)
    return record


async def run_load(url: str, items: list[Item], offsets: list[float]) -> tuple[list[Record], float]:
    limits = httpx.Limits(max_connections=len(items) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        start = time.perf_counter()
        records = await asyncio.gather(*(one(client, i, o, start) for i, o in zip(items, offsets)))
        wall = time.perf_counter() - start
    return list(records), wall


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)  # nearest rank
    return ordered[min(len(ordered), max(1, math.ceil(q / 100 * len(ordered)))) - 1]


def summarize(records: list[Record], wall: float, items: list[Item]) -> dict:
    errors = [r.error for r in records if r.error]
    short = [r for r in records if r.kind == "short" and not r.error]
    long = [r for r in records if r.kind == "long" and not r.error]
    gaps = [b - a for r in short for a, b in zip(r.chunks, r.chunks[1:])]
    ttft_short = [r.ttft for r in short if r.ttft is not None]
    ttft_long = [r.ttft for r in long if r.ttft is not None]
    out_tokens = sum(r.output_tokens for r in records)
    prompt_tokens = sum(len(i.prompt) for i, r in zip(items, records) if not r.error)
    ms = lambda v: None if v is None else round(1000 * v, 1)  # noqa: E731
    return {
        "errors": len(errors),
        "first_errors": errors[:3],
        "short_ttft_p50_ms": ms(percentile(ttft_short, 50)),
        "short_ttft_p99_ms": ms(percentile(ttft_short, 99)),
        "short_itl_p50_ms": ms(percentile(gaps, 50)),
        "short_itl_p99_ms": ms(percentile(gaps, 99)),
        "long_ttft_p50_ms": ms(percentile(ttft_long, 50)),
        "long_ttft_p99_ms": ms(percentile(ttft_long, 99)),
        "output_tokens_per_s": round(out_tokens / wall, 1),
        "total_tokens_per_s": round((out_tokens + prompt_tokens) / wall, 1),
        "wall_s": round(wall, 1),
        "ttft_s": [None if r.ttft is None else round(r.ttft, 4) for r in records],
    }


def free_port() -> int:
    with closing(socket.socket()) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """A server process on a free loopback port, in its own process group."""

    def __init__(self, command: list[str], port: int, log: Path, env: dict | None = None):
        self.url = f"http://127.0.0.1:{port}"
        self.log = log.open("w")
        # Outside the checkout: vLLM's transformers imports `kernels`, which the checkout's
        # own kernels/ folder would hide (as in cpu_peers.py's workers).
        self.process = subprocess.Popen(
            command,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            cwd=tempfile.gettempdir(),
        )
        deadline = time.monotonic() + 1200
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{command[:4]} exited; see {log}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"{command[:4]} did not start; see {log}")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(60)
        self.log.close()


def start_pagedllm(policy: str, logs: Path) -> Server:
    port = free_port()
    command = [sys.executable, "-P", "-m", "pagedllm_integrations.cli", "serve"]
    command += ["--port", str(port), "--served-model-name", MODEL_NAME]
    command += ["--max-model-len", str(MAX_MODEL_LEN), "--scheduling-policy", policy]
    command += ["--disable-log-stats"]
    return Server(command, port, logs / f"pagedllm-{policy}.log")


def start_vllm(logs: Path, threads: int) -> Server:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cpu_peers import _tool, hf_folder_of  # the same folder and vLLM as cpu_peers.py

    from pagedllm_integrations.engine.model_loader import default_model_path

    folder = hf_folder_of(default_model_path())
    python = _tool("install-vllm-cpu")
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), VLLM_CPU_KVCACHE_SPACE="2")
    env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder)]
    command += ["--served-model-name", MODEL_NAME, "--port", str(port), "--dtype", "bfloat16"]
    command += ["--max-model-len", str(MAX_MODEL_LEN), "--seed", "0"]
    return Server(command, port, logs / "vllm.log", env)


def measure_capacity(url: str, items: list[Item]) -> float:
    """Requests finished per second with all of them sent at once (a saturated server)."""
    records, wall = asyncio.run(run_load(url, items, [0.0] * len(items)))
    bad = [r.error for r in records if r.error]
    if bad:
        raise RuntimeError(f"capacity run failed: {bad[:3]}")
    return len(items) / wall


def worst_ratio(
    base: dict, other: dict, kinds: list[str], kind: str | None = None, floor_s: float = 0.5
) -> float | None:
    """Largest TTFT(other) / TTFT(base) over the same requests (of `kind`, or all); a base
    below floor_s counts as floor_s: a step or two of queueing is not a wait."""
    ratios = [
        b / max(a, floor_s)
        for a, b, k in zip(base["ttft_s"], other["ttft_s"], kinds)
        if a is not None and b is not None and kind in (None, k)
    ]
    return round(max(ratios), 2) if ratios else None


def print_table(report: dict) -> None:
    header = (
        f"{'system':<22}{'load':>5}{'short TTFT P50/P99 ms':>24}{'short ITL P50/P99 ms':>22}"
        f"{'long TTFT P50/P99 ms':>22}{'out tok/s':>10}{'all tok/s':>10}{'worst/fcfs':>11}"
    )
    print(header)
    for row in report["rows"]:
        r = row["result"]
        print(
            f"{row['system']:<22}{row['load']:>5.0%}"
            f"{str(r['short_ttft_p50_ms']) + ' / ' + str(r['short_ttft_p99_ms']):>24}"
            f"{str(r['short_itl_p50_ms']) + ' / ' + str(r['short_itl_p99_ms']):>22}"
            f"{str(r['long_ttft_p50_ms']) + ' / ' + str(r['long_ttft_p99_ms']):>22}"
            f"{r['output_tokens_per_s']:>10}{r['total_tokens_per_s']:>10}"
            f"{row.get('worst_ttft_vs_fcfs', '')!s:>11}{row.get('worst_long_ttft_vs_fcfs', '')!s:>6}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=60, help="requests per load level")
    parser.add_argument("--capacity-requests", type=int, default=30)
    parser.add_argument("--loads", default="0.5,0.8,1.0")
    parser.add_argument("--skip", default="", help="comma-separated: vllm, short_first")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="benchmarks/results/latency_mix.json")
    parser.add_argument("--logs", default="/tmp/latency_mix_logs")
    args = parser.parse_args()
    skip = {s for s in args.skip.split(",") if s}
    loads = [float(x) for x in args.loads.split(",")]
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    report: dict = {"requests": args.requests, "loads": loads, "short": SHORT, "long": LONG}
    report["uptime_before"] = os.getloadavg()
    systems = [("pagedllm fcfs", "fcfs")]
    if "short_first" not in skip:
        systems.append(("pagedllm short_first", "short_first"))
    if "vllm" not in skip:
        systems.append(("vllm", None))
    rows: list[dict] = []
    # pagedllm's servers run side by side (an idle one takes no CPU) and take turns at each
    # load, so that load from elsewhere on the machine falls on both alike; vLLM after them.
    servers = {name: start_pagedllm(policy, logs) for name, policy in systems if policy}
    try:
        for server in servers.values():  # first-use compilation, allocator
            warm = workload(10, args.seed + 99, VOCAB)
            asyncio.run(run_load(server.url, warm, [0.0] * len(warm)))
        cap_items = workload(args.capacity_requests, args.seed + 7, VOCAB)
        report["capacity_req_s"] = round(
            measure_capacity(servers["pagedllm fcfs"].url, cap_items), 3
        )
        print(f"capacity (pagedllm fcfs): {report['capacity_req_s']} requests/s", flush=True)
        for load in loads:
            for name, server in servers.items():
                rows.append(run_level(name, server.url, load, report["capacity_req_s"], args))
                save(report, rows, args.json)
    finally:
        for server in servers.values():
            server.stop()
    if any(policy is None for _, policy in systems):
        server = start_vllm(logs, args.threads)
        try:
            warm = workload(10, args.seed + 99, VOCAB)
            asyncio.run(run_load(server.url, warm, [0.0] * len(warm)))
            for load in loads:
                rows.append(run_level("vllm", server.url, load, report["capacity_req_s"], args))
                save(report, rows, args.json)
        finally:
            server.stop()
    save(report, rows, args.json)
    print_table(report)
    return 0


def save(report: dict, rows: list[dict], path: str) -> None:
    """The report so far (written after every level: a run cut short keeps what it did)."""
    base = {row["load"]: row["result"] for row in rows if row["system"] == "pagedllm fcfs"}
    for row in rows:
        if row["system"] != "pagedllm fcfs" and row["load"] in base:
            fcfs, kinds = base[row["load"]], row["result"]["kinds"]
            row["worst_ttft_vs_fcfs"] = worst_ratio(fcfs, row["result"], kinds)
            row["worst_long_ttft_vs_fcfs"] = worst_ratio(fcfs, row["result"], kinds, "long")
    report["rows"] = rows
    report["uptime_after"] = os.getloadavg()
    report["cpu"] = _cpu_name()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2))


def run_level(name: str, url: str, load: float, capacity: float, args) -> dict:
    """One system at one load: the same requests and arrival times for every system."""
    items = workload(args.requests, args.seed + int(100 * load), VOCAB)
    offsets = poisson_offsets(args.requests, load * capacity, args.seed + int(100 * load))
    records, wall = asyncio.run(run_load(url, items, offsets))
    result = summarize(records, wall, items)
    result["kinds"] = [i.kind for i in items]
    print(f"{name} at {load:.0%}: {json.dumps(result)[:300]}", flush=True)
    return {"system": name, "load": load, "result": result, "loadavg": os.getloadavg()}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"


if __name__ == "__main__":
    sys.exit(main())
