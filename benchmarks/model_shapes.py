"""Random-weight models in the real shapes people run, as GGUF files llama.cpp's own tools
write: for speed at 0.6B-8B, where nothing can be downloaded.

    python benchmarks/model_shapes.py qwen3-0.6b llama-3.2-1b --quant Q4_K_M,Q4_0
    python benchmarks/model_shapes.py --list

For each shape: a Hugging Face folder (config.json in the model's real widths, bf16
safetensors of N(0, 0.02) weights with unit norms, SmolLM2's tokenizer files: the vocabulary
rows past its 49,152 tokens are padding tokens, so the embedding and LM head keep the real
size), then llama.cpp's `convert_hf_to_gguf.py` (bf16 GGUF) and `llama-quantize` (each
--quant type), from the build `../shared/tools/build-llama-cpp` makes. Speed does not depend
on the values. The folder is what vLLM's CPU build loads; the GGUF files what llama.cpp and
pagedllm load. Files go under $PAGEDLLM_PEERS_DIR (default ~/.cache/pagedllm-peers)/shapes/
and are reused when present.

The Qwen3-30B-A3B shape keeps its real widths, 128 experts and 8 routed per token but only
`layers` of its 48 layers (the benchmark measures per-token work, not 17 GB of disk).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS = Path(os.environ.get("PAGEDLLM_PEERS_DIR", Path.home() / ".cache" / "pagedllm-peers"))
SHAPES_DIR = PEERS / "shapes"

# The real configs' widths (from each model's config.json on the Hugging Face hub).
_QWEN3 = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936,
    max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
    head_dim=128, attention_bias=False, hidden_act="silu",
)  # fmt: skip
SHAPES: dict[str, dict] = {
    "qwen3-0.6b": dict(
        _QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True,
    ),
    "llama-3.2-1b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192),
        tie_word_embeddings=True, hidden_act="silu",
    ),
    "gemma-3-1b": dict(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=262144,
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        max_position_embeddings=32768, rope_theta=1000000.0, rope_local_base_freq=10000.0,
        sliding_window=512, sliding_window_pattern=6, query_pre_attn_scalar=256,
        rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
    ),
    "qwen3-4b": dict(
        _QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
    ),
    "phi-4-mini": dict(
        architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=200064,
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
        num_attention_heads=24, num_key_value_heads=8, max_position_embeddings=131072,
        original_max_position_embeddings=4096, partial_rotary_factor=0.75,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, hidden_act="silu",
        rope_scaling=dict(type="longrope", long_factor=[1.0] * 48, short_factor=[1.0] * 48),
    ),
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192),
        tie_word_embeddings=False, hidden_act="silu",
    ),
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936,
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], num_hidden_layers=8, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu",
    ),
}  # fmt: skip


def _tool(name: str) -> str:
    script = ROOT.parent / "shared" / "tools" / name
    return subprocess.run([str(script)], capture_output=True, text=True, check=True).stdout.strip()


def hf_folder(name: str) -> Path:
    """The shape's Hugging Face folder, written once (weights generated tensor by tensor)."""
    target = SHAPES_DIR / name / "hf"
    if (target / "config.json").exists():
        return target
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from pagedllm_integrations.engine.model_loader import default_model_path, gguf_to_hf_folder

    config = dict(SHAPES[name], bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    tmp = target.with_name("hf.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    hf_config = AutoConfig.from_pretrained(tmp)
    with torch.device("meta"):
        shapes = {k: (tuple(v.shape), v.dtype) for k, v in
                  AutoModelForCausalLM.from_config(hf_config).state_dict().items()}  # fmt: skip
    if hf_config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    generator = torch.Generator().manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    index: dict[str, str] = {}
    files = 0

    def flush() -> None:
        nonlocal files, shard
        if shard:
            files += 1
            name_ = f"model-{files:05d}.safetensors"
            save_file(shard, str(tmp / name_), metadata={"format": "pt"})
            index.update(dict.fromkeys(shard, name_))
            shard = {}

    for key, (shape, _) in shapes.items():
        if "norm" in key:
            value = torch.zeros(shape) if "gemma" in name else torch.ones(shape)
        else:
            value = torch.randn(shape, generator=generator) * 0.02
        shard[key] = value.to(torch.bfloat16)
        if sum(t.numel() * 2 for t in shard.values()) > 2 << 30:
            flush()
    flush()
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": index}, indent=1)
    )
    tokenizer_source = gguf_to_hf_folder(default_model_path())
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_source / file, tmp / file)
    _fit_tokenizer(tmp, config)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def _fit_tokenizer(folder: Path, config: dict) -> None:
    """Make SmolLM2's tokenizer files pass for the shape's own with llama.cpp's converter.

    - The vocabulary is padded with unused tokens up to the model's `vocab_size`: the
      Gemma converter cuts the embedding to the tokenizer's size (the others pad the
      GGUF vocabulary instead), which would leave 49,169 of Gemma's 262,144 rows.
    - Phi-3/4's converter reads a GPT-2 tokenizer.json only where tokenizer_config.json
      names GPT2Tokenizer (Phi-4-mini's does); otherwise it wants a sentencepiece file."""
    tokenizer_path = folder / "tokenizer.json"
    tokenizer = json.loads(tokenizer_path.read_text())
    vocab = tokenizer["model"]["vocab"]
    counted = len(vocab) + len(tokenizer["added_tokens"])  # as the Gemma converter counts
    next_id = max(vocab.values()) + 1
    for offset in range(config["vocab_size"] - counted):
        vocab[f"<unused_{offset}>"] = next_id + offset
    tokenizer_path.write_text(json.dumps(tokenizer, ensure_ascii=False))
    if config["model_type"] == "phi3":
        settings_path = folder / "tokenizer_config.json"
        settings = json.loads(settings_path.read_text())
        settings["tokenizer_class"] = "GPT2Tokenizer"
        settings_path.write_text(json.dumps(settings, indent=1))


def gguf_file(name: str, quant: str) -> Path:
    """The shape quantized to `quant` by llama-quantize (from a bf16 GGUF of the folder)."""
    out = SHAPES_DIR / name / f"{name}-{quant}.gguf"
    if out.exists():
        return out
    binaries = Path(_tool("build-llama-cpp"))
    source = binaries.parent.parent / "src"
    folder = hf_folder(name)
    bf16 = SHAPES_DIR / name / f"{name}-bf16.gguf"
    if not bf16.exists():
        done = subprocess.run(
            [sys.executable, str(source / "convert_hf_to_gguf.py"), str(folder),
             "--outtype", "bf16", "--outfile", str(bf16)],
            capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{done.stderr[-3000:]}")
    partial = out.with_suffix(".tmp")
    subprocess.run(
        [str(binaries / "llama-quantize"), str(bf16), str(partial), quant],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    partial.rename(out)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("shapes", nargs="*", help=", ".join(SHAPES))
    parser.add_argument("--quant", default="Q4_K_M", help="llama-quantize types, comma-separated")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--drop-bf16", action="store_true", help="remove the bf16 GGUF after")
    args = parser.parse_args()
    if args.list or not args.shapes:
        for name, config in SHAPES.items():
            print(f"{name:15} {config['architectures'][0]}")
        return 0
    for name in args.shapes:
        for quant in args.quant.split(","):
            print(gguf_file(name, quant), flush=True)
        if args.drop_bf16:
            (SHAPES_DIR / name / f"{name}-bf16.gguf").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
