"""GGUF files (llama.cpp's format, what Ollama pulls) read in place, weights kept quantized.

A GGUF file becomes a small Hugging Face folder in the pagedllm cache, made once: its
config.json and tokenizer (read from the GGUF metadata by transformers) and `gguf.json`,
which names the GGUF file. The weights stay in the GGUF file: each load reads them from
there (memory-mapped), so there is no float32 copy on disk. Quantized tensors come out as
`GGUFTensor`s, still in their blocks; the model's linear layers decide what to do with
them: pack them for the C++ kernels (quant/gguf_blocks.py, exact), or dequantize them
(`GGUFTensor.dense`) for the float32 reference path.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

_MARKER = "gguf.json"
_FOLDER_VERSION = "v2"  # v1 folders held dequantized float32 safetensors
_GGUF_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
_GGUF_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_FLOAT_TYPES = {"F32": np.float32, "F16": np.float16}


@dataclass(slots=True)
class GGUFTensor:
    """One quantized GGUF weight [N, K], still in llama.cpp's blocks.

    data: uint8 [N, bytes per row] (a view of the memory-mapped file, rows possibly
    reordered); type_name: the GGML type (Q4_1, Q4_K, ...).
    """

    type_name: str
    data: np.ndarray
    shape: tuple[int, int]

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight dequantized (as llama.cpp dequantizes it), as a torch tensor."""
        from ..quant.gguf_blocks import dequantize_to

        return dequantize_to(self.type_name, self.data, self.shape, dtype)

    def permute_rows(self, order: np.ndarray) -> GGUFTensor:
        return GGUFTensor(self.type_name, self.data[order], self.shape)


def as_dense(value: torch.Tensor | GGUFTensor, dtype: torch.dtype) -> torch.Tensor:
    """A checkpoint tensor as a dense torch tensor of `dtype`, whatever form it came in."""
    if isinstance(value, GGUFTensor):
        return value.dense(torch.float32).to(dtype)
    return value.to(dtype)


# ------------------------------------------------------------------- the folder
def is_gguf_folder(folder: Path) -> bool:
    return (Path(folder) / _MARKER).exists()


def gguf_file_of(folder: Path) -> Path:
    return Path(json.loads((Path(folder) / _MARKER).read_text())["file"])


def load_with_transformers(folder: Path, **kwargs: Any):
    """transformers' own AutoModelForCausalLM for a model folder; a GGUF folder's weights
    are read (and dequantized by transformers) from its GGUF file."""
    from transformers import AutoModelForCausalLM

    if is_gguf_folder(folder):
        file = gguf_file_of(folder)
        return AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, **kwargs)
    return AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)


