"""examples/rag_llama_index.py runs end to end, small: retrieval, a streamed answer, sources."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("llama_index.core")

ROOT = Path(__file__).resolve().parent.parent


def test_rag_example_streams_an_answer_from_the_documents(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "rag_llama_index.py"),
            "--max-tokens",
            "16",
            "--prefix-cache-dir",
            str(tmp_path),
            "How much does a basic service cost?",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    answer = result.stdout.split("A: ", 1)[1].split("Sources:", 1)[0]
    assert "45 euros" in answer, result.stdout
    assert "repairs.md" in result.stdout.split("Sources:", 1)[1], result.stdout
    assert re.search(r"prompt lookup: [\d.]+% of \d+ drafted tokens accepted", result.stdout)
