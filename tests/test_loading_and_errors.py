"""Model sources (folder, GGUF, Hugging Face id in the local cache), rope configs, and the
clear errors a user gets for bad input — after which the engine keeps serving."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch

from pagedllm_integrations import LLM, EngineConfig, SamplingParams
from pagedllm_integrations.engine.model_loader import cache_dir, resolve_model
from pagedllm_integrations.engine.models.layers import rope_inv_freq
from pagedllm_integrations.engine.white_box import core_of


def test_not_a_model_folder_is_a_clear_error(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="not a model folder"):
        LLM(str(tmp_path))


def test_unsupported_architecture_is_named(tmp_path, tiny_llama_dir):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        LLM(str(tmp_path))


def test_missing_model_file_and_bad_names():
    with pytest.raises(ValueError, match="does not exist"):
        LLM("/nonexistent/model.gguf")
    with pytest.raises(ValueError, match="not a file, a folder, an Ollama model"):
        LLM("not a model name!")


def test_unknown_engine_argument_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown engine argument\(s\) \['max_num_sequences'\]"):
        EngineConfig.from_kwargs(max_num_sequences=4)


def test_hub_id_resolves_from_the_local_cache_offline(tmp_path, tiny_llama_dir):
    # The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<rev>/...}.
    repo = tmp_path / "models--acme--tiny-llama"
    revision = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tiny_llama_dir, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    source = resolve_model("acme/tiny-llama", download_dir=str(tmp_path))
    assert source.folder == repo / "snapshots" / revision
    with LLM("acme/tiny-llama", download_dir=str(tmp_path), disable_log_stats=True) as llm:
        out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_hub_id_without_an_org_resolves_end_to_end(tmp_path, tiny_llama_dir, monkeypatch):
    """`PagedLLM(model="gpt2")`, HuggingFacePipeline's own example: the hub's oldest
    repositories have no org. A tiny Llama stands in for the weights (GPT-2's architecture
    is not one pagedllm runs), in the layout huggingface_hub writes for such an id."""
    from pagedllm_integrations.langchain import PagedLLM

    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "no-ollama"))  # not in Ollama's store
    repo = tmp_path / "models--tinyllama"
    revision = "89abcdef0123456789abcdef0123456789abcdef"
    shutil.copytree(tiny_llama_dir, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    assert resolve_model("tinyllama", download_dir=str(tmp_path)).folder == (
        repo / "snapshots" / revision
    )
    llm = PagedLLM(model="tinyllama", download_dir=str(tmp_path), max_new_tokens=4,
                   temperature=0)  # fmt: skip
    try:
        by_id = llm.invoke("Hello")
    finally:
        llm.close()
    with LLM(str(tiny_llama_dir), disable_log_stats=True) as reference:
        out = reference.generate("Hello", SamplingParams(temperature=0, max_tokens=4),
                                 use_tqdm=False)  # fmt: skip
    assert by_id == out[0].outputs[0].text


def test_a_name_alone_that_is_nowhere_says_where_it_was_looked_for(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    with pytest.raises(ValueError, match=r"'gpt2'.*Hugging Face cache.*nor has Ollama pulled it"):
        resolve_model("gpt2", download_dir=str(tmp_path))


def test_hub_id_neither_cached_nor_reachable_names_the_id(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"'meta-llama/Llama-3\.2-1B-Instruct'"):
        resolve_model("meta-llama/Llama-3.2-1B-Instruct", download_dir=str(tmp_path))


def test_gguf_conversion_is_cached_and_the_second_load_is_fast(default_model_folder):
    from pagedllm_integrations.engine.model_loader import default_model_path, gguf_to_hf_folder

    assert default_model_folder.parent == cache_dir() / "gguf"
    started = time.perf_counter()
    assert gguf_to_hf_folder(default_model_path()) == default_model_folder
    assert time.perf_counter() - started < 1.0  # a stat and a path check, no conversion


def test_gguf_folder_tokenizer_is_the_one_autotokenizer_gives(default_model_folder):
    """A GGUF folder's generic tokenizer is loaded without AutoTokenizer's detour through
    AutoConfig; it is the same tokenizer: ids, decoding, special tokens, chat template."""
    from transformers import AutoTokenizer

    from pagedllm_integrations.engine.model_loader import load_tokenizer

    ours, auto = (
        load_tokenizer(default_model_folder),
        AutoTokenizer.from_pretrained(str(default_model_folder)),
    )
    assert type(ours) is type(auto)
    for text in ["Hello world", "<|im_start|>user\nhi<|im_end|>", "naïve café 你好 🙂", " \n\t x"]:
        assert ours(text).input_ids == auto(text).input_ids
        assert ours.decode(ours(text).input_ids) == auto.decode(auto(text).input_ids)
    assert ours.all_special_tokens == auto.all_special_tokens
    assert (ours.eos_token_id, ours.bos_token_id) == (auto.eos_token_id, auto.bos_token_id)
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    ) == auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        {"rope_type": "dynamic", "factor": 2.0},
    ],
)
def test_rope_scaling_matches_transformers(rope):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim, theta, max_pos = 64, 500000.0, 2048
    config = LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        max_position_embeddings=max_pos,
        rope_parameters={"rope_theta": theta, **rope},
    )
    max_model_len = 4 * max_pos  # beyond the original context, so dynamic NTK kicks in
    expected, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu", seq_len=max_model_len)
    scaling = dict(rope)
    scaling.setdefault("original_max_position_embeddings", max_pos)
    got = rope_inv_freq(head_dim, theta, scaling, max_model_len)
    torch.testing.assert_close(got, expected.float(), rtol=1e-6, atol=0)


def test_unsupported_rope_type_is_a_clear_error():
    with pytest.raises(ValueError, match="rope scaling type 'yarn' is not supported"):
        rope_inv_freq(64, 10000.0, {"rope_type": "yarn", "factor": 2.0}, 4096)


def test_bad_requests_are_value_errors_and_the_engine_keeps_serving(default_llm):
    params = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match="prompt is empty"):
        default_llm.generate("", params)
    with pytest.raises(ValueError, match="prompt is empty"):
        default_llm.generate([[]], params)
    too_long = [1] * default_llm.engine.max_model_len
    with pytest.raises(ValueError, match="max_model_len"):
        default_llm.generate([too_long], params)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        default_llm.generate([[10**9]], params)
    with pytest.raises(ValueError, match="max_tokens must be a positive integer"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="max_tokens must be a positive integer"):
        SamplingParams(max_tokens=-3)
    with pytest.raises(ValueError, match=r"unknown sampling parameter\(s\) \['temprature'\]"):
        SamplingParams.from_kwargs(temprature=0.5)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    # A bad prompt among good ones is refused before any is submitted.
    with pytest.raises(ValueError):
        default_llm.generate(["fine", ""], params)
    out = default_llm.generate("The capital of France is", params, use_tqdm=False)
    assert out[0].outputs[0].text.strip()
    assert default_llm.engine.num_free_blocks() == core_of(default_llm).num_blocks


def test_kv_budget_too_small_for_one_sequence_is_explained(tiny_llama_dir):
    with pytest.raises(ValueError, match="raise kv_cache_memory"):
        LLM(str(tiny_llama_dir), num_kv_blocks=2, max_model_len=512)
