"""Shared fixtures: the embedded default model (one engine for the whole session) and tiny
random Llama checkpoints written by transformers into temporary folders."""

from __future__ import annotations

import os
import sys

# Triton's CPU interpreter must be chosen before triton is imported anywhere.
try:
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The scheduler asserts its invariants after every step in the tests (off in production).
os.environ.setdefault("PAGEDLLM_CHECK_INVARIANTS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import json
import shutil
from pathlib import Path

import pytest
import torch

# `python -m pytest` from the repository root puts the root on sys.path, and then the
# folder `kernels/` (installed as pagedllm_integrations.kernels) hides Hugging Face's
# `kernels` package, which transformers >= 5.25 imports. `make test` runs `python -P`;
# this covers a hand-typed `python -m pytest`.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]


@pytest.fixture(scope="session")
def default_model_folder() -> Path:
    """The embedded SmolLM2 GGUF converted to a Hugging Face folder (cached on disk)."""
    from pagedllm_integrations.engine.model_loader import default_model_path, gguf_to_hf_folder

    return gguf_to_hf_folder(default_model_path())


@pytest.fixture(scope="session")
def default_llm():
    """One LLM on the embedded default model with the default settings (on a CPU with bf16
    instructions: the fast path), shared by every test that needs it."""
    from pagedllm_integrations import LLM

    llm = LLM(disable_log_stats=True, max_model_len=2048, max_num_seqs=32)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def small_default_engine():
    """A wrapper holding the shared engine of the default model file with 160 MiB of KV
    cache and max_model_len 2048, for a module's wrappers with those settings to share
    (loaded once, not once per test)."""
    from pagedllm_integrations.engine.model_loader import default_model_path
    from pagedllm_integrations.langchain import ChatPagedLLM

    engine = {"kv_cache_memory": 160 << 20, "max_model_len": 2048}
    holder = ChatPagedLLM(model=str(default_model_path()), engine_kwargs=engine)
    holder.engine  # noqa: B018 - loads it
    yield holder
    holder.close()


@pytest.fixture(scope="session")
def default_llm_f32():
    """The embedded default model on the float32 reference path: what parity with
    transformers is measured on."""
    from pagedllm_integrations import LLM

    llm = LLM(disable_log_stats=True, max_model_len=2048, max_num_seqs=32, dtype="float32")
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def hf_default_model():
    """transformers reading the same GGUF file on its own: an independent reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedllm_integrations.engine.model_loader import default_model_path

    path = default_model_path()
    folder, name = str(path.parent), path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval(), tokenizer


def make_tiny_llama(
    folder: Path,
    tokenizer_source: Path,
    *,
    num_kv_heads: int = 2,
    num_heads: int = 4,
    hidden_size: int = 64,
    num_layers: int = 2,
    architecture: str = "llama",
    shards: int = 2,
    seed: int = 0,
    **overrides,
) -> Path:
    """A random Llama-family checkpoint (safetensors, `shards` files) with a real tokenizer.

    The weights are drawn wider than usual (std 0.2) so that greedy choices are decided by
    clear margins, not by rounding noise.
    """
    import transformers

    torch.manual_seed(seed)
    vocab = 49152  # SmolLM2's tokenizer, copied in below
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=1024,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if architecture == "qwen2":
        config = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(config)
    elif architecture == "mistral":
        config = transformers.MistralConfig(**common)
        model = transformers.MistralForCausalLM(config)
    else:
        config = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # random biases too, so a bias that is dropped shows up
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.2)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    # A shard limit a little over 1/shards of the total gives exactly `shards` files.
    model.save_pretrained(folder, max_shard_size=max(int(total * 1.2) // shards, 1))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        src = tokenizer_source / name
        if src.exists():
            shutil.copy(src, folder / name)
    return folder


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, default_model_folder) -> Path:
    """Tiny random Llama with GQA (4 query heads, 2 KV heads), float32, two safetensors shards."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    return make_tiny_llama(folder, default_model_folder)


@pytest.fixture(scope="session")
def tiny_llama_factory(tmp_path_factory, default_model_folder):
    """Make more tiny checkpoints: tiny_llama_factory(name, **config_overrides) -> folder."""

    def make(name: str, **kwargs) -> Path:
        folder = tmp_path_factory.mktemp(name)
        return make_tiny_llama(folder, default_model_folder, **kwargs)

    return make


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())
