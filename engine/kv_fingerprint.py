"""What KV blocks written to disk depend on, as one fingerprint.

Keys and values are only interchangeable between engines that would compute the same bits
into the same layout. The fingerprint is a SHA-256 over:

- the weights' identity: for each weight file (the GGUF file itself, or a folder's
  safetensors / .bin shards and its config.json) its name, size, modification time and an
  xxh3-128 of 16 samples of 64 KiB spread over the file (start and end included);
- the model's configuration (`ModelConfig`) and the rotary tables it built (rope type,
  theta and scaling, which for dynamic and longrope scaling depend on max_model_len);
- the compute plan: activation dtype, KV-cache dtype, the CPU fast path or not, the
  attention backend, the device type;
- the KV layout: block size and every layer's key and value shapes per block (the fast
  path's head-major bf16 k [Hkv, D, block_size], v [Hkv, block_size, D]; the torch and
  Triton layout [block_size, Hkv, D]) and dtype;
- the tensor-parallel rank and size (always 0 of 1: the disk cache refuses tensor
  parallelism, see engine/config.py);
- the format version of the block files.

A change to any of them gives another folder in the directory, and a file that still ends
up in the wrong folder is refused by the fingerprint in its own header.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import torch
import xxhash

from .gguf_loader import gguf_file_of, is_gguf_folder

FORMAT_VERSION = 1
_SAMPLES = 16
_SAMPLE_BYTES = 64 << 10


def file_identity(path: Path) -> dict[str, Any]:
    """Name, size, modification time and a sampled content digest of one file."""
    stat = path.stat()
    state = xxhash.xxh3_128()
    with open(path, "rb") as f:
        span = max(stat.st_size - _SAMPLE_BYTES, 0)
        for index in range(_SAMPLES):
            f.seek(span * index // (_SAMPLES - 1))
            state.update(f.read(_SAMPLE_BYTES))
    return {
        "file": str(path.resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "sampled_xxh3_128": state.hexdigest(),
    }


def weights_identity(folder: Path) -> list[dict[str, Any]]:
    """The identity of every file the weights are read from."""
    if is_gguf_folder(folder):
        files = [gguf_file_of(folder)]
    else:
        patterns = ("*.safetensors", "pytorch_model*.bin", "config.json")
        files = sorted({Path(p) for pattern in patterns for p in glob.glob(str(folder / pattern))})
    return [file_identity(path) for path in files]


def _rotary_tables(model: torch.nn.Module) -> list[str]:
    """A digest of positions 1 and 2 of every distinct rotary table: they fix the
    frequencies and the attention factor whatever the rope type."""
    from .models.rotary import RotaryEmbedding

    digests = []
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            rows = torch.cat(module.table_rows(slice(1, 3))).float().cpu().contiguous()
            digests.append(xxhash.xxh3_64_hexdigest(rows.numpy().tobytes()))
    return sorted(set(digests))


def kv_fingerprint(
    *,
    folder: Path,
    model_name: str,
    model: torch.nn.Module,
    model_config: Any,
    plan: Any,
    device: torch.device,
    block_size: int,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    tensor_parallel_rank: int = 0,
    tensor_parallel_size: int = 1,
) -> tuple[str, str, dict[str, Any]]:
    """(fingerprint, folder name, the description it was made from)."""
    description = {
        "format_version": FORMAT_VERSION,
        "model_name": model_name,
        "weights": weights_identity(folder),
        "model_config": dataclasses.asdict(model_config),
        "rotary_tables": _rotary_tables(model),
        "dtype": str(plan.dtype),
        "kv_cache_dtype": str(plan.kv_cache_dtype),
        "cpu_fast_path": bool(plan.fused_cpu),
        "attention_backend": plan.attention_backend,
        "device": device.type,
        "block_size": block_size,
        "kv_layout": [
            [list(k.shape[1:]), list(v.shape[1:]), str(k.dtype), str(v.dtype)] for k, v in kv_caches
        ],
        "tensor_parallel": {"rank": tensor_parallel_rank, "size": tensor_parallel_size},
    }
    text = json.dumps(description, sort_keys=True, default=str)
    fingerprint = hashlib.sha256(text.encode()).hexdigest()[:32]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", os.path.basename(model_name))[:48] or "model"
    return fingerprint, f"{slug}-{fingerprint}", description
