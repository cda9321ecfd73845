"""NomicBERT checkpoints for tests and benchmarks: a random one in nomic-ai's layout
(`NomicBertModel`, as nomic-embed-text v1.5 ships: config.json with GPT-2 style names,
model.safetensors, a BERT WordPiece tokenizer, sentence-transformers' mean pooling and
Normalize), and an independent torch forward pass of it to check the engine against.

transformers has no NomicBERT (nomic's own modeling code is `trust_remote_code`, not
installed here), so `nomic_embeddings` is written from what that code computes:

    x = LayerNorm_emb(word[ids] + token_type[0])
    per layer (post-norm):
        q, k, v = split(Wqkv x)  into heads;  q, k = neox rotary (base rotary_emb_base)
        x = LayerNorm_1(x + out_proj(softmax(q k^T / sqrt(d)) v))
        x = LayerNorm_2(x + fc2(fc11(x) * silu(fc12(x))))
    mean over the tokens, L2-normalized
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

# nomic-embed-text v1.5's config, shapes aside
_NOMIC_CONFIG = {
    "architectures": ["NomicBertModel"],
    "model_type": "nomic_bert",
    "activation_function": "swiglu",
    "causal": False,
    "layer_norm_epsilon": 1e-12,
    "max_trained_positions": 2048,
    "n_positions": 8192,
    "prenorm": False,
    "qkv_proj_bias": False,
    "mlp_fc1_bias": False,
    "mlp_fc2_bias": False,
    "rotary_emb_base": 1000,
    "rotary_emb_fraction": 1.0,
    "rotary_emb_interleaved": False,
    "rotary_emb_scale_base": None,
    "rotary_scaling_factor": None,
    "type_vocab_size": 2,
    "vocab_size": 30528,  # the tokenizer's 30,522, padded to a multiple of 64
    "torch_dtype": "float32",
}
_TOKENIZER_FILES = (
    "vocab.txt",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


def make_nomic_folder(
    folder: Path,
    vocab_source: Path,
    hidden: int,
    heads: int,
    layers: int,
    intermediate: int,
    scale: float = 0.2,
    seed: int = 0,
) -> Path:
    """A random NomicBertModel in `folder`; the tokenizer comes from `vocab_source` (a BERT
    uncased folder: nomic's tokenizer is bert-base-uncased's)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = {
        **_NOMIC_CONFIG,
        "n_embd": hidden,
        "n_head": heads,
        "n_layer": layers,
        "n_inner": intermediate,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    def norm(prefix: str) -> dict[str, torch.Tensor]:
        return {
            f"{prefix}.weight": 1.0 + rand(hidden) * 0.5,
            f"{prefix}.bias": rand(hidden) * 0.5,
        }

    tensors = {
        "embeddings.word_embeddings.weight": rand(config["vocab_size"], hidden) * 5,
        "embeddings.token_type_embeddings.weight": rand(2, hidden) * 5,
        **norm("emb_ln"),
    }
    for i in range(layers):
        prefix = f"encoder.layers.{i}"
        tensors.update(
            {
                f"{prefix}.attn.Wqkv.weight": rand(3 * hidden, hidden) / hidden**0.5 * 5,
                f"{prefix}.attn.out_proj.weight": rand(hidden, hidden) / hidden**0.5 * 5,
                f"{prefix}.mlp.fc11.weight": rand(intermediate, hidden) / hidden**0.5 * 5,
                f"{prefix}.mlp.fc12.weight": rand(intermediate, hidden) / hidden**0.5 * 5,
                f"{prefix}.mlp.fc2.weight": rand(hidden, intermediate) / intermediate**0.5 * 5,
                **norm(f"{prefix}.norm1"),
                **norm(f"{prefix}.norm2"),
            }
        )
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    for name in _TOKENIZER_FILES:
        shutil.copy(vocab_source / name, folder / name)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config["model_max_length"] = 8192  # nomic's, not MiniLM's 512
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": hidden, "pooling_mode_mean_tokens": True})
    )
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]  # fmt: skip
    (folder / "modules.json").write_text(json.dumps(modules))
    return folder


@torch.no_grad()
def nomic_embeddings(folder: Path, texts: list[str]) -> torch.Tensor:
    """[len(texts), hidden] float32: each text alone through the formula above (float64
    inside, so that the reference's own rounding is out of the comparison)."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    config = json.loads((folder / "config.json").read_text())
    weights = {k: v.double() for k, v in load_file(str(folder / "model.safetensors")).items()}
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    hidden, heads = config["n_embd"], config["n_head"]
    head_dim = hidden // heads
    eps = config["layer_norm_epsilon"]
    inv_freq = 1.0 / (
        config["rotary_emb_base"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    )

    def layer_norm(x: torch.Tensor, prefix: str) -> torch.Tensor:
        return F.layer_norm(
            x, (hidden,), weights[f"{prefix}.weight"], weights[f"{prefix}.bias"], eps
        )

    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        first, second = x[..., : head_dim // 2], x[..., head_dim // 2 :]
        return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)

    vectors = []
    for text in texts:
        ids = torch.tensor(tokenizer(text).input_ids)
        length = ids.shape[0]
        angles = torch.outer(torch.arange(length, dtype=torch.float64), inv_freq)[:, None, :]
        cos, sin = angles.cos(), angles.sin()  # [L, 1, head_dim / 2]
        x = weights["embeddings.word_embeddings.weight"][ids]
        x = layer_norm(x + weights["embeddings.token_type_embeddings.weight"][0], "emb_ln")
        for i in range(config["n_layer"]):
            p = f"encoder.layers.{i}"
            q, k, v = (
                (x @ weights[f"{p}.attn.Wqkv.weight"].T).view(length, 3, heads, head_dim).unbind(1)
            )
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            scores = torch.einsum("qhd,khd->hqk", q, k) / head_dim**0.5
            attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(length, hidden)
            x = layer_norm(x + attended @ weights[f"{p}.attn.out_proj.weight"].T, f"{p}.norm1")
            up = x @ weights[f"{p}.mlp.fc11.weight"].T
            gate = x @ weights[f"{p}.mlp.fc12.weight"].T
            x = layer_norm(x + (up * F.silu(gate)) @ weights[f"{p}.mlp.fc2.weight"].T, f"{p}.norm2")
        vectors.append(F.normalize(x.mean(0), dim=-1))
    return torch.stack(vectors).float()
