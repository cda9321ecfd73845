"""Load time, memory and single-request decode speed: pagedllm beside transformers.

    python benchmarks/load_and_decode.py [--model PATH] [--tokens 128]

Each system runs in its own fresh subprocess (so resident memory is its own), one after
the other, on the same machine and model: load, one warm-up, then one request decoding
`--tokens` tokens with EOS ignored. Decode speed counts the tokens after the first (the
prefill is excluded). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "Write a long story about a lighthouse keeper and a storm."


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def measure_pagedllm(model: str | None, tokens: int) -> dict:
    import torch

    from pagedllm_integrations import LLM, SamplingParams
    from pagedllm_integrations.engine.white_box import core_of

    base = rss_mib()
    started = time.perf_counter()
    llm = LLM(model, disable_log_stats=True, max_model_len=2048, kv_cache_memory=256 << 20)
    load = time.perf_counter() - started
    weights = sum(p.numel() * p.element_size() for p in core_of(llm).model.parameters())
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(PROMPT, params.clone(max_tokens=4), use_tqdm=False)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0]
    m = out.metrics
    decode = (len(out.outputs[0].token_ids) - 1) / (m.last_token_time - m.first_token_time)
    result = {
        "system": "pagedllm",
        "load_s": load,
        "rss_mib": rss_mib() - base,
        "weights_mib": weights / 2**20,
        "kv_cache_mib": core_of(llm).kv_cache_bytes / 2**20,
        "decode_tok_s": decode,
        "threads": torch.get_num_threads(),
    }
    llm.shutdown()
    return result


def measure_transformers(model: str | None, tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedllm_integrations.engine.model_loader import default_model_path

    path = Path(model) if model else default_model_path()
    base = rss_mib()
    started = time.perf_counter()
    if path.suffix == ".gguf":
        kwargs = {"gguf_file": path.name}
        folder = str(path.parent)
    else:
        kwargs, folder = {}, str(path)
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()
    load = time.perf_counter() - started
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids

    def generate(n: int) -> float:
        begin = time.perf_counter()
        with torch.no_grad():
            hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=tokenizer.eos_token_id,
            )
        return time.perf_counter() - begin

    generate(4)
    first = generate(1)  # the prefill and the first token
    total = generate(tokens)
    weights = sum(p.numel() * p.element_size() for p in hf.parameters())
    return {
        "system": "transformers",
        "load_s": load,
        "rss_mib": rss_mib() - base,
        "weights_mib": weights / 2**20,
        "decode_tok_s": (tokens - 1) / (total - first),
        "threads": torch.get_num_threads(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--only", choices=["pagedllm", "transformers"])
    parser.add_argument("--json", default="benchmarks/results/load_and_decode.json")
    args = parser.parse_args()
    if args.only:
        measure = measure_pagedllm if args.only == "pagedllm" else measure_transformers
        print(json.dumps(measure(args.model, args.tokens)))
        return 0
    rows = []
    for system in ("pagedllm", "transformers"):
        command = [sys.executable, __file__, "--only", system, "--tokens", str(args.tokens)]
        if args.model:
            command += ["--model", args.model]
        done = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy())
        if done.returncode != 0:
            print(done.stderr, file=sys.stderr)
            return done.returncode
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"{'system':<14}{'load s':>8}{'RSS MiB':>9}{'weights MiB':>13}{'decode tok/s':>14}")
    for r in rows:
        print(
            f"{r['system']:<14}{r['load_s']:>8.1f}{r['rss_mib']:>9.0f}"
            f"{r['weights_mib']:>13.0f}{r['decode_tok_s']:>14.1f}"
        )
    ratio = rows[0]["decode_tok_s"] / rows[1]["decode_tok_s"]
    print(f"single-request decode: pagedllm {ratio:.2f}x transformers")
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rows": rows, "decode_ratio": ratio}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
