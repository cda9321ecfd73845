"""AWQ INT4 quality on the default model (SmolLM2-135M-Instruct), on CPU.

Perplexity on a held-out public-domain text (quant/data/evaluation.txt) for:
  full precision | plain round-to-nearest INT4 (RTN) | pagedllm's AWQ INT4
all at group size 64 (576 = SmolLM2's hidden size is not a multiple of 128), computed by
transformers' own model holding each set of weights. Then the AWQ checkpoint is written,
served by the engine, and compared with the full-precision engine: weight memory, greedy
answers to a few questions, decode speed.

    .venv/bin/python benchmarks/awq_quality.py [--num-samples 32] [--seq-len 256] [--threads 1]

Takes a few minutes on 2 CPU cores. Writes benchmarks/results/awq_quality.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from pagedllm_integrations import LLM, SamplingParams
from pagedllm_integrations.cli_quantize import (
    DEFAULT_CALIBRATION,
    load_float_model,
    read_calibration_text,
)
from pagedllm_integrations.engine.model_loader import default_model_path, gguf_to_hf_folder
from pagedllm_integrations.engine.white_box import core_of
from pagedllm_integrations.quant.awq_format import AWQConfig
from pagedllm_integrations.quant.awq_linear import AWQLinear
from pagedllm_integrations.quant.quantizer import (
    QuantizeOptions,
    awq_quantize_model,
    calibration_blocks,
    rtn_quantize_model,
    save_awq_checkpoint,
)

EVALUATION = DEFAULT_CALIBRATION.parent / "evaluation.txt"
RESULTS = Path(__file__).parent / "results" / "awq_quality.json"
QUESTIONS = [
    "What is the capital of France?",
    "How many days are there in a week?",
    "Name a primary color.",
]


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, window: int) -> float:
    """exp(mean NLL) over non-overlapping windows of `window` tokens."""
    total_nll, count = 0.0, 0
    for start in range(0, ids.numel() - 1, window):
        chunk = ids[start : start + window]
        if chunk.numel() < 2:
            break
        logits = model(chunk[None]).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum")
        total_nll += float(nll)
        count += chunk.numel() - 1
    return math.exp(total_nll / count)


def engine_weight_bytes(llm: LLM) -> dict[str, int]:
    """Bytes the engine's model holds: decoder linears, and everything (embeddings, norms...)."""
    model = core_of(llm).model
    linear = 0
    for module in model.modules():
        if isinstance(module, AWQLinear):
            linear += module.weight_bytes()
        elif hasattr(module, "load") and hasattr(module, "weight"):
            linear += module.weight.numel() * module.weight.element_size()
            if getattr(module, "bias", None) is not None:
                linear += module.bias.numel() * module.bias.element_size()
    everything = sum(p.numel() * p.element_size() for p in model.parameters())
    everything += sum(m.weight_bytes() for m in model.modules() if isinstance(m, AWQLinear))
    return {"decoder_linears": linear, "total": everything}


