"""pagedllm: a paged, continuously batched LLM engine inside your Python process.

    from pagedllm_integrations import LLM, SamplingParams
    llm = LLM()  # the embedded SmolLM2-135M-Instruct
    print(llm.generate("The capital of France is", SamplingParams(temperature=0))[0].outputs[0].text)

LangChain: `pagedllm_integrations.langchain` (PagedLLM, ChatPagedLLM, PagedEmbeddings).
LlamaIndex: `pagedllm_integrations.llama_index` (PagedLlamaIndexLLM, PagedEmbedding).
Embeddings offline: `LLM(model).embed(texts)` (vLLM's shape: `outputs[i].outputs.embedding`).
`shutdown_shared_engines()` stops every engine the wrappers share and frees its memory.
"""

from .chat.errors import IncompleteOutputError
from .engine.async_engine import AsyncEngine, RequestStream
from .engine.client import EngineClient
from .engine.config import EngineConfig
from .engine.factory import shared_engine, shutdown_shared_engines
from .engine.llm import LLM
from .engine.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestOutput,
)
from .engine.pooling import PoolingParams
from .engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "AsyncEngine",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "EngineClient",
    "EngineConfig",
    "IncompleteOutputError",
    "Logprob",
    "PoolingParams",
    "RequestOutput",
    "RequestOutputKind",
    "RequestStream",
    "SamplingParams",
    "StructuredOutputsParams",
    "shared_engine",
    "shutdown_shared_engines",
]
__version__ = "0.1.0"
