"""The decoder layers as one C++ call (engine/models/fused_stack.py) against the module path.

The fused stack runs the same kernels in the same order, so every token and every
log-probability must be equal, bit for bit: on the default GGUF (packed weights), on dense
Llama, Qwen2 (biases) and Mistral (sliding window) checkpoints held in bf16, and on every
other family's, with prompts and decodes mixed in one step. What it does not run (MoE
blocks) keeps the modules, and the engine's load line says why.
"""

from __future__ import annotations

import pytest

from pagedllm_integrations import LLM, SamplingParams
from pagedllm_integrations.engine.compute_plan import cpu_fast_path_isa
from pagedllm_integrations.engine.white_box import core_of
from pagedllm_integrations.kernels import cpu_ext

pytestmark = pytest.mark.skipif(
    not (cpu_fast_path_isa() is not None and cpu_ext.load()),
    reason="the fused stack is part of the CPU fast path",
)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a kingdom far away, there lived a princess who loved to read",
]
PARAMS = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)


def outputs(llm: LLM, fused: bool) -> list[tuple[list[int], list]]:
    model = core_of(llm).model
    model.use_fused_stack = fused
    llm.engine.reset_prefix_cache()  # every token computed by the path under test
    # Different lengths at once: one step carries prompt chunks and decodes together.
    results = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [(r.outputs[0].token_ids, r.outputs[0].logprobs) for r in results]


def test_default_model_runs_the_fused_stack_with_the_module_paths_numbers(default_llm):
    model = core_of(default_llm).model
    try:
        fused = outputs(default_llm, True)
        assert model.fused_stack() is not None
        assert outputs(default_llm, False) == fused
    finally:
        model.use_fused_stack = True


def test_steps_of_every_size_share_the_step_workspace_with_the_same_numbers(default_llm):
    """24 prompts of ~40 tokens, prefilled in steps of hundreds of rows, then decoded: the
    stack's layer buffers (~15 MB at 512 rows) and 24 rows of logits (4.7 MB) take turns in
    the step workspace, which grows with the steps. Same numbers as the module path (whose
    logits use the workspace alone), before and after the workspace has grown."""
    model = core_of(default_llm).model
    prompts = [
        f"Item {i}: " + "the quick brown fox jumps over the lazy dog " * 4 for i in range(24)
    ]
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=2, ignore_eos=True)

    def run(fused: bool) -> list:
        model.use_fused_stack = fused
        default_llm.engine.reset_prefix_cache()
        results = default_llm.generate(prompts, params, use_tqdm=False)
        return [(r.outputs[0].token_ids, r.outputs[0].logprobs) for r in results]

    try:
        fused = run(True)
        assert run(False) == fused
        assert run(True) == fused
    finally:
        model.use_fused_stack = True


@pytest.mark.parametrize(
    "architecture,extra",
    [("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": 8})],
)
def test_dense_checkpoints_match_bit_for_bit(architecture, extra, tiny_llama_factory):
    folder = tiny_llama_factory(f"stack-{architecture}", architecture=architecture, **extra)
    with LLM(str(folder), disable_log_stats=True, max_model_len=256) as llm:
        fused = outputs(llm, True)
        assert core_of(llm).model.fused_stack() is not None
        assert outputs(llm, False) == fused


@pytest.mark.parametrize("kind", ["qwen3", "gemma2", "gemma3", "phi3", "phi4_mini", "qwen3_moe"])
def test_every_family_runs_the_stack_with_the_module_paths_bits(kind, tmp_path):
    """Qwen3's q/k norms, Gemma's sandwich (1 + w) norms, GeGLU, soft-caps, sliding layers
    and Gemma 3's local rotary tables, Phi-3's fused checkpoint linears, Phi-4-mini's
    partial longrope rotary and Qwen3-MoE's experts (beside a dense layer): all in the
    stack, each token and log-probability the module path's."""
    from family_checkpoints import make_family_checkpoint

    folder = make_family_checkpoint(tmp_path / kind, kind)
    prompts = PROMPTS[:2] if kind == "phi4_mini" else PROMPTS  # a 32-token context there
    max_model_len = 32 if kind == "phi4_mini" else 128
    with LLM(str(folder), disable_log_stats=True, max_model_len=max_model_len) as llm:
        model = core_of(llm).model
        assert model.fused_stack() is not None, model.stack_status()
        assert model.stack_status() == "decoder layers as one C++ stack"

        def run(fused: bool) -> list:
            model.use_fused_stack = fused
            llm.engine.reset_prefix_cache()
            params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
            results = llm.generate(prompts, params, use_tqdm=False)
            return [(r.outputs[0].token_ids, r.outputs[0].logprobs) for r in results]

        fused = run(True)
        assert run(False) == fused


def test_a_model_the_stack_cannot_run_says_why(caplog, monkeypatch, tmp_path):
    """A model needing what the backend's stack table lacks keeps the module path, and the
    load line names the missing capability (here a table without MoE, as before the stack
    ran experts)."""
    import logging

    from family_checkpoints import make_family_checkpoint

    from pagedllm_integrations.engine.models import backend

    monkeypatch.setattr(backend, "CPU_STACK", backend.ALL_FEATURES - {"moe"})
    folder = make_family_checkpoint(tmp_path / "moe", "qwen3_moe")
    with caplog.at_level(logging.INFO, logger="pagedllm_integrations.engine.engine_builder"):
        llm = LLM(str(folder), disable_log_stats=True, max_model_len=128)
    with llm:
        assert core_of(llm).model.fused_stack() is None
        status = core_of(llm).model.stack_status()
        assert "the C++ stack does not run moe (a mixture of experts MLP" in status
        assert status in caplog.text
        assert llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
