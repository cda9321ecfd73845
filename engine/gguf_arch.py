"""Everything architecture-specific about GGUF files, as tables: which Hugging Face
architecture a `general.architecture` is, what each GGUF tensor is called in a Hugging Face
checkpoint, what llama.cpp's converter (convert_hf_to_gguf.py) did to it that has to be
undone, and the config.json its metadata describes.

    hf_name("gemma2", "blk.3.post_ffw_norm.weight")
        -> "model.layers.3.post_feedforward_layernorm.weight"
    fix_tensor("gemma2", "blk.3.post_ffw_norm.weight", w, config) -> [(that name, w - 1)]

A tensor is a torch tensor (float GGUF types) or a still-quantized `GGUFTensor`
(gguf_loader.py: whole rows of llama.cpp blocks); the fix-ups that apply to quantized
weights move or cut whole rows, so they never dequantize.

What the converter does per architecture (and `fix_tensor` undoes):
- llama, mistral: q and k rows permuted from rotate-half order into interleaved pairs;
- gemma2, gemma3: every RMSNorm weight stored as w + 1 (Gemma's norm multiplies by 1 + w);
- qwen3moe: each layer's experts stacked into one [E, out, in] tensor per projection;
- phi3: q/k/v and gate/up stay fused (attn_qkv, ffn_up holding gate|up, as in the
  Hugging Face checkpoint); the longrope factors become tensors (rope_factors_long/short)
  and go back into the config.
- bert, nomic-bert: names only (gguf_bert.py; nomic keeps q, k, v fused as Wqkv).
Nothing else is transformed; everything keeps the Hugging Face [out, in] layout.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .gguf_bert import (
    BERT_BLOCK,
    BERT_TOP_LEVEL,
    NOMIC_BERT_BLOCK,
    NOMIC_BERT_TOP_LEVEL,
    bert_config,
    nomic_bert_config,
    write_bert_files,
)

# GGUF tensor name (the part after blk.N.) -> Hugging Face name (after model.layers.N.).
_LLAMA_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA_BLOCK = {
    **_LLAMA_BLOCK,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_QWEN3_MOE_BLOCK = {
    **_LLAMA_BLOCK,
    "ffn_gate_inp": "mlp.gate",
    # stacked [E, ...]: one Hugging Face tensor per expert, {expert} filled in
    "ffn_gate_exps": "mlp.experts.{expert}.gate_proj",
    "ffn_up_exps": "mlp.experts.{expert}.up_proj",
    "ffn_down_exps": "mlp.experts.{expert}.down_proj",
}
_PHI3_BLOCK = {
    **_LLAMA_BLOCK,
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_up": "mlp.gate_up_proj",  # gate | up, fused as in the Hugging Face checkpoint
}
_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors that carry configuration, not weights (read by the config builders).
_CONFIG_TENSORS = ("rope_freqs", "rope_factors_long", "rope_factors_short")


@dataclass(frozen=True, slots=True)
class GGUFArch:
    hf_architecture: str
    model_type: str  # config.json's model_type (what transformers' Auto classes key on)
    block: dict[str, str]
    fixes: tuple[str, ...] = ()  # "unpermute_qk", "norm_minus_one"
    # metadata (keys without the "<arch>." prefix) + tensor shapes -> config.json fields;
    # None: transformers reads the config from the file itself
    config: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]] | None = None
    # Encoders (bert) name their tensors their own way, and carry a tokenizer transformers
    # cannot read from GGUF: (file, metadata, folder) writes it (and any other files).
    top_level: dict[str, str] | None = None  # GGUF name -> HF name (weight and bias)
    layer_prefix: str = "model.layers"
    write_files: Callable[[Any, dict[str, Any], Any], None] | None = None


def _key(meta: dict[str, Any], name: str, default: Any = None) -> Any:
    return meta.get(name, default)


def _base_config(meta: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """The fields every llama.cpp text architecture writes the same way."""
    heads = int(meta["attention.head_count"])
    hidden = int(meta["embedding_length"])
    config: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": int(_key(meta, "feed_forward_length", 0)),
        "num_hidden_layers": int(meta["block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_key(meta, "attention.head_count_kv", heads)),
        "head_dim": int(_key(meta, "attention.key_length", hidden // heads)),
        "max_position_embeddings": int(_key(meta, "context_length", 4096)),
        "rms_norm_eps": float(_key(meta, "attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_key(meta, "rope.freq_base", 10000.0)),
        "vocab_size": int(tensors["token_embd.weight"]["shape"][0]),
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": "float32",
    }
    scaling_type = _key(meta, "rope.scaling.type")
    if scaling_type in ("linear", "yarn") and _key(meta, "rope.scaling.factor"):
        config["rope_scaling"] = {
            "rope_type": scaling_type,
            "factor": float(meta["rope.scaling.factor"]),
        }
        if _key(meta, "rope.scaling.original_context_length"):
            original = int(meta["rope.scaling.original_context_length"])
            config["rope_scaling"]["original_max_position_embeddings"] = original
    return config


def _qwen3_config(meta: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    return _base_config(meta, tensors)


def _qwen3_moe_config(meta: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    config = _base_config(meta, tensors)
    config.update(
        num_experts=int(meta["expert_count"]),
        num_experts_per_tok=int(meta["expert_used_count"]),
        moe_intermediate_size=int(meta["expert_feed_forward_length"]),
        # llama.cpp's qwen3moe graph renormalizes the top-k weights unless a file says not to.
        norm_topk_prob=bool(_key(meta, "expert_weights_norm", True)),
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    return config


def _gemma_scalar(config: dict[str, Any], layers_of_27b: int) -> int:
    """query_pre_attn_scalar, which GGUF does not store: llama.cpp takes head_dim, except
    for the 27B models (recognised by their layer count), where it is hidden / heads."""
    if config["num_hidden_layers"] == layers_of_27b:
        return config["hidden_size"] // config["num_attention_heads"]
    return int(config["head_dim"])


def _gemma2_config(meta: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    config = _base_config(meta, tensors)
    config.update(
        sliding_window=int(_key(meta, "attention.sliding_window", 4096)),
        attn_logit_softcapping=_key(meta, "attn_logit_softcapping", 50.0),
        final_logit_softcapping=_key(meta, "final_logit_softcapping", 30.0),
        query_pre_attn_scalar=_gemma_scalar(config, 46),
        hidden_activation="gelu_pytorch_tanh",
    )
    return config


def _gemma3_config(meta: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    config = _base_config(meta, tensors)
    pattern = _key(meta, "attention.sliding_window_pattern", 6)
    layers = config["num_hidden_layers"]
    if isinstance(pattern, list):  # per layer: True where the layer is sliding
        types = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        types = [
            "sliding_attention" if (i + 1) % int(pattern) else "full_attention"
            for i in range(layers)
        ]
    config.update(
        sliding_window=int(_key(meta, "attention.sliding_window", 4096)),
        layer_types=types,
        # llama.cpp's default for the local layers' rope base when a file does not give one.
        rope_local_base_freq=float(_key(meta, "rope.freq_base_swa", 10000.0)),
        query_pre_attn_scalar=_gemma_scalar(config, 62),
        hidden_activation="gelu_pytorch_tanh",
        attn_logit_softcapping=None,
        final_logit_softcapping=_key(meta, "final_logit_softcapping"),
    )
    return config


def _phi3_config(meta: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    config = _base_config(meta, tensors)
    rotary = int(_key(meta, "rope.dimension_count", config["head_dim"]))
    config["partial_rotary_factor"] = rotary / config["head_dim"]
    window = int(_key(meta, "attention.sliding_window", 0))
    config["sliding_window"] = window or None
    if "rope_factors_long.weight" in tensors and "rope_factors_short.weight" in tensors:
        original = int(_key(meta, "rope.scaling.original_context_length", 4096))
        scaling: dict[str, Any] = {
            "rope_type": "longrope",
            "long_factor": tensors["rope_factors_long.weight"]["values"],
            "short_factor": tensors["rope_factors_short.weight"]["values"],
            "original_max_position_embeddings": original,
        }
        if _key(meta, "rope.scaling.attn_factor") is not None:
            scaling["attention_factor"] = float(meta["rope.scaling.attn_factor"])
        config["rope_scaling"] = scaling
        config["original_max_position_embeddings"] = original
    return config


GGUF_ARCHITECTURES: dict[str, GGUFArch] = {
    "llama": GGUFArch("LlamaForCausalLM", "llama", _LLAMA_BLOCK, ("unpermute_qk",)),
    "mistral": GGUFArch("MistralForCausalLM", "mistral", _LLAMA_BLOCK, ("unpermute_qk",)),
    "qwen2": GGUFArch("Qwen2ForCausalLM", "qwen2", _LLAMA_BLOCK),
    "qwen3": GGUFArch("Qwen3ForCausalLM", "qwen3", _LLAMA_BLOCK, config=_qwen3_config),
    "qwen3moe": GGUFArch(
        "Qwen3MoeForCausalLM", "qwen3_moe", _QWEN3_MOE_BLOCK, config=_qwen3_moe_config
    ),
    "gemma2": GGUFArch(
        "Gemma2ForCausalLM", "gemma2", _GEMMA_BLOCK, ("norm_minus_one",), _gemma2_config
    ),
    "gemma3": GGUFArch(
        "Gemma3ForCausalLM", "gemma3_text", _GEMMA_BLOCK, ("norm_minus_one",), _gemma3_config
    ),
    "phi3": GGUFArch("Phi3ForCausalLM", "phi3", _PHI3_BLOCK, config=_phi3_config),
    "bert": GGUFArch(
        "BertModel",
        "bert",
        BERT_BLOCK,
        config=bert_config,
        top_level=BERT_TOP_LEVEL,
        layer_prefix="encoder.layer",
        write_files=write_bert_files,
    ),
    "nomic-bert": GGUFArch(
        "NomicBertModel",
        "nomic_bert",
        NOMIC_BERT_BLOCK,
        config=nomic_bert_config,
        top_level=NOMIC_BERT_TOP_LEVEL,
        layer_prefix="encoder.layers",
        write_files=write_bert_files,
    ),
}
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def gguf_arch(name: str) -> GGUFArch:
    if name not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {name!r}; supported: {sorted(GGUF_ARCHITECTURES)}"
        )
    return GGUF_ARCHITECTURES[name]


def hf_name(arch: str, gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (None: not a weight, e.g. rope factors).

    A stacked expert tensor's name holds an `{expert}` placeholder: it becomes one Hugging
    Face tensor per expert (see `fix_tensor`). ValueError for a tensor the table lacks.
    """
    spec = gguf_arch(arch)
    base, _, suffix = gguf_name.rpartition(".")
    if spec.top_level is not None and base in spec.top_level:
        return f"{spec.top_level[base]}.{suffix}"
    if spec.top_level is None and base in _TOP_LEVEL and suffix == "weight":
        return f"{_TOP_LEVEL[base]}.weight"
    if base in _CONFIG_TENSORS:
        return None
    match = _BLOCK_NAME.match(gguf_name)
    if match and match.group(2) in spec.block:
        layer, leaf, kind = match.groups()
        return f"{spec.layer_prefix}.{layer}.{spec.block[leaf]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} is not known for architecture {arch!r}")