def gguf_to_hf_folder(path: Path) -> Path:
    """The cached config + tokenizer folder of a GGUF file (made once per file version)."""
    import xxhash

    stat = path.stat()
    identity = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{_FOLDER_VERSION}"
    key = xxhash.xxh64_hexdigest(identity.encode())
    from .model_loader import cache_dir

    target = cache_dir() / "gguf" / f"{path.stem}-{key}"
    if (target / _MARKER).exists():
        return target
    logger.info("reading the config and tokenizer of %s into %s (once)", path, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        _write_folder(path, tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_folder(path: Path, out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    folder, name = str(path.parent), path.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as error:
        raise ValueError(f"{path} could not be read as a GGUF model: {error}") from error
    arch = str(read_gguf(path).metadata.get("general.architecture"))
    if arch not in _GGUF_ARCH:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(_GGUF_ARCH)}")
    config.architectures = [_GGUF_ARCH[arch]]
    config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    (out / _MARKER).write_text(json.dumps({"file": str(path.resolve())}))


@dataclass(slots=True)
class GGUFTensorInfo:
    name: str
    type_name: str  # GGML type: F32, Q4_1, Q4_K, ...
    shape: tuple[int, ...]  # as GGUF lists it: innermost dimension first
    data: np.ndarray  # a view of the memory-mapped file: uint8 blocks, or the float values


@dataclass(slots=True)
class GGUFFile:
    """The metadata (scalars only) and tensors of a GGUF file, read without parsing its
    large arrays (the tokenizer's vocabulary), which is most of what gguf.GGUFReader spends
    its time on (seconds for a small model)."""

    metadata: dict[str, Any]
    tensors: list[GGUFTensorInfo]


_SCALARS = {  # GGUF value type -> struct format
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
    12: "<d",
}  # fmt: skip
_STRING, _ARRAY = 8, 9


def read_gguf(path: Path) -> GGUFFile:
    import struct

    import gguf

    raw = np.memmap(path, dtype=np.uint8, mode="r")
    buffer = memoryview(raw)
    offset = 0

    def take(fmt: str):
        nonlocal offset
        (value,) = struct.unpack_from(fmt, buffer, offset)
        offset += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal offset
        length = take("<Q")
        offset += length
        return bytes(buffer[offset - length : offset]).decode("utf-8", errors="replace")

    def value(kind: int):
        nonlocal offset
        if kind in _SCALARS:
            return take(_SCALARS[kind])
        if kind == _STRING:
            return string()
        if kind != _ARRAY:
            raise ValueError(f"{path}: unknown GGUF value type {kind}")
        item, count = take("<I"), take("<Q")
        if item in _SCALARS and count <= 64:  # small arrays (e.g. per-layer sizes) are kept
            return [take(_SCALARS[item]) for _ in range(count)]
        if item in _SCALARS:  # large numeric arrays: skipped
            offset += count * struct.calcsize(_SCALARS[item])
        else:  # arrays of strings (a vocabulary) or of arrays: walked, not kept
            for _ in range(count):
                value(item)
        return None

    if bytes(buffer[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    offset = 4
    take("<I")  # version
    num_tensors, num_kv = take("<Q"), take("<Q")
    metadata = {}
    for _ in range(num_kv):
        key = string()
        metadata[key] = value(take("<I"))
    infos = []
    for _ in range(num_tensors):
        name = string()
        dims = tuple(take("<Q") for _ in range(take("<I")))
        infos.append((name, dims, take("<I"), take("<Q")))
    alignment = int(metadata.get("general.alignment") or 32)
    start = -(-offset // alignment) * alignment
    tensors = []
    for name, dims, kind, data_offset in infos:
        qtype = gguf.GGMLQuantizationType(kind)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
        row_bytes = dims[0] // block * size
        data = raw[start + data_offset : start + data_offset + rows * row_bytes]
        if qtype.name in _FLOAT_TYPES:
            data = data.view(_FLOAT_TYPES[qtype.name])
        elif qtype.name == "BF16":
            data = data.view(np.uint16)
        else:
            data = data.reshape(rows, row_bytes)
        tensors.append(GGUFTensorInfo(name, qtype.name, dims, data))
    return GGUFFile(metadata, tensors)


# ------------------------------------------------------------------ the weights
def iter_gguf_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor | GGUFTensor]]:
    """(Hugging Face name, tensor) for every weight of the folder's GGUF file. Float
    tensors come as torch tensors, quantized ones as GGUFTensors (no copy made)."""
    with open(Path(folder) / "config.json") as f:
        config = json.load(f)
    num_heads = int(config["num_attention_heads"])
    num_kv_heads = int(config.get("num_key_value_heads") or num_heads)
    for tensor in read_gguf(gguf_file_of(folder)).tensors:
        hf_name = _hf_name(tensor.name)
        if hf_name is None:
            continue
        if config.get("tie_word_embeddings") and hf_name == "lm_head.weight":
            continue
        value = _tensor_value(tensor)
        # llama.cpp's converter interleaves the rotary halves of q and k; undo it.
        if tensor.name.endswith("attn_q.weight"):
            value = _unpermute_rotary(value, num_heads)
        elif tensor.name.endswith("attn_k.weight"):
            value = _unpermute_rotary(value, num_kv_heads)
        yield hf_name, value


def _tensor_value(tensor: GGUFTensorInfo) -> torch.Tensor | GGUFTensor:
    type_name = tensor.type_name
    # GGUF lists dimensions innermost first: [K, N] is a weight of N rows of K values.
    shape = tuple(int(d) for d in reversed(tensor.shape))
    if type_name in _FLOAT_TYPES or type_name == "BF16":
        values = np.asarray(tensor.data)
        if type_name == "BF16":
            raw = torch.from_numpy(np.ascontiguousarray(values).view(np.int16).copy())
            return raw.view(torch.bfloat16).reshape(shape).float()
        return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)
    if len(shape) != 2:
        raise ValueError(f"quantized GGUF tensor {tensor.name} is not a matrix: {shape}")
    return GGUFTensor(type_name, np.asarray(tensor.data), (shape[0], shape[1]))


def _hf_name(name: str) -> str | None:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    match = re.match(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$", name)
    if match and match.group(2) in _GGUF_NAMES:
        return f"model.layers.{match.group(1)}.{_GGUF_NAMES[match.group(2)]}.{match.group(3)}"
    return None  # e.g. rope_freqs: the rope config comes from the metadata


def _unpermute_order(rows: int, num_heads: int) -> np.ndarray:
    """Row order that turns llama.cpp's interleaved rotary layout back into the halves
    layout of Hugging Face: in each head, rows (0, 2, 4, ..., 1, 3, 5, ...)."""
    half = rows // num_heads // 2
    order = np.arange(rows).reshape(num_heads, half, 2).transpose(0, 2, 1)
    return order.reshape(-1)


def _unpermute_rotary(value: Any, num_heads: int):
    rows = value.shape[0]
    order = _unpermute_order(rows, num_heads)
    if isinstance(value, GGUFTensor):
        return value.permute_rows(order)  # whole rows of blocks move: no dequantization
    return value[torch.from_numpy(order)]
