"""BERT GGUF files (llama.cpp's `bert` architecture: all-MiniLM, bge, e5 converted by
convert_hf_to_gguf.py; and `nomic-bert`: nomic-embed-text, as Ollama ships it): the tensor
tables, the config, the WordPiece tokenizer, and the pooling, each back in the Hugging
Face / sentence-transformers form the engine reads.

- Tensors keep their Hugging Face layout; only the names differ (gguf's BERT table).
- The vocabulary is stored in "phantom space" form: a word-start token has a leading
  U+2581, a continuation has lost its `##`, [SPECIAL] tokens are as they were. Undone
  here, it is a WordPiece vocabulary again. `tokenizer.ggml.normalizer.lowercase` says
  whether the model lower-cases (files without it: a vocabulary with no A-Z is uncased).
- nomic-bert keeps q, k, v fused (attn_qkv, nomic's Wqkv) and its rotary unpermuted (neox
  order, as nomic's checkpoint has it): only names change there too.
- `<arch>.pooling_type` (1 mean, 2 CLS, 3 last) becomes sentence-transformers' Pooling
  config; the file does not record normalization, and its vectors are normalized, as
  llama.cpp's llama-embedding and llama-server do by default.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BERT_BLOCK = {
    "attn_q": "attention.self.query",
    "attn_k": "attention.self.key",
    "attn_v": "attention.self.value",
    "attn_output": "attention.output.dense",
    "attn_output_norm": "attention.output.LayerNorm",
    "ffn_up": "intermediate.dense",
    "ffn_down": "output.dense",
    "layer_output_norm": "output.LayerNorm",
}
BERT_TOP_LEVEL = {
    "token_embd": "embeddings.word_embeddings",
    "position_embd": "embeddings.position_embeddings",
    "token_types": "embeddings.token_type_embeddings",
    "token_embd_norm": "embeddings.LayerNorm",
}
NOMIC_BERT_BLOCK = {
    "attn_qkv": "attn.Wqkv",
    "attn_output": "attn.out_proj",
    "attn_output_norm": "norm1",
    "ffn_up": "mlp.fc11",
    "ffn_gate": "mlp.fc12",
    "ffn_down": "mlp.fc2",
    "layer_output_norm": "norm2",
}
NOMIC_BERT_TOP_LEVEL = {
    "token_embd": "embeddings.word_embeddings",
    "token_types": "embeddings.token_type_embeddings",
    "token_embd_norm": "emb_ln",
}
_POOLING = {1: "pooling_mode_mean_tokens", 2: "pooling_mode_cls_token", 3: "pooling_mode_lasttoken"}


def _type_vocab_size(tensors: dict[str, Any]) -> int:
    if "token_types.weight" in tensors:
        return int(tensors["token_types.weight"]["shape"][0])
    return 2


def bert_config(meta: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    hidden = int(meta["embedding_length"])
    heads = int(meta["attention.head_count"])
    return {
        "hidden_size": hidden,
        "intermediate_size": int(meta["feed_forward_length"]),
        "num_hidden_layers": int(meta["block_count"]),
        "num_attention_heads": heads,
        "max_position_embeddings": int(meta.get("context_length", 512)),
        "layer_norm_eps": float(meta.get("attention.layer_norm_epsilon", 1e-12)),
        "vocab_size": int(tensors["token_embd.weight"]["shape"][0]),
        "type_vocab_size": _type_vocab_size(tensors),
        "hidden_act": "gelu",
        "position_embedding_type": "absolute",
        "torch_dtype": "float32",
    }


def nomic_bert_config(meta: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """nomic-ai's config.json names (what engine/models/bert.parse_nomic_bert_config reads);
    llama.cpp's converter already wrote the trained context (2,048) as context_length."""
    context = int(meta.get("context_length", 2048))
    return {
        "n_embd": int(meta["embedding_length"]),
        "n_inner": int(meta["feed_forward_length"]),
        "n_layer": int(meta["block_count"]),
        "n_head": int(meta["attention.head_count"]),
        "n_positions": context,
        "max_trained_positions": context,
        "layer_norm_epsilon": float(meta.get("attention.layer_norm_epsilon", 1e-12)),
        "rotary_emb_base": float(meta.get("rope.freq_base", 1000.0)),
        "rotary_emb_fraction": 1.0,
        "activation_function": "swiglu",
        "qkv_proj_bias": False,
        "mlp_fc1_bias": False,
        "mlp_fc2_bias": False,
        "prenorm": False,
        "causal": False,
        "vocab_size": int(tensors["token_embd.weight"]["shape"][0]),
        "type_vocab_size": _type_vocab_size(tensors),
        "torch_dtype": "float32",
    }


def write_bert_files(path: Path, metadata: dict[str, Any], out: Path) -> None:
    """The tokenizer and sentence-transformers' Pooling / Normalize files of a BERT (or
    nomic-bert) GGUF file, written into its cached folder `out`."""
    from gguf import GGUFReader
    from tokenizers import BertWordPieceTokenizer
    from transformers import PreTrainedTokenizerFast

    arch = str(metadata.get("general.architecture", "bert"))
    reader = GGUFReader(str(path))
    field = reader.fields.get("tokenizer.ggml.tokens")
    if field is None:
        raise ValueError(f"{path} holds no tokenizer vocabulary (tokenizer.ggml.tokens)")
    tokens = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    words = [_wordpiece(token) for token in tokens]
    uncased = metadata.get("tokenizer.ggml.normalizer.lowercase")
    if uncased is None:  # older files: uncased vocabularies hold no A-Z outside [SPECIAL]s
        uncased = not any(
            "A" <= c <= "Z" for word in words if not word.startswith("[") for c in word
        )
    wordpiece = BertWordPieceTokenizer(
        {word: index for index, word in enumerate(words)},
        lowercase=bool(uncased),
        strip_accents=None,
        clean_text=True,
        handle_chinese_chars=True,
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=wordpiece._tokenizer,
        model_max_length=int(metadata.get(f"{arch}.context_length", 512)),
        **{f"{kind}_token": f"[{kind.upper()}]" for kind in ("unk", "sep", "pad", "cls", "mask")},
    )
    tokenizer.save_pretrained(str(out))
    pooling = int(metadata.get(f"{arch}.pooling_type", 2))
    if pooling not in _POOLING:
        raise ValueError(
            f"{path}: {arch}.pooling_type {pooling} is not mean (1), CLS (2) or last (3)"
        )
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(json.dumps({_POOLING[pooling]: True}))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]  # fmt: skip
    (out / "modules.json").write_text(json.dumps(modules, indent=2))


def _wordpiece(token: str) -> str:
    if token.startswith("\u2581"):
        return token[1:]
    if token.startswith("[") and token.endswith("]"):
        return token
    return "##" + token
