"""Python started in the checkout root without -P: the root is on sys.path, so the folder
kernels/ is importable as a top-level `kernels`, the name of Hugging Face's package that
transformers imports. That import must reach Hugging Face's package (or, where it is not
installed, fail saying what to do), and pagedllm's own kernels stay importable."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run_in_checkout_root(*args: str) -> subprocess.CompletedProcess[str]:
    # No -P: the current directory (the checkout root) goes first on sys.path.
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_transformers_gets_hugging_face_kernels_and_pagedllm_its_own():
    hub_installed = importlib.util.find_spec("kernels") is not None  # this run has -P
    code = (
        "import transformers.integrations.hub_kernels\n"
        "from pagedllm_integrations.kernels import ops\n"
        "print(ops.__file__)\n"
        "import kernels\n"
        "print(kernels.__file__)\n"
    )
    result = _run_in_checkout_root("-c", code)
    if not hub_installed:
        assert result.returncode != 0 and "run Python with -P" in result.stderr
        return
    assert result.returncode == 0, result.stderr
    ours, theirs = result.stdout.split()
    assert Path(ours) == ROOT / "kernels" / "ops.py"
    assert not Path(theirs).is_relative_to(ROOT / "kernels")


def test_without_another_kernels_package_the_error_says_what_to_do():
    # -S: no site-packages, so the checkout's folder is the only `kernels` there is.
    result = _run_in_checkout_root("-S", "-c", "import kernels")
    assert result.returncode != 0
    assert "ImportError" in result.stderr
    assert "pagedllm_integrations.kernels" in result.stderr
    assert "run Python with -P" in result.stderr


def test_engine_and_quant_as_top_level_names_say_what_to_import():
    for folder in ("engine", "quant"):
        result = _run_in_checkout_root("-S", "-c", f"import {folder}")
        assert result.returncode != 0
        assert f"import `pagedllm_integrations.{folder}`" in result.stderr
