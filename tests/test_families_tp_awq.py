"""Tensor parallelism and AWQ for the new families.

AWQ: each tiny checkpoint's linears (attention, MLP, every expert; Phi-3's fused qkv_proj
and gate_up_proj as one tensor each) quantized group-wise to INT4 and packed AutoAWQ's
way; the reference is transformers on a dense checkpoint holding the dequantized weights.
TP: two gloo ranks on CPU against the one-rank engine on the same folder.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from family_checkpoints import assert_engine_matches, hf_greedy, make_family_checkpoint
from safetensors.torch import load_file, save_file

from pagedllm_integrations import LLM, SamplingParams
from pagedllm_integrations.engine.distributed.tp_layers import shard_config
from pagedllm_integrations.engine.models.config import ModelConfig
from pagedllm_integrations.engine.white_box import core_of
from pagedllm_integrations.quant.awq_format import AWQConfig, quantize_weight

PROMPTS = [
    "The capital of France is",
    "It is a truth universally acknowledged, that a single man in possession",
    "1, 2, 3, 4,",
]
SHORT_PROMPTS = [PROMPTS[0], PROMPTS[2]]  # for max_model_len 32 (longrope's short factors)
GROUP = 32


def write_awq_and_dequantized(folder: Path, awq: Path, dense: Path) -> None:
    """awq: packed INT4 linears (fp16 scales), everything else as is; dense: the same model
    with each quantized linear replaced by its dequantized float32 weight."""
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(shard))
    packed, dequantized = {}, {}
    for name, weight in tensors.items():
        if name.endswith("_proj.weight") and weight.shape[1] % GROUP == 0:
            q = quantize_weight(weight, GROUP)
            module = name.removesuffix(".weight")
            packed.update({f"{module}.{k}": v for k, v in q.pack().items()})
            dequantized[name] = q.dequantize()
        else:
            packed[name] = dequantized[name] = weight
    config = json.loads((folder / "config.json").read_text())
    for out, weights, extra in (
        (awq, packed, {"quantization_config": AWQConfig(group_size=GROUP).to_hf_dict()}),
        (dense, dequantized, {}),
    ):
        out.mkdir(parents=True)
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps({**config, **extra}))
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (folder / name).exists():
                shutil.copy(folder / name, out / name)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe", "gemma2", "phi4_mini"])
def test_awq_checkpoint_of_each_family(kind, tmp_path):
    folder = make_family_checkpoint(tmp_path / kind, kind, shards=1)
    write_awq_and_dequantized(folder, tmp_path / "awq", tmp_path / "dense")
    names = load_file(tmp_path / "awq" / "model.safetensors").keys()
    quantized = {n.removesuffix(".qweight") for n in names if n.endswith(".qweight")}
    if kind == "phi4_mini":
        assert "model.layers.0.self_attn.qkv_proj" in quantized  # fused, quantized as one
    if kind == "qwen3_moe":
        assert "model.layers.0.mlp.experts.5.down_proj" in quantized
    max_model_len, prompts = (32, SHORT_PROMPTS) if kind == "phi4_mini" else (128, PROMPTS)
    expected = hf_greedy(tmp_path / "dense", prompts)
    assert_engine_matches(
        tmp_path / "awq", prompts, expected, expect_hits=False, max_model_len=max_model_len
    )


ENGINE_ARGS = dict(disable_log_stats=True, num_kv_blocks=64, dtype="float32")


def _greedy(llm: LLM, prompts: list[str]):
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=3)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("kind", ["gemma2", "phi4_mini", "qwen3_moe", "phi4_mini-awq"])
def test_tp2_matches_one_rank(kind, tmp_path):
    """Gemma 2 (soft-caps, windows, q/k scale), Phi-4-mini (fused checkpoint linears split
    per rank, partial rotary), Qwen3-MoE (each expert split, router replicated), and the
    Phi-4-mini AWQ checkpoint (fused packed tensors split per rank)."""
    folder = make_family_checkpoint(tmp_path / kind, kind.removesuffix("-awq"), shards=1)
    if kind.endswith("-awq"):
        write_awq_and_dequantized(folder, tmp_path / "awq", tmp_path / "dense")
        folder = tmp_path / "awq"
    max_model_len, prompts = (32, SHORT_PROMPTS) if kind.startswith("phi4") else (128, PROMPTS)
    with LLM(str(folder), max_model_len=max_model_len, **ENGINE_ARGS) as llm:
        reference = _greedy(llm, prompts)
    with LLM(
        str(folder), tensor_parallel_size=2, max_model_len=max_model_len, **ENGINE_ARGS
    ) as llm:
        assert core_of(llm).executor.kv_caches[0][0].shape[2] == 1  # 2 KV heads / 2 ranks
        outputs = _greedy(llm, prompts)
    for tp, ref in zip(outputs, reference):
        assert tp.token_ids == ref.token_ids
        for tp_top, ref_top in zip(tp.logprobs, ref.logprobs):
            for token, logprob in ref_top.items():
                assert abs(tp_top[token].logprob - logprob.logprob) < 1e-3


def test_tp_size_that_does_not_divide_the_experts_is_refused(tmp_path):
    folder = make_family_checkpoint(tmp_path / "moe", "qwen3_moe", moe_intermediate_size=33)
    cfg = ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    with pytest.raises(ValueError, match="must divide moe_intermediate_size 33"):
        LLM(str(folder), tensor_parallel_size=2, **ENGINE_ARGS)
    assert shard_config(cfg, 1).moe_intermediate_size == 33


def test_quantizer_calibrates_qwen3_and_refuses_gemma(tmp_path):
    """`pagedllm quantize` folds scales into Llama-shaped blocks: Qwen3 is one (its q/k norms
    act after the projections); Gemma's sandwich norms are not, so it is refused by name."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedllm_integrations.cli_quantize import (
        DEFAULT_CALIBRATION,
        quantize_checkpoint,
        read_calibration_text,
    )
    from pagedllm_integrations.quant.quantizer import (
        QuantizeOptions,
        awq_quantize_model,
        calibration_blocks,
        save_awq_checkpoint,
    )

    gemma = make_family_checkpoint(tmp_path / "gemma", "gemma2", shards=1)
    with pytest.raises(ValueError, match="not Gemma2ForCausalLM"):
        quantize_checkpoint(str(gemma), tmp_path / "gemma-awq")

    folder = make_family_checkpoint(tmp_path / "qwen3", "qwen3", shards=1)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    options = QuantizeOptions(group_size=GROUP, num_samples=8, seq_len=64, progress=False)
    texts = read_calibration_text(DEFAULT_CALIBRATION)
    blocks = calibration_blocks(tokenizer, texts, options.num_samples, options.seq_len)
    quantized, _ = awq_quantize_model(model, blocks, options)
    out = save_awq_checkpoint(
        model, quantized, tmp_path / "awq", AWQConfig(group_size=GROUP), folder, tokenizer
    )
    expected = []  # the quantized model in memory holds exactly the checkpoint's weights
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            generated = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )  # fmt: skip
        new = generated[0, ids.shape[1] :].tolist()
        eos = model.generation_config.eos_token_id
        expected.append(new[: new.index(eos) + 1] if eos in new else new)
    assert_engine_matches(out, PROMPTS, expected, expect_hits=False, max_model_len=128)