def fix_tensor(
    arch: str, gguf_name: str, tensor: Any, config: dict[str, Any]
) -> list[tuple[str, Any]]:
    """(Hugging Face name, tensor) pairs for one GGUF tensor, with llama.cpp's
    transformations undone. `tensor`: a torch tensor, or a GGUFTensor of whole quantized
    rows (a stacked [E, N, K] one as E * N rows). `config`: the model's config.json."""
    name = hf_name(arch, gguf_name)
    if name is None:
        return []
    spec = gguf_arch(arch)
    if "unpermute_qk" in spec.fixes and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
        heads = config["num_attention_heads"]
        if ".attn_k." in gguf_name:
            heads = config.get("num_key_value_heads") or heads
        tensor = unpermute_rotary(tensor, heads)
    if "norm_minus_one" in spec.fixes and gguf_name.rsplit(".", 1)[0].endswith("norm"):
        tensor = _dense(tensor) - 1.0
    if "{expert}" in name:  # [E, out, in] -> E tensors [out, in]
        experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
        return [(name.format(expert=e), _expert(tensor, e, experts)) for e in range(experts)]
    return [(name, tensor)]


def _dense(tensor: Any) -> torch.Tensor:
    return tensor if isinstance(tensor, torch.Tensor) else tensor.dense(torch.float32)


