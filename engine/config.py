"""Engine settings: one dataclass, checked once, named as vLLM names them."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from .cpu_share import DEFAULT_EMBEDDING_CPU_SHARE
from .spec_decode.config import SpeculativeConfig

GiB = 1 << 30

# Accepted for drop-in compatibility with vLLM/LangChain arguments, with no effect here.
_ACCEPTED_AND_IGNORED = {"trust_remote_code", "enforce_eager", "disable_custom_all_reduce"}
# Fields that do not change what an engine computes (see EngineConfig.cache_key).
_NO_EFFECT_ON_THE_ENGINE = (
    "disable_log_stats",
    "log_stats_interval",
    "trust_remote_code",
    "enforce_eager",
)


def _auto_device() -> str:
    """The device "auto" resolves to (as the engine resolves it)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class ContextLengthError(ValueError):
    """max_model_len is longer than the model's context; `requested` and `limit` let a
    front end name the setting the user gave it (num_ctx, context_window, n_ctx)."""

    def __init__(self, requested: int, limit: int, message: str | None = None):
        super().__init__(
            message
            or f"max_model_len {requested} exceeds the model's context length {limit} "
            "(max_position_embeddings)"
        )
        self.requested = requested
        self.limit = limit


@dataclass(slots=True)
class EngineConfig:
    """Everything that decides how an engine is built.

    Two configs that compare equal build interchangeable engines; the integrations use
    `cache_key()` to share one engine between every wrapper with the same settings.
    """

    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct GGUF
    tokenizer: str | None = None
    revision: str | None = None
    download_dir: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    quantization: str | None = None  # None | "awq"
    max_model_len: int | None = None  # default: the model's context length (kv_sizing.py)
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = (
        None  # default chunked: 512 CPU, 2048 GPU; else max_model_len
    )
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    # vLLM's switch of the same name: True keeps one block table per request and every
    # sliding-window layer's keys for the whole sequence. By default a model with sliding
    # layers (Gemma 2/3, Mistral) frees what left their window (engine/kv_layout.py).
    disable_hybrid_kv_cache_manager: bool = False
    kv_cache_memory: int | None = None  # bytes of KV cache; CPU default: kv_sizing.py
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None  # overrides both budgets above (tests)
    swap_space: float = 0.0  # GiB of host memory for swapped-out KV blocks; 0 = recompute
    # GiB of disk for what host swap space cannot hold (engine/swap_space.py), in a file
    # (reserved at startup, unnamed, removed with the process) in swap_dir; default folder:
    # pagedllm's cache folder (~/.cache/pagedllm/swap).
    swap_disk_space: float = 0.0
    # GiB of KV blocks past kv_cache_memory in a file the kernel pages (CPU, one process;
    # engine/kv_disk_tier.py): one sequence, or many, may then need more KV than memory.
    # Its file is made like the swap disk tier's, in swap_dir.
    kv_disk_space: float = 0.0
    swap_dir: str | None = None
    # A directory where prefix-cache blocks outlive the process (engine/disk_prefix_cache.py)
    prefix_cache_dir: str | None = None
    prefix_cache_max_gib: float = 8.0  # size limit of that directory (all models in it)
    scheduling_policy: Any = "fcfs"  # "fcfs" | "priority" | "short_first" | a SchedulingPolicy
    # auto (triton on CUDA; on CPU the fast path's C++ kernels, else torch) | torch | triton | cpu
    attention_backend: str = "auto"
    kv_cache_dtype: str = (
        "auto"  # auto (bf16 on the CPU fast path, else dtype) | float32 | bfloat16
    )
    seed: int = 0
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1  # engine replicas (needs distributed_executor_backend="ray")
    distributed_executor_backend: str | None = None  # None | "mp" | "ray" (replicas on Ray)
    served_model_name: str | None = None
    disable_log_stats: bool = False
    log_stats_interval: float = 5.0
    max_logprobs: int = 20
    # Speculative decoding by prompt lookup, as vLLM spells it: {"method": "ngram",
    # "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2} (a dict,
    # its JSON text or a SpeculativeConfig; becomes a SpeculativeConfig). None: off.
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None
    trust_remote_code: bool = False
    enforce_eager: bool = True
    # CPU threads of the fast path's kernels for this engine (llama.cpp's n_threads); None:
    # torch's thread count. Other paths run on torch's threads (torch.set_num_threads).
    num_threads: int | None = None
    # auto | generate | pooling (vLLM's names): what the engine serves. auto: an encoder
    # embeds, a decoder generates and embeds (engine/pooling_step.py's model_tasks).
    runner: str = "auto"
    # Embeddings: {"pooling_type": "mean" | "cls" | "last", "normalize": bool} over what
    # the model's sentence-transformers files say (engine/pooling.py). None: theirs.
    pooler_config: dict[str, Any] | None = None
    # An embedding-only engine's share of the time while a generation engine of this
    # process has requests in flight (engine/cpu_share.py); 1.0: never yield.
    embedding_cpu_share: float = DEFAULT_EMBEDDING_CPU_SHARE

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.from_value(self.speculative_config)
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "half", "float"):
            raise ValueError(
                f"dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}"
            )
        if self.block_size <= 0 or self.block_size % 8:
            raise ValueError(f"block_size must be a positive multiple of 8, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.quantization not in (None, "awq"):
            raise ValueError(f"quantization must be None or 'awq', got {self.quantization!r}")
        if self.attention_backend not in ("auto", "torch", "triton", "cpu"):
            raise ValueError(
                f"attention_backend must be auto, torch, triton or cpu, got {self.attention_backend!r}"
            )
        if self.swap_space < 0:
            raise ValueError("swap_space must be >= 0 GiB")
        if self.swap_disk_space < 0:
            raise ValueError("swap_disk_space must be >= 0 GiB")
        if self.kv_disk_space < 0:
            raise ValueError("kv_disk_space must be >= 0 GiB")
        if self.swap_dir is not None and not (self.swap_disk_space or self.kv_disk_space):
            raise ValueError(
                "swap_dir is set but swap_disk_space and kv_disk_space are 0: it is the "
                "folder of their files; set one of them too, or no swap_dir"
            )
        if self.kv_disk_space and self.tensor_parallel_size > 1:
            raise ValueError(
                "kv_disk_space is not supported with tensor_parallel_size > 1 (the disk tier "
                "is one process's KV cache)"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        if self.num_threads is not None:
            if isinstance(self.num_threads, bool) or not isinstance(self.num_threads, int):
                raise ValueError(f"num_threads must be an integer, got {self.num_threads!r}")
            if self.num_threads < 1:
                raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
            if self.tensor_parallel_size > 1:
                raise ValueError(
                    "num_threads is not supported with tensor_parallel_size > 1 (each rank "
                    "runs on torch's threads); leave one of them unset"
                )
        self._check_prefix_cache_dir()
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"runner must be auto, generate or pooling, got {self.runner!r}")
        if not 0.0 < self.embedding_cpu_share <= 1.0:
            raise ValueError(
                f"embedding_cpu_share must be in (0, 1], got {self.embedding_cpu_share!r}"
            )
        if self.pooler_config is not None and not isinstance(self.pooler_config, dict):
            raise ValueError(
                "pooler_config must be a dict such as {'pooling_type': 'mean', 'normalize': "
                f"True}}, got {type(self.pooler_config).__name__}"
            )
        if self.data_parallel_size < 1:
            raise ValueError("data_parallel_size must be >= 1")
        if self.distributed_executor_backend not in (None, "mp", "ray"):
            raise ValueError(
                "distributed_executor_backend must be None, 'mp' or 'ray', got "
                f"{self.distributed_executor_backend!r}"
            )
        if self.data_parallel_size > 1 and self.distributed_executor_backend != "ray":
            raise ValueError(
                f"data_parallel_size {self.data_parallel_size} runs replicas on Ray: also set "
                "distributed_executor_backend='ray' (and pip install ray)"
            )

    def _check_prefix_cache_dir(self) -> None:
        if not self.prefix_cache_max_gib > 0:
            raise ValueError(f"prefix_cache_max_gib must be > 0, got {self.prefix_cache_max_gib}")
        if self.prefix_cache_dir is None:
            return
        if not isinstance(self.prefix_cache_dir, str | os.PathLike) or not str(
            self.prefix_cache_dir
        ):
            raise ValueError(
                f"prefix_cache_dir must be a directory path, got {self.prefix_cache_dir!r}"
            )
        self.prefix_cache_dir = os.path.abspath(
            os.path.expanduser(os.fspath(self.prefix_cache_dir))
        )
        if not self.enable_prefix_caching:
            raise ValueError(
                "prefix_cache_dir keeps prefix-cache blocks on disk: it needs "
                "enable_prefix_caching=True"
            )
        if self.tensor_parallel_size > 1:
            raise ValueError(
                "prefix_cache_dir is not supported with tensor_parallel_size > 1 (each rank "
                "holds a slice of every block in another process); leave one of them unset"
            )

    @property
    def speculation(self) -> SpeculativeConfig | None:
        """speculative_config as checked in __post_init__ (None: no speculative decoding)."""
        spec = self.speculative_config
        return spec if isinstance(spec, SpeculativeConfig) else None

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from keyword arguments; an unknown name is a ValueError that lists the known."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known - _ACCEPTED_AND_IGNORED)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
        return cls(**{k: v for k, v in kwargs.items() if k in known})

    def cache_key(self) -> tuple:
        """A hashable identity: equal keys mean one engine can serve both. Settings that
        cannot change the engine are left out, so they never start a second one (a second
        copy of the weights): the log settings; trust_remote_code (the engine runs no code
        from a model repository: it implements each family itself) and enforce_eager (it
        has no CUDA graphs); and device "auto" counts as the device it resolves to."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in _NO_EFFECT_ON_THE_ENGINE:
            values.pop(name)
        if values["device"] == "auto":
            values["device"] = _auto_device()
        return tuple((name, repr(value)) for name, value in values.items())
