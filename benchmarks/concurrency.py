"""Output tokens/s against the number of concurrent requests: pagedllm and transformers.

    python benchmarks/concurrency.py [--levels 1,4,16,64] [--prompt-tokens 128] [--output-tokens 32]

At each level N, N requests with random prompts (mixed lengths around --prompt-tokens)
arrive at once. pagedllm takes them as they come (continuous batching); transformers
runs them as one padded static batch of N (its best case: it needs no queueing logic).
Prints a table and writes JSON for benchmarks/plot.py.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from pagedllm_integrations import AsyncEngine, SamplingParams
from pagedllm_integrations.engine.bench import LoadedModel, _hf_generate, load_hf_model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--levels", default="1,4,16,64")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--json", default="benchmarks/results/concurrency.json")
    args = parser.parse_args()

    engine = AsyncEngine(model=args.model, disable_log_stats=True, max_model_len=2048)
    pad = engine.tokenizer.eos_token_id or 0
    rng = random.Random(0)
    vocab = engine.model_info.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    levels = [int(x) for x in args.levels.split(",")]
    batches = []
    for level in levels:
        lens = [
            rng.randint(args.prompt_tokens // 2, args.prompt_tokens * 3 // 2) for _ in range(level)
        ]
        batches.append([[rng.randint(1000, vocab - 1000) for _ in range(n)] for n in lens])
    rows = []
    for level, prompts in zip(levels, batches):
        engine.reset_prefix_cache()
        started = time.perf_counter()
        streams = [engine.add_request({"prompt_token_ids": p}, params) for p in prompts]
        for stream in streams:
            stream.result()
        rows.append(
            {
                "concurrency": level,
                "pagedllm_tok_s": level * args.output_tokens / (time.perf_counter() - started),
            }
        )
    loaded = LoadedModel.of(engine)  # the weights' source: shutdown frees the weights
    engine.shutdown()
    # transformers only once the engine is gone: with both OpenMP pools alive on a small
    # machine, each system's parallel ops throttle the other's.
    if not args.skip_hf:
        hf = load_hf_model(loaded)
        for row, prompts in zip(rows, batches):
            seconds = _hf_generate(hf, prompts, args.output_tokens, pad)
            row["transformers_static_tok_s"] = row["concurrency"] * args.output_tokens / seconds
    for row in rows:
        print(json.dumps(row))
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
