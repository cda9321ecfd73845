"""Time to first token with and without a prefix-cache hit on a shared ~1,000-token system prompt.

    python benchmarks/prefix_cache.py [--model PATH] [--repeats 3]

Each repeat asks two questions after the same long system prompt, on a fresh prefix cache:
the first computes the whole prompt, the second only its own suffix. The same pair also
runs with prefix caching off, as the baseline. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from pagedllm_integrations import AsyncEngine, SamplingParams

SYSTEM = (
    "You are the help desk of Harbor Lane Bicycles. Answer briefly and politely, using only "
    "the shop's handbook. The shop sells, rents and repairs city bikes, mountain bikes and "
    "electric bikes; members of the Harbor Club get discounts and a free yearly service. "
)
QUESTIONS = ["When does the shop open on Sunday?", "How much does a basic service cost?"]


def ttft(engine: AsyncEngine, prompt_ids: list[int]) -> tuple[float, int]:
    started = time.perf_counter()
    output = engine.add_request(
        {"prompt_token_ids": prompt_ids}, SamplingParams(temperature=0, max_tokens=1)
    ).result()
    return time.perf_counter() - started, output.num_cached_tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="benchmarks/results/prefix_cache.json")
    args = parser.parse_args()

    rows = {}
    for caching in (True, False):
        engine = AsyncEngine(
            model=args.model, enable_prefix_caching=caching, disable_log_stats=True
        )
        tokenizer = engine.tokenizer
        system_ids = tokenizer(SYSTEM * 40, add_special_tokens=False).input_ids[
            : args.system_tokens
        ]
        prompts = [
            system_ids + tokenizer(" " + q, add_special_tokens=False).input_ids for q in QUESTIONS
        ]
        ttft(engine, tokenizer("warm up").input_ids)
        firsts, seconds, hits = [], [], []
        for _ in range(args.repeats):
            engine.reset_prefix_cache()
            first, _ = ttft(engine, prompts[0])
            second, cached = ttft(engine, prompts[1])
            firsts.append(first)
            seconds.append(second)
            hits.append(cached)
        engine.shutdown()
        rows[caching] = {
            "prompt_tokens": len(prompts[1]),
            "first_ttft_s": statistics.median(firsts),
            "second_ttft_s": statistics.median(seconds),
            "second_cached_tokens": hits[-1],
        }

    on, off = rows[True], rows[False]
    print(f"{'prefix caching':<16}{'prompt':>8}{'1st TTFT':>10}{'2nd TTFT':>10}{'2nd cached':>12}")
    for name, row in (("on", on), ("off", off)):
        print(
            f"{name:<16}{row['prompt_tokens']:>8}{row['first_ttft_s']:>9.3f}s"
            f"{row['second_ttft_s']:>9.3f}s{row['second_cached_tokens']:>12}"
        )
    speedup = off["second_ttft_s"] / on["second_ttft_s"]
    print(f"second request TTFT: {speedup:.1f}x lower with the prefix cache")
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"on": on, "off": off, "ttft_speedup": speedup}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
