"""Build the documentation site (API reference from docstrings) with mkdocs.

    python docs/build.py [--out site]

engine/, kernels/ and quant/ are sub-packages of `pagedllm_integrations` only once
installed (setuptools' package-dir mapping). mkdocstrings reads source files, so this
script lays out the package as it is installed — links in build/docs-src — and points
mkdocstrings there. The tests run it with --strict so the reference cannot rot.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAPPED = {"engine": "engine", "kernels": "kernels", "quant": "quant"}


def layout_sources() -> Path:
    src = ROOT / "build" / "docs-src"
    package = src / "pagedllm_integrations"
    package.mkdir(parents=True, exist_ok=True)
    for entry in (ROOT / "pagedllm_integrations").iterdir():
        _link(package / entry.name, entry)
    for name, folder in MAPPED.items():
        _link(package / name, ROOT / folder)
    return src


def _link(link: Path, target: Path) -> None:
    if link.is_symlink() or link.exists():
        if link.is_symlink() and link.resolve() == target.resolve():
            return
        link.unlink()
    os.symlink(target, link)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "site"))
    args = parser.parse_args()
    src = layout_sources()
    env = dict(os.environ, PAGEDLLM_DOCS_SRC=str(src))
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", args.out]
    return subprocess.call(command, cwd=ROOT, env=env)


if __name__ == "__main__":
    raise SystemExit(main())
