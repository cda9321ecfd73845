"""The new families on the CPU fast path (the default where the CPU has bf16 instructions):
bf16 weights (packed GGUF blocks for a quantized file) with float32 sums and the C++
kernels, close to the float32 reference path, and every token independent of batching.

Gemma's (1 + w) norms and soft-caps, Qwen3-MoE's experts, Phi-4-mini's partial rotary
(which stays in torch: the rotary kernel turns whole heads) all run here.
"""

from __future__ import annotations

import pytest
from family_checkpoints import make_family_checkpoint
from gguf_export import write_gguf

from pagedllm_integrations import LLM, SamplingParams
from pagedllm_integrations.engine.compute_plan import cpu_fast_path_isa
from pagedllm_integrations.engine.white_box import core_of
from pagedllm_integrations.kernels import cpu_ext

pytestmark = pytest.mark.skipif(
    not (cpu_fast_path_isa() is not None and cpu_ext.load()),
    reason="the fast path needs AVX-512 and the C++ kernels",
)

PROMPTS = [
    "The capital of France is",
    "It is a truth universally acknowledged, that a single man in possession",
    "1, 2, 3, 4,",
]
SHORT = [PROMPTS[0], PROMPTS[2]]  # phi4_mini runs a 32-token context (longrope short factors)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
FIRST = SamplingParams(temperature=0, max_tokens=1, logprobs=5)


def _assert_close_to_float32(fast, reference) -> None:
    """Same first token; the top log-probabilities they share agree to 0.15."""
    for f, r in zip(fast, reference):
        f_top, r_top = f.outputs[0].logprobs[0], r.outputs[0].logprobs[0]
        assert f.outputs[0].token_ids[0] == r.outputs[0].token_ids[0]
        shared = set(f_top) & set(r_top)
        assert len(shared) >= 3
        for token in shared:
            assert abs(f_top[token].logprob - r_top[token].logprob) < 0.15


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe", "gemma2", "gemma3", "phi4_mini"])
def test_family_on_the_fast_path(kind, tmp_path):
    folder = make_family_checkpoint(tmp_path / kind, kind, shards=1)
    max_model_len, prompts = (32, SHORT) if kind == "phi4_mini" else (128, PROMPTS)
    settings = dict(disable_log_stats=True, max_model_len=max_model_len)
    with LLM(str(folder), **settings) as fast:
        assert core_of(fast).plan.fused_cpu  # dtype "auto": the default
        batched = _tokens(fast.generate(prompts, GREEDY, use_tqdm=False))
        for prompt, want in zip(prompts, batched):
            assert _tokens(fast.generate(prompt, GREEDY, use_tqdm=False)) == [want]
        first = fast.generate(prompts, FIRST, use_tqdm=False)
    with LLM(str(folder), dtype="float32", **settings) as reference:
        assert not core_of(reference).plan.fused_cpu
        _assert_close_to_float32(first, reference.generate(prompts, FIRST, use_tqdm=False))


# What a GGUF file cannot say is fixed in the checkpoint (see test_gguf_families.py).
GGUF_EXPRESSIBLE = {"qwen3_moe": dict(mlp_only_layers=[]), "gemma2": dict(query_pre_attn_scalar=16)}


@pytest.mark.parametrize("kind", ["qwen3_moe", "gemma2", "phi4_mini"])
def test_quantized_gguf_stays_packed_on_the_fast_path(kind, tmp_path, monkeypatch):
    """A Q8_0 GGUF: experts cut per expert and Phi-3's fused qkv / gate_up cut per shard
    by whole rows of blocks, held packed; the float32 path dequantizes the same file."""
    from pagedllm_integrations.quant.packed import TiledWeight
    from pagedllm_integrations.quant.packed_linear import PackedStackedLinear

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    folder = make_family_checkpoint(tmp_path / kind, kind, **GGUF_EXPRESSIBLE.get(kind, {}))
    gguf_file = write_gguf(folder, tmp_path / f"{kind}.gguf", quantize="Q8_0")
    max_model_len, prompts = (32, SHORT) if kind == "phi4_mini" else (128, PROMPTS)
    settings = dict(disable_log_stats=True, max_model_len=max_model_len)
    with LLM(str(gguf_file), **settings) as fast:
        linears = [m for m in core_of(fast).model.modules() if isinstance(m, PackedStackedLinear)]
        assert linears and all(isinstance(w, TiledWeight) for m in linears for w in m.segments)
        first = fast.generate(prompts, FIRST, use_tqdm=False)
    with LLM(str(gguf_file), dtype="float32", **settings) as reference:
        _assert_close_to_float32(first, reference.generate(prompts, FIRST, use_tqdm=False))
