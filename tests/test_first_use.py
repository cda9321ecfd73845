"""`pip install` of the wheel alone, then the first call (issue 44); slow: it builds the
wheel and installs it with its dependencies into a fresh virtual environment.

benchmarks/first_use.py does the work (and times it: the target of a first token within
10 s of the call lives there); this test checks what the user gets: the answer the source
tree's engine gives, kernels from the wheel (nothing compiled), the model from the wheel
(nothing converted), and the package imported from the environment, not from a checkout.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from pagedllm_integrations import SamplingParams
from pagedllm_integrations.kernels import isa_levels

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def load_benchmark():
    spec = importlib.util.spec_from_file_location("first_use", ROOT / "benchmarks/first_use.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pip_install_of_the_wheel_alone_answers_at_once(tmp_path, default_llm):
    benchmark = load_benchmark()
    report = benchmark.run(None, tmp_path)
    expected = (
        default_llm.chat(
            [{"role": "user", "content": benchmark.PROMPT}],
            SamplingParams(temperature=0, max_tokens=24),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .text
    )
    for kind in ("llm", "chat"):  # shown with -s; benchmarks/first_use.py prints a table
        r = report[kind]
        print(f"{kind}: call -> first token {r['call_to_first_token_s']:.1f} s "
              f"(CPU {r['cpu_s']:.1f} s, load average {r['load_average']:.1f})")  # fmt: skip
    level, fits = isa_levels.best_level(isa_levels.cpu_flags())
    for kind in ("llm", "chat"):
        result = report[kind]
        assert result["text"] == expected, kind
        assert result["package"].startswith(str(tmp_path / "venv")), result["package"]
        # Nothing compiled and nothing converted: the cache holds neither.
        assert "ext" not in result["cache_after"] and "gguf" not in result["cache_after"]
        assert "compiling" not in result["stderr"] and "converting" not in result["stderr"]
        if level is not None and fits:
            assert result["kernels"] == f"prebuilt {level.name}"
