"""EmbeddingGemma-300m's shape: pagedllm against sentence-transformers, in one run.

    python benchmarks/embeddings_gemma.py                  # 100 passages, 2 threads, 2 rounds

Model: random weights in EmbeddingGemma-300m's shape (Gemma 3, 24 layers, 768 wide, 3 query
heads and 1 KV head of 256, MLP 1,152, sliding window 512 in five layers of six,
bidirectional; vocabulary 262,144; mean pooling, Dense 768->3,072->768, Normalize), saved by
sentence-transformers itself; its tokenizer is the tests' small byte-level BPE (so a
passage is more tokens than with Gemma's: the comparison holds, the absolute rates are
lower). Speed does not depend on the values.

- documents/s: 50-300-word passages, sentence-transformers float32 batch 32 against pagedllm
  with its defaults, each in a process of its own with the same threads, alternating
  rounds, best of the rounds;
- one short query's latency in process: the median of 20 calls.
Prints a table; writes JSON to benchmarks/results/embeddings_gemma.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

import embeddings as common  # noqa: E402  (benchmarks/embeddings.py: passages, timing)

_RESULT = "RESULT "
QUERY = "task: search result | query: " + common.QUERY


def make_folder(root: Path) -> Path:
    """The random EmbeddingGemma-shaped folder, written by sentence-transformers (cached)."""
    import torch
    import transformers
    from family_checkpoints import _token_ids, make_tokenizer
    from sentence_transformers import SentenceTransformer, models

    folder = root / "embedding-gemma-shape"
    if (folder / "modules.json").exists():
        return folder
    hf = root / "hf"
    tokenizer = make_tokenizer(hf, "gemma")
    ids = {k: v for k, v in _token_ids(tokenizer, "gemma").items() if v is not None}
    config = transformers.Gemma3TextConfig(
        vocab_size=262144, hidden_size=768, intermediate_size=1152, num_hidden_layers=24,
        num_attention_heads=3, num_key_value_heads=1, head_dim=256, sliding_window=512,
        query_pre_attn_scalar=256, max_position_embeddings=2048,
        use_bidirectional_attention=True,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        **ids,
    )  # fmt: skip
    transformers.Gemma3TextModel(config).eval().save_pretrained(hf)
    identity = torch.nn.Identity()
    SentenceTransformer(
        modules=[
            models.Transformer(str(hf)),
            models.Pooling(768, pooling_mode="mean"),
            models.Dense(768, 3072, bias=False, activation_function=identity),
            models.Dense(3072, 768, bias=False, activation_function=identity),
            models.Normalize(),
        ]
    ).save(str(folder))
    return folder


def worker(name: str, folder: str, threads: int, count: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    texts = common.passages(count, seed=2)
    if name == "st":
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(folder, device="cpu")
        model.encode(texts[:8], batch_size=32)
        started = time.perf_counter()
        model.encode(texts, batch_size=32)
        elapsed = time.perf_counter() - started
        return {
            "docs_per_s": count / elapsed,
            "query_ms": common._latency(lambda: model.encode([QUERY])),
        }
    from pagedllm_integrations import LLM

    with LLM(folder, disable_log_stats=True) as llm:
        llm.embed(texts[:8], use_tqdm=False)
        started = time.perf_counter()
        llm.embed(texts, use_tqdm=False)
        elapsed = time.perf_counter() - started
        query_ms = common._latency(lambda: llm.embed([QUERY], use_tqdm=False))
    return {"docs_per_s": count / elapsed, "query_ms": query_ms}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--passages", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "pagedllm-gemma"))
    parser.add_argument(
        "--json", default=str(ROOT / "benchmarks" / "results" / "embeddings_gemma.json")
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    folder = make_folder(Path(args.work))
    if args.worker:
        result = worker(args.worker, str(folder), args.threads, args.passages)
        print(_RESULT + json.dumps(result), flush=True)
        return 0
    runs: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for name in ("st", "pagedllm"):
            command = [sys.executable, "-P", __file__, "--worker", name, "--work", args.work,
                       "--threads", str(args.threads), "--passages", str(args.passages)]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            lines = [x for x in done.stdout.splitlines() if x.startswith(_RESULT)]
            if not lines:
                raise RuntimeError(f"worker {name} failed:\n{done.stderr[-3000:]}")
            runs.setdefault(name, []).append(json.loads(lines[0][len(_RESULT) :]))
    report = {
        "cpu": common._cpu(),
        "threads": args.threads,
        "passages": args.passages,
        **{name: common._best(rounds) for name, rounds in runs.items()},
    }
    print(f"{report['cpu']}, {args.threads} threads, {args.passages} passages")
    for name, label in (("pagedllm", "pagedllm"), ("st", "sentence-transformers")):
        entry = report[name]
        print(f"{label:<24}{entry['docs_per_s']:>8.2f} docs/s{entry['query_ms']:>9.1f} ms a query")
    ratio = report["pagedllm"]["docs_per_s"] / report["st"]["docs_per_s"]
    print(f"pagedllm / sentence-transformers: {ratio:.2f}x docs/s")
    common.write_report(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
