"""How a long prompt's prefill steps grow with depth, per step token budget.

    python benchmarks/prefill_chunks.py [--prompt 4096] [--budgets 512,256,128]

One prompt of random token ids runs alone on the default model with chunked prefill, once
per `max_num_batched_tokens` budget; every engine step is timed. A chunk deep in the
prompt attends to every earlier key, so its step is longer than the first one: that step is
what a stream decoding beside the prompt waits for (its inter-token latency). Prints each
budget's step times (seconds), its longest step and the prefill speed (prompt tokens over
the prefill steps' time).
"""

from __future__ import annotations

import argparse
import random
import time

from pagedllm_integrations import SamplingParams
from pagedllm_integrations.engine.async_engine import AsyncEngine
from pagedllm_integrations.engine.config import EngineConfig
from pagedllm_integrations.engine.model_loader import default_model_path
from pagedllm_integrations.engine.white_box import core_of

GENERATED = 4  # tokens after the prompt (their steps are not prefill)


def step_times(prompt_len: int, budget: int, seed: int) -> list[float]:
    config = EngineConfig(
        model=str(default_model_path()),
        disable_log_stats=True,
        max_model_len=prompt_len + 64,
        max_num_batched_tokens=budget,
    )
    with AsyncEngine(config) as engine:
        core = core_of(engine)
        times: list[float] = []
        step = core.step

        def timed_step():  # runs on the engine thread
            started = time.perf_counter()
            outputs = step()
            times.append(time.perf_counter() - started)
            return outputs

        core.step = timed_step  # type: ignore[method-assign]
        rng = random.Random(seed)
        prompt = [rng.randint(1000, 48000) for _ in range(prompt_len)]
        params = SamplingParams(temperature=0, max_tokens=GENERATED, ignore_eos=True)
        engine.add_request({"prompt_token_ids": prompt}, params).result()
    return times[: len(times) - (GENERATED - 1)]  # the last prefill step samples token 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=4096, help="prompt tokens")
    parser.add_argument("--budgets", default="512,256,128", help="max_num_batched_tokens")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for budget in (int(b) for b in args.budgets.split(",")):
        times = step_times(args.prompt, budget, args.seed)
        print(
            f"budget {budget:5d}: {len(times)} steps, longest {max(times):.3f} s, "
            f"prefill {args.prompt / sum(times):.0f} tok/s; steps {[round(t, 3) for t in times]}"
        )


if __name__ == "__main__":
    main()
