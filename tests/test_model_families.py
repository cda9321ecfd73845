"""Every model family against transformers: greedy tokens equal `generate`, batched and alone.

Tiny random checkpoints of each family (tests/family_checkpoints.py) in float32, served with
prefix caching on and chunked prefill forced (16 tokens a step, so prompts span steps). The
sliding-window families (Gemma 2 and 3: window 8; the Phi-4-mini-like model: window 24) get
prompts several windows long.
"""

from __future__ import annotations

import json

import pytest
import torch
from family_checkpoints import (
    FAMILIES,
    assert_engine_matches,
    hf_greedy,
    make_family_checkpoint,
)
from safetensors.torch import load_file, save_file

from pagedllm_integrations.engine.models.config import ModelConfig

PROMPTS = [
    "The capital of France is",
    "It is a truth universally acknowledged, that a single man in possession of a good "
    "fortune, must be in want of a wife.",
    "1, 2, 3, 4,",
    '{"name": "get_weather", "arguments": {"city":',
    "def fibonacci(n):",
]


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory):
    """family_dir(kind) -> the folder of a tiny random checkpoint of that family (made once)."""
    made: dict[str, object] = {}

    def get(kind: str):
        if kind not in made:
            made[kind] = make_family_checkpoint(tmp_path_factory.mktemp(kind), kind)
        return made[kind]

    return get


@pytest.mark.parametrize("kind", [k for k in FAMILIES if k != "phi4_mini"])
def test_family_matches_transformers(family_dir, kind):
    folder = family_dir(kind)
    assert_engine_matches(folder, PROMPTS, hf_greedy(folder, PROMPTS), max_model_len=128)


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "qwen3_moe"])
def test_bfloat16_starts_like_transformers(family_dir, kind):
    """In bfloat16 the kernels round differently from transformers: the first tokens agree
    (Gemma's (1 + w) norms and soft-caps, the experts' routing weights in bf16)."""
    import torch

    from pagedllm_integrations import LLM, SamplingParams

    folder = family_dir(kind)
    expected = hf_greedy(folder, PROMPTS, 4, dtype=torch.bfloat16)
    params = SamplingParams(temperature=0, max_tokens=4)
    with LLM(str(folder), dtype="bfloat16", disable_log_stats=True, max_model_len=128) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert [g[:3] for g in got] == [e[:3] for e in expected]


def test_gemma_prompts_span_several_windows(family_dir):
    from transformers import AutoTokenizer

    for kind in ("gemma2", "gemma3"):
        config = json.loads((family_dir(kind) / "config.json").read_text())
        tokenizer = AutoTokenizer.from_pretrained(family_dir(kind))
        assert config["sliding_window"] == 8
        assert len(tokenizer(PROMPTS[1]).input_ids) > 4 * config["sliding_window"]


def test_phi4_mini_longrope_short_and_long_contexts(family_dir):
    """longrope's short factors while the engine's context fits the original one (32 here),
    its long factors beyond it, where transformers uses them too (prompts longer than 32);
    partial rotary (0.75 of each head) and a 24-token sliding window throughout."""
    folder = family_dir("phi4_mini")
    short = [p for p in PROMPTS if p != PROMPTS[1]]
    expected = hf_greedy(folder, short)
    assert_engine_matches(folder, short, expected, expect_hits=False, max_model_len=32)
    long = [PROMPTS[1], PROMPTS[1] + " " + PROMPTS[3], PROMPTS[1] + " Mr. Bennet said"]
    assert_engine_matches(folder, long, hf_greedy(folder, long), max_model_len=256)


def test_gemma3_multimodal_checkpoint_runs_its_text_model(family_dir, tmp_path):
    """A Gemma3ForConditionalGeneration folder (config under text_config, weights under
    model.language_model., a vision tower beside them) gives the text model's tokens."""
    source = family_dir("gemma3")
    config = json.loads((source / "config.json").read_text())
    wrapped = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": {k: v for k, v in config.items() if k != "architectures"},
        "vision_config": {"hidden_size": 8},
        "eos_token_id": config["eos_token_id"],
    }
    (tmp_path / "config.json").write_text(json.dumps(wrapped))
    tensors = {}
    for shard in sorted(source.glob("*.safetensors")):
        for name, tensor in load_file(shard).items():
            tensors[name.replace("model.", "model.language_model.", 1)] = tensor
    tensors["model.vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.ones(8, 3)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / name).exists():
            (tmp_path / name).write_bytes((source / name).read_bytes())
    prompts = PROMPTS[:3]
    assert_engine_matches(tmp_path, prompts, hf_greedy(source, prompts), max_model_len=128)


def test_unsupported_architecture_names_the_supported_ones():
    with pytest.raises(ValueError) as error:
        ModelConfig.from_hf_dict({"architectures": ["MambaForCausalLM"], "hidden_size": 8})
    message = str(error.value)
    assert "MambaForCausalLM" in message
    for name in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                 "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM"):  # fmt: skip
        assert name in message
