"""GGUF files (llama.cpp's format, what Ollama pulls) read in place, weights kept quantized.

A GGUF file becomes a small Hugging Face folder in the pagedllm cache, made once: its
config.json and tokenizer (read from the GGUF metadata by transformers) and `gguf.json`,
which names the GGUF file. The weights stay in the GGUF file: each load reads them from
there (memory-mapped), so there is no float32 copy on disk. Once a tensor has been taken,
its pages of the mapping are handed back (they stay in the page cache, outside the
process's resident memory), so a load never holds the file and the packed weights at once. Quantized tensors come out as
`GGUFTensor`s, still in their blocks; the model's linear layers decide what to do with
them: pack them for the C++ kernels (quant/gguf_blocks.py, exact), or dequantize them
(`GGUFTensor.dense`) for the float32 reference path.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..quant.gguf_tensor import GGUFTensor

logger = logging.getLogger(__name__)

_MARKER = "gguf.json"
# v1 folders held dequantized float32 safetensors; v2 configs came from transformers alone,
# v3 from gguf_arch's tables for the architectures transformers reads incompletely.
_FOLDER_VERSION = "v3"
_FLOAT_TYPES = {"F32": np.float32, "F16": np.float16}


# ------------------------------------------------------------------- the folder


def is_gguf_folder(folder: Path) -> bool:
    return (Path(folder) / _MARKER).exists()


def gguf_file_of(folder: Path) -> Path:
    """The GGUF file a converted folder reads its weights from (a relative path, as in the
    wheel's embedded model, is relative to the folder)."""
    file = Path(json.loads((Path(folder) / _MARKER).read_text())["file"])
    return file if file.is_absolute() else (Path(folder) / file).resolve()


def write_marker(folder: Path, gguf_file: Path | str) -> None:
    """Point a converted folder at its GGUF file (replaced in one step)."""
    tmp = Path(folder) / f".{_MARKER}.{os.getpid()}"
    tmp.write_text(json.dumps({"file": str(gguf_file)}))
    os.replace(tmp, Path(folder) / _MARKER)


def load_with_transformers(folder: Path, **kwargs: Any):
    """transformers' own AutoModelForCausalLM for a model folder; a GGUF folder's weights
    are read (and dequantized by transformers) from its GGUF file."""
    from transformers import AutoModelForCausalLM

    if is_gguf_folder(folder):
        file = gguf_file_of(folder)
        return AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, **kwargs)
    return AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)


