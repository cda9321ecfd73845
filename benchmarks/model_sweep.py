"""pagedllm against llama.cpp and vLLM's CPU build over model families and sizes, 0.6B-8B.

    python benchmarks/model_sweep.py                                  # every shape, Q4_K_M
    python benchmarks/model_sweep.py --shapes qwen3-0.6b,llama-3.2-1b --quant Q4_K_M,Q4_0
    python benchmarks/model_sweep.py --report benchmarks/results/sweep_zen4.json   # table only
    python benchmarks/model_sweep.py --report benchmarks/results/sweep_xeon_amx.json \
        --chart docs/img/model_sweep_xeon_amx.png

Each shape (benchmarks/model_shapes.py: random weights in the real widths, converted and
quantized by llama.cpp's own tools) runs `benchmarks/cpu_peers.py` with its GGUF for
llama.cpp and pagedllm and its Hugging Face folder for vLLM (in bf16, as vLLM runs it), a
1,024-token prefill and the bandwidth bound, the systems taking turns for `--rounds`
rounds. Every model's report is kept in one JSON per machine (`--json`), keyed by shape and
type, so reruns add to it; the table and the chart (docs/img/model_sweep.png) are made
from all of it. Large shapes take long on 2 cores (an 8B model's 64 sequences: tens of
minutes per system and round): `--npl` and `--rounds` trade coverage for time, and
`--skip vllm` leaves out the peer that reads 16-bit weights.
A long model can be measured in parts: `--merge` adds a run's sequence counts to the
model's kept report instead of replacing it (`merge_reports`).

Targets (issue 39), per family and size: one stream >= 1.5x llama.cpp's generation speed
and >= 80% of the bandwidth bound; 16 and 64 sequences >= 1.5x vLLM's CPU build (where it
runs the family) and >= 3x llama.cpp; a 1,024-token prefill >= 1.2x vLLM's; peak memory
<= 1.2x llama.cpp's from 1B up.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from model_shapes import SHAPES, gguf_file, hf_folder  # noqa: E402

SYSTEMS = ("llama.cpp", "vllm", "pagedllm")


def run_one(shape: str, quant: str, args: argparse.Namespace) -> dict:
    gguf = gguf_file(shape, quant)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        command = [
            sys.executable, str(ROOT / "benchmarks" / "cpu_peers.py"), "--model", str(gguf),
            "--hf-folder", str(hf_folder(shape)), "--npl", args.npl, "--rounds",
            str(args.rounds), "--threads", str(args.threads), "--prefill", str(args.prefill),
            "--bandwidth", "--json", str(out),
        ] + (["--skip", args.skip] if args.skip else [])  # fmt: skip
        done = subprocess.run(command, text=True, capture_output=True)
        print(done.stdout, flush=True)
        if done.returncode != 0:
            return {"error": done.stderr[-3000:]}
        return json.loads(out.read_text())


def ratios(report: dict) -> dict:
    """The targets' ratios of one model's report (missing where a system did not run)."""
    result: dict = {}
    paged, llama, vllm = (report.get(s) for s in ("pagedllm", "llama.cpp", "vllm"))
    if paged is None:
        return result
    if llama is not None and "1" in paged:
        result["gen_vs_llama"] = paged["1"]["gen_tokens_per_s"] / llama["1"]["gen_tokens_per_s"]
        result["memory_vs_llama"] = paged["peak_rss_mib"] / llama["peak_rss_mib"]
    if report.get("read_gb_per_s") and "1" in paged:
        bound = report["read_gb_per_s"] * 1e9 / report["weight_bytes_per_token"]
        result["bandwidth_share"] = paged["1"]["gen_tokens_per_s"] / bound
    for n in ("16", "64"):
        if n not in paged:
            continue
        if vllm is not None and n in vllm:
            result[f"{n}_vs_vllm"] = paged[n]["all_tokens_per_s"] / vllm[n]["all_tokens_per_s"]
        if llama is not None and n in llama:
            result[f"{n}_vs_llama"] = paged[n]["all_tokens_per_s"] / llama[n]["all_tokens_per_s"]
    if vllm is not None and "prefill" in paged and "prefill" in vllm:
        result["prefill_vs_vllm"] = (
            paged["prefill"]["tokens_per_s"] / vllm["prefill"]["tokens_per_s"]
        )
    return result


COLUMNS = [  # (ratio key, heading, target, higher is better)
    ("gen_vs_llama", "1 stream / llama.cpp", 1.5, True),
    ("bandwidth_share", "1 stream / bound", 0.8, True),
    ("16_vs_vllm", "16 / vLLM", 1.5, True),
    ("16_vs_llama", "16 / llama.cpp", 3.0, True),
    ("64_vs_vllm", "64 / vLLM", 1.5, True),
    ("64_vs_llama", "64 / llama.cpp", 3.0, True),
    ("prefill_vs_vllm", "prefill 1k / vLLM", 1.2, True),
    ("memory_vs_llama", "memory / llama.cpp", 1.2, False),
]


def print_table(results: dict) -> None:
    print("| model | " + " | ".join(c[1] for c in COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    for key, report in results.items():
        if "error" in report:
            print(f"| {key} | failed: {report['error'].splitlines()[-1][:80]} |")
            continue
        found = ratios(report)
        cells = []
        for name, _, target, higher in COLUMNS:
            if name not in found:
                cells.append("-")
                continue
            value = found[name]
            met = value >= target if higher else value <= target
            shown = f"{value:.0%}" if name == "bandwidth_share" else f"{value:.2f}x"
            cells.append(f"**{shown}**" if met else shown)
        print(f"| {key} | " + " | ".join(cells) + " |")
    print("(bold: the target met)")


def plot(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k, r in results.items() if "error" not in r]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (names, title) in zip(
        axes,
        [
            (["gen_vs_llama", "16_vs_llama", "64_vs_llama"], "against llama.cpp (same GGUF)"),
            (["16_vs_vllm", "64_vs_vllm", "prefill_vs_vllm"], "against vLLM's CPU build (bf16)"),
        ],
    ):
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            values = [ratios(results[k]).get(name, 0.0) for k in keys]
            ax.bar([x + i * width for x in range(len(keys))], values, width, label=name)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([x + width for x in range(len(keys))], keys, rotation=30, ha="right")
        ax.set_ylabel("pagedllm / peer")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def merge_reports(old: dict, new: dict) -> dict:
    """A rerun's report added to the one kept for the same model: the rerun's entries per
    system (sequence counts, prefill) replace the old ones of the same name and the others
    stay; peak memory is the larger of the two (the run with more sequences peaks higher);
    both runs' rounds are kept. The run's other fields (the streaming-read rate the
    bandwidth bound divides by, ...) come from the run that measured one stream. So a long
    model can be measured in parts (`--npl 1,16`, then `--npl 64 --prefill 0 --merge`)."""
    if "error" in old or "error" in new:
        return new
    one_stream, other = (new, old) if 1 in new.get("npl", []) else (old, new)
    merged = {k: v for k, v in {**other, **one_stream}.items() if k not in SYSTEMS}
    merged["npl"] = sorted(set(old.get("npl", [])) | set(new.get("npl", [])))
    merged["rounds"] = old.get("rounds", []) + new.get("rounds", [])
    for system in SYSTEMS:
        if system not in new:
            continue
        entry = {**old.get(system, {}), **new[system]}
        peaks = [
            r["peak_rss_mib"] for r in (old.get(system, {}), new[system]) if "peak_rss_mib" in r
        ]
        if peaks:
            entry["peak_rss_mib"] = max(peaks)
        merged[system] = entry
    merged["merged_runs"] = old.get("merged_runs", 1) + 1
    return merged


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--quant", default="Q4_K_M")
    parser.add_argument("--npl", default="1,16,64")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill", type=int, default=1024)
    parser.add_argument("--skip", default="", help="systems to leave out (cpu_peers --skip)")
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "sweep.json"))
    parser.add_argument("--report", help="print the table and chart of this JSON, run nothing")
    parser.add_argument(
        "--merge", action="store_true", help="add to the model's kept report, not replace it"
    )
    parser.add_argument(
        "--chart",
        default=str(ROOT / "docs" / "img" / "model_sweep.png"),
        help="where the chart goes (one per CPU class: name it after the JSON's machine)",
    )
    args = parser.parse_args()
    path = Path(args.report or args.json)
    results = json.loads(path.read_text()) if path.exists() else {}
    if not args.report:
        for shape in args.shapes.split(","):
            for quant in args.quant.split(","):
                key = f"{shape} {quant}"
                print(f"== {key}", flush=True)
                report = run_one(shape, quant, args)
                if args.merge and key in results:
                    report = merge_reports(results[key], report)
                results[key] = report
                path.write_text(json.dumps(results, indent=1))  # kept after every model
    print_table(results)
    plot(results, Path(args.chart))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
