"""Charts for README.md and BENCHMARKS.md from the benchmarks' JSON (benchmarks/results/).

    python benchmarks/plot.py            # writes docs/img/*.png for the results present

- throughput.png: output tokens/s against concurrent requests (benchmarks/concurrency.py)
- prefix_cache_ttft.png: time to first token with and without a prefix-cache hit
  (benchmarks/prefix_cache.py)
- cpu_peers.png: all tokens/s against sequences at once, pagedllm, llama.cpp and vLLM's CPU
  build on the same CPU (benchmarks/cpu_peers.py)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parent.parent


def plot_concurrency(data: dict, out: Path) -> None:
    rows = data["rows"]
    levels = [r["concurrency"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(
        levels, [r["pagedllm_tok_s"] for r in rows], "o-", label="pagedllm (continuous batching)"
    )
    if all("transformers_static_tok_s" in r for r in rows):
        ax.plot(
            levels,
            [r["transformers_static_tok_s"] for r in rows],
            "s--",
            label="transformers (one static batch)",
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(x) for x in levels])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Throughput against concurrency (SmolLM2-135M, CPU)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_prefix_cache(data: dict, out: Path) -> None:
    labels = ["first request\n(cold)", "second request\ncache off", "second request\ncache on"]
    values = [data["on"]["first_ttft_s"], data["off"]["second_ttft_s"], data["on"]["second_ttft_s"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    bars = ax.bar(labels, values, color=["#999999", "#d62728", "#2ca02c"])
    for bar, value in zip(bars, values):
        ax.text(bar.get_x() + bar.get_width() / 2, value, f"{value:.2f}s", ha="center", va="bottom")
    ax.set_ylabel("time to first token (s)")
    tokens = data["on"]["prompt_tokens"]
    ax.set_title(
        f"Shared {tokens}-token prompt: TTFT {data['ttft_speedup']:.1f}x lower with the cache"
    )
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_cpu_peers(data: dict, out: Path) -> None:
    styles = {"pagedllm": "o-", "llama.cpp": "s--", "vllm": "^--"}
    labels = {"pagedllm": "pagedllm (defaults)", "llama.cpp": "llama.cpp", "vllm": "vLLM CPU"}
    levels = data["npl"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for system, style in styles.items():
        if system in data:
            speeds = [data[system][str(n)]["all_tokens_per_s"] for n in levels]
            ax.plot(levels, speeds, style, label=labels[system])
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(x) for x in levels])
    ax.set_xlabel("sequences at once (128 prompt + 128 generated tokens each)")
    ax.set_ylabel("all tokens/s")
    cpu = data.get("cpu", "CPU").split(" (")[0]
    ax.set_title(f"SmolLM2-135M Q4_1 GGUF, {data['threads']} threads on {cpu}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--out", default=str(ROOT / "docs" / "img"))
    args = parser.parse_args()
    results, out = Path(args.results), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    made = []
    charts = {
        "concurrency.json": (plot_concurrency, "throughput.png"),
        "prefix_cache.json": (plot_prefix_cache, "prefix_cache_ttft.png"),
        "cpu_peers.json": (plot_cpu_peers, "cpu_peers.png"),
    }
    for source, (plot, name) in charts.items():
        if (results / source).exists():
            plot(json.loads((results / source).read_text()), out / name)
            made.append(out / name)
    for path in made:
        print(f"wrote {path}")
    if not made:
        print(f"no benchmark results in {results}: run the benchmarks first")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
