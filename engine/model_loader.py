"""Find a model (embedded default, Hugging Face id, folder or GGUF file) and load it.

Every source ends as a Hugging Face folder (config.json, safetensors, tokenizer files):
a GGUF file is converted once into such a folder under the pagedllm cache
(`$PAGEDLLM_CACHE_DIR`, else `$XDG_CACHE_HOME/pagedllm`, else `~/.cache/pagedllm`), so
its second load reads plain safetensors and skips the slow GGUF parsing.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..kernels.cache_dir import cache_dir  # noqa: F401 - the one definition, kept importable here
from . import ollama_store
from .default_model import (  # noqa: F401 - where callers have always found them
    DEFAULT_MODEL_NAME,
    DEFAULT_MODEL_PACKAGE,
    DEFAULT_MODEL_PIP,
    default_model_folder,
    default_model_path,
)
from .gguf_loader import gguf_to_hf_folder, is_gguf_folder, iter_gguf_weights

logger = logging.getLogger(__name__)

# `org/name`, or a name alone (`gpt2`: the hub's oldest repositories have no org).
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")
_WEIGHT_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


@dataclass(slots=True)
class ModelSource:
    folder: Path  # a Hugging Face folder (for GGUF: the converted copy in the cache)
    name: str  # what to call the model (served name, ls_model_name, ...)
    origin: str  # the file, folder or hub id the user gave
    # Defaults that come with the model beyond its folder (an Ollama Modelfile's PARAMETERs):
    # sampling defaults over generation_config.json's, and a context length.
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    context_length: int | None = None


def resolve_model(
    model: str | None, revision: str | None = None, download_dir: str | None = None
) -> ModelSource:
    """Turn what the user gave into a Hugging Face folder on local disk.

    In order: nothing (the embedded default), a GGUF file, a folder; then a name. A name
    with a colon (`qwen3:0.6b`) is an Ollama model, which must have been pulled; a name
    without one (`llama3.1`, `gpt2`, `org/name`) is the Ollama model `name:latest` when
    Ollama's store holds it, else a Hugging Face id."""
    if model is None:
        folder = default_model_folder()
        return ModelSource(folder, DEFAULT_MODEL_NAME, str(default_model_path()))
    path = Path(os.path.expanduser(model))
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(
                f"{model} is a file but not a .gguf model; give a GGUF file or a folder"
            )
        return ModelSource(gguf_to_hf_folder(path), path.stem, model)
    if path.is_dir():
        if not (path / "config.json").exists():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return ModelSource(gguf_to_hf_folder(ggufs[0]), ggufs[0].stem, model)
            raise ValueError(
                f"{model} is not a model folder: it has no config.json (and not exactly one .gguf)"
            )
        return ModelSource(path, path.name, model)
    if model.endswith(".gguf"):
        raise ValueError(f"GGUF file {model} does not exist")
    if ":" in model or ollama_store.is_pulled(model):
        return _from_ollama(model)
    if _HUB_ID.match(model):
        return ModelSource(_from_hub(model, revision, download_dir), model, model)
    raise ValueError(
        f"model {model!r} is not a file, a folder, an Ollama model (name:tag) or a Hugging "
        "Face id (name or org/name)"
    )


def _from_ollama(name: str) -> ModelSource:
    pulled = ollama_store.open_model(name)
    # Keyed by the blob's digest: the conversion is shared by every tag of the same weights.
    folder = gguf_to_hf_folder(pulled.gguf, content_id=f"sha256:{pulled.digest}")
    return ModelSource(folder, name, name, dict(pulled.sampling_defaults), pulled.context_length)


