"""Every type mix llama-quantize writes loads on the fast path and equals its float32
dequantization within the fast path's usual tolerance.

Files are written as `llama-quantize` writes them (tests/gguf_mixes.py: its per-tensor type
rules for the Q2_K .. Q8_0 presets and --pure, over random checkpoints whose widths are
whole 256-value K-quant blocks, with one width that is not, so the fallback types appear).
Q4_K_M is the common case that once failed to load: half of its layers hold attn_q and
attn_k in Q4_K and attn_v in Q6_K, one stacked qkv linear of two formats.
"""

from __future__ import annotations

import gguf
import pytest
from family_checkpoints import make_family_checkpoint
from gguf_export import write_gguf
from gguf_mixes import PRESETS

from pagedllm_integrations import LLM, SamplingParams
from pagedllm_integrations.engine.compute_plan import cpu_fast_path_isa
from pagedllm_integrations.engine.white_box import core_of
from pagedllm_integrations.kernels import cpu_ext

pytestmark = pytest.mark.skipif(
    not (cpu_fast_path_isa() is not None and cpu_ext.load()),
    reason="the fast path needs AVX-512 or AVX2 and the C++ kernels",
)

# K-quant widths (multiples of 256), except the MLP's inner width: ffn_down's rows of 320
# values take llama-quantize's fallback types (Q5_0, Q5_1, Q8_0, Q4_0).
SHAPE = dict(
    hidden_size=256,
    intermediate_size=320,
    num_attention_heads=4,
    num_key_value_heads=1,  # GQA 4, as llama-quantize's Q2_K rules look at
    head_dim=64,
    num_hidden_layers=2,
    # Narrower than the families' default init (0.2 at width 64): at width 256 that would
    # make logits so steep that int8 activation noise moves them by ~0.5.
    initializer_range=0.1,
)
EXTRA = {
    "qwen3_moe": dict(moe_intermediate_size=64, mlp_only_layers=[]),
    "gemma2": dict(num_hidden_layers=3),  # their layer types name three layers
    "gemma3": dict(num_hidden_layers=3),
}
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
# How far the fast path's log-probabilities may lie from the float32 path's on these models.
# Its int8 activations (llama.cpp's Q8 blocks) move them by 0.09-0.24 at width 256 (the top
# 20 of four prompts, every preset; largest for Q5_1, whose mins multiply the activations'
# rounding); at width 64 (the families' own tests) 0.15 holds.
TOLERANCE = 0.3
FIRST = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made: dict = {}

    def get(kind: str):
        if kind not in made:
            shape = dict(SHAPE, **EXTRA.get(kind, {}))
            if kind in ("phi3", "phi4_mini"):
                shape.pop("head_dim")  # Phi-3 derives it from hidden / heads
            folder = tmp_path_factory.mktemp(kind)
            made[kind] = make_family_checkpoint(folder, kind, shards=1, **shape)
        return made[kind]

    return get


def _types(path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


def check_mix(folder, tmp_path, preset: str, pure: bool = False) -> dict[str, str]:
    path = write_gguf(folder, tmp_path / f"{preset}.gguf", mix=preset, pure=pure)
    settings = dict(disable_log_stats=True, max_model_len=128)
    with LLM(str(path), **settings) as fast:  # the defaults: the fast path
        engine = core_of(fast)
        assert engine.plan.fused_cpu
        model = engine.model
        assert model.fused_stack() is not None, model.stack_status()
        first = fast.generate(PROMPTS, FIRST, use_tqdm=False)
        batched = [o.outputs[0].token_ids for o in fast.generate(PROMPTS, GREEDY, use_tqdm=False)]
        alone = [fast.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
        assert alone == batched  # batch invariance holds over mixed-format linears too
    with LLM(str(path), dtype="float32", **settings) as reference:
        expected = reference.generate(PROMPTS, FIRST, use_tqdm=False)
    for f, r in zip(first, expected):
        f_top, r_top = f.outputs[0].logprobs[0], r.outputs[0].logprobs[0]
        # The fast path's choice is the reference's, or one the reference ranks within the
        # tolerance of its own (random models have near ties).
        chosen, best = f.outputs[0].token_ids[0], max(v.logprob for v in r_top.values())
        assert chosen in r_top and r_top[chosen].logprob > best - TOLERANCE
        shared = set(f_top) & set(r_top)
        assert len(shared) >= 3
        for token in shared:
            assert abs(f_top[token].logprob - r_top[token].logprob) < TOLERANCE
    return _types(path)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_loads_on_the_fast_path(preset, checkpoints, tmp_path):
    types = check_mix(checkpoints("llama"), tmp_path, preset)
    assert types["blk.0.attn_q.weight"] != "F32"


def test_q4_k_m_stacks_two_formats_in_one_qkv(checkpoints, tmp_path):
    """Layer 1's v is Q6_K beside a Q4_K q and k: one C++ Linear of a u4 and an i6
    segment (Q6_K's q in 6 bits); layer 0's qkv is one u4 segment."""
    types = check_mix(checkpoints("llama"), tmp_path, "Q4_K_M")
    assert types["blk.1.attn_v.weight"] == "Q6_K" and types["blk.1.attn_q.weight"] == "Q4_K"
    assert types["blk.0.attn_v.weight"] == "Q4_K"
    assert types["blk.0.ffn_down.weight"] == "Q5_0"  # 320-value rows: the fallback of Q4_K
    path = tmp_path / "Q4_K_M.gguf"
    with LLM(str(path), disable_log_stats=True, max_model_len=64) as llm:
        layers = core_of(llm).model.layers
        assert layers[1].self_attn.qkv_proj.kernel.segment_formats() == ["u4/32", "i6/16"]
        assert layers[0].self_attn.qkv_proj.kernel.segment_formats() == ["u4/32"]


def test_pure_q4_k_m_keeps_one_type(checkpoints, tmp_path):
    types = check_mix(checkpoints("llama"), tmp_path, "Q4_K_M", pure=True)
    assert types["blk.1.attn_v.weight"] == "Q4_K" and types["output.weight"] == "Q4_K"


@pytest.mark.parametrize("kind", ["qwen3", "gemma3", "phi3", "qwen3_moe"])
def test_q4_k_m_of_every_family(kind, checkpoints, tmp_path):
    check_mix(checkpoints(kind), tmp_path, "Q4_K_M")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3", "gemma2", "gemma3", "phi3", "phi4_mini", "qwen3_moe"])
@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_of_every_family(kind, preset, checkpoints, tmp_path):
    check_mix(checkpoints(kind), tmp_path, preset)
