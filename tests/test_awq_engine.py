"""AWQ end to end: quantize a tiny Llama, write the checkpoint, serve it with the engine.

The reference is transformers' model holding the quantized weights in memory: the engine,
reading the packed checkpoint through AWQLinear, must give the same log-probabilities.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from pagedllm_integrations import LLM, SamplingParams
from pagedllm_integrations.cli import main as cli_main
from pagedllm_integrations.cli_quantize import (
    DEFAULT_CALIBRATION,
    load_float_model,
    read_calibration_text,
)
from pagedllm_integrations.quant.awq_format import AWQConfig, dequantize
from pagedllm_integrations.quant.quantizer import (
    QuantizeOptions,
    awq_quantize_model,
    calibration_blocks,
    save_awq_checkpoint,
)

PROMPTS = ["The capital of France is", "Mr. Bennet said to his wife", "1, 2, 3,"]
MAX_NEW = 8


@pytest.fixture(scope="module")
def calibration_texts() -> list[str]:
    return read_calibration_text(DEFAULT_CALIBRATION)[:40]


def _reference_logprobs(model, prompt_ids: list[int], generated: list[int]) -> torch.Tensor:
    """log-softmax [len(generated), vocab] of transformers' model at each generated position."""
    ids = torch.tensor([prompt_ids + generated[:-1]])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return logits.log_softmax(-1)[len(prompt_ids) - 1 :]


def _assert_engine_matches(folder, model, tokenizer, atol: float, greedy: bool = True) -> None:
    """Engine log-probs (top 5 at each greedy step) equal the reference model's."""
    with LLM(str(folder), dtype="float32", disable_log_stats=True) as llm:
        outputs = llm.generate(
            PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=5), use_tqdm=False
        )
    for prompt, output in zip(PROMPTS, outputs):
        completion = output.outputs[0]
        assert len(completion.token_ids) == MAX_NEW
        reference = _reference_logprobs(model, tokenizer(prompt).input_ids, completion.token_ids)
        if greedy:  # the same greedy path (skipped for an fp16 reference: near-ties flip)
            assert completion.token_ids == reference.argmax(-1).tolist()
        for step, top in enumerate(completion.logprobs):
            for token, logprob in top.items():
                assert abs(logprob.logprob - reference[step, token].item()) < atol


@pytest.mark.parametrize("case", ["gqa", "mha_v_dense"])
def test_awq_checkpoint_in_engine_matches_quantized_model(
    case, tiny_llama_factory, tmp_path, calibration_texts
):
    """GQA (v->o not folded); MHA with v_proj kept dense (v->o folded, mixed qkv stack)."""
    mha = case == "mha_v_dense"
    src = tiny_llama_factory(
        f"awq-{case}", hidden_size=128, num_heads=4, num_kv_heads=4 if mha else 2, shards=1
    )
    model, tokenizer = load_float_model(src)
    float_logits = model(torch.tensor([tokenizer(PROMPTS[0]).input_ids])).logits.detach()
    blocks = calibration_blocks(tokenizer, calibration_texts, 6, 48)
    options = QuantizeOptions(
        group_size=64,
        n_grid=10,
        search_samples=2,
        progress=False,
        modules_to_not_convert=["v_proj"] if mha else [],
    )
    quantized, report = awq_quantize_model(model, blocks, options)
    assert ("0.vo" in report.ratios) == mha
    assert len(quantized) == 2 * (6 if mha else 7)
    out = save_awq_checkpoint(
        model, quantized, tmp_path / "awq", AWQConfig(group_size=64), src, tokenizer
    )

    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 64,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
        q_proj = "model.layers.0.self_attn.q_proj"
        assert handle.get_tensor(f"{q_proj}.qweight").shape == (128, 16)
        assert handle.get_tensor(f"{q_proj}.qzeros").shape == (2, 16)
        assert handle.get_tensor(f"{q_proj}.scales").dtype == torch.float16
        # The packed tensors are exactly the in-memory quantized weight.
        w_t = dequantize(
            handle.get_tensor(f"{q_proj}.qweight"),
            handle.get_tensor(f"{q_proj}.qzeros"),
            handle.get_tensor(f"{q_proj}.scales"),
            64,
            torch.float32,
        )
        assert torch.equal(w_t.t(), model.model.layers[0].self_attn.q_proj.weight)
    assert f"{q_proj}.weight" not in names and "lm_head.weight" in names
    v_dense = "model.layers.0.self_attn.v_proj.weight" in names
    assert v_dense == mha

    # Quantization moved the model, but not far.
    quant_logits = model(torch.tensor([tokenizer(PROMPTS[0]).input_ids])).logits.detach()
    assert not torch.equal(quant_logits, float_logits)
    relative = (quant_logits - float_logits).norm() / float_logits.norm()
    assert relative < 0.5

    _assert_engine_matches(out, model, tokenizer, atol=2e-4)


