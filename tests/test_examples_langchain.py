"""The LangChain examples run as a user runs them (a fresh process, offline), small."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("langchain_core")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_example(name: str, *args: str) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_rag_example_streams_answers_and_reads_the_prefix_cache_from_disk_next_time(
    tmp_path: Path,
) -> None:
    disk = ["--prefix-cache-dir", str(tmp_path / "prefix-cache"), "--max-tokens", "16"]
    hits_line = r"prefix cache: (\d+) of \d+ prompt tokens were hits \((\d+) read from disk\)"
    out = run_example("rag_langchain.py", "--questions", "3", *disk)
    hits = [(int(h), int(d)) for h, d in re.findall(hits_line, out)]
    assert len(hits) == 3, out
    assert hits[0] == (0, 0) and hits[1][0] > 300 and hits[2][0] > 300, out  # from memory
    assert hits[1][1] == hits[2][1] == 0, out
    closing = re.search(r"([\d.]+) tokens/s; prefix-cache hit rate ([\d.]+)%", out)
    assert closing is not None, out
    assert float(closing.group(1)) > 0 and float(closing.group(2)) > 25
    lookup = re.search(r"prompt lookup: ([\d.]+)% of (\d+) drafted tokens accepted", out)
    assert lookup is not None and int(lookup.group(2)) > 0, out  # the example turns it on
    # The system prompt was hit twice: its blocks are on disk. The next run's first
    # question reads them from there.
    again = run_example("rag_langchain.py", "--questions", "1", *disk)
    (first,) = [(int(h), int(d)) for h, d in re.findall(hits_line, again)]
    assert first[0] > 300 and first[1] == first[0], again
    assert f"prefix cache on disk ({tmp_path / 'prefix-cache'}): {first[1]} prompt" in again


def test_agent_example_calls_a_tool_and_answers() -> None:
    out = run_example(
        "agent_langchain.py", "--question", "When is the shop open on Sunday?", "--max-tokens", "48"
    )
    call = re.search(r"model calls (\w+)\(", out)
    assert call is not None and call.group(1) in ("opening_hours", "rental_price"), out
    assert re.search(rf"tool {call.group(1)} returns: .+", out), out
    assert re.search(r"assistant: .+", out), out


def test_structured_output_example_fills_the_schema() -> None:
    out = run_example("structured_output.py", "--max-tokens", "48")
    orders = re.findall(
        r"order: +BikeOrder\(customer='(\w*)', bike_type='(\w+)', days=(\d+)\)", out
    )
    assert len(orders) == 2, out
    assert {bike for _, bike, _ in orders} <= {"city", "mountain", "electric"}
