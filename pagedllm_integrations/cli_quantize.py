"""`pagedllm quantize --model DIR_OR_GGUF --out DIR [--calib FILE] [--group-size 64] ...`.

Writes an AutoAWQ "gemm" checkpoint (4-bit, zero points) that `LLM(out)`, vLLM and
transformers load.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch

from .quant.awq_format import AWQConfig
from .quant.quantizer import (
    DEFAULT_CALIBRATION,
    QuantizeOptions,
    QuantizeReport,
    awq_quantize_model,
    calibration_blocks,
    save_awq_checkpoint,
)

logger = logging.getLogger(__name__)


def read_calibration_text(path: Path) -> list[str]:
    """A text file -> its paragraphs (blank-line separated)."""
    if not path.exists():
        raise ValueError(f"calibration file {path} does not exist")
    paragraphs = [p.strip() for p in path.read_text(encoding="utf-8").split("\n\n")]
    paragraphs = [p for p in paragraphs if p]
    if not paragraphs:
        raise ValueError(f"calibration file {path} is empty")
    return paragraphs


# Families whose blocks have the Llama shape the quantizer folds scales into: input norm ->
# q/k/v, post-attention norm -> gate/up (Qwen3's q/k norms act after q/k_proj, so they keep).
QUANTIZABLE_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


def load_float_model(folder: Path):
    """transformers' own implementation of the model, in float32 (the calibration vehicle)."""
    from transformers import AutoTokenizer

    from .engine.gguf_loader import load_with_transformers

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = load_with_transformers(folder, dtype=torch.float32)
    return model.eval(), tokenizer


def quantize_checkpoint(
    model: str | None,
    out: Path,
    calibration: Path = DEFAULT_CALIBRATION,
    options: QuantizeOptions | None = None,
) -> QuantizeReport:
    """Resolve `model` (folder, GGUF, hub id, None = embedded default), quantize, write `out`."""
    from .engine.model_loader import read_config, resolve_model

    options = options or QuantizeOptions()
    source = resolve_model(model)
    hf_config = read_config(source.folder)
    if (hf_config.get("quantization_config") or {}).get("quant_method") not in (None, "gguf"):
        raise ValueError(f"{source.origin} is already quantized; give a full-precision model")
    architecture = (hf_config.get("architectures") or ["?"])[0]
    if architecture not in QUANTIZABLE_ARCHITECTURES:
        raise ValueError(
            f"`pagedllm quantize` calibrates {', '.join(QUANTIZABLE_ARCHITECTURES)} models, not "
            f"{architecture} (its norms or fused linears need their own scale folding); AWQ "
            "checkpoints of it made by AutoAWQ load and run"
        )
    texts = read_calibration_text(Path(calibration))
    float_model, tokenizer = load_float_model(source.folder)
    blocks = calibration_blocks(tokenizer, texts, options.num_samples, options.seq_len)
    logger.info(
        "AWQ: %s, %d calibration blocks of %d tokens, group size %d",
        source.origin,
        blocks.shape[0],
        blocks.shape[1],
        options.group_size,
    )
    quantized, report = awq_quantize_model(float_model, blocks, options)
    config = AWQConfig(
        group_size=options.group_size, modules_to_not_convert=list(options.modules_to_not_convert)
    )
    save_awq_checkpoint(float_model, quantized, out, config, source.folder, tokenizer)
    return report


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument(
        "--model", default=None, help="HF folder, GGUF file or hub id (default: embedded model)"
    )
    parser.add_argument("--out", required=True, help="folder to write the AWQ checkpoint to")
    parser.add_argument(
        "--calib",
        default=str(DEFAULT_CALIBRATION),
        help="calibration text file (paragraphs split on blank lines); default: a public-domain "
        "passage shipped with pagedllm",
    )
    parser.add_argument("--group-size", type=int, default=64, help="inputs per scale (default 64)")
    parser.add_argument("--num-samples", type=int, default=64, help="calibration blocks")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per calibration block")
    parser.add_argument(
        "--search-samples",
        type=int,
        default=16,
        help="blocks used to score each scale candidate (fewer is faster)",
    )
    parser.add_argument("--no-clip", action="store_true", help="skip the clipping search")
    parser.add_argument(
        "--no-duo-scaling", action="store_true", help="scale by activations only (s = s_x^alpha)"
    )
    parser.add_argument(
        "--modules-to-not-convert",
        nargs="*",
        default=[],
        help="keep linears whose name contains any of these strings in fp16",
    )


def run(args: argparse.Namespace) -> int:
    options = QuantizeOptions(
        group_size=args.group_size,
        num_samples=args.num_samples,
        seq_len=args.seq_len,
        search_samples=args.search_samples,
        clip=not args.no_clip,
        duo_scaling=not args.no_duo_scaling,
        modules_to_not_convert=list(args.modules_to_not_convert),
    )
    started = time.perf_counter()
    try:
        quantize_checkpoint(args.model, Path(args.out), Path(args.calib), options)
    except ValueError as error:
        print(f"error: {error}")
        return 2
    print(f"wrote AWQ checkpoint to {args.out} in {time.perf_counter() - started:.1f}s")
    return 0