def chat_answers(llm: LLM, max_tokens: int) -> tuple[list[str], float]:
    """Greedy answers to QUESTIONS, and decode tokens/s of one request alone."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outputs = [llm.chat(c, params, use_tqdm=False)[0] for c in conversations]
    answers = [o.outputs[0].text.strip() for o in outputs]
    timed = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    started = time.perf_counter()
    llm.generate("Once upon a time", timed, use_tqdm=False)
    return answers, 64 / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--num-samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--search-samples", type=int, default=8)
    parser.add_argument("--window", type=int, default=512, help="perplexity window (tokens)")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    folder = gguf_to_hf_folder(default_model_path())
    base, tokenizer = load_float_model(folder)
    eval_ids = torch.tensor(tokenizer(EVALUATION.read_text()).input_ids)
    texts = read_calibration_text(DEFAULT_CALIBRATION)
    blocks = calibration_blocks(tokenizer, texts, args.num_samples, args.seq_len)
    print(f"evaluation: {eval_ids.numel()} tokens; calibration: {tuple(blocks.shape)} blocks")

    results: dict = {
        "model": "SmolLM2-135M-Instruct",
        "group_size": args.group_size,
        "calibration_blocks": list(blocks.shape),
        "evaluation_tokens": int(eval_ids.numel()),
        "threads": torch.get_num_threads(),
    }
    ppl_fp = perplexity(base, eval_ids, args.window)

    rtn_model = copy.deepcopy(base)
    rtn_quantize_model(rtn_model, args.group_size)
    ppl_rtn = perplexity(rtn_model, eval_ids, args.window)
    del rtn_model

    awq_model = copy.deepcopy(base)
    options = QuantizeOptions(
        group_size=args.group_size,
        num_samples=args.num_samples,
        seq_len=args.seq_len,
        search_samples=args.search_samples,
    )
    started = time.perf_counter()
    quantized, report = awq_quantize_model(awq_model, blocks, options)
    quant_seconds = time.perf_counter() - started
    ppl_awq = perplexity(awq_model, eval_ids, args.window)
    print(f"perplexity fp32 {ppl_fp:.3f}, RTN {ppl_rtn:.3f}, AWQ {ppl_awq:.3f}", flush=True)
    results["perplexity"] = {"fp32": ppl_fp, "rtn_int4": ppl_rtn, "awq_int4": ppl_awq}
    results["perplexity_ratio"] = {"rtn_int4": ppl_rtn / ppl_fp, "awq_int4": ppl_awq / ppl_fp}
    results["quantize_seconds"] = quant_seconds
    results["quantize_seconds_per_layer"] = quant_seconds / len(report.seconds_per_layer)
    results["alpha"] = report.ratios

    with tempfile.TemporaryDirectory() as tmp:
        out = save_awq_checkpoint(
            awq_model,
            quantized,
            Path(tmp) / "awq",
            AWQConfig(group_size=args.group_size),
            folder,
            tokenizer,
        )
        results["checkpoint_bytes"] = {
            "fp32_source": (folder / "model.safetensors").stat().st_size,
            "awq": (out / "model.safetensors").stat().st_size,
        }
        engines = {}
        runs = (
            ("fp32", None, "auto"),  # the CPU engine runs float32 by default
            ("awq_int4", str(out), "auto"),  # float32 activations: exact, slow int4 kernels
            ("awq_int4_bf16", str(out), "bfloat16"),  # torch's AVX512 bf16 int4 kernel
        )
        for name, source, dtype in runs:
            with LLM(source, disable_log_stats=True, max_model_len=1024, dtype=dtype) as llm:
                answers, tok_s = chat_answers(llm, 40)
                engines[name] = {
                    "weight_bytes": engine_weight_bytes(llm),
                    "answers": dict(zip(QUESTIONS, answers)),
                    "decode_tokens_per_s": tok_s,
                }
        results["engine"] = engines

    print()
    print(f"{'weights':<10}{'perplexity':>12}{'ratio':>8}")
    for key, label in (("fp32", "fp32"), ("rtn_int4", "RTN int4"), ("awq_int4", "AWQ int4")):
        ppl = results["perplexity"][key]
        print(f"{label:<10}{ppl:>12.3f}{ppl / ppl_fp:>8.3f}")
    print(
        f"\nquantization: {quant_seconds:.0f}s "
        f"({results['quantize_seconds_per_layer']:.1f}s per layer)"
    )
    mib = 1 << 20
    for name, engine in engines.items():
        wb = engine["weight_bytes"]
        print(
            f"{name:<14} linears {wb['decoder_linears'] / mib:7.1f} MiB, all weights "
            f"{wb['total'] / mib:7.1f} MiB, decode {engine['decode_tokens_per_s']:.1f} tok/s"
        )
        for question, answer in engine["answers"].items():
            print(f"   Q: {question}\n   A: {answer[:160]!r}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0 if ppl_awq < ppl_rtn else 1


if __name__ == "__main__":
    sys.exit(main())
