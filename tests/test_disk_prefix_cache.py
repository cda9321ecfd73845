"""The prefix cache that survives a restart (`prefix_cache_dir`): blocks written by one
process are loaded by the next, give the same tokens, and a file that is not exactly the
block asked for (another model, another layout, corrupt, truncated) is never loaded."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import make_tiny_llama

from pagedllm_integrations import LLM, SamplingParams
from pagedllm_integrations.engine.config import EngineConfig
from pagedllm_integrations.engine.private_dir import KEY_FILE
from pagedllm_integrations.engine.white_box import core_of

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8)
# Small KV pools load fast; max_model_len leaves room for the prompts below.
ENGINE = dict(disable_log_stats=True, num_kv_blocks=96, max_model_len=512)
SYSTEM = "You are a careful assistant of the bicycle shop. Answer in one short word. " * 12
STORE_LOGGER = "pagedllm_integrations.engine.prefix_store"
QUESTIONS = [" Name a fruit.", " Name a colour.", " Name a city.", " Name a river."]


class ComputedTokens:
    """A stat logger that adds up the tokens every forward pass computed."""

    def __init__(self) -> None:
        self.total = 0

    def record(self, scheduler, iteration) -> None:
        self.total += iteration.num_batched_tokens


@pytest.fixture(scope="module")
def prompts(default_model_folder) -> list[list[int]]:
    """Token-id prompts: one shared system prompt, then a question each."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_folder))
    system = tokenizer(SYSTEM, add_special_tokens=False).input_ids
    return [system + tokenizer(q, add_special_tokens=False).input_ids for q in QUESTIONS]


@pytest.fixture(scope="module")
def expected(tiny_llama_dir, prompts) -> list[list[int]]:
    """Each prompt's greedy tokens from an engine with no disk cache."""
    with LLM(str(tiny_llama_dir), **ENGINE) as llm:
        return [
            llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
            for p in prompts
        ]


def system_len(prompts: list[list[int]]) -> int:
    """Tokens at the start of every prompt."""
    length = 0
    while all(len(p) > length and p[length] == prompts[0][length] for p in prompts):
        length += 1
    return length


def block_files(folder: Path) -> list[Path]:
    return sorted(Path(folder).rglob("*.kv"))


def generate(llm: LLM, prompt: list[int], **kwargs):
    return llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False, **kwargs)[0]


def chain_files(llm: LLM, prompt: list[int], num_blocks: int) -> list[Path]:
    """The files of a prompt's first blocks, in chain order (named by their hashes)."""
    engine = core_of(llm)
    group = engine.request_states.build(llm.engine.process_inputs({"prompt_token_ids": prompt}))
    request = group.children[0]
    hashes = engine.kv_manager.full_block_hashes(request, num_blocks * BLOCK)
    return [engine.disk_cache.store.path_of(h) for h in hashes]


def all_blocks_free(llm: LLM) -> bool:
    return llm.engine.num_free_blocks() == llm.engine.num_total_blocks()


_WRITER = """
import json, sys
from pagedllm_integrations import LLM, SamplingParams
model, cache, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
params = SamplingParams(temperature=0, max_tokens=8)
with LLM(model, prefix_cache_dir=cache, **json.loads(sys.argv[4])) as llm:
    outputs = [llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0] for p in prompts]
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outputs],
                  "cached": [o.num_cached_tokens for o in outputs]}))
"""


