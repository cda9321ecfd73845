"""What resuming preempted requests from the disk swap tier waits on, with and without the
scheduler's read-ahead of their blocks.

    python benchmarks/swap_read_ahead.py [--requests 16] [--prompt-tokens 256] [--max-tokens 384]

One engine on the default model with KV memory for a fraction of the requests and swap
space on disk only (`swap_disk_space`), so that decoding requests preempt each other and
their blocks go to the file and come back. A real machine short of memory would have
evicted a waiting request's pages from the page cache by the time it resumes; here the
benchmark evicts them at once after each swap-out (msync, then MADV_PAGEOUT on the slots
written), so every swap-in has to come from the disk. Runs the same requests with the
read-ahead on and off (alternating, `--rounds` each) and prints the time the engine thread
spent in swap-ins, the bytes the process read from disk meanwhile, and the wall time.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

from pagedllm_integrations import LLM, SamplingParams
from pagedllm_integrations.engine.white_box import core_of

MADV_PAGEOUT = 21  # Linux 5.4+; Python's mmap module has no name for it before 3.12


def _read_bytes() -> int:
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("read_bytes"))


def run_once(llm: LLM, prompts: list[list[int]], max_tokens: int, read_ahead: bool) -> dict:
    runner = core_of(llm).executor.runner
    space = runner.swap_space
    store, load, ahead = space.store, space.load, space.read_ahead
    spent = {"load_s": 0.0, "loads": 0, "read_bytes_in_loads": 0}

    def store_then_evict(kv_caches, block_ids, slots):
        store(kv_caches, block_ids, slots)
        space._mapping.flush()  # write the dirty pages, so that PAGEOUT can drop them
        for start, length in space.disk_ranges(slots):
            space._mapping.madvise(MADV_PAGEOUT, start, length)

    def timed_load(kv_caches, block_ids, slots):
        before, began = _read_bytes(), time.perf_counter()
        load(kv_caches, block_ids, slots)
        spent["load_s"] += time.perf_counter() - began
        spent["read_bytes_in_loads"] += _read_bytes() - before
        spent["loads"] += 1

    space.store, space.load = store_then_evict, timed_load
    space.read_ahead = ahead if read_ahead else (lambda slots: None)
    stats_before = llm.engine.counters.snapshot()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    began = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - began
    space.store, space.load, space.read_ahead = store, load, ahead
    stats = llm.engine.counters.snapshot()
    return {
        **spent,
        "wall_s": wall,
        "blocks_swapped_in": stats["blocks_swapped_in"] - stats_before["blocks_swapped_in"],
        "blocks_read_ahead": stats["blocks_swap_read_ahead"]
        - stats_before["blocks_swap_read_ahead"],
        "tokens": [o.outputs[0].token_ids for o in outputs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [
        [rng.randint(1000, 48000) for _ in range(args.prompt_tokens)] for _ in range(args.requests)
    ]
    # KV memory for about a third of the requests at their full length.
    blocks = args.requests * (args.prompt_tokens + args.max_tokens) // 16 // 3
    with (
        tempfile.TemporaryDirectory(dir=".") as swap_dir,  # on disk: /tmp may be memory
        LLM(
            num_kv_blocks=blocks,
            max_num_seqs=args.requests,
            swap_disk_space=1.0,
            swap_dir=swap_dir,
            enable_prefix_caching=False,
            disable_log_stats=True,
        ) as llm,
    ):
        results: dict[bool, list[dict]] = {True: [], False: []}
        for _ in range(args.rounds):
            for read_ahead in (False, True):
                results[read_ahead].append(run_once(llm, prompts, args.max_tokens, read_ahead))
        disk = core_of(llm).executor.runner.swap_space.disk
        kv_bytes = sum(t[0].numel() * t.element_size() for pair in disk for t in pair)
    assert results[True][0]["tokens"] == results[False][0]["tokens"], "outputs differ"
    print(f"{args.requests} requests x ({args.prompt_tokens} + {args.max_tokens}) tokens, "
          f"KV memory {blocks} blocks, ~{kv_bytes / 2**10:.0f} KiB per swapped block")  # fmt: skip
    for read_ahead in (False, True):
        rows = results[read_ahead]
        name = "read-ahead on " if read_ahead else "read-ahead off"
        print(
            f"{name}: swap-ins {statistics.mean(r['loads'] for r in rows):.0f} "
            f"({statistics.mean(r['blocks_swapped_in'] for r in rows):.0f} blocks, "
            f"{statistics.mean(r['blocks_read_ahead'] for r in rows):.0f} read ahead), "
            f"engine thread in swap-ins {[round(r['load_s'] * 1000) for r in rows]} ms, "
            f"disk read during them {[round(r['read_bytes_in_loads'] / 2**20) for r in rows]} "
            f"MiB, wall {[round(r['wall_s'], 2) for r in rows]} s"
        )


if __name__ == "__main__":
    main()
