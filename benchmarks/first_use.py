"""The first ten minutes of a new user: `pip install` of the wheel alone, then the first call.

    python benchmarks/first_use.py [--wheel dist/pagedllm-*.whl] [--out results/first_use.json]

Builds the wheel (as `make wheel` does) unless one is given, installs it with pip into a
fresh virtual environment (no make, no source tree; torch first, the release the wheel's
kernels were built against, as a CPU user installs the CPU build of torch first), and from
another directory, with an empty pagedllm cache (no compiled kernels, no converted GGUF),
runs two fresh processes:
- `LLM()` and a one-token `generate`: seconds from the `LLM()` call to the first token;
- `ChatPagedLLM().stream(...)`: seconds from the call to the first streamed chunk.
Each reports where its kernels came from and what its cache holds afterwards. The target
is a first token within 10 s of the call on a 2-core machine. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Name three colours."

# Run inside the fresh environment. Times start at the call, after `import` (reported apart).
PROBE = r"""
import json, os, resource, sys, time
def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
load_average = os.getloadavg()[0]
started = time.perf_counter()
kind = sys.argv[1]
if kind == "llm":
    from pagedllm_integrations import LLM, SamplingParams
    imported, cpu_at_call = time.perf_counter(), cpu()
    llm = LLM()
    out = llm.chat([{"role": "user", "content": sys.argv[2]}],
                   SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    first, cpu_at_first = time.perf_counter(), cpu()
    text = llm.chat([{"role": "user", "content": sys.argv[2]}],
                    SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0].text
else:
    from pagedllm_integrations.langchain import ChatPagedLLM
    imported, cpu_at_call = time.perf_counter(), cpu()
    chat = ChatPagedLLM(temperature=0, max_tokens=24)
    chunks = chat.stream(sys.argv[2])
    text = next(chunks).content
    first, cpu_at_first = time.perf_counter(), cpu()
    text += "".join(chunk.content for chunk in chunks)
from pagedllm_integrations.kernels import cpu_ext
import pagedllm_integrations
cache = os.environ["PAGEDLLM_CACHE_DIR"]
print(json.dumps({
    "import_s": imported - started,
    "call_to_first_token_s": first - imported,
    "cpu_s": cpu_at_first - cpu_at_call,  # CPU time of all threads: the quiet-machine cost
    "load_average": load_average,  # other work on the machine stretches the wall time
    "text": text,
    "kernels": cpu_ext.loaded_from(),
    "cache_after": sorted(os.listdir(cache)) if os.path.isdir(cache) else [],
    "package": os.path.dirname(pagedllm_integrations.__file__),
}))
"""


def build_wheel(out: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(out), str(ROOT)],
        check=True,
    )  # fmt: skip
    (wheel,) = out.glob("pagedllm-*.whl")
    return wheel


def fresh_env(wheel: Path, folder: Path) -> Path:
    """A new virtual environment with the wheel (and its langchain extra) installed by pip."""
    import torch

    subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
    python = folder / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, f"torch=={torch.__version__}"], check=True)
    subprocess.run([*pip, f"{wheel}[langchain]"], check=True)
    return python


def probe(python: Path, kind: str, cache: Path, workdir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PAGEDLLM_"))}
    env.update(PAGEDLLM_CACHE_DIR=str(cache), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(
        [str(python), "-c", PROBE, kind, PROMPT], cwd=workdir, env=env,
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the {kind} probe failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["stderr"] = done.stderr
    return result


def run(wheel: Path | None, scratch: Path) -> dict:
    started = time.perf_counter()
    wheel = wheel or build_wheel(scratch / "dist")
    built = time.perf_counter()
    python = fresh_env(wheel, scratch / "venv")
    installed = time.perf_counter()
    workdir = scratch / "elsewhere"
    workdir.mkdir()
    results = {
        kind: probe(python, kind, scratch / f"cache-{kind}", workdir) for kind in ("llm", "chat")
    }
    return {
        "wheel": wheel.name,
        "wheel_mib": wheel.stat().st_size / 2**20,
        "build_s": built - started,
        "install_s": installed - built,
        **results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wheel", type=Path, help="a built wheel (default: build one)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/first_use.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pagedllm-first-use-") as scratch:
        report = run(args.wheel, Path(scratch))
    print(f"wheel {report['wheel']} ({report['wheel_mib']:.0f} MiB): build "
          f"{report['build_s']:.0f} s, pip install into a fresh venv {report['install_s']:.0f} s")  # fmt: skip
    print(f"{'call':<26} {'import':>7} {'call -> 1st token':>18} {'its CPU time':>13} "
          f"{'load avg':>8}  kernels")  # fmt: skip
    for kind, label in (("llm", "LLM() + generate"), ("chat", "ChatPagedLLM().stream()")):
        r = report[kind]
        print(f"{label:<26} {r['import_s']:>6.1f}s {r['call_to_first_token_s']:>17.1f}s "
              f"{r['cpu_s']:>12.1f}s {r['load_average']:>8.1f}  {r['kernels']}")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
