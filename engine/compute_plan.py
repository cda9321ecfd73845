"""How the model computes on this machine: dtypes, kernels, weight format — chosen once.

    dtype="auto" on a CPU with AVX-512 or AVX2 and a C++ compiler: the CPU fast path. Weights stay
        as the checkpoint packs them (GGUF Q4/Q5/Q6/Q8 and AWQ 4-bit in exact packed forms,
        float checkpoints in bf16). Packed linears quantize their input rows to int8 in
        blocks of 32 (as llama.cpp) and sum exact integer products per weight group (AMX
        tiles for batches where the CPU has AMX-INT8, AVX512-VNNI for few rows, or the
        same sums from vpmaddubsw without it, in 8-lane halves on AVX2); bf16 linears
        multiply bf16 activations into float32 sums (vdpbf16ps with AVX512-BF16 / AMX, else
        the same sums as float32 FMAs) (quant/packed_linear.py). Every instruction set
        gives the same bits (tests/test_cpu_kernels_isa.py). Norms, rotary, activation, cache writes and
        attention run as C++ kernels; the residual stream stays float32; the KV cache is
        bf16.
    dtype="auto" on other CPUs, or dtype="float32": the float32 reference path, token for
        token what transformers computes (the parity tests pin it).
    dtype="auto" on a GPU: bf16 (fp16 for fp16 checkpoints and AWQ), Triton kernels.
    dtype="bfloat16" / "float16" on a CPU: that dtype in eager torch.

`describe()` says what was picked; the engine logs it at load.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(slots=True)
class ComputePlan:
    dtype: torch.dtype  # activations (and dense weights, off the fast path)
    kv_cache_dtype: torch.dtype
    fused_cpu: bool  # the CPU fast path: C++ kernels and packed / bf16 weights
    attention_backend: str  # kernels.ops backend
    reason: str  # why this plan (for the log line)

    def describe(self) -> str:
        if self.fused_cpu:
            return (
                "CPU fast path: packed weights x int8 activations, bf16 weights x bf16 "
                f"activations, fused C++ kernels, {_name(self.kv_cache_dtype)} KV cache "
                f"({self.reason})"
            )
        return (
            f"{_name(self.dtype)} activations, {_name(self.kv_cache_dtype)} KV cache, "
            f"{self.attention_backend} attention ({self.reason})"
        )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_has_bf16() -> bool:
    """True when this CPU multiplies bf16 natively (AVX512-BF16 or AMX)."""
    return bool({"avx512_bf16", "amx_bf16"} & _cpu_flags())


def cpu_fast_path_isa() -> str | None:
    """The instruction set the C++ fast path runs on here, or None when it would be slow.

    AVX512-VNNI multiplies int8 activations by packed weights in one instruction per 64
    products; without it (Skylake-SP) vpmaddubsw gives the same integer sums; AMX-INT8
    (Sapphire Rapids and later) multiplies 16 rows by a weight group in one tile
    instruction, again the same sums (used for batches once Linux grants the tile state). AVX512-BF16 /
    AMX multiply bf16 (dense weights) natively; plain AVX-512 (F and BW, e.g. Cascade Lake)
    runs the same products as float32 FMAs: the same sums, bitwise.
    """
    flags = _cpu_flags()
    if not {"avx512f", "avx512bw"} <= flags:
        if {"avx2", "fma", "f16c"} <= flags:
            # Most laptops and desktops (Intel Core client parts, AMD Zen 1-3): 8-lane
            # forms of the same kernels, the same bits.
            return "AVX2 CPU: int8 sums from vpmaddubsw, bf16 as float32 FMAs"
        return None
    int8 = "VNNI" if "avx512_vnni" in flags else "no VNNI"
    if "amx_int8" in flags:
        int8 += ", AMX-INT8"
    bf16 = "BF16" if cpu_has_bf16() else "bf16 as float32 FMAs"
    return f"AVX-512 CPU: {int8}, {bf16}"


def choose_plan(
    device: torch.device,
    dtype: str,
    kv_cache_dtype: str,
    attention_backend: str,
    hf_config: dict[str, Any],
    checkpoint_dtype: str | None,
    tensor_parallel_size: int,
) -> ComputePlan:
    """The plan for an engine's settings on `device` (see the module docstring)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    if tensor_parallel_size > 1 and kv_cache_dtype != "auto":
        raise ValueError("kv_cache_dtype cannot be set with tensor parallelism (ranks use dtype)")
    is_awq = (hf_config.get("quantization_config") or {}).get("quant_method") == "awq"
    if device.type == "cpu" and dtype == "auto" and attention_backend in ("auto", "cpu"):
        fast, why = _fast_path_available(tensor_parallel_size)
        if fast:
            kv = torch.bfloat16 if kv_cache_dtype == "auto" else DTYPES[kv_cache_dtype]
            return ComputePlan(torch.float32, kv, True, "cpu", why)
        if attention_backend == "cpu":
            raise ValueError(f"attention_backend='cpu' needs the CPU fast path, which {why}")
        if is_awq and "AVX512" in torch.backends.cpu.get_cpu_capability():
            # torch's int4 matmul is vectorised for bf16 activations only (19.9 tok/s in
            # bf16 against 3.0 in float32 on an AVX512 CPU).
            plan_dtype, why = torch.bfloat16, f"AWQ in bf16: {why}"
        else:
            plan_dtype, why = torch.float32, f"float32: {why}"
    elif dtype != "auto":
        plan_dtype, why = DTYPES[dtype], "asked for"
    elif device.type == "cpu":
        plan_dtype, why = torch.float32, "asked for the torch attention backend"
    elif is_awq:
        plan_dtype, why = torch.float16, "AWQ on GPU"
    else:
        plan_dtype = torch.float16 if checkpoint_dtype == "float16" else torch.bfloat16
        why = "GPU default"
    if attention_backend == "cpu":
        raise ValueError("attention_backend='cpu' is the CPU fast path: it needs dtype='auto'")
    kv = plan_dtype if kv_cache_dtype == "auto" else DTYPES[kv_cache_dtype]
    return ComputePlan(plan_dtype, kv, False, attention_backend, why)


def _fast_path_available(tensor_parallel_size: int) -> tuple[bool, str]:
    if tensor_parallel_size > 1:
        return False, "tensor parallelism runs the float32 path"
    isa = cpu_fast_path_isa()
    if isa is None:
        return False, "the CPU has neither AVX-512 (F, BW) nor AVX2 with FMA and F16C"
    from ..kernels import cpu_ext

    if not cpu_ext.load():
        return False, f"the C++ kernels are unavailable ({cpu_ext.load_error()})"
    return True, isa