def _from_hub(repo_id: str, revision: str | None, download_dir: str | None) -> Path:
    """The local Hugging Face cache first; the network only where it is allowed and needed."""
    from huggingface_hub import snapshot_download

    kwargs: dict[str, Any] = dict(
        repo_id=repo_id, revision=revision, cache_dir=download_dir, allow_patterns=_WEIGHT_PATTERNS
    )
    # A name alone may have been meant for Ollama: say where it was looked for.
    ollama = (
        f"; nor has Ollama pulled it into {ollama_store.models_dir()}" if "/" not in repo_id else ""
    )
    try:
        return Path(snapshot_download(local_files_only=True, **kwargs))
    except Exception as cached_error:
        offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
        if offline:
            raise ValueError(
                f"model {repo_id!r} (revision {revision or 'main'}) is not in the local Hugging "
                f"Face cache ({download_dir or 'default cache'}) and HF_HUB_OFFLINE is set{ollama}"
            ) from cached_error
    try:
        return Path(snapshot_download(**kwargs))
    except Exception as error:
        raise ValueError(
            f"model {repo_id!r} (revision {revision or 'main'}) is neither in the local Hugging "
            f"Face cache nor reachable ({type(error).__name__}: {error}){ollama}"
        ) from error


# ------------------------------------------------------- Hugging Face folders
def read_config(folder: Path) -> dict[str, Any]:
    with open(folder / "config.json") as f:
        return json.load(f)


def iter_weights(folder: Path) -> Iterator[tuple[str, Any]]:
    """(name, tensor) for every tensor of a folder: safetensors shards, else .bin files.

    A folder made from a GGUF file holds no weights: they are read from the GGUF file,
    and its quantized tensors come as `GGUFTensor`s (still packed; see gguf_loader.py)."""
    from safetensors import safe_open

    if is_gguf_folder(folder):
        yield from iter_gguf_weights(folder)
        return
    files = sorted(glob.glob(str(folder / "*.safetensors")))
    index = folder / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            files = sorted({str(folder / v) for v in json.load(f)["weight_map"].values()})
    if files:
        for file in files:
            with safe_open(file, framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                    yield name, handle.get_tensor(name)
        return
    bins = sorted(glob.glob(str(folder / "pytorch_model*.bin")))
    if not bins:
        raise ValueError(f"{folder} holds no weights (*.safetensors or pytorch_model*.bin)")
    for file in bins:
        yield from torch.load(file, map_location="cpu", weights_only=True).items()


def load_tokenizer(source: str | Path, revision: str | None = None):
    from transformers import AutoTokenizer

    try:
        generic = _generic_fast_tokenizer(source)
        if generic is not None:
            return generic
        return _drop_build_inputs(AutoTokenizer.from_pretrained(str(source), revision=revision))
    except Exception as error:
        raise ValueError(f"could not load a tokenizer from {source}: {error}") from error


def _drop_build_inputs(tokenizer):
    """Drop the Python copies of the vocabulary and merges that transformers' family
    tokenizers (Gemma, Llama, Qwen2, ...: `TokenizersBackend` subclasses) keep after
    building their Rust tokenizer from them. Nothing reads them afterwards (encoding,
    decoding, added tokens and saving all go through `_tokenizer`), and for a large
    vocabulary they are most of the tokenizer's memory: Gemma 3's 262,144 tokens and
    514,906 merges held 150 MiB of Python objects."""
    if getattr(tokenizer, "_tokenizer", None) is not None:
        for name in ("_vocab", "_merges"):
            if isinstance(getattr(tokenizer, name, None), (dict, list)):
                setattr(tokenizer, name, None)
    return tokenizer


def _generic_fast_tokenizer(source: str | Path):
    """The tokenizer of a local folder whose tokenizer_config.json names the generic
    PreTrainedTokenizerFast (what a GGUF file's folder holds), loaded as that class directly.

    AutoTokenizer would give the same object, but it first reads config.json through
    AutoConfig, which imports the model family's modules and their dependencies
    (accelerate, PIL, ~700 modules): 2-3 s and ~70 MB of resident memory for nothing."""
    config_file = Path(source) / "tokenizer_config.json"
    if not (config_file.is_file() and (Path(source) / "tokenizer.json").is_file()):
        return None
    with open(config_file) as f:
        if json.load(f).get("tokenizer_class") != "PreTrainedTokenizerFast":
            return None
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(source))
