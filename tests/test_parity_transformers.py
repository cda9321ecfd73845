"""Greedy output equals Hugging Face transformers' `generate`, token for token."""

from __future__ import annotations

import os

import pytest
import torch

from pagedllm_integrations import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "Explain in one sentence why the sky is blue, and then give an example of a blue object.",
    "Q: What is the largest planet in the solar system?\nA:",
    "Once upon a time, in a kingdom far away, there lived a princess who loved to read books "
    "about distant stars, strange machines and the people who built them. One day",
    "Translate to French: I like apples.",
]
MAX_NEW = 24


def hf_greedy(model, tokenizer, prompt: str, max_new: int) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )
    new = out[0, ids.shape[1] :].tolist()
    eos = tokenizer.eos_token_id
    return new[: new.index(eos) + 1] if eos in new else new


def test_default_model_matches_transformers_batched_and_alone(default_llm_f32, hf_default_model):
    model, tokenizer = hf_default_model
    expected = [hf_greedy(model, tokenizer, p, MAX_NEW) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    batched = default_llm_f32.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batched] == expected
    for prompt, want in zip(PROMPTS, expected):
        alone = default_llm_f32.generate(prompt, params, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == want
        assert alone.outputs[0].text == tokenizer.decode(want, skip_special_tokens=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_gqa_llama_two_shards_matches_transformers(tiny_llama_dir, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shards = [f for f in os.listdir(tiny_llama_dir) if f.endswith(".safetensors")]
    assert len(shards) == 2, shards
    torch_dtype = getattr(torch, dtype)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch_dtype).eval()
    expected = [hf_greedy(model, tokenizer, p, 16) for p in PROMPTS]
    with LLM(str(tiny_llama_dir), dtype=dtype, disable_log_stats=True) as llm:
        params = SamplingParams(temperature=0, max_tokens=16)
        batched = llm.generate(PROMPTS, params, use_tqdm=False)
        got = [o.outputs[0].token_ids for o in batched]
        if dtype == "float32":
            assert got == expected
        else:  # bf16 rounding differs between kernels: allow a late divergence, not an early one
            for g, e in zip(got, expected):
                assert g[:4] == e[:4]


@pytest.mark.parametrize("architecture", ["qwen2", "mistral"])
def test_other_llama_family_architectures_match_transformers(tiny_llama_factory, architecture):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tiny_llama_factory(architecture, architecture=architecture, shards=1)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    expected = [hf_greedy(model, tokenizer, p, 12) for p in PROMPTS[:4]]
    with LLM(str(folder), disable_log_stats=True, dtype="float32") as llm:
        outputs = llm.generate(
            PROMPTS[:4], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False
        )
    assert [o.outputs[0].token_ids for o in outputs] == expected