def test_a_new_process_loads_what_another_wrote_computes_less_and_answers_the_same(
    tiny_llama_dir, tmp_path, prompts, expected
):
    cache = tmp_path / "cache"
    # Process 1: three requests share the system prompt, so its blocks are hit twice.
    done = subprocess.run(
        [sys.executable, "-P", "-c", _WRITER, str(tiny_llama_dir), str(cache),
         json.dumps(prompts[:3]), json.dumps(ENGINE)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    first = json.loads(done.stdout.strip().splitlines()[-1])
    assert first["tokens"] == expected[:3]
    shared_tokens = system_len(prompts) // BLOCK * BLOCK
    assert first["cached"] == [0, shared_tokens, shared_tokens]
    # Written at their second hit (the third request); the shutdown waited for the files.
    assert len(block_files(cache)) == shared_tokens // BLOCK

    # Process 2 (this one): a new question after the same system prompt.
    with LLM(str(tiny_llama_dir), prefix_cache_dir=str(cache), **ENGINE) as llm:
        computed = ComputedTokens()
        llm.engine.add_stat_logger(computed)
        output = generate(llm, prompts[3])
        stats = llm.engine.scheduler_stats()
        assert output.outputs[0].token_ids == expected[3]
        assert output.num_cached_tokens == stats.prefix_cache_disk_loaded == shared_tokens
        generated = len(output.outputs[0].token_ids)
        # Only the question's tokens (and the decode steps) ran through the model.
        assert computed.total == len(prompts[3]) - shared_tokens + generated - 1
        assert stats.prefix_cache_disk_written == 0  # nothing new worth writing
        assert all_blocks_free(llm)


def test_save_prefix_writes_every_full_block_and_a_new_engine_starts_from_them(
    tiny_llama_dir, tmp_path, prompts, expected
):
    cache = tmp_path / "cache"
    system = prompts[0][: system_len(prompts)]
    with LLM(str(tiny_llama_dir), prefix_cache_dir=str(cache), **ENGINE) as llm:
        saved = llm.save_prefix({"prompt_token_ids": system})
        assert saved == len(system) // BLOCK * BLOCK
        assert len(block_files(cache)) == saved // BLOCK
        assert llm.engine.precompute({"prompt_token_ids": system}) == saved  # already there
        assert len(block_files(cache)) == saved // BLOCK
        assert all_blocks_free(llm)
    with LLM(str(tiny_llama_dir), prefix_cache_dir=str(cache), **ENGINE) as llm:
        output = generate(llm, prompts[0])
        assert output.outputs[0].token_ids == expected[0]
        assert output.num_cached_tokens == llm.engine.scheduler_stats().prefix_cache_disk_loaded
        assert output.num_cached_tokens == saved
        # Another cache_salt names other blocks: nothing of this prompt is shared with it.
        salted = llm.engine.add_request(
            {"prompt_token_ids": prompts[1]}, GREEDY, cache_salt="another tenant"
        ).result()
        assert salted.num_cached_tokens == 0
        assert salted.outputs[0].token_ids == expected[1]
        assert all_blocks_free(llm)


def test_blocks_are_read_beside_the_steps_of_the_other_requests(
    tiny_llama_dir, tmp_path, prompts, expected
):
    """While a request's prefix blocks are read from disk (held here at a gate), a stream
    already decoding keeps getting tokens; then the request starts from the blocks read and
    answers the same. A request aborted while its blocks are read ends cleanly."""
    system = prompts[0][: system_len(prompts)]
    with LLM(str(tiny_llama_dir), prefix_cache_dir=str(tmp_path / "cache"), **ENGINE) as llm:
        saved = llm.save_prefix({"prompt_token_ids": system})
        assert llm.engine.reset_prefix_cache()  # memory forgets: the blocks come from disk
        store = core_of(llm).disk_cache.store
        gate = threading.Event()
        reads_started = threading.Event()
        read = store.read

        def gated_read(record, out):  # the reader thread
            reads_started.set()
            assert gate.wait(timeout=120), "the test never opened the gate"
            return read(record, out)

        store.read = gated_read
        decode = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        stream = llm.engine.add_request({"prompt_token_ids": prompts[3][-8:]}, decode)
        tokens: list[float] = []  # arrival times of the stream's outputs
        follower = threading.Thread(
            target=lambda: [tokens.append(time.monotonic()) for _ in stream]
        )
        follower.start()
        deadline = time.monotonic() + 60
        while not tokens and time.monotonic() < deadline:
            time.sleep(0.01)

        loading = llm.engine.add_request({"prompt_token_ids": prompts[0]}, GREEDY)
        assert reads_started.wait(timeout=60)
        during = len(tokens)
        deadline = time.monotonic() + 60
        while len(tokens) < during + 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(tokens) >= during + 5, "the stream stalled while blocks were read"
        gate.set()
        output = loading.result()
        assert output.outputs[0].token_ids == expected[0]
        assert output.num_cached_tokens == saved  # all of the saved prefix came from disk

        # Aborted while its blocks are read: it ends, and nothing is held.
        gate.clear()
        reads_started.clear()
        salted = llm.engine.add_request(
            {"prompt_token_ids": prompts[1]}, GREEDY, cache_salt="unsaved"
        )  # nothing of it on disk: scheduled at once
        assert salted.result().outputs[0].token_ids == expected[1]
        llm.engine.abort(stream.request_id)
        follower.join(timeout=60)
        assert llm.engine.reset_prefix_cache()
        aborted = llm.engine.add_request({"prompt_token_ids": prompts[2]}, GREEDY)
        assert reads_started.wait(timeout=60)
        llm.engine.abort(aborted.request_id)
        assert aborted.result().outputs[0].finish_reason == "abort"
        gate.set()
        assert generate(llm, prompts[2]).outputs[0].token_ids == expected[2]
        assert all_blocks_free(llm)


def test_blocks_of_other_weights_or_another_kv_layout_are_never_loaded(
    default_model_folder, tmp_path, prompts, caplog
):
    model, cache, kept = tmp_path / "model", tmp_path / "cache", tmp_path / "kept"
    make_tiny_llama(model, default_model_folder, seed=0)
    with LLM(str(model), prefix_cache_dir=str(cache), **ENGINE) as llm:
        assert llm.save_prefix({"prompt_token_ids": prompts[0]}) > 0
        old_folder = core_of(llm).disk_cache.folder
    # New weights at the same path (a fine-tune saved over the old one): the same chained
    # hashes, so the same file names, but another fingerprint.
    shutil.rmtree(model)
    make_tiny_llama(model, default_model_folder, seed=1)
    with LLM(str(model), **ENGINE) as reference:
        expected = generate(reference, prompts[0]).outputs[0].token_ids
    with LLM(str(model), prefix_cache_dir=str(cache), **ENGINE) as llm:
        new_folder = core_of(llm).disk_cache.folder
        assert new_folder != old_folder
        assert generate(llm, prompts[0]).outputs[0].token_ids == expected
        assert llm.engine.scheduler_stats().prefix_cache_disk_loaded == 0
        assert llm.save_prefix({"prompt_token_ids": prompts[0]}) > 0
    shutil.copytree(new_folder, kept)
    # The old files put where the new weights look (by hand, or a fingerprint collision):
    # the first is opened, refused by the fingerprint in its header, and removed.
    for path in old_folder.glob("*.kv"):
        shutil.copy(path, new_folder / path.name)
    with (
        caplog.at_level(logging.WARNING, logger=STORE_LOGGER),
        LLM(str(model), prefix_cache_dir=str(cache), **ENGINE) as llm,
    ):
        assert generate(llm, prompts[0]).outputs[0].token_ids == expected
        assert llm.engine.scheduler_stats().prefix_cache_disk_loaded == 0
        assert all_blocks_free(llm)
    assert any("written for another model" in r.getMessage() for r in caplog.records)

    # The float32 reference path keeps another KV layout and dtype: another folder, and
    # the fast path's files of these very weights, put there, are refused too.
    caplog.clear()
    with LLM(str(model), dtype="float32", **ENGINE) as reference:
        expected32 = generate(reference, prompts[0]).outputs[0].token_ids
    with (
        caplog.at_level(logging.WARNING, logger=STORE_LOGGER),
        LLM(str(model), dtype="float32", prefix_cache_dir=str(cache), **ENGINE) as llm,
    ):
        folder32 = core_of(llm).disk_cache.folder
        assert folder32 not in (old_folder, new_folder)
        for path in kept.glob("*.kv"):
            shutil.copy(path, folder32 / path.name)
        assert generate(llm, prompts[0]).outputs[0].token_ids == expected32
        assert llm.engine.scheduler_stats().prefix_cache_disk_loaded == 0
        assert all_blocks_free(llm)
    assert any("written for another model" in r.getMessage() for r in caplog.records)


def test_a_truncated_or_corrupt_block_file_is_skipped_with_a_warning_never_loaded(
    tiny_llama_dir, tmp_path, prompts, expected, caplog
):
    cache = tmp_path / "cache"
    with LLM(str(tiny_llama_dir), prefix_cache_dir=str(cache), **ENGINE) as llm:
        saved = llm.save_prefix({"prompt_token_ids": prompts[0]})
        files = chain_files(llm, prompts[0], saved // BLOCK)
    assert len(files) >= 6 and all(f.exists() for f in files)
    truncated, corrupt = files[2], files[4]
    truncated.write_bytes(truncated.read_bytes()[:-100])
    data = bytearray(corrupt.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of one key or value
    corrupt.write_bytes(bytes(data))

    with caplog.at_level(logging.WARNING, logger=STORE_LOGGER):
        with LLM(str(tiny_llama_dir), prefix_cache_dir=str(cache), **ENGINE) as llm:
            output = generate(llm, prompts[0])
            assert output.outputs[0].token_ids == expected[0]
            assert output.num_cached_tokens == 2 * BLOCK  # the blocks before the bad one
            assert not truncated.exists()  # removed, so that it can be written again
            # Saving again writes the missing block; the corrupt one is still on disk.
            assert llm.save_prefix({"prompt_token_ids": prompts[0]}) == saved
            assert truncated.exists() and corrupt.exists()
            assert all_blocks_free(llm)
        assert any("truncated" in r.getMessage() for r in caplog.records)

        with LLM(str(tiny_llama_dir), prefix_cache_dir=str(cache), **ENGINE) as llm:
            output = generate(llm, prompts[0])
            assert output.outputs[0].token_ids == expected[0]
            assert output.num_cached_tokens == 4 * BLOCK
            assert not corrupt.exists()
            assert all_blocks_free(llm)
        assert any("checksum mismatch" in r.getMessage() for r in caplog.records)


def forge_block(path: Path, key: bytes) -> None:
    """Zero the keys and values of a block file and sign it again with `key`."""
    data = path.read_bytes()
    _, _, header_len, payload_len = struct.unpack_from("<8s16sIQ", data)
    body = data[: 36 + header_len] + bytes(payload_len)
    path.write_bytes(body + hmac.new(key, body, hashlib.sha256).digest())


def test_a_forged_block_file_is_refused_and_the_answer_stays(
    tiny_llama_dir, tmp_path, prompts, expected, caplog
):
    cache = tmp_path / "cache"
    with LLM(str(tiny_llama_dir), prefix_cache_dir=str(cache), **ENGINE) as llm:
        saved = llm.save_prefix({"prompt_token_ids": prompts[0]})
        first = chain_files(llm, prompts[0], saved // BLOCK)[0]
    original = first.read_bytes()
    # Other keys and values in the format's own layout, signed without the directory's
    # secret (anyone can recompute a plain checksum; nobody else can this MAC).
    forge_block(first, b"not the key" * 3)
    with (
        caplog.at_level(logging.WARNING, logger=STORE_LOGGER),
        LLM(str(tiny_llama_dir), prefix_cache_dir=str(cache), **ENGINE) as llm,
    ):
        output = generate(llm, prompts[0])
        assert output.outputs[0].token_ids == expected[0]
        assert (
            output.num_cached_tokens == llm.engine.scheduler_stats().prefix_cache_disk_loaded == 0
        )
        assert all_blocks_free(llm)
    assert any("checksum mismatch" in r.getMessage() for r in caplog.records)
    # The same forgery signed with the secret (only its owner can read it) is loaded: the
    # MAC is what keeps it out.
    first.write_bytes(original)
    forge_block(first, (cache / KEY_FILE).read_bytes())
    with LLM(str(tiny_llama_dir), prefix_cache_dir=str(cache), **ENGINE) as llm:
        generate(llm, prompts[0])
        assert llm.engine.scheduler_stats().prefix_cache_disk_loaded > 0


def test_a_model_folder_that_is_a_link_is_refused(tiny_llama_dir, tmp_path, prompts):
    cache, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    with LLM(str(tiny_llama_dir), prefix_cache_dir=str(cache), **ENGINE) as llm:
        folder = core_of(llm).disk_cache.folder
    # A link would put the files where the size limit does not count them.
    shutil.move(folder, elsewhere)
    folder.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(ValueError, match="symbolic link"):
        LLM(str(tiny_llama_dir), prefix_cache_dir=str(cache), **ENGINE)


def test_settings_that_cannot_work_are_refused(tmp_path, default_llm):
    assert EngineConfig().prefix_cache_dir is None  # off unless asked for
    with pytest.raises(ValueError, match="save_prefix needs a prefix-cache directory"):
        default_llm.save_prefix("You are a helpful assistant.")
    with pytest.raises(ValueError, match="enable_prefix_caching=True"):
        EngineConfig(prefix_cache_dir=str(tmp_path), enable_prefix_caching=False)
    with pytest.raises(ValueError, match="tensor_parallel_size > 1"):
        EngineConfig(prefix_cache_dir=str(tmp_path), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="prefix_cache_max_gib must be > 0"):
        EngineConfig(prefix_cache_dir=str(tmp_path), prefix_cache_max_gib=0)
    with pytest.raises(ValueError, match="must be a directory path"):
        EngineConfig(prefix_cache_dir="")
    config = EngineConfig(prefix_cache_dir="~/kv")
    assert config.prefix_cache_dir == os.path.expanduser("~/kv")


def test_the_server_and_cli_take_the_directory(tmp_path):
    import argparse

    from pagedllm_integrations.cli_generate import engine_kwargs
    from pagedllm_integrations.server.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser, "serve")
    args = parser.parse_args(["--prefix-cache-dir", str(tmp_path), "--prefix-cache-max-gib", "2.5"])
    config = EngineConfig.from_kwargs(**engine_kwargs(args))
    assert (config.prefix_cache_dir, config.prefix_cache_max_gib) == (str(tmp_path), 2.5)
    assert EngineConfig.from_kwargs(**engine_kwargs(parser.parse_args([]))).prefix_cache_dir is None


def test_disk_totals_reach_the_prometheus_metrics():
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from pagedllm_integrations.engine.metrics import IterationStats, SchedulerStats
    from pagedllm_integrations.server.metrics import PrometheusStatLogger

    prometheus = PrometheusStatLogger("m")
    for loaded, written in [(32, 0), (32, 16), (96, 16)]:  # the engine's cumulative totals
        stats = SchedulerStats(prefix_cache_disk_loaded=loaded, prefix_cache_disk_written=written)
        prometheus.record(stats, IterationStats())
    text = generate_latest(prometheus.registry).decode()
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert values["pagedllm:prefix_cache_disk_loaded_tokens_total"] == 96
    assert values["pagedllm:prefix_cache_disk_written_tokens_total"] == 16
