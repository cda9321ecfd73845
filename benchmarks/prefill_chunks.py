"""How a long prompt's prefill steps grow with depth, and what streams decoding beside it
wait for its chunks, with and without the depth cap.

    python benchmarks/prefill_chunks.py [--prompt 4096] [--budgets 512,256,128]
    python benchmarks/prefill_chunks.py --decoding 4 [--budgets 512]

Alone (`--decoding 0`): one prompt of random token ids runs with chunked prefill, once per
`max_num_batched_tokens` budget, every engine step timed. A chunk deep in the prompt
attends to every earlier key, so its step is longer than the first one. Prints each
budget's step times (seconds), its longest step and the prefill speed.

Beside decoding streams (`--decoding N`): N short requests decode (ignoring EOS) while the
long prompt is submitted; once with the scheduler's depth cap (engine/prefill_cost.py: a
chunk in a step with decodes is cut to what the budget buys at its depth) and once without
(the cost model removed, chunks as the token budget allows). Prints the long prompt's time
to its first token and the streams' inter-token gaps while it prefilled: the median, the
P99 and the longest.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import threading
import time

from pagedllm_integrations import SamplingParams
from pagedllm_integrations.engine.async_engine import AsyncEngine
from pagedllm_integrations.engine.config import EngineConfig
from pagedllm_integrations.engine.model_loader import default_model_path
from pagedllm_integrations.engine.white_box import core_of

GENERATED = 4  # tokens after the prompt when it runs alone (their steps are not prefill)
SHORT_PROMPT = 32  # tokens of each decoding stream's prompt


def make_engine(prompt_len: int, budget: int) -> AsyncEngine:
    config = EngineConfig(
        model=str(default_model_path()),
        disable_log_stats=True,
        max_model_len=prompt_len + 64,
        max_num_batched_tokens=budget,
    )
    return AsyncEngine(config)


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randint(1000, 48000) for _ in range(length)]


def step_times(prompt_len: int, budget: int, seed: int) -> list[float]:
    """Seconds of each prefill step of one prompt alone."""
    with make_engine(prompt_len, budget) as engine:
        core = core_of(engine)
        times: list[float] = []
        step = core.step

        def timed_step():  # runs on the engine thread
            started = time.perf_counter()
            outputs = step()
            times.append(time.perf_counter() - started)
            return outputs

        core.step = timed_step  # type: ignore[method-assign]
        prompt = random_prompt(random.Random(seed), prompt_len)
        params = SamplingParams(temperature=0, max_tokens=GENERATED, ignore_eos=True)
        engine.add_request({"prompt_token_ids": prompt}, params).result()
    return times[: len(times) - (GENERATED - 1)]  # the last prefill step samples token 1


def beside_streams(
    prompt_len: int, budget: int, streams: int, depth_cap: bool, seed: int
) -> tuple[float, list[float]]:
    """The long prompt's time to first token, and the gaps (s) between the decoding
    streams' tokens while it prefilled."""
    rng = random.Random(seed)
    with make_engine(prompt_len, budget) as engine:
        if not depth_cap:
            core_of(engine).scheduler.prefill_cost = None  # chunks by the token budget only
        arrivals: list[list[float]] = [[] for _ in range(streams)]
        first_tokens = threading.Barrier(streams + 1)
        decode = SamplingParams(temperature=0, max_tokens=prompt_len, ignore_eos=True)
        handles = [
            engine.add_request({"prompt_token_ids": random_prompt(rng, SHORT_PROMPT)}, decode)
            for _ in range(streams)
        ]

        def follow(index: int) -> None:
            for count, _ in enumerate(handles[index]):
                arrivals[index].append(time.perf_counter())
                if count == 0:
                    first_tokens.wait()

        readers = [threading.Thread(target=follow, args=(i,)) for i in range(streams)]
        for reader in readers:
            reader.start()
        first_tokens.wait()  # every stream is decoding
        long_params = SamplingParams(temperature=0, max_tokens=1)
        submitted = time.perf_counter()
        engine.add_request(
            {"prompt_token_ids": random_prompt(rng, prompt_len)}, long_params
        ).result()
        done = time.perf_counter()
        for handle in handles:
            engine.abort(handle.request_id)
        for reader in readers:
            reader.join()
    gaps = [
        later - earlier
        for times in arrivals
        for earlier, later in itertools.pairwise(times)
        if submitted <= later <= done
    ]
    return done - submitted, gaps


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=4096, help="prompt tokens")
    parser.add_argument("--budgets", default="512,256,128", help="max_num_batched_tokens")
    parser.add_argument("--decoding", type=int, default=0, help="streams decoding beside it")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for budget in (int(b) for b in args.budgets.split(",")):
        if args.decoding == 0:
            times = step_times(args.prompt, budget, args.seed)
            print(
                f"budget {budget:5d}: {len(times)} steps, longest {max(times):.3f} s, "
                f"prefill {args.prompt / sum(times):.0f} tok/s; "
                f"steps {[round(t, 3) for t in times]}"
            )
            continue
        for depth_cap in (True, False):
            ttft, gaps = beside_streams(args.prompt, budget, args.decoding, depth_cap, args.seed)
            print(
                f"budget {budget:5d}, {args.decoding} streams, depth cap "
                f"{'on ' if depth_cap else 'off'}: prompt's first token {ttft:.2f} s "
                f"({args.prompt / ttft:.0f} tok/s); streams' gaps while it prefilled: "
                f"P50 {statistics.median(gaps) * 1e3:.0f} ms, "
                f"P99 {percentile(gaps, 0.99) * 1e3:.0f} ms, "
                f"max {max(gaps) * 1e3:.0f} ms ({len(gaps)} gaps)"
            )


if __name__ == "__main__":
    main()
