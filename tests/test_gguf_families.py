"""GGUF files of every family (written here as llama.cpp's converter writes them) load and
give transformers' greedy tokens for the checkpoint they were made from.

What GGUF cannot say is fixed in the checkpoints: llama.cpp derives Gemma's
query_pre_attn_scalar (head_dim below 27B) and Gemma 3's layer pattern (five sliding, one
global) and local rope base (10000), and runs every Qwen3-MoE layer sparse.
"""

from __future__ import annotations

import json

import pytest
from family_checkpoints import (
    FAMILIES,
    assert_engine_matches,
    hf_greedy,
    make_family_checkpoint,
)
from gguf_export import write_gguf

from pagedllm_integrations.engine import gguf_arch
from pagedllm_integrations.engine.model_loader import gguf_to_hf_folder, load_tokenizer

PROMPTS = [
    "The capital of France is",
    "It is a truth universally acknowledged, that a single man in possession of a good "
    "fortune, must be in want of a wife.",
    '{"name": "get_weather", "arguments": {"city":',
]
GGUF_EXPRESSIBLE = {
    "qwen3_moe": dict(mlp_only_layers=[]),
    "gemma2": dict(query_pre_attn_scalar=16),
    "gemma3": dict(
        query_pre_attn_scalar=16,
        num_hidden_layers=6,
        layer_types=None,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
}


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("kind", FAMILIES)
def test_gguf_of_each_family_gives_transformers_tokens(kind, tmp_path):
    folder = make_family_checkpoint(tmp_path / kind, kind, **GGUF_EXPRESSIBLE.get(kind, {}))
    gguf_file = write_gguf(folder, tmp_path / f"{kind}.gguf")
    converted = gguf_to_hf_folder(gguf_file)
    original = json.loads((folder / "config.json").read_text())
    assert (
        json.loads((converted / "config.json").read_text())["architectures"]
        == (original["architectures"])
    )
    # The tokenizer rebuilt from the GGUF vocabulary tokenizes as the original does.
    ours, theirs = load_tokenizer(converted), load_tokenizer(folder)
    for prompt in PROMPTS:
        assert ours(prompt).input_ids == theirs(prompt).input_ids
    max_model_len = 32 if kind == "phi4_mini" else 128  # phi4_mini: longrope's short factors
    prompts = PROMPTS if kind != "phi4_mini" else [PROMPTS[0], PROMPTS[2]]
    expected = hf_greedy(folder, prompts)
    assert_engine_matches(
        gguf_file, prompts, expected, expect_hits=kind != "phi4_mini", max_model_len=max_model_len
    )


def test_gguf_tables_name_and_fix_tensors():
    import torch

    config = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 3}
    w = torch.arange(6.0)
    [(name, fixed)] = gguf_arch.fix_tensor("gemma3", "blk.2.attn_q_norm.weight", w, config)
    assert name == "model.layers.2.self_attn.q_norm.weight" and torch.equal(fixed, w - 1)
    assert gguf_arch.hf_name("gemma2", "blk.0.ffn_norm.weight") == (
        "model.layers.0.pre_feedforward_layernorm.weight"
    )
    assert gguf_arch.hf_name("qwen3", "blk.0.ffn_norm.weight") == (
        "model.layers.0.post_attention_layernorm.weight"
    )
    assert (
        gguf_arch.hf_name("phi3", "blk.1.ffn_up.weight") == "model.layers.1.mlp.gate_up_proj.weight"
    )
    assert gguf_arch.hf_name("phi3", "rope_factors_long.weight") is None
    stacked = torch.randn(3, 5, 4)
    pieces = gguf_arch.fix_tensor("qwen3moe", "blk.1.ffn_down_exps.weight", stacked, config)
    assert [name for name, _ in pieces] == [
        f"model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(3)
    ]
    assert all(torch.equal(t, stacked[e]) for e, (_, t) in enumerate(pieces))
    # qwen2 and qwen3 q/k are not permuted by the converter (llama's are).
    q = torch.randn(16, 4)  # 4 heads of 4 rows: the permutation moves rows
    assert torch.equal(gguf_arch.fix_tensor("qwen3", "blk.0.attn_q.weight", q, config)[0][1], q)
    assert not torch.equal(gguf_arch.fix_tensor("llama", "blk.0.attn_q.weight", q, config)[0][1], q)
    # Quantized weights (whole rows of blocks) are cut per expert and unpermuted by rows.
    import numpy as np

    from pagedllm_integrations.engine.gguf_loader import GGUFTensor

    packed = GGUFTensor("Q8_0", np.arange(15 * 34, dtype=np.uint8).reshape(15, 34), (15, 32))
    pieces = gguf_arch.fix_tensor("qwen3moe", "blk.0.ffn_up_exps.weight", packed, config)
    assert [p.shape for _, p in pieces] == [(5, 32)] * 3
    assert np.array_equal(pieces[2][1].data, packed.data[10:15])
    rows = GGUFTensor("Q8_0", np.arange(16 * 34, dtype=np.uint8).reshape(16, 34), (16, 32))
    [(_, moved)] = gguf_arch.fix_tensor("llama", "blk.0.attn_q.weight", rows, config)
    dense_moved = gguf_arch.unpermute_rotary(torch.arange(16.0)[:, None], 4)[:, 0].long()
    assert np.array_equal(moved.data, rows.data[dense_moved.numpy()])
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'mamba'"):
        gguf_arch.hf_name("mamba", "token_embd.weight")
    with pytest.raises(ValueError, match="not known"):
        gguf_arch.hf_name("qwen3", "blk.0.ssm_conv1d.weight")


def test_a_conversion_says_what_it_does_where_no_logging_is_set_up(tmp_path):
    """Converting a GGUF takes tens of seconds for a real model: a WARNING line says so,
    which Python prints on stderr when the application set up no logging (issue 44)."""
    import os
    import subprocess
    import sys

    folder = make_family_checkpoint(tmp_path / "qwen3", "qwen3")
    gguf_file = write_gguf(folder, tmp_path / "qwen3.gguf")
    code = (
        "import sys; from pathlib import Path\n"
        "from pagedllm_integrations.engine.gguf_loader import gguf_to_hf_folder\n"
        "gguf_to_hf_folder(Path(sys.argv[1]))\n"
    )
    env = {**os.environ, "PAGEDLLM_CACHE_DIR": str(tmp_path / "fresh")}
    done = subprocess.run([sys.executable, "-P", "-c", code, str(gguf_file)], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "qwen3.gguf" in line]
    assert lines[0].startswith(f"converting {gguf_file} for pagedllm once")
    assert "about 10-40 s" in lines[0] and "converted qwen3.gguf in" in lines[1]
