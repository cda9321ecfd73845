"""What streams that are decoding wait while other requests' prefixes come back from disk.

    python benchmarks/disk_prefix_overlap.py [--system-tokens 2000] [--loads 4] [--streams 4]

One engine on the default model with `prefix_cache_dir`: `--loads` system prompts of random
token ids are saved to disk (`save_prefix`) and dropped from memory (`reset_prefix_cache`).
Then `--streams` requests decode, and `--loads` requests, each starting with its own system
prompt, arrive one after another, each once the one before has its first token; each one's
blocks are read from the block files (from the page cache: they were just written). Prints the
requests' time to first token and the streams' gaps between tokens while they arrived:
with the reads on the engine thread, every read is a gap; on the reader thread, the streams
go on.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import tempfile
import threading
import time

from pagedllm_integrations import SamplingParams
from pagedllm_integrations.engine.async_engine import AsyncEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--loads", type=int, default=4)
    parser.add_argument("--streams", type=int, default=4)
    args = parser.parse_args()
    rng = random.Random(0)
    systems = [
        [rng.randint(1000, 48000) for _ in range(args.system_tokens)] for _ in range(args.loads)
    ]
    with (
        tempfile.TemporaryDirectory() as cache,
        AsyncEngine(prefix_cache_dir=cache, disable_log_stats=True) as engine,
    ):
        saved = sum(engine.save_prefix({"prompt_token_ids": system}) for system in systems)
        assert engine.reset_prefix_cache()  # memory forgets them: they come from disk
        decode = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)
        streams = [
            engine.add_request({"prompt_token_ids": [rng.randint(1000, 48000)] * 8}, decode)
            for _ in range(args.streams)
        ]
        arrivals: list[list[float]] = [[] for _ in streams]

        def follow(index: int) -> None:
            for _ in streams[index]:
                arrivals[index].append(time.perf_counter())

        readers = [threading.Thread(target=follow, args=(i,)) for i in range(len(streams))]
        for reader in readers:
            reader.start()
        while not all(arrivals):
            time.sleep(0.01)
        ttfts, loaded = [], 0
        began = time.perf_counter()
        one_token = SamplingParams(temperature=0, max_tokens=1)
        for system in systems:
            question = [rng.randint(1000, 48000) for _ in range(16)]
            submitted = time.perf_counter()
            output = engine.add_request({"prompt_token_ids": system + question}, one_token).result()
            ttfts.append(time.perf_counter() - submitted)
            loaded += output.num_cached_tokens
        ended = time.perf_counter()
        for stream in streams:
            engine.abort(stream.request_id)
        for reader in readers:
            reader.join()
        disk_loaded = engine.scheduler_stats().prefix_cache_disk_loaded
    gaps = [
        later - earlier
        for times in arrivals
        for earlier, later in itertools.pairwise(times)
        if began <= later <= ended
    ]
    print(
        f"system prompts of {args.system_tokens} tokens ({saved} saved), {args.loads} loads beside "
        f"{args.streams} streams: tokens read from disk {disk_loaded}, cached per load "
        f"{loaded / args.loads:.0f}; time to first token median "
        f"{statistics.median(ttfts) * 1e3:.0f} ms; streams' gaps meanwhile: median "
        f"{statistics.median(gaps) * 1e3:.1f} ms, max {max(gaps) * 1e3:.1f} ms ({len(gaps)})"
    )


if __name__ == "__main__":
    main()