def test_quantize_cli_writes_a_checkpoint_the_engine_serves(tiny_llama_factory, tmp_path):
    src = tiny_llama_factory("awq-cli", hidden_size=128, num_heads=4, num_kv_heads=2, shards=2)
    out = tmp_path / "cli-awq"
    code = cli_main(
        [
            "quantize",
            "--model",
            str(src),
            "--out",
            str(out),
            "--group-size",
            "32",
            "--num-samples",
            "2",
            "--seq-len",
            "32",
            "--search-samples",
            "1",
        ]
    )
    assert code == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"]["group_size"] == 32
    assert (out / "tokenizer.json").exists()
    with LLM(str(out), dtype="float32", disable_log_stats=True) as llm:
        text = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(text[0].outputs[0].token_ids) == 4
    bad = cli_main(
        ["quantize", "--model", str(src), "--out", str(tmp_path / "x"), "--seq-len", "100000"]
    )
    assert bad == 2  # too little calibration text: a clear error, not a traceback


def test_autoawq_checkpoint_loads_and_matches_its_forward(
    tiny_llama_factory, tmp_path, calibration_texts, monkeypatch
):
    """A second implementation: AutoAWQ quantizes, pagedllm serves what it wrote."""
    pytest.importorskip("datasets")
    awq = pytest.importorskip("awq")
    from awq.modules.linear import gemm
    from awq.quantize.quantizer import AwqQuantizer
    from awq.utils.packing_utils import dequantize_gemm
    from transformers import AutoModelForCausalLM

    class CpuSafeQuantizer(AwqQuantizer):
        """AutoAWQ snapshots weights with `.cpu()`, which aliases them on a CPU: clone instead."""

        def _compute_best_scale(self, x, w_mean, x_mean, module2inspect, *args, **kwargs):
            original = module2inspect.state_dict
            module2inspect.state_dict = lambda *a, **k: {
                n: t.clone() for n, t in original(*a, **k).items()
            }
            try:
                return super()._compute_best_scale(
                    x, w_mean, x_mean, module2inspect, *args, **kwargs
                )
            finally:
                del module2inspect.state_dict

    src = tiny_llama_factory("autoawq-src", hidden_size=128, num_heads=4, num_kv_heads=2, shards=1)
    wrapper = awq.AutoAWQForCausalLM.from_pretrained(str(src), torch_dtype=torch.float32)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(src))
    wrapper.quantize(
        tokenizer,
        quant_config={"zero_point": True, "q_group_size": 64, "w_bit": 4, "version": "GEMM"},
        calib_data=calibration_texts,
        # AutoAWQ takes max_calib_samples paragraphs (dropping any over max_calib_seq_len
        # tokens), joins them and cuts blocks of max_calib_seq_len tokens.
        max_calib_seq_len=64,
        max_calib_samples=12,
        quantizer_cls=CpuSafeQuantizer,
    )
    wrapper.model.half()
    out = tmp_path / "autoawq"
    wrapper.save_quantized(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, out / name)

    # 1. AutoAWQ's own forward (WQLinear_GEMM's pure-torch path). It runs in fp16 and its
    #    rounding grows through the layers: a loose bound (a wrong layout is off by whole units).
    monkeypatch.setattr(gemm, "TRITON_AVAILABLE", False)
    _assert_engine_matches(out, wrapper.model, tokenizer, atol=0.15, greedy=False)

    # 2. Tight: transformers in fp32 with weights from AutoAWQ's dequantize_gemm.
    reference = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    state = {}
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
            if name.endswith(".qweight"):
                module = name[: -len(".qweight")]
                w_t = dequantize_gemm(
                    handle.get_tensor(name),
                    handle.get_tensor(f"{module}.qzeros"),
                    handle.get_tensor(f"{module}.scales").float(),  # exact products
                    4,
                    64,
                )
                state[f"{module}.weight"] = w_t.float().t()
            elif not name.endswith((".qzeros", ".scales")):
                state[name] = handle.get_tensor(name).float()
    missing, unexpected = reference.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing)
    _assert_engine_matches(out, reference, tokenizer, atol=2e-4)