def _expert(tensor: Any, expert: int, experts: int) -> Any:
    if isinstance(tensor, torch.Tensor):
        if tensor.dim() != 3 or tensor.shape[0] != experts:
            raise ValueError(
                f"stacked experts of shape {tuple(tensor.shape)}, not [{experts}, ...]"
            )
        return tensor[expert].contiguous()
    rows = tensor.shape[0] // experts  # a quantized stack: E * N rows
    return tensor.rows(expert * rows, (expert + 1) * rows)


def unpermute_rotary(weight: Any, num_heads: int) -> Any:
    """Undo llama.cpp's q/k permutation: within each head, rows (0, half, 1, half+1, ...)
    back to (0, 1, ..., half-1, half, ...), the rotate-half order of Hugging Face. A
    quantized weight moves whole rows of blocks: nothing is dequantized."""
    order = unpermute_order(weight.shape[0], num_heads)
    if isinstance(weight, torch.Tensor):
        return weight[torch.from_numpy(order)]
    return weight.permute_rows(order)


def unpermute_order(rows: int, num_heads: int) -> np.ndarray:
    """Row order that turns llama.cpp's interleaved rotary layout back into the halves
    layout: in each head, rows (0, 2, 4, ..., 1, 3, 5, ...)."""
    half = rows // num_heads // 2
    return np.arange(rows).reshape(num_heads, half, 2).transpose(0, 2, 1).reshape(-1)


def hf_config(
    arch: str, metadata: dict[str, Any], tensors: dict[str, Any]
) -> dict[str, Any] | None:
    """config.json fields for a GGUF file of `arch`, or None where transformers reads the
    config from the file itself (llama, mistral, qwen2).

    metadata: the `<arch>.` keys with that prefix dropped, plus `tokenizer.ggml.*` as is.
    tensors: name -> {"shape": torch order, "values": list} ("values" only for the small
    config-carrying tensors such as rope factors).
    """
    spec = gguf_arch(arch)
    if spec.config is None:
        return None
    config = spec.config(metadata, tensors)
    config["architectures"] = [spec.hf_architecture]
    config["model_type"] = spec.model_type
    for ours, theirs in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        value = metadata.get(f"tokenizer.ggml.{theirs}")
        if value is not None:
            config[ours] = int(value)
    return config
