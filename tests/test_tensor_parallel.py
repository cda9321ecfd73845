"""Tensor parallelism on CPU: gloo ranks in spawned processes against one-rank engines.

The reference for every TP run is the same checkpoint in a single-rank engine: greedy
tokens must be identical and log-probabilities equal to float32 rounding (the all-reduce
sums the partial products in a different order than one matmul).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch.distributed as dist

from pagedllm_integrations import LLM, SamplingParams
from pagedllm_integrations.engine.async_engine import AsyncEngine, RequestError
from pagedllm_integrations.engine.config import EngineConfig
from pagedllm_integrations.engine.distributed.tp_layers import shard_config
from pagedllm_integrations.engine.model_loader import read_config
from pagedllm_integrations.engine.models.llama import LlamaConfig
from pagedllm_integrations.engine.white_box import core_of

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,"]
ENGINE_ARGS = dict(disable_log_stats=True, num_kv_blocks=96, max_model_len=512, dtype="float32")


def _greedy(llm: LLM, max_tokens: int = 12, logprobs: int | None = 3):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=logprobs)
    return [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _assert_same(tp_outputs, ref_outputs, atol: float) -> None:
    for tp, ref in zip(tp_outputs, ref_outputs):
        assert tp.token_ids == ref.token_ids
        for tp_top, ref_top in zip(tp.logprobs, ref.logprobs):
            for token, logprob in ref_top.items():
                assert abs(tp_top[token].logprob - logprob.logprob) < atol


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) is gone for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids: list[int], seconds: float = 15.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = [p for p in pids if _pid_alive(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return alive


def test_shard_config_splits_heads_and_says_what_divides(default_model_folder):
    cfg = LlamaConfig.from_hf_dict(read_config(default_model_folder))
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size) == (9, 3, 1536)
    with pytest.raises(
        ValueError, match=r"must divide num_attention_heads 9.*sizes that work: \[3\]"
    ):
        shard_config(cfg, 2)
    rank_cfg = shard_config(cfg, 3)
    assert (rank_cfg.num_heads, rank_cfg.num_kv_heads, rank_cfg.intermediate_size) == (3, 1, 512)
    assert rank_cfg.head_dim == cfg.head_dim and rank_cfg.hidden_size == cfg.hidden_size


def test_tp_size_that_does_not_divide_heads_fails_before_spawning(tiny_llama_dir):
    with pytest.raises(
        ValueError, match="tensor_parallel_size 4 must divide num_key_value_heads 2"
    ):
        LLM(str(tiny_llama_dir), tensor_parallel_size=4, **ENGINE_ARGS)
    assert not dist.is_initialized()


def test_tp2_tiny_gqa_with_biases_matches_one_rank(tiny_llama_factory):
    """4 query / 2 KV heads; q/k/v, o and MLP biases (o/down bias added once, by rank 0)."""
    folder = tiny_llama_factory("tp-bias", attention_bias=True, mlp_bias=True)
    with LLM(str(folder), **ENGINE_ARGS) as llm:
        reference = _greedy(llm)
    with LLM(str(folder), tensor_parallel_size=2, **ENGINE_ARGS) as llm:
        runner = core_of(llm).executor
        assert len(runner.worker_pids) == 1
        # Each rank's cache holds only its heads: [blocks, block_size, Hkv/2, D].
        assert runner.kv_caches[0][0].shape == (96, 16, 1, 16)
        outputs = _greedy(llm)
        pids = runner.worker_pids
    _assert_same(outputs, reference, atol=1e-4)
    assert all(len(o.token_ids) == 12 for o in outputs)
    assert _wait_gone(pids) == [] and not dist.is_initialized()


def test_tp3_default_model_matches_one_rank(default_llm_f32):
    """SmolLM2-135M: 9 heads / 3 KV heads / 1536 MLP features divide by 3 (not by 2).
    Tensor parallelism runs the float32 path: compared with one float32 rank."""
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=3)
    reference = [o.outputs[0] for o in default_llm_f32.generate(PROMPTS, params, use_tqdm=False)]
    with LLM(tensor_parallel_size=3, **ENGINE_ARGS) as llm:
        assert core_of(llm).executor.kv_caches[0][0].shape[2] == 1  # 3 KV heads / 3 ranks
        outputs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    _assert_same(outputs, reference, atol=2e-4)


def test_tp2_awq_checkpoint_matches_one_rank(tiny_llama_factory, tmp_path):
    """AWQ layers are sliced at load time: qweight/qzeros by packs of 8 output columns,
    row-parallel ones by input rows and whole groups."""
    from pagedllm_integrations.cli_quantize import load_float_model
    from pagedllm_integrations.quant.awq_format import AWQConfig
    from pagedllm_integrations.quant.quantizer import rtn_quantize_model, save_awq_checkpoint

    src = tiny_llama_factory("tp-awq", hidden_size=128, num_heads=4, num_kv_heads=2, shards=1)
    model, tokenizer = load_float_model(src)
    quantized = rtn_quantize_model(model, group_size=32)
    out = save_awq_checkpoint(
        model, quantized, tmp_path / "awq", AWQConfig(group_size=32), src, tokenizer
    )
    with LLM(str(out), **ENGINE_ARGS) as llm:
        reference = _greedy(llm)
    with LLM(str(out), tensor_parallel_size=2, **ENGINE_ARGS) as llm:
        outputs = _greedy(llm)
    _assert_same(outputs, reference, atol=1e-3)


def test_killed_rank_fails_requests_and_stops_the_other_ranks(tiny_llama_factory):
    folder = tiny_llama_factory("tp-crash", hidden_size=96, num_heads=6, num_kv_heads=3)
    engine = AsyncEngine(EngineConfig(model=str(folder), tensor_parallel_size=3, **ENGINE_ARGS))
    try:
        runner = core_of(engine).executor
        pids = runner.worker_pids
        assert len(pids) == 2
        stream = engine.add_request(
            "Hello", SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        )
        outputs = iter(stream)
        next(outputs)  # generating
        os.kill(pids[0], signal.SIGKILL)
        # Which side notices first decides the details ("rank1 died" from the monitor, or
        # gloo's "connection reset" from the collective): the behaviour is what is asserted.
        with pytest.raises(RequestError, match="tensor-parallel group is gone"):
            for _ in outputs:
                pass
        assert _wait_gone(pids) == []  # the surviving rank was stopped, not orphaned
        # The engine keeps answering: every later request fails fast, and says why.
        with pytest.raises(RequestError, match="group is gone, restart the engine"):
            engine.add_request("Hi", SamplingParams(max_tokens=2)).result()
        assert not dist.is_initialized()
    finally:
        engine.shutdown()


def test_ranks_exit_when_the_driver_is_killed(tiny_llama_dir, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys, time
            from pagedllm_integrations import LLM
            from pagedllm_integrations.engine.white_box import core_of
            if __name__ == "__main__":
                llm = LLM({str(tiny_llama_dir)!r}, tensor_parallel_size=2, **{ENGINE_ARGS!r})
                print(*core_of(llm).executor.worker_pids, flush=True)
                time.sleep(120)
            """
        )
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    driver = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        line = driver.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 1 and _pid_alive(pids[0])
        driver.send_signal(signal.SIGKILL)  # no cleanup code runs in the driver
        driver.wait(timeout=10)
        assert _wait_gone(pids) == []
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()


def test_a_driver_that_exits_without_shutdown_stops_its_ranks_quietly(tiny_llama_dir, tmp_path):
    """At interpreter exit multiprocessing terminates the ranks (SIGTERM): an ending, which
    must not be logged as a rank dying."""
    script = tmp_path / "driver.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import logging
            from pagedllm_integrations import LLM
            from pagedllm_integrations.engine.white_box import core_of
            if __name__ == "__main__":
                logging.basicConfig(level=logging.WARNING)
                llm = LLM({str(tiny_llama_dir)!r}, tensor_parallel_size=2, **{ENGINE_ARGS!r})
                print(*core_of(llm).executor.worker_pids, flush=True)
            """
        )
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 1 and _wait_gone(pids) == []
    assert "died" not in done.stderr and "ERROR" not in done.stderr, done.stderr
