"""examples/offline_batch.py runs as a user runs it (a fresh process, offline), small."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "offline_batch.py"


def test_offline_batch_example_generates_one_batch():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--num-prompts", "6", "--max-tokens", "8"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = re.search(
        r"6 prompts, (\d+) tokens .* (\d+) sequences in the largest step", done.stdout
    )
    assert summary is not None, done.stdout
    assert int(summary.group(1)) == 6 * 8
    assert int(summary.group(2)) == 6  # all prompts ran in one engine step
    assert "generate" in done.stderr  # the tqdm progress bar
    assert done.stdout.count("### ") == 4
