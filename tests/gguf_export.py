"""Write a Hugging Face checkpoint as a GGUF file the way llama.cpp's converter does.

Tensor names come from the `gguf` package's own name map (llama.cpp's gguf-py, the table
convert_hf_to_gguf.py uses), metadata through GGUFWriter's `add_*` calls, and the value
changes are the converter's, applied here by hand (pagedllm's loader must undo them):
- gemma2/gemma3: every norm weight written as w + 1;
- qwen3moe: each layer's experts stacked [E, out, in] per projection;
- phi3: longrope factors written as rope_factors_long/short tensors plus attn factor and
  original context metadata; the rotary dim as rope.dimension_count;
- llama: q and k rows permuted from rotate-half order to llama.cpp's interleaved pairs.
The tokenizer is written as a byte-level BPE ("gpt2") vocabulary with its merges.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import torch

GGUF_ARCH = {
    "LlamaForCausalLM": "LLAMA",
    "Qwen3ForCausalLM": "QWEN3",
    "Qwen3MoeForCausalLM": "QWEN3MOE",
    "Gemma2ForCausalLM": "GEMMA2",
    "Gemma3ForCausalLM": "GEMMA3",
    "Phi3ForCausalLM": "PHI3",
}


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _rope(config: dict) -> dict:
    params = dict(config.get("rope_parameters") or {})
    if "full_attention" in params:
        params = dict(params["full_attention"])
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    return params


def _llama_permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf's permutation of a llama q or k weight [heads * D, in]."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(
    folder: Path, out: Path, quantize: str | None = None, mix: str | None = None, pure=False
) -> Path:
    """quantize: None (every tensor F32) or a GGML type name ("Q8_0"): the linear weights
    (matrices and stacked experts, not norms, embeddings or the router) in that type.
    mix: a llama-quantize preset ("Q4_K_M"), every tensor given the type llama-quantize
    gives it (gguf_mixes.mix_type; with `pure`, as `llama-quantize --pure`)."""
    import gguf
    from gguf_mixes import mix_type
    from gguf_mixes import quantize as quantize_array

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    arch = getattr(gguf.MODEL_ARCH, GGUF_ARCH[config["architectures"][0]])
    arch_name = gguf.MODEL_ARCH_NAMES[arch]
    layers = config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(out), arch_name)
    writer.add_name(folder.name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = _rope(config)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if "head_dim" in config:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    extra: dict[str, np.ndarray] = {}
    if arch_name == "qwen3moe":
        writer.add_expert_count(config.get("num_experts") or config["num_local_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    elif arch_name == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
        writer.add_sliding_window(config["sliding_window"])
    elif arch_name == "gemma3":
        writer.add_sliding_window(config["sliding_window"])
        if rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
    elif arch_name == "phi3":
        partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        writer.add_rope_dimension_count(int(head_dim * partial))
        writer.add_sliding_window(config.get("sliding_window") or 0)
        if rope.get("rope_type") == "longrope":
            original = rope.get("original_max_position_embeddings")
            original = original or config["original_max_position_embeddings"]
            scale = config["max_position_embeddings"] / original
            attn = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
            writer.add_rope_scaling_attn_factors(attn)
            writer.add_rope_scaling_orig_ctx_len(original)
            extra["rope_factors_long.weight"] = np.array(rope["long_factor"], np.float32)
            extra["rope_factors_short.weight"] = np.array(rope["short_factor"], np.float32)
    _add_tokenizer(writer, folder)

    names = gguf.get_tensor_name_map(arch, layers)
    weights = _weights(folder)
    experts: dict[tuple[str, int, str], dict[int, torch.Tensor]] = {}
    for name, tensor in weights.items():
        match = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight$", name)
        if match:  # collected, then stacked per layer and projection
            layer, expert, proj = int(match.group(1)), int(match.group(2)), match.group(3)
            experts.setdefault(("mlp.experts", layer, proj), {})[expert] = tensor
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"no GGUF name for {name}"
        value = tensor.float()
        if arch_name in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            value = value + 1
        if arch_name == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            kv_heads = config["num_key_value_heads"]
            value = _llama_permute(value, heads if "q_proj" in name else kv_heads)
        extra[gguf_name] = value.numpy()
    for (_, layer, proj), by_expert in experts.items():
        stacked = torch.stack([by_expert[e] for e in sorted(by_expert)]).float()
        gguf_name = names.get_name(
            f"model.layers.{layer}.mlp.experts.{proj}.weight", try_suffixes=(".weight",)
        )
        extra[gguf_name] = stacked.numpy()
    gqa = heads // config["num_key_value_heads"]
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    tied = "output.weight" not in extra
    for gguf_name, array in extra.items():
        array = np.ascontiguousarray(array)
        chosen = None
        if mix is not None:
            match = re.match(r"blk\.(\d+)\.", gguf_name)
            chosen = mix_type(
                mix, gguf_name, array.shape, layer=int(match.group(1)) if match else 0,
                layers=layers, gqa=gqa, experts=experts, tied=tied, pure=pure,
            )  # fmt: skip
        elif quantize and array.ndim >= 2 and gguf_name.startswith("blk."):
            chosen = None if "gate_inp" in gguf_name else quantize
        if chosen is None:
            writer.add_tensor(gguf_name, array)
        elif chosen == "F16":
            writer.add_tensor(gguf_name, array.astype(np.float16))
        else:
            qtype = getattr(gguf.GGMLQuantizationType, chosen)
            writer.add_tensor(gguf_name, quantize_array(array, chosen), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_tokenizer(writer, folder: Path) -> None:
    """A byte-level BPE vocabulary: tokens by id, control tokens marked, merges."""
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = dict(spec["model"]["vocab"])
    special = {t["content"] for t in spec.get("added_tokens", []) if t.get("special")}
    for token in spec.get("added_tokens", []):
        vocab[token["content"]] = token["id"]
    tokens = [None] * (max(vocab.values()) + 1)
    for token, index in vocab.items():
        tokens[index] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges(merges)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    config = json.loads((folder / "config.json").read_text())
    for key, add in (("eos_token_id", writer.add_eos_token_id), ("bos_token_id", writer.add_bos_token_id)):  # fmt: skip
        if config.get(key) is not None:
            add(config[key])
    if settings.get("pad_token") in vocab:
        writer.add_pad_token_id(vocab[settings["pad_token"]])
    template = settings.get("chat_template")
    if template is None and (folder / "chat_template.jinja").exists():
        template = (folder / "chat_template.jinja").read_text()
    if template:
        writer.add_chat_template(template)
