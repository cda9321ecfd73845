"""Write a BERT folder (all-MiniLM-L6-v2, or a tiny random one) or a NomicBERT folder as a
GGUF file in the layout llama.cpp's convert_hf_to_gguf.py gives `BertModel` /
`NomicBertModel`, with the `gguf` package's own tensor name tables: what the tests read when
llama.cpp's converter is not installed.

What the converter does, and this too: tensor names from gguf's BERT table (`bert.` prefix
and the pooler dropped), 1-d tensors and the position / token-type tables in F32, the
matrices in the chosen type; the WordPiece vocabulary in "phantom space" form (a word start
gets a leading U+2581, a `##` continuation loses its `##`, special tokens stay) and its
`normalizer.lowercase` flag;
`<arch>.pooling_type` from sentence-transformers' Pooling config; `attention.causal` false.
NomicBERT: nomic's names for the sizes (n_embd, ...), `rope.freq_base` from
rotary_emb_base, the 2,048 trained positions as the context length, Wqkv kept fused.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

_POOLING = {"mean": 1, "cls": 2, "last": 3}


def _pooling(folder: Path) -> int:
    config = folder / "1_Pooling" / "config.json"
    if not config.exists():
        return _POOLING["cls"]
    settings = json.loads(config.read_text())
    if settings.get("pooling_mode_mean_tokens"):
        return _POOLING["mean"]
    return _POOLING["last"] if settings.get("pooling_mode_lasttoken") else _POOLING["cls"]


def _phantom(token: str, special: bool) -> str:
    if special:  # [CLS], [SEP], ... (the [unusedN] tokens are not special: they get U+2581)
        return token
    return token[2:] if token.startswith("##") else "\u2581" + token


def export_bert_gguf(folder: Path, out: Path, weight_type: str = "F16") -> Path:
    """`folder` (config.json, model.safetensors, vocab.txt) -> a GGUF file at `out`.
    weight_type: F32, F16 or Q8_0 for the matrices."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    nomic = config.get("architectures") == ["NomicBertModel"]
    arch = gguf.MODEL_ARCH.NOMIC_BERT if nomic else gguf.MODEL_ARCH.BERT
    if nomic:  # nomic's GPT-2 style names; the context it was trained for
        config = {
            "num_hidden_layers": config["n_layer"],
            "max_position_embeddings": config.get("max_trained_positions", 2048),
            "hidden_size": config["n_embd"],
            "intermediate_size": config["n_inner"],
            "num_attention_heads": config["n_head"],
            "layer_norm_eps": config["layer_norm_epsilon"],
            "type_vocab_size": config["type_vocab_size"],
            "rope_theta": config["rotary_emb_base"],
        }
    layers = int(config["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(folder.name)
    writer.add_context_length(int(config["max_position_embeddings"]))
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_block_count(layers)
    writer.add_head_count(int(config["num_attention_heads"]))
    writer.add_layer_norm_eps(float(config.get("layer_norm_eps", 1e-12)))
    if nomic:
        writer.add_rope_freq_base(float(config["rope_theta"]))
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType(_pooling(folder)))
    writer.add_file_type(
        {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
         "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[weight_type]
    )  # fmt: skip

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    special = set(tokenizer.all_special_ids)
    tokens = [_phantom(token, index in special) for token, index in vocab]
    types = [
        gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
        for i in range(len(tokens))
    ]
    # A vocabulary padded past the tokenizer's (nomic's 30,528 rows for 30,522 tokens):
    # the converter names the extra rows [PAD<i>].
    rows = json.loads((folder / "config.json").read_text()).get("vocab_size", len(tokens))
    types += [gguf.TokenType.USER_DEFINED] * (rows - len(tokens))
    tokens += [f"[PAD{i}]" for i in range(len(tokens), rows)]
    writer.add_token_type_count(int(config.get("type_vocab_size", 2)))
    writer.add_tokenizer_model("bert")
    writer.add_bool("tokenizer.ggml.normalizer.lowercase", bool(tokenizer.do_lower_case))
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(True)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    for name, value in (
        ("bos", tokenizer.cls_token_id), ("eos", tokenizer.sep_token_id),
        ("unk", tokenizer.unk_token_id), ("sep", tokenizer.sep_token_id),
        ("pad", tokenizer.pad_token_id), ("cls", tokenizer.cls_token_id),
        ("mask", tokenizer.mask_token_id),
    ):  # fmt: skip
        adder = getattr(writer, f"add_{name}_token_id", None)  # newer gguf has cls / mask
        if value is not None and adder is not None:
            adder(int(value))

    names = gguf.get_tensor_name_map(arch, layers)
    keep_f32 = ("position_embd", "token_types")
    for raw, tensor in load_file(str(folder / "model.safetensors")).items():
        name = raw.removeprefix("bert.")
        if name.startswith(("pooler.", "cls.")) or name.endswith("position_ids"):
            continue
        mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise ValueError(f"no GGUF name for {raw}")
        data = tensor.to(torch.float32).numpy()
        if data.ndim == 1 or mapped.startswith(keep_f32) or weight_type == "F32":
            writer.add_tensor(mapped, data)
        elif weight_type == "F16":
            writer.add_tensor(mapped, data.astype(np.float16))
        else:
            quantized = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(mapped, quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
