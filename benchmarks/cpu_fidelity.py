"""What the CPU fast path costs in fidelity: perplexity and greedy agreement against the
float32 reference path (which equals transformers token for token).

    python benchmarks/cpu_fidelity.py                      # the embedded SmolLM2 Q4_1 GGUF
    python benchmarks/cpu_fidelity.py --model path/to/model.gguf

Perplexity is measured on held-out text (quant/data/evaluation.txt, public domain, not the
AWQ calibration text) in windows of --window tokens; greedy agreement is, per prompt of the
parity tests, how many of --tokens generated tokens the fast path produces before it first
differs from float32. Both paths read the same GGUF file: float32 dequantizes it exactly,
the fast path keeps its blocks packed (exact values) and computes in bf16 with float32 sums.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from pagedllm_integrations.engine.attention_metadata import AttentionMetadata
from pagedllm_integrations.engine.config import EngineConfig
from pagedllm_integrations.engine.llm_engine import LLMEngine
from pagedllm_integrations.engine.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "Explain in one sentence why the sky is blue, and then give an example of a blue object.",
    "Q: What is the largest planet in the solar system?\nA:",
    "Once upon a time, in a kingdom far away, there lived a princess who loved to read books "
    "about distant stars, strange machines and the people who built them. One day",
    "Translate to French: I like apples.",
]


@torch.inference_mode()
def window_nll(engine: LLMEngine, ids: list[int]) -> tuple[float, int]:
    """Summed negative log-likelihood of ids[1:] given their prefixes (one forward pass)."""
    runner = engine.executor.runner
    n, bs = len(ids), engine.config.block_size
    per_table = -(-n // bs)
    groups = runner.layout.num_groups  # each block-table group its own blocks (kv_layout.py)
    blocks = torch.arange(groups * per_table, dtype=torch.int32).view(groups, 1, per_table)
    positions = torch.arange(n)
    slots = torch.stack([positions + g * per_table * bs for g in range(groups)])  # [G, n]
    meta = AttentionMetadata(
        slot_mapping=slots[0],
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=blocks[0],
        max_seqlen_q=n,
        max_seqlen_k=n,
        backend=runner.backend,
    )
    if runner.layout.grouped:
        meta.set_groups(blocks, slots, runner.layout.layer_groups)
    hidden = engine.model(torch.tensor(ids), positions, runner.kv_caches, meta)
    logits = engine.model.compute_logits(hidden[:-1])
    targets = torch.tensor(ids[1:])
    nll = torch.nn.functional.cross_entropy(logits, targets, reduction="sum")
    return float(nll), n - 1


def perplexity(engine: LLMEngine, text: str, window: int) -> float:
    ids = engine.tokenizer(text).input_ids
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window + 1]
        if len(chunk) < 2:
            break
        nll, n = window_nll(engine, chunk)
        total, count = total + nll, count + n
    return math.exp(total / count)


def greedy(engine: LLMEngine, tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(engine.inputs.process_inputs(prompt, params, request_id=str(index)))
    finished: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
    return [finished[str(i)] for i in range(len(PROMPTS))]


def measure(model: str | None, dtype: str, window: int, tokens: int) -> dict:
    started = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, disable_log_stats=True))
    text = (ROOT / "quant" / "data" / "evaluation.txt").read_text()
    result = {
        "plan": engine.plan.describe(),
        "perplexity": perplexity(engine, text, window),
        "greedy": greedy(engine, tokens),
        "seconds": time.perf_counter() - started,
    }
    engine.shutdown()
    return result


def agreement(a: list[int], b: list[int]) -> int:
    """Tokens until the first difference."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="GGUF file or folder (default: embedded)")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument(
        "--json", default=str(ROOT / "benchmarks" / "results" / "cpu_fidelity.json")
    )
    args = parser.parse_args()
    reference = measure(args.model, "float32", args.window, args.tokens)
    fast = measure(args.model, "auto", args.window, args.tokens)
    agree = [agreement(a, b) for a, b in zip(reference["greedy"], fast["greedy"])]
    change = fast["perplexity"] / reference["perplexity"] - 1
    print(f"float32 reference: {reference['plan']}")
    print(f"default:           {fast['plan']}")
    print(
        f"perplexity (held-out text, {args.window}-token windows): float32 "
        f"{reference['perplexity']:.3f}, default {fast['perplexity']:.3f} ({change:+.2%})"
    )
    print(f"greedy agreement over {len(PROMPTS)} prompts x {args.tokens} tokens: tokens until "
          f"the first difference {agree} (identical: {sum(a == args.tokens for a in agree)}/"
          f"{len(agree)})")  # fmt: skip
    report = {
        "model": args.model or "embedded SmolLM2-135M-Instruct Q4_1",
        "float32": {k: v for k, v in reference.items() if k != "greedy"},
        "default": {k: v for k, v in fast.items() if k != "greedy"},
        "perplexity_change": change,
        "greedy_agreement_tokens": agree,
        "tokens": args.tokens,
    }
    Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
