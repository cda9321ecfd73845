"""The backend a model is built with (engine/models/backend.py): chosen once, read by every
layer at construction, and a capability table that refuses what it cannot run."""

from __future__ import annotations

import pytest
import torch

from pagedllm_integrations.engine.models.backend import (
    ALL_FEATURES,
    FEATURES,
    Backend,
    backend_for,
    model_features,
    torch_backend,
)
from pagedllm_integrations.engine.models.config import ModelConfig
from pagedllm_integrations.engine.models.layers import GatedMLP, RMSNorm, dense_linear
from pagedllm_integrations.engine.models.registry import build_model
from pagedllm_integrations.engine.models.rotary import RotaryEmbedding


def config(**overrides) -> ModelConfig:
    fields = dict(
        architecture="Qwen3ForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
        rope_theta=10000.0, rope_scaling=None, max_position_embeddings=64,
        tie_word_embeddings=True, qkv_bias=False, o_bias=False, mlp_bias=False,
        sliding_window=None, qk_norm=True,
    )  # fmt: skip
    fields.update(overrides)
    return ModelConfig(**fields)


def test_a_model_says_what_it_needs():
    assert model_features(config()) == {"gated_mlp", "qk_norm"}
    gemma_like = config(
        architecture="Gemma3ForCausalLM", hidden_act="gelu_pytorch_tanh", qk_norm=True,
        rms_norm_unit_offset=True, sliding_window=8, layer_types=["sliding_attention",
        "full_attention"], local_rope_theta=500.0, attn_logit_softcap=5.0,
    )  # fmt: skip
    assert model_features(gemma_like, frozenset({"sandwich_norms"})) == {
        "gated_mlp", "gelu", "qk_norm", "unit_offset_norm", "sliding_window",
        "per_layer_rotary", "logit_soft_cap", "sandwich_norms",
    }  # fmt: skip
    assert "moe" in model_features(config(num_experts=8, num_experts_per_tok=2))
    assert set(FEATURES) == ALL_FEATURES


def test_the_capability_table_refuses_what_a_backend_cannot_run():
    lacking = Backend("test", dense_linear, False, "torch", ALL_FEATURES - {"qk_norm"})
    with pytest.raises(
        ValueError, match=r"the test backend cannot run this model: it lacks qk_norm"
    ):
        build_model(config(), torch.float32, torch.device("cpu"), 64, lacking)
    model = build_model(config(qk_norm=False), torch.float32, torch.device("cpu"), 64, lacking)
    assert model.backend is lacking


def test_every_layer_takes_its_kernels_from_the_backend_at_construction():
    """No flag is switched after the model is built: the CPU backend's layers are fused
    from their constructor on, the reference's never."""
    fast = backend_for(True, "cpu", dense_linear)
    for backend, fused in ((fast, True), (torch_backend(), False)):
        model = build_model(config(), torch.float32, torch.device("cpu"), 64, backend)
        kernel_layers = [
            m for m in model.modules() if isinstance(m, RMSNorm | RotaryEmbedding | GatedMLP)
        ]
        assert kernel_layers and all(m.fused is fused for m in kernel_layers)
        assert model.embed_tokens.fused is fused


def test_the_stack_table_says_what_keeps_a_model_off_the_stack():
    fast = backend_for(True, "cpu", dense_linear)
    moe = model_features(config(num_experts=8, num_experts_per_tok=2))
    assert fast.stack_missing(moe) == []  # the CPU stack runs every feature
    dense_only = Backend("test", dense_linear, True, "cpu", ALL_FEATURES, ALL_FEATURES - {"moe"})
    assert dense_only.stack_missing(moe) == [f"moe ({FEATURES['moe']})"]
    assert torch_backend().stack_missing(moe) == ["a whole-step stack"]
