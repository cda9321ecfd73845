"""Offline batch generation: many prompts in, one engine batch, a progress bar.

python examples/offline_batch.py [--model PATH] [--max-tokens 64] [--num-prompts 32]
"""

from __future__ import annotations

import argparse
import time

from pagedllm_integrations import LLM, SamplingParams

TOPICS = [
    "the moon",
    "bread",
    "rivers",
    "owls",
    "trains",
    "glaciers",
    "chess",
    "volcanoes",
    "honey bees",
    "lighthouses",
    "maps",
    "the violin",
    "rain",
    "deserts",
    "kites",
    "coral",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=32)
    args = parser.parse_args()

    llm = LLM(args.model)
    conversations = [
        [{"role": "user", "content": f"Write two sentences about {TOPICS[i % len(TOPICS)]}."}]
        for i in range(args.num_prompts)
    ]
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=0, max_tokens=args.max_tokens)
    started = time.perf_counter()
    outputs = llm.chat(conversations, params)  # one call: the engine batches them all
    elapsed = time.perf_counter() - started
    for conversation, output in list(zip(conversations, outputs))[:4]:
        print(f"\n### {conversation[0]['content']}\n{output.outputs[0].text.strip()}")
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(
        f"\n{len(outputs)} prompts, {tokens} tokens in {elapsed:.1f}s "
        f"({tokens / elapsed:.1f} tokens/s, {llm.engine.counters.snapshot()['max_seqs_in_step']} "
        "sequences in the largest step)"
    )
    llm.shutdown()


if __name__ == "__main__":
    main()
