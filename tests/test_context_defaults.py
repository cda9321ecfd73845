"""max_model_len and the KV budget with no settings: a sequence may be as long as the
model's own context (as in vLLM), the CPU KV budget grows to hold one, and where memory
cannot, the default is lowered to what it holds and the log says what the full context
needs. Settings the user gives are honoured or refused."""

from __future__ import annotations

import logging

import pytest

from pagedllm_integrations.engine.config import GiB
from pagedllm_integrations.engine.kv_sizing import fit_cpu_context
from pagedllm_integrations.engine.white_box import core_of

BLOCK = 16
PER_BLOCK = 16 * 114688  # Qwen3-0.6B: 112 KiB of bf16 keys and values a token


def test_default_budget_grows_to_one_full_context_sequence():
    fit = fit_cpu_context(40960, True, None, PER_BLOCK, BLOCK, memory_bytes=24 * GiB)
    assert fit.max_model_len == 40960 and fit.note == ""
    assert fit.kv_budget_bytes == 40960 // BLOCK * PER_BLOCK  # 4.375 GiB


def test_default_budget_is_at_least_one_gib():
    fit = fit_cpu_context(2048, True, None, PER_BLOCK, BLOCK, memory_bytes=24 * GiB)
    assert fit.kv_budget_bytes == GiB and fit.max_model_len == 2048


def test_a_context_larger_than_a_quarter_of_memory_is_lowered_and_said(caplog):
    with caplog.at_level(logging.WARNING):
        fit = fit_cpu_context(131072, True, None, PER_BLOCK, BLOCK, memory_bytes=8 * GiB)
    assert fit.kv_budget_bytes == 2 * GiB
    assert fit.max_model_len == 2 * GiB // PER_BLOCK * BLOCK < 131072
    assert "14.00 GiB" in fit.note and "kv_cache_memory=" in fit.note
    assert "max_model_len lowered" in caplog.text


def test_an_explicit_kv_budget_lowers_only_a_default_length():
    fit = fit_cpu_context(40960, True, 256 << 20, PER_BLOCK, BLOCK)
    assert fit.kv_budget_bytes == 256 << 20
    assert fit.max_model_len == (256 << 20) // PER_BLOCK * BLOCK
    assert "kv_cache_memory holds" in fit.note
    # A length the user set is left as set: the block check refuses it (below).
    fit = fit_cpu_context(40960, False, 256 << 20, PER_BLOCK, BLOCK)
    assert fit.max_model_len == 40960 and fit.note == ""


def test_an_explicit_length_grows_the_default_budget():
    fit = fit_cpu_context(32768, False, None, PER_BLOCK, BLOCK, memory_bytes=24 * GiB)
    assert fit.max_model_len == 32768 and fit.kv_budget_bytes == 32768 // BLOCK * PER_BLOCK


@pytest.fixture(scope="module")
def long_context_model(tiny_llama_factory):
    """A tiny random checkpoint whose own context is 32,768 positions."""
    return tiny_llama_factory("long-context", max_position_embeddings=32768)


def test_engine_defaults_to_the_models_context_and_runs_a_prompt_past_8k(long_context_model):
    from pagedllm_integrations.engine.llm import LLM
    from pagedllm_integrations.engine.sampling_params import SamplingParams

    llm = LLM(str(long_context_model), disable_log_stats=True)
    engine = core_of(llm)
    assert engine.max_model_len == 32768
    assert engine.num_blocks * engine.config.block_size >= 32768
    prompt = {"prompt_token_ids": [(7 * i) % 40000 + 100 for i in range(9000)]}
    [out] = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0))
    assert len(out.outputs[0].token_ids) == 4
    assert engine.kv_manager.pool.num_free_blocks == engine.num_blocks  # nothing leaked


def test_engine_lowers_a_default_length_to_an_explicit_budget(long_context_model, caplog):
    from pagedllm_integrations.engine.llm import LLM

    with caplog.at_level(logging.WARNING):
        llm = LLM(str(long_context_model), kv_cache_memory=1 << 20, disable_log_stats=True)
    engine = core_of(llm)
    assert engine.max_model_len == engine.num_blocks * engine.config.block_size < 32768
    assert "max_model_len lowered" in caplog.text and "kv_cache_memory=" in caplog.text
    with pytest.raises(ValueError, match="max_model_len 32768 needs"):
        LLM(str(long_context_model), kv_cache_memory=1 << 20, max_model_len=32768)
