"""Tiny random checkpoints of each model family, written by transformers into a folder.

Each comes with a small byte-level BPE tokenizer trained here (a few hundred tokens, the
family's special tokens added whole), so the models stay tiny (vocab ~ 500, hidden 64)
and the tests fast. Weights are drawn wider than transformers' default (std 0.2) so that
greedy choices are decided by clear margins, not by rounding noise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from pagedllm_integrations.engine.white_box import core_of

_CORPUS = Path(__file__).resolve().parents[1] / "quant" / "data" / "calibration.txt"
_JSON_LINES = [
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    '[{"name": "add", "arguments": {"a": 1, "b": 2.5, "ok": true, "tags": ["x", null]}}]',
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 <>[]{}()=+-*/_:;,.!?'\"|#@$%^&~`\\",
]

# Special tokens of each family (what its tokenizer holds as single added tokens), and which
# one ends a turn (the model's eos in these tiny checkpoints).
SPECIAL_TOKENS: dict[str, list[str]] = {
    "qwen3": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
              "<tool_response>", "</tool_response>", "<think>", "</think>"],
    "gemma": ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
    "phi3": ["<unk>", "<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>",
             "<|end|>", "<|tool|>", "<|/tool|>", "<|tool_call|>", "<|/tool_call|>",
             "<|tool_response|>"],
}  # fmt: skip
EOS_TOKEN = {"qwen3": "<|im_end|>", "gemma": "<eos>", "phi3": "<|endoftext|>"}
BOS_TOKEN = {"qwen3": None, "gemma": "<bos>", "phi3": None}


def make_tokenizer(folder: Path, family: str, vocab_size: int = 512):
    """Train a byte-level BPE on a little English, JSON and code; save it in `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = SPECIAL_TOKENS[family]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = _CORPUS.read_text().splitlines()
    tokenizer.train_from_iterator(text + _JSON_LINES * 20, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN[family],
        bos_token=BOS_TOKEN[family],
        pad_token=EOS_TOKEN[family] if family != "gemma" else "<pad>",
    )
    wrapped.save_pretrained(str(folder))
    return wrapped


def _common(vocab: int, **overrides: Any) -> dict[str, Any]:
    config = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    config.update(overrides)
    return config


def _token_ids(tokenizer, family: str) -> dict[str, Any]:
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN[family])
    bos = BOS_TOKEN[family]
    pad = tokenizer.pad_token_id
    return dict(
        eos_token_id=eos,
        bos_token_id=tokenizer.convert_tokens_to_ids(bos) if bos else None,
        pad_token_id=pad,
    )


# family name -> (tokenizer family, transformers config class, model class, config overrides)
def _family_config(kind: str, vocab: int, ids: dict[str, Any], **overrides: Any):
    import transformers as tf

    if kind == "qwen3":
        cfg = tf.Qwen3Config(**_common(vocab, **ids, **overrides))
        return cfg, tf.Qwen3ForCausalLM
    if kind == "llama":  # Llama 3's shape (SmolLM2, Qwen2 and Mistral are tested elsewhere)
        cfg = tf.LlamaConfig(**_common(vocab, **ids, **overrides))
        return cfg, tf.LlamaForCausalLM
    if kind == "qwen3_moe":
        settings = dict(
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        )
        settings.update(overrides)
        cfg = tf.Qwen3MoeConfig(**_common(vocab, **ids, **settings))
        return cfg, tf.Qwen3MoeForCausalLM
    if kind == "gemma2":
        settings = dict(
            sliding_window=8,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0,  # small caps: the tanh bends real scores
            final_logit_softcapping=3.0,
            hidden_activation="gelu_pytorch_tanh",
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            num_hidden_layers=3,
            tie_word_embeddings=True,  # as every Gemma (llama.cpp's gemma2 has no output tensor)
        )
        settings.update(overrides)
        cfg = tf.Gemma2Config(**_common(vocab, **ids, **settings))
        return cfg, tf.Gemma2ForCausalLM
    if kind == "gemma3":
        settings = dict(
            sliding_window=8,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            num_hidden_layers=3,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
            },
        )
        settings.update(overrides)
        cfg = tf.Gemma3TextConfig(**_common(vocab, **ids, **settings))
        return cfg, tf.Gemma3ForCausalLM
    if kind in ("phi3", "phi4_mini"):
        settings: dict[str, Any] = dict(num_key_value_heads=2)
        settings.pop("head_dim", None)
        if kind == "phi4_mini":  # partial rotary and longrope, as Phi-4-mini
            head = overrides.get("hidden_size", 64) // overrides.get("num_attention_heads", 4)
            rotary = head * 3 // 4
            generator = torch.Generator().manual_seed(1)
            settings.update(
                max_position_embeddings=256,
                original_max_position_embeddings=32,
                rope_parameters={
                    "rope_type": "longrope",
                    "rope_theta": 10000.0,
                    "partial_rotary_factor": 0.75,
                    "short_factor": (1 + torch.rand(rotary // 2, generator=generator)).tolist(),
                    "long_factor": (1 + 8 * torch.rand(rotary // 2, generator=generator)).tolist(),
                    "original_max_position_embeddings": 32,
                },
                sliding_window=24,
                tie_word_embeddings=True,
            )
        settings.update(overrides)
        common = _common(vocab, **ids, **settings)
        common.pop("head_dim")
        cfg = tf.Phi3Config(**common)
        return cfg, tf.Phi3ForCausalLM
    raise ValueError(f"unknown family {kind!r}")


TOKENIZER_FAMILY = {
    "llama": "qwen3",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3",
    "gemma2": "gemma",
    "gemma3": "gemma",
    "phi3": "phi3",
    "phi4_mini": "phi3",
}
FAMILIES = tuple(TOKENIZER_FAMILY)


def make_family_checkpoint(
    folder: Path, kind: str, *, seed: int = 0, shards: int = 2, **overrides: Any
) -> Path:
    """A random `kind` checkpoint (float32 safetensors in `shards` files) with its tokenizer."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(folder, TOKENIZER_FAMILY[kind])
    torch.manual_seed(seed)
    cfg, model_class = _family_config(
        kind, len(tokenizer), _token_ids(tokenizer, TOKENIZER_FAMILY[kind]), **overrides
    )
    model = model_class(cfg).eval()
    with torch.no_grad():  # norms drawn around their neutral value, so a wrong offset shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0 if kind.startswith("gemma") else 1.0, 0.2)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(folder, max_shard_size=max(int(total * 1.2) // shards, 1))
    return folder


def read_config(folder: Path) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


# ------------------------------------------------------------------ comparing with transformers
MAX_NEW = 12


def hf_greedy(
    folder, prompts: list[str], max_new: int = MAX_NEW, dtype: torch.dtype = torch.float32
) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, alone, cut after the first eos."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    eos = model.generation_config.eos_token_id
    results = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        new = out[0, ids.shape[1] :].tolist()
        results.append(new[: new.index(eos) + 1] if eos in new else new)
    return results


def assert_engine_matches(
    folder, prompts: list[str], expected: list[list[int]], expect_hits=True, **engine_args
):
    """The engine's greedy tokens equal `expected`: the prompts batched, then each alone (over
    prefix-cache hits), with chunked prefill forced by a 16-token step budget."""
    from pagedllm_integrations import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    settings = dict(dtype="float32", disable_log_stats=True, max_num_batched_tokens=16)
    settings.update(engine_args)
    with LLM(str(folder), **settings) as llm:
        engine = core_of(llm)
        assert engine.config.enable_prefix_caching and engine.config.enable_chunked_prefill
        batched = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in batched] == expected
        for prompt, want in zip(prompts, expected):  # alone, now over prefix-cache hits
            alone = llm.generate(prompt, params, use_tqdm=False)[0]
            assert alone.outputs[0].token_ids == want, prompt
        if expect_hits:  # the long prompt fills whole 16-token blocks, found again alone
            assert engine.counters.snapshot()["prefix_cache_hits"] > 0
