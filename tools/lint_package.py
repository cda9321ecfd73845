"""The import contracts and mypy over the package as it installs: `make lint` runs this.

In the checkout, engine/, kernels/ and quant/ sit beside pagedllm_integrations/ and are
mapped under it only by setup.py's package_dir, so a tool that walks folders sees four
unconnected trees, and `from ..chat` in engine/ points at nothing. This copies the Python
files into build/package-tree/pagedllm_integrations/ with the mapped folders inside (the
layout of the wheel), then runs import-linter's contracts (.importlinter) and mypy over
that copy. Messages name the checkout's files.

    python -P tools/lint_package.py
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "pagedllm_integrations"
MAPPED = ("engine", "kernels", "quant")  # as in setup.py: folder -> pagedllm_integrations.<folder>
CONTRACTS = ROOT / ".importlinter"
TREE = ROOT / "build" / "package-tree"


def stage(dest: Path) -> Path:
    """Copy the package's Python files into `dest` (emptied first), laid out as installed;
    return the package folder there."""
    if dest.exists():
        shutil.rmtree(dest)
    package = dest / PACKAGE
    _copy_python(ROOT / PACKAGE, package)
    for folder in MAPPED:
        _copy_python(ROOT / folder, package / folder)
    return package


def _copy_python(source: Path, target: Path) -> None:
    for pattern in ("*.py", "py.typed"):
        for path in source.rglob(pattern):
            if "__pycache__" in path.parts:
                continue
            out = target / path.relative_to(source)
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, out)


def checkout_path(staged: str) -> str:
    """The checkout's file for a path in the staged tree (pagedllm_integrations/engine/x.py
    -> engine/x.py); other text unchanged."""
    prefix = PACKAGE + "/"
    if staged.startswith(prefix) and staged[len(prefix) :].split("/", 1)[0] in MAPPED:
        return staged[len(prefix) :]
    return staged


def run_contracts(tree: Path) -> subprocess.CompletedProcess[str]:
    """import-linter over the staged tree (it imports the package from there)."""
    lint_imports = Path(sys.executable).parent / "lint-imports"
    command = [str(lint_imports), str(CONTRACTS), "--no-cache"]
    return subprocess.run(command, cwd=tree, capture_output=True, text=True)


def run_mypy(tree: Path) -> subprocess.CompletedProcess[str]:
    """mypy over the whole staged package, with the checkout's settings and cache."""
    command = [
        sys.executable, "-m", "mypy",
        "--config-file", str(ROOT / "pyproject.toml"),
        "--cache-dir", str(ROOT / ".mypy_cache"),
        "-p", PACKAGE,
    ]  # fmt: skip
    return subprocess.run(command, cwd=tree, capture_output=True, text=True)


def _in_checkout_terms(output: str) -> str:
    lines = []
    for line in output.splitlines(keepends=True):
        path, sep, rest = line.partition(":")
        lines.append(checkout_path(path) + sep + rest if sep else line)
    return "".join(lines)


def main() -> int:
    stage(TREE)
    failed = 0
    for check in (run_contracts, run_mypy):
        result = check(TREE)
        sys.stdout.write(_in_checkout_terms(result.stdout + result.stderr))
        failed = failed or result.returncode
    return failed


if __name__ == "__main__":
    sys.exit(main())