def gguf_to_hf_folder(path: Path, content_id: str | None = None) -> Path:
    """The cached config + tokenizer folder of a GGUF file (made once per file version).

    A file is known by its path, size and modification time; `content_id` (an Ollama
    blob's sha256, which names its bytes wherever the blob lies) keys the folder by content
    instead, and the folder is pointed at this copy of the file."""
    import xxhash

    from ..kernels.cache_dir import cache_dir

    stat = path.stat()
    identity = content_id or f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    key = xxhash.xxh64_hexdigest(f"{identity}|{_FOLDER_VERSION}".encode())
    target = cache_dir() / "gguf" / f"{path.stem}-{key}"
    if (target / _MARKER).exists():
        if content_id is not None and gguf_file_of(target) != path.resolve():
            write_marker(target, path.resolve())
        return target
    started = time.perf_counter()
    # A WARNING, so that the wait is explained also where no logging is set up (stderr).
    logger.warning(
        "converting %s for pagedllm once (its config and tokenizer; about 10-40 s); cached in %s",
        path,
        target,
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        _write_folder(path, tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.warning("converted %s in %.0f s", path.name, time.perf_counter() - started)
    return target


def _write_folder(path: Path, out: Path) -> None:
    """config.json, the tokenizer files and the marker naming the GGUF file.

    The config comes from `gguf_arch` (its tables know each architecture's metadata keys)
    except for the Llama-family files, whose config transformers reads completely.
    """
    from transformers import AutoConfig, AutoTokenizer

    from . import gguf_arch

    folder, name = str(path.parent), path.name
    gguf_file = read_gguf(path)
    arch = str(gguf_file.metadata.get("general.architecture"))
    spec = gguf_arch.gguf_arch(arch)  # ValueError naming the supported architectures
    if spec.write_files is not None:  # an encoder: tokenizer and pooling files of its own
        config = gguf_arch.hf_config(
            arch, _arch_metadata(gguf_file, arch), _tensor_facts(gguf_file)
        )
        spec.write_files(path, gguf_file.metadata, out)
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (out / _MARKER).write_text(json.dumps({"file": str(path.resolve())}))
        return
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        config = gguf_arch.hf_config(
            arch, _arch_metadata(gguf_file, arch), _tensor_facts(gguf_file)
        )
        if config is None:
            hf = AutoConfig.from_pretrained(folder, gguf_file=name)
            hf.architectures = [spec.hf_architecture]
            config = hf.to_dict()
    except ValueError:
        raise
    except Exception as error:
        raise ValueError(f"{path} could not be read as a GGUF model: {error}") from error
    (out / "config.json").write_text(json.dumps(config, indent=2, default=_json_default) + "\n")
    tokenizer.save_pretrained(str(out))
    if gguf_file.metadata.get("tokenizer.ggml.model") == "gpt2":
        _load_tokenizer_as_saved(out)
    write_marker(out, path.resolve())


def _arch_metadata(gguf_file: GGUFFile, arch: str) -> dict[str, Any]:
    """The `<arch>.*` keys (prefix dropped) and the tokenizer's special token ids."""
    prefix = f"{arch}."
    metadata = {k[len(prefix) :]: v for k, v in gguf_file.metadata.items() if k.startswith(prefix)}
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        if gguf_file.metadata.get(key) is not None:
            metadata[key] = gguf_file.metadata[key]
    return metadata


def _tensor_facts(gguf_file: GGUFFile) -> dict[str, Any]:
    """name -> {"shape" (torch order)}, plus "values" for the config-carrying rope tensors."""
    facts: dict[str, Any] = {}
    for tensor in gguf_file.tensors:
        facts[tensor.name] = {"shape": [int(d) for d in reversed(tensor.shape)]}
        if tensor.name.startswith(("rope_factors_", "rope_freqs")):
            factors = _tensor_value(tensor)  # float32 in every file: a torch tensor
            facts[tensor.name]["values"] = [float(v) for v in factors.reshape(-1)]  # type: ignore[union-attr]
    return facts


def _load_tokenizer_as_saved(folder: Path) -> None:
    """Have the folder's byte-level BPE tokenizer reload exactly as tokenizer.json describes
    it. transformers names the architecture's own tokenizer class (GemmaTokenizer for a
    gemma file, say), and those classes rebuild their sentencepiece-style pipeline on load,
    which mangles a byte-level vocabulary (Phi-4-mini's, for one)."""
    path = folder / "tokenizer_config.json"
    settings = json.loads(path.read_text())
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(settings, indent=2) + "\n")


def _json_default(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


@dataclass(slots=True)
class GGUFTensorInfo:
    name: str
    type_name: str  # GGML type: F32, Q4_1, Q4_K, ...
    shape: tuple[int, ...]  # as GGUF lists it: innermost dimension first
    data: np.ndarray  # a view of the memory-mapped file: uint8 blocks, or the float values
    offset: int = 0  # of the data in the file, in bytes
    nbytes: int = 0


@dataclass(slots=True)
class GGUFFile:
    """The metadata (scalars only) and tensors of a GGUF file, read without parsing its
    large arrays (the tokenizer's vocabulary), which is most of what gguf.GGUFReader spends
    its time on (seconds for a small model)."""

    metadata: dict[str, Any]
    tensors: list[GGUFTensorInfo]
    mapping: mmap.mmap | None = None  # the file, read-only
    released: int = 0  # bytes of the mapping, from its start, whose pages have been dropped

    def release(self, tensor: GGUFTensorInfo) -> None:
        """Drop the resident pages of the file up to the end of a tensor's bytes (after
        they have been copied; tensors are taken in file order).

        Everything before the tensor goes too, not only its own bytes: the kernel maps the
        page cache around each fault (fault-around, and whole large folios), so reading
        one tensor maps pages of its neighbours, released or not yet read. Dropping only
        each tensor's own range left ~50 MiB of the 94 MiB default model resident.

        The mapping is read-only and backed by the file, so a later read of the same bytes
        (a view still held somewhere) simply faults them in again: this costs no
        correctness, only the pages' place in this process's resident set."""
        if self.mapping is None or tensor.nbytes == 0:
            return
        page = mmap.PAGESIZE
        end = min(-(-(tensor.offset + tensor.nbytes) // page) * page, len(self.mapping))
        if end > self.released:
            self.mapping.madvise(mmap.MADV_DONTNEED, self.released, end - self.released)
            self.released = end

    def release_all(self) -> None:
        """Drop every resident page of the file (the load is over)."""
        if self.mapping is not None and len(self.mapping):
            self.mapping.madvise(mmap.MADV_DONTNEED, 0, len(self.mapping))
            self.released = len(self.mapping)


_SCALARS = {  # GGUF value type -> struct format
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
    12: "<d",
}  # fmt: skip
_STRING, _ARRAY = 8, 9


def read_gguf(path: Path) -> GGUFFile:
    import struct

    import gguf

    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    raw = np.frombuffer(mapping, dtype=np.uint8)
    buffer = memoryview(raw)  # type: ignore[arg-type]  # numpy: a buffer
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
        begin = start + data_offset
        data = raw[begin : begin + rows * row_bytes]
        if qtype.name in _FLOAT_TYPES:
            data = data.view(_FLOAT_TYPES[qtype.name])
        elif qtype.name == "BF16":
            data = data.view(np.uint16)
        else:
            data = data.reshape(rows, row_bytes)
        tensors.append(GGUFTensorInfo(name, qtype.name, dims, data, begin, rows * row_bytes))
    # The nested readers form a reference cycle (`value` calls itself through its closure)
    # that holds `buffer`, and through it the mapping, until the cyclic garbage collector
    # happens to run: after a load that kept the file's pages mapped (~50 MiB resident for
    # the default model) for the engine's life. Released here, the mapping lives exactly as
    # long as the GGUFFile and the tensor views taken from it.
    buffer.release()
    return GGUFFile(metadata, tensors, mapping)


# ------------------------------------------------------------------ the weights
def iter_gguf_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor | GGUFTensor]]:
    """(Hugging Face name, tensor) for every weight of the folder's GGUF file. Float
    tensors come as torch tensors, quantized ones as GGUFTensors (no copy made); names,
    layouts and llama.cpp's transformations are undone by `gguf_arch`."""
    from . import gguf_arch

    with open(Path(folder) / "config.json") as f:
        config = json.load(f)
    gguf_file = read_gguf(gguf_file_of(folder))
    arch = str(gguf_file.metadata.get("general.architecture"))
    for tensor in gguf_file.tensors:
        if gguf_arch.hf_name(arch, tensor.name) is None:
            continue  # a tensor that carries configuration (rope factors)
        for hf_name, value in gguf_arch.fix_tensor(
            arch, tensor.name, _tensor_value(tensor), config
        ):
            if config.get("tie_word_embeddings") and hf_name == "lm_head.weight":
                continue
            yield hf_name, value
        gguf_file.release(tensor)
    # Pages a consumer faulted in again (a view it read after its tensor was released).
    gguf_file.release_all()


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
    if len(shape) < 2:
        raise ValueError(f"quantized GGUF tensor {tensor.name} is not a matrix: {shape}")
    # A stacked [E, N, K] tensor (experts) is E * N rows of K: gguf_arch cuts it per expert.
    rows = int(np.prod(shape[:-1]))
    return GGUFTensor(type_name, np.asarray(tensor.data), (rows, shape[-1]))
