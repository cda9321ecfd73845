"""Prefix-cache hit rate of the cache-aware Ray router against round-robin.

    python benchmarks/ray_router_bench.py [--model PATH] [--replicas 2] [--groups 8]
        [--per-group 8] [--prefix-tokens 512] [--num-kv-blocks 512] [--concurrency 8]

Requests come in groups that share a long prefix (a system prompt, a document); each has
its own short suffix. The same shuffled request list runs twice on the same replicas, each
time on freshly emptied prefix caches: once routed round-robin, once by the prefix-aware
router. The hit rate is prompt tokens served by the replicas' prefix caches over prompt
tokens looked up (the engines' own counters). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from pathlib import Path

from pagedllm_integrations import SamplingParams
from pagedllm_integrations.engine.config import EngineConfig
from pagedllm_integrations.engine.distributed.ray_replicas import RayReplicaEngine


def make_requests(args, vocab_low: int, vocab_high: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    prefixes = [
        [rng.randrange(vocab_low, vocab_high) for _ in range(args.prefix_tokens)]
        for _ in range(args.groups)
    ]
    requests = [
        prefix + [rng.randrange(vocab_low, vocab_high) for _ in range(args.suffix_tokens)]
        for prefix in prefixes
        for _ in range(args.per_group)
    ]
    rng.shuffle(requests)
    return requests


def run(engine: RayReplicaEngine, requests: list[list[int]], args) -> dict:
    """All requests through `engine` with at most `concurrency` in flight; counter deltas."""
    assert engine.reset_prefix_cache(), "the replicas still hold blocks"
    before = engine.counters.snapshot()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    slots = threading.Semaphore(args.concurrency)
    ttfts: list[float] = []
    cached: list[int] = []
    lock = threading.Lock()

    def one(ids: list[int]) -> None:
        try:
            started = time.perf_counter()
            first, final = None, None
            for output in engine.add_request({"prompt_token_ids": ids}, params):
                final = output
                if first is None:
                    first = time.perf_counter() - started
            with lock:
                ttfts.append(first or 0.0)
                cached.append(final.num_cached_tokens if final is not None else 0)
        finally:
            slots.release()

    started = time.perf_counter()
    threads = []
    for ids in requests:
        slots.acquire()
        thread = threading.Thread(target=one, args=(ids,))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    after = engine.counters.snapshot()
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    per_replica = [
        a["prompt_tokens"] - b["prompt_tokens"]
        for a, b in zip(after["replicas"], before["replicas"])
    ]
    return {
        "hit_rate": hits / max(queries, 1),
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prompt_tokens_per_replica": per_replica,
        "mean_cached_tokens": statistics.mean(cached),
        "mean_ttft_s": statistics.mean(ttfts),
        "p90_ttft_s": sorted(ttfts)[int(0.9 * (len(ttfts) - 1))],
        "wall_s": wall,
        "requests_per_s": len(requests) / wall,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, default=512)
    parser.add_argument("--suffix-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-kv-blocks", type=int, default=512, help="KV blocks per replica")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="benchmarks/results/ray_router.json")
    args = parser.parse_args()

    config = EngineConfig(
        model=args.model,
        data_parallel_size=args.replicas,
        distributed_executor_backend="ray",
        num_kv_blocks=args.num_kv_blocks,
        max_model_len=args.prefix_tokens + args.suffix_tokens + args.max_tokens + 16,
        disable_log_stats=True,
    )
    engine = RayReplicaEngine(config)
    try:
        requests = make_requests(args, 1000, min(engine.model_info.vocab_size, 40000))
        warm = SamplingParams(max_tokens=2)
        for _ in range(2 * args.replicas):
            engine.add_request({"prompt_token_ids": [1000, 1001, 1002]}, warm).result()
        results = {}
        for policy in ("round_robin", "prefix"):
            engine.set_router_policy(policy)
            results[policy] = run(engine, requests, args)
    finally:
        engine.shutdown()

    rr, px = results["round_robin"], results["prefix"]
    print(
        f"{len(requests)} requests: {args.groups} groups x {args.per_group}, "
        f"{args.prefix_tokens}-token shared prefix + {args.suffix_tokens}-token suffix, "
        f"{args.replicas} replicas, {args.num_kv_blocks} KV blocks each, "
        f"concurrency {args.concurrency}"
    )
    print(f"{'router':<12} {'hit rate':>9} {'cached/req':>11} {'mean TTFT':>10} {'wall':>8}"
          f"  prompt tokens per replica")  # fmt: skip
    for name, r in results.items():
        print(
            f"{name:<12} {r['hit_rate']:>8.1%} {r['mean_cached_tokens']:>11.0f} "
            f"{r['mean_ttft_s']:>9.3f}s {r['wall_s']:>7.1f}s  {r['prompt_tokens_per_replica']}"
        )
    ideal = (
        (args.per_group - 1)
        * args.prefix_tokens
        / (args.per_group * (args.prefix_tokens + args.suffix_tokens))
    )
    print(
        f"prefix-aware / round-robin: hit rate x{px['hit_rate'] / max(rr['hit_rate'], 1e-9):.2f}, "
        f"wall time x{rr['wall_s'] / px['wall_s']:.2f} faster; ideal hit rate {ideal:.1%}"
    )  # fmt: skip
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(
        json.dumps({"args": vars(args), "results": results, "ideal_hit_rate": ideal}, indent=2)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
