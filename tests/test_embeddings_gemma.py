"""EmbeddingGemma's architecture in the engine: a Gemma 3 text model with bidirectional
attention (`Gemma3TextModel`, `use_bidirectional_attention`: full layers see the whole
text, sliding layers a window on both sides), mean pooling, two Dense projections and
Normalize from its sentence-transformers files; a tiny random one, saved by
sentence-transformers itself, against sentence-transformers' own vectors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from family_checkpoints import _common, _token_ids, make_tokenizer
from test_embeddings_models import ENGINE, embed, held_out_texts, min_cosine

from pagedllm_integrations import LLM
from pagedllm_integrations.engine.white_box import core_of

st = pytest.importorskip("sentence_transformers")
HIDDEN = 64


def make_embedding_gemma(root: Path, window: int = 8) -> Path:
    """Gemma3TextModel (3 layers: sliding, sliding, full; `window` as its config.json says
    it) -> mean pooling -> Dense(64, 128) -> Dense(128, 64) -> Normalize, written by
    sentence-transformers as EmbeddingGemma's folder is."""
    import transformers
    from sentence_transformers import SentenceTransformer, models

    hf = root / "hf"
    tokenizer = make_tokenizer(hf, "gemma")
    settings = dict(
        sliding_window=window,
        query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        num_hidden_layers=3,
        use_bidirectional_attention=True,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
        },
    )
    config = transformers.Gemma3TextConfig(
        **_common(len(tokenizer), **_token_ids(tokenizer, "gemma"), **settings)
    )
    torch.manual_seed(0)
    model = transformers.Gemma3TextModel(config).eval()
    with torch.no_grad():  # norms around their neutral value, so a wrong offset shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.3)
    model.save_pretrained(hf)
    identity = torch.nn.Identity()
    pipeline = SentenceTransformer(
        modules=[
            models.Transformer(str(hf)),
            models.Pooling(HIDDEN, pooling_mode="mean"),
            models.Dense(HIDDEN, 2 * HIDDEN, bias=False, activation_function=identity),
            models.Dense(2 * HIDDEN, HIDDEN, bias=False, activation_function=identity),
            models.Normalize(),
        ]
    )
    torch.manual_seed(1)
    with torch.no_grad():
        for module in list(pipeline)[2:4]:
            module.linear.weight.normal_(0.0, 0.2)
    folder = root / "embedding-gemma"
    pipeline.save(str(folder))
    return folder


@pytest.fixture(scope="module")
def gemma_folder(tmp_path_factory) -> Path:
    return make_embedding_gemma(tmp_path_factory.mktemp("embedding-gemma"))


@pytest.fixture(scope="module")
def texts() -> list[str]:
    # 1 to 60 words: most texts longer than the sliding window's reach (4 tokens a side)
    return held_out_texts(14, seed=21, max_words=60)


@pytest.fixture(scope="module")
def reference(gemma_folder, texts) -> torch.Tensor:
    model = st.SentenceTransformer(str(gemma_folder), device="cpu")
    return model.encode(texts, convert_to_tensor=True, batch_size=4)


def test_embedding_gemma_float32_matches_sentence_transformers(gemma_folder, texts, reference):
    with LLM(str(gemma_folder), dtype="float32", **ENGINE) as llm:
        engine = core_of(llm)
        assert not engine.model_config.causal
        assert engine.pooler.describe().startswith(
            "mean pooling, Dense 64->128, Dense 128->64, normalized"
        )
        got = embed(llm, texts)
        assert llm.engine.num_free_blocks() == llm.engine.num_total_blocks()
        with pytest.raises(ValueError, match="does not generate text"):
            llm.generate("hello", use_tqdm=False)
    assert got.shape == reference.shape == (len(texts), HIDDEN)
    assert torch.allclose(got, reference.float(), atol=3e-5), (got - reference).abs().max()


def test_embedding_gemma_default_path(gemma_folder, texts, reference):
    """The defaults (the CPU fast path's linears and kernels; the layers as modules): within
    the fidelity floor, and a text's vector the same bits alone as batched: "?" fits the
    sliding layers' reach (C++ attention) and is batched beside texts that do not."""
    with LLM(str(gemma_folder), **ENGINE) as llm:
        tokenizer = llm.get_tokenizer()
        assert len(tokenizer(texts[4]).input_ids) <= 5 < len(tokenizer(texts[5]).input_ids)
        together = embed(llm, texts)
        alone = torch.cat([embed(llm, [text]) for text in texts[:6]])
    assert min_cosine(together, reference) >= 0.999
    assert torch.equal(together[:6], alone)


def test_the_sliding_window_reaches_both_ways(gemma_folder, tmp_path, texts):
    """The window is what sentence-transformers applies: a model whose config says a
    window wider than every text gives other vectors than this one (so the window is in
    use), and each engine matches its own reference."""
    import json
    import shutil

    wide = tmp_path / "wide"
    shutil.copytree(gemma_folder, wide)
    config = json.loads((wide / "config.json").read_text())
    config["sliding_window"] = 512
    (wide / "config.json").write_text(json.dumps(config))
    long_texts = [t for t in texts if len(t.split()) > 20]
    want = st.SentenceTransformer(str(wide), device="cpu").encode(
        long_texts, convert_to_tensor=True
    )
    narrow = st.SentenceTransformer(str(gemma_folder), device="cpu").encode(
        long_texts, convert_to_tensor=True
    )
    assert not torch.allclose(want, narrow, atol=1e-3)
    with LLM(str(wide), dtype="float32", **ENGINE) as llm:
        assert torch.allclose(embed(llm, long_texts), want.float(), atol=3e-5)
