"""The CPU paged-attention kernels of this checkout against another commit's, for each
instruction-set build this CPU can run: the same bits, and the time.

    python benchmarks/attention_builds.py --baseline HEAD~1 [--rounds 3]

For each build (-march=native; without AVX512-BF16, i.e. the FMA kernels of AVX-512 CPUs
such as Cascade Lake and Ice Lake; without AVX-512, i.e. the AVX2 kernels of laptops), the
kernel library is compiled from both source trees (the baseline's from `git archive`), in
child processes, into a cache folder (a few minutes the first time). Each child runs 240
attention cases and the timed ones; the script checks that both trees' outputs are equal
bit for bit, and prints each timing as the best of `--rounds` runs per tree, the trees
alternating, with the ratio. Timed (SmolLM2's heads: 9 query, 3 KV, head_dim 64, bf16 and
float32 caches; times x 30 layers): 64 sequences decoding at 192 keys, 16 at 1,000, 16
verifying 5 tokens at 1,000, and a 512-row prompt chunk at depth 2,048 (also at head_dim
128, 16 / 8 heads).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILDS = {"native": "", "no-avx512bf16": "-mno-avx512bf16", "avx2": "-mno-avx512f"}

CHILD = r"""
import sys, time, torch
from torch.utils import cpp_extension
csrc, build, flags, sources, out = sys.argv[1:6]
cpp_extension.load(
    name="pagedllm_attention_builds", sources=[csrc + "/" + s for s in sources.split(",")],
    extra_cflags=["-O3", "-march=native", *flags.split(), "-ffp-contract=off", "-fopenmp",
                  "-std=c++17"],
    extra_ldflags=["-fopenmp"], extra_include_paths=[csrc], build_directory=build,
    is_python_module=False)
attend = torch.ops.pagedllm.paged_attention_rows_

def case(g, heads, kv_heads, d, lens, query_lens, dtype, window=0, soft_cap=0.0):
    bs, tables, used = 16, [], 0
    width = max(-(-n // bs) for n in lens)
    for n in lens:
        count = -(-n // bs)
        tables.append(list(range(used, used + count)) + [0] * (width - count))
        used += count
    order = torch.randperm(used, generator=g)  # blocks scattered over the cache
    tables = [[int(order[b]) for b in row] for row in tables]
    k = torch.randn(used, kv_heads, d, bs, generator=g).to(dtype)
    v = torch.randn(used, kv_heads, bs, d, generator=g).to(dtype)
    cu = [0]
    for n in query_lens:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], heads, d, generator=g)
    return [q, k, v, torch.zeros_like(q), torch.arange(len(lens)),
            torch.tensor(cu, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
            torch.tensor(tables, dtype=torch.int32), d ** -0.5, window, soft_cap]

g = torch.Generator().manual_seed(7)
outputs = []
for dtype in (torch.bfloat16, torch.float32):
    for heads, kv in ((6, 2), (9, 3), (8, 8), (4, 1), (10, 2)):
        for d in (32, 64, 80, 128):
            for window, cap in ((0, 0.0), (0, 5.0), (33, 0.0)):
                for lens, query_lens in (([1, 9, 40, 70, 130, 300], [1, 1, 3, 1, 20, 40]),
                                         ([200 + 7 * i for i in range(12)], [1] * 6 + [5] * 6)):
                    args = case(g, heads, kv, d, lens, query_lens, dtype, window, cap)
                    attend(*args)
                    outputs.append(args[3])
times = {}
for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "f32")):
    for label, shape, reps in (
        ("decode 64 x 192", (9, 3, 64, [192] * 64, [1] * 64), 50),
        ("decode 16 x 1000", (9, 3, 64, [1000] * 16, [1] * 16), 50),
        ("verify 16 x 5 @ 1000", (9, 3, 64, [1000] * 16, [5] * 16), 20),
        ("prompt 512 @ 2048", (9, 3, 64, [2048], [512]), 5),
        ("prompt 512 @ 2048 d128", (16, 8, 128, [2048], [512]), 3),
    ):
        args = case(g, *shape, dtype)
        best = float("inf")
        for _ in range(reps):
            began = time.perf_counter()
            attend(*args)
            best = min(best, time.perf_counter() - began)
        times[f"{label} {name}"] = best * 30 * 1000  # ms, 30 layers
torch.save({"outputs": outputs, "times": times}, out)
"""


def sources() -> str:
    from pagedllm_integrations.kernels.isa_levels import SOURCES  # the library's .cpp files

    return ",".join(SOURCES)


def run_child(csrc: Path, build: Path, flags: str, out: Path) -> dict:
    build.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [sys.executable, "-P", "-c", CHILD, str(csrc), str(build), flags, sources(), str(out)],
        capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    import torch

    return torch.load(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="a git commit or ref")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--builds", default=",".join(BUILDS))
    args = parser.parse_args()
    import torch

    cache = Path(tempfile.gettempdir()) / "pagedllm-attention-builds"
    baseline = cache / "baseline-src"
    if baseline.exists():
        subprocess.run(["rm", "-rf", str(baseline)], check=True)
    baseline.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", args.baseline, "kernels/csrc"],
        capture_output=True, check=True,
    ).stdout  # fmt: skip
    (cache / "baseline.tar").write_bytes(archive)
    with tarfile.open(cache / "baseline.tar") as tar:
        tar.extractall(baseline, filter="data")
    trees = {"baseline": baseline / "kernels" / "csrc", "this": ROOT / "kernels" / "csrc"}
    for build in args.builds.split(","):
        flags = BUILDS[build]
        best: dict[str, dict[str, float]] = {name: {} for name in trees}
        outputs = {}
        for _ in range(args.rounds):
            for name, csrc in trees.items():
                result = run_child(csrc, cache / f"{build}-{name}", flags, cache / "out.pt")
                outputs[name] = result["outputs"]
                for key, ms in result["times"].items():
                    best[name][key] = min(best[name].get(key, float("inf")), ms)
        same = all(torch.equal(a, b) for a, b in zip(outputs["baseline"], outputs["this"]))
        print(f"{build}: {len(outputs['this'])} cases, outputs "
              f"{'equal bit for bit' if same else 'DIFFER'}")  # fmt: skip
        for key in best["this"]:
            was, now = best["baseline"][key], best["this"][key]
            print(f"  {key:28s} {was:8.1f} -> {now:8.1f} ms  ({now / was:.2f}x)")


if __name__ == "__main__":
    main()
