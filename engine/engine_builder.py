"""Building an `LLMEngine`: load, size and wire its parts, once, before the first step.

`LLMEngine` is the step loop (engine/llm_engine.py); everything it runs with is made here,
each part from the ones before it:

    device, model source, config.json   -> ModelConfig, pooler, compute plan
    context: the setting, the model's, what the KV memory holds (max_model_len)
    tokenizer, EOS ids, generation defaults
    executor (the model, its linears from the plan's factory) -> step budget
    KV blocks (memory, then the disk tier) -> KV cache manager, scheduler, disk prefix cache
    sampler, draft verifier, ModelInfo, input processor, request-state builder

and the load line that says what was chosen. The builder is scratch: its results are the
`EngineParts`, which the engine holds.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .compute_plan import ComputePlan, choose_plan
from .config import ContextLengthError, EngineConfig, GiB
from .disk_prefix_cache import DiskPrefixCache
from .executor import LocalExecutor, build_executor
from .generation_config import generation_defaults, read_generation_config
from .heap import release_freed_memory
from .input_processor import InputProcessor
from .kv_cache_manager import KVCacheManager
from .kv_disk_tier import NO_KV_DISK, KVDiskPlan, kv_block_copier
from .kv_layout import KVLayout, describe_layout, plain_layout, windowed_layout
from .kv_sizing import ContextFit, check_blocks_hold_a_sequence, fit_cpu_context, kv_bytes_per_block
from .model_info import ModelInfo
from .model_loader import ModelSource, load_tokenizer, read_config, resolve_model
from .models.config import ModelConfig
from .models.layers import LinearFactory, dense_linear
from .pooling import PoolerConfig, read_pooler_config
from .pooling_step import model_tasks
from .prefill_cost import PrefillCost
from .request_state import RequestStateBuilder
from .sampler import Sampler
from .scheduler import Scheduler
from .spec_decode.ngram import NgramProposer
from .spec_decode.verifier import DraftVerifier
from .step_budget import default_batched_tokens, step_budget
from .swap_space import SwapPlan, describe_swap

logger = logging.getLogger(__name__)


@dataclass(eq=False, repr=False)
class EngineParts:
    """What an engine runs with, as built from its `EngineConfig` (LLMEngine's fields)."""

    config: EngineConfig
    device: torch.device
    model_name: str  # served_model_name, else the source's name
    model_folder: Path  # the Hugging Face folder the model was read from
    model_config: ModelConfig
    pooler: PoolerConfig  # an embedding model's pooling (read for every model)
    plan: ComputePlan  # dtype, KV dtype, attention backend, the CPU fast path or not
    dtype: torch.dtype
    max_model_len: int  # after fitting the KV memory
    tokenizer: Any
    eos_token_ids: tuple[int, ...]
    generation_defaults: dict[str, Any]  # generation_config.json < an Ollama Modelfile
    executor: LocalExecutor | Any  # or the tensor-parallel one (build_executor)
    model: torch.nn.Module  # this process's model (rank 0's shard under TP)
    vocab_size: int
    max_num_batched_tokens: int  # tokens per step
    num_blocks: int  # KV blocks of the pool: memory, then the disk tier
    kv_cache_bytes: int  # the KV blocks in memory
    kv_manager: KVCacheManager
    scheduler: Scheduler
    disk_cache: DiskPrefixCache | None  # prefix_cache_dir's second level
    sampler: Sampler
    verifier: DraftVerifier
    info: ModelInfo  # the facts front ends read
    inputs: InputProcessor  # validates requests on callers' threads
    request_states: RequestStateBuilder  # the engine thread's live state per request
    load_time: float  # seconds to build


class EngineBuilder:
    """Builds the parts of one engine from its config (`EngineBuilder(config).build()`)."""

    def __init__(self, config: EngineConfig):
        self.config = config

    def build(self) -> EngineParts:
        """Every part, in the order each needs the last; logs the load line at the end."""
        started = time.perf_counter()
        source, hf_config = self._read_model()
        self.max_model_len = self._resolve_max_model_len(source.context_length)
        self.kv_layout = self._choose_kv_layout()
        bytes_per_block = kv_bytes_per_block(
            self.model_config,
            self.config.block_size,
            self.plan.kv_cache_dtype,
            self.config.tensor_parallel_size,
            num_slots=self.kv_layout.num_slots,
        )
        kv_disk = self._kv_disk_plan(bytes_per_block)
        fit = self._fit_context(bytes_per_block, kv_disk.blocks)
        self._read_tokenizer(source)
        self._load_weights(source, hf_config)
        memory_blocks = self._determine_num_blocks(
            self.config.block_size, bytes_per_block, fit, kv_disk
        )
        swap = self._make_kv_cache(source, memory_blocks, bytes_per_block, kv_disk)
        self._wire_requests()
        self.load_time = time.perf_counter() - started
        if not self.model_config.causal:
            logger.info("%s is an embedding model: %s", self.model_name, self.pooler.describe())
        logger.info(
            "loaded %s (%s; %s, %s) in %.1fs: %d KV blocks of %d tokens (%.2f GiB)%s%s, "
            "max_model_len %d%s%s",
            self.model_name,
            self.plan.describe(),
            self.model.stack_status() if hasattr(self.model, "stack_status") else "",
            self.device,
            self.load_time,
            memory_blocks,
            self.config.block_size,
            self.kv_cache_bytes / GiB,
            describe_layout(self.kv_layout),
            kv_disk.describe(bytes_per_block),
            self.max_model_len,
            fit.note,
            describe_swap(swap, bytes_per_block),
        )
        return self._parts()

    # ------------------------------------------------------------ the stages
    def _read_model(self) -> tuple[ModelSource, dict[str, Any]]:
        """The device, the model's source and config, its pooler, the compute plan."""
        config = self.config
        self.device = _resolve_device(config.device)
        source = resolve_model(config.model, config.revision, config.download_dir)
        self.model_name = config.served_model_name or source.name
        self.model_folder = source.folder
        hf_config = read_config(source.folder)
        self.model_config = ModelConfig.from_hf_dict(hf_config)
        self.pooler = read_pooler_config(
            source.folder, hf_config, self.model_config.causal, config.pooler_config
        )
        self.plan = choose_plan(
            self.device,
            config.dtype,
            config.kv_cache_dtype,
            config.attention_backend,
            hf_config,
            self.model_config.torch_dtype,
            config.tensor_parallel_size,
        )
        self._check_num_threads()
        self.dtype = self.plan.dtype
        return source, hf_config

    def _read_tokenizer(self, source: ModelSource) -> None:
        """The tokenizer, the EOS ids and the generation defaults."""
        config = self.config
        self.tokenizer = load_tokenizer(config.tokenizer or source.folder, config.revision)
        # Parsing a large vocabulary's tokenizer.json peaks at hundreds of MiB (Gemma 3's:
        # ~580): hand those pages back before the weights load, so the peaks do not add up.
        release_freed_memory()
        generation_config = read_generation_config(source.folder)
        self.eos_token_ids = self._eos_token_ids(generation_config)
        self.generation_defaults = {
            **generation_defaults(generation_config, self.model_name),
            **source.sampling_defaults,  # an Ollama Modelfile's PARAMETERs
        }

    def _load_weights(self, source: ModelSource, hf_config: dict[str, Any]) -> None:
        """The executor and its model (linears from the plan's factory); the step budget."""
        self.executor = build_executor(
            self.config,
            source.folder,
            hf_config,
            self.model_config,
            self.dtype,
            self.device,
            self.max_model_len,
            self._linear_factory(hf_config, source.folder),
            self.plan,
        )
        self.model = self.executor.model  # this process's model (rank 0's shard under TP)
        self.vocab_size = self.model_config.vocab_size
        encoder = not self.model_config.causal
        self.max_num_batched_tokens = step_budget(
            self.config, self.device, self.max_model_len, encoder
        )

    def _make_kv_cache(
        self, source: ModelSource, memory_blocks: int, bytes_per_block: int, kv_disk: KVDiskPlan
    ) -> SwapPlan:
        """The KV block pool and its manager, the scheduler over them, the KV tensors on
        every rank, the disk prefix cache; returns the swap space's plan."""
        config = self.config
        self.num_blocks = memory_blocks + kv_disk.blocks  # the pool's: memory, then disk
        swap = SwapPlan.from_sizes(
            config.swap_space, config.swap_disk_space, config.swap_dir, bytes_per_block
        )
        self.kv_cache_bytes = memory_blocks * bytes_per_block  # in memory
        self.kv_manager = KVCacheManager(
            self.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            model_identity=source.origin,
            memory_blocks=memory_blocks,
            group_windows=self.kv_layout.group_windows,
        )
        self.scheduler = Scheduler(
            self.kv_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            policy=config.scheduling_policy,
            swap=swap,
            proposer=NgramProposer(config.speculation) if config.speculation else None,
            encoder_only=not self.model_config.causal,
            prefill_cost=(
                PrefillCost.for_model(self.model_config, self.device.type)
                if self.model_config.causal
                else None
            ),
        )
        self.executor.allocate(self.num_blocks, config.block_size, swap, kv_disk, self.kv_layout)
        if kv_disk.blocks:  # cold cached blocks move into the file instead of being dropped
            self.kv_manager.pool.copy_blocks = kv_block_copier(self.executor.kv_caches)
        self.disk_cache = None
        if config.prefix_cache_dir is not None:
            self.disk_cache = DiskPrefixCache.create(
                config.prefix_cache_dir,
                int(config.prefix_cache_max_gib * GiB),
                self.kv_manager,
                self.executor.kv_caches,
                folder=source.folder,
                model_name=self.model_name,
                model=self.model,
                model_config=self.model_config,
                plan=self.plan,
                device=self.device,
            )
        return swap

    def _wire_requests(self) -> None:
        """The sampler and draft verifier, the facts front ends read (ModelInfo), the
        callers' input processor and the engine thread's request-state builder."""
        config = self.config
        self.sampler = Sampler(self.vocab_size, self.device, seed=config.seed)
        self.verifier = DraftVerifier(self.sampler)
        self.info = ModelInfo(
            name=self.model_name,
            architecture=self.model_config.architecture,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
            block_size=config.block_size,
            generation_defaults=dict(self.generation_defaults),
            tasks=model_tasks(
                config.runner, not self.model_config.causal, config.tensor_parallel_size
            ),
            embedding_size=self.pooler.embedding_size(self.model_config.hidden_size),
            pooler=self.pooler,
        )
        inputs = self.inputs = InputProcessor(config, self.tokenizer, self.info)
        # The closure holds the input processor, not the builder (the engine must not keep
        # the builder, and what it refers to, alive).
        self.request_states = RequestStateBuilder(
            self.tokenizer, self.device, self.pooler, lambda: inputs.structured_outputs
        )

    def _parts(self) -> EngineParts:
        return EngineParts(
            config=self.config,
            device=self.device,
            model_name=self.model_name,
            model_folder=self.model_folder,
            model_config=self.model_config,
            pooler=self.pooler,
            plan=self.plan,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            tokenizer=self.tokenizer,
            eos_token_ids=self.eos_token_ids,
            generation_defaults=self.generation_defaults,
            executor=self.executor,
            model=self.model,
            vocab_size=self.vocab_size,
            max_num_batched_tokens=self.max_num_batched_tokens,
            num_blocks=self.num_blocks,
            kv_cache_bytes=self.kv_cache_bytes,
            kv_manager=self.kv_manager,
            scheduler=self.scheduler,
            disk_cache=self.disk_cache,
            sampler=self.sampler,
            verifier=self.verifier,
            info=self.info,
            inputs=self.inputs,
            request_states=self.request_states,
            load_time=self.load_time,
        )

    # ------------------------------------------------------------ model setup
    def _check_num_threads(self) -> None:
        """num_threads sets the threads of the CPU fast path's kernels: on a GPU the CPU
        does no such work (noted); a CPU path on torch's threads refuses it."""
        threads = self.config.num_threads
        if threads is None or self.plan.fused_cpu:
            return
        if self.device.type != "cpu":
            logger.warning(
                "num_threads=%d has no effect: the model runs on %s", threads, self.device
            )
            return
        raise ValueError(
            f"num_threads={threads} sets the threads of the CPU fast path's kernels, and "
            f"this engine runs {self.plan.describe()} on torch's threads: call "
            "torch.set_num_threads(n) instead"
        )

    def _resolve_max_model_len(self, model_default: int | None) -> int:
        """The setting, else the model's own (an Ollama num_ctx), else its context length
        (which `_fit_context` may lower to what the KV cache holds)."""
        limit = self.model_config.max_position_embeddings
        if self.config.max_model_len is None:
            # sentence-transformers' max_seq_length: the length the model was tuned for
            # (all-MiniLM-L6-v2: 256 of its 512 positions).
            trained = self.pooler.max_seq_length if not self.model_config.causal else None
            return min(limit, trained or limit, model_default or limit)
        if self.config.max_model_len > limit and (
            not self.model_config.rope_scaling or not self.model_config.causal
        ):
            raise ContextLengthError(self.config.max_model_len, limit)
        return self.config.max_model_len

    def _choose_kv_layout(self) -> KVLayout:
        """Sliding-window layers free what left their window (engine/kv_layout.py) unless
        the model has none that ever would, or the engine keeps one table per request:
        disable_hybrid_kv_cache_manager, tensor parallelism (the ranks' step messages
        carry one table) or a disk prefix cache (its files hold every layer of a block)."""
        cfg, config = self.model_config, self.config
        windows = [cfg.layer_sliding_window(layer) for layer in range(cfg.num_layers)]
        plain = plain_layout(cfg.num_layers)
        if not cfg.causal or not any(window and window < self.max_model_len for window in windows):
            return plain
        for setting, keeps_all in (
            ("disable_hybrid_kv_cache_manager", config.disable_hybrid_kv_cache_manager),
            ("tensor_parallel_size > 1", config.tensor_parallel_size > 1),
            ("prefix_cache_dir", config.prefix_cache_dir is not None),
        ):
            if keeps_all:
                logger.info("%s: sliding-window layers keep every token's keys", setting)
                return plain
        return windowed_layout(windows)

    def _sequence_blocks(self, num_tokens: int) -> int:
        """Blocks one sequence of `num_tokens` holds at most in this engine's layout."""
        return self.kv_layout.sequence_blocks(
            num_tokens, self.config.block_size, self._step_tokens_bound()
        )

    def _tokens_held(self, num_blocks: int) -> int:
        """The longest sequence `num_blocks` blocks hold in this engine's layout."""
        return self.kv_layout.max_sequence_tokens(
            num_blocks, self.config.block_size, self._step_tokens_bound()
        )

    def _step_tokens_bound(self) -> int:
        """The most tokens one request adds in a step: the step's budget and its drafts."""
        budget = self.config.max_num_batched_tokens
        if budget is None:
            budget = (
                default_batched_tokens(self.device)
                if self.config.enable_chunked_prefill
                else self.max_model_len
            )
        speculation = self.config.speculation
        return budget + (speculation.num_speculative_tokens if speculation else 0)

    def _kv_disk_plan(self, bytes_per_block: int) -> KVDiskPlan:
        """The KV disk tier (kv_disk_space): a CPU decoder's, in one process."""
        if not self.config.kv_disk_space:
            return NO_KV_DISK
        if self.device.type != "cpu" or not self.model_config.causal:
            raise ValueError(
                f"kv_disk_space is for a decoder's KV cache on a CPU; this engine runs "
                f"{'an encoder' if not self.model_config.causal else 'on ' + str(self.device)}"
            )
        return KVDiskPlan.from_size(
            self.config.kv_disk_space, self.config.swap_dir, bytes_per_block
        )

    def _fit_context(self, bytes_per_block: int, disk_blocks: int) -> ContextFit:
        """A CPU engine's KV budget, with max_model_len lowered to it (and the KV disk
        tier's blocks) when not set: before the model is built, as rotary tables and
        long-context scaling follow max_model_len."""
        config = self.config
        if self.device.type != "cpu" or not self.model_config.causal or config.num_kv_blocks:
            return ContextFit(self.max_model_len, 0)
        if bytes_per_block <= 0:  # more tensor-parallel ranks than KV heads: refused with
            return ContextFit(self.max_model_len, 0)  # its own message when ranks are built
        fit = fit_cpu_context(
            self.max_model_len,
            config.max_model_len is None,
            config.kv_cache_memory,
            bytes_per_block,
            config.block_size,
            disk_blocks=disk_blocks,
            sequence_blocks=self._sequence_blocks,
            tokens_held=self._tokens_held,
        )
        self.max_model_len = fit.max_model_len
        return fit

    def _eos_token_ids(self, generation_config: dict[str, Any]) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        eos = generation_config.get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
        return tuple(sorted(ids))

    def _linear_factory(self, hf_config: dict[str, Any], folder: Path) -> LinearFactory:
        method = (hf_config.get("quantization_config") or {}).get("quant_method")
        if method in (None, "gguf"):  # GGUF blocks reach the linears as they are
            if self.config.quantization == "awq":
                raise ValueError(
                    "quantization='awq' needs an AWQ checkpoint (quantization_config.quant_method "
                    "'awq' in config.json); make one with `pagedllm quantize`"
                )
            if self.plan.fused_cpu:
                from ..quant.packed_linear import amx_bf16_available, encoder_linear, packed_linear

                if self.model_config.causal:
                    return packed_linear
                if amx_bf16_available():
                    logger.info("encoder linears: dense weights on AMX-BF16 tiles")
                return encoder_linear
            return dense_linear
        if method == "awq":
            from ..quant.awq_linear import awq_linear_factory

            kernel = "packed" if self.plan.fused_cpu else "auto"
            return awq_linear_factory(
                hf_config["quantization_config"], folder, kernel, dense_linear=dense_linear
            )
        raise ValueError(f"unsupported quantization method {method!r} (pagedllm runs AWQ)")

    def _determine_num_blocks(
        self, block_size: int, per_block: int, fit: ContextFit, kv_disk: KVDiskPlan
    ) -> int:
        """KV blocks in memory; with the disk tier's, they must hold one sequence."""
        if not self.model_config.causal:
            return 1  # an encoder keeps nothing between steps (the pool needs one block)
        if self.config.num_kv_blocks is not None:
            num_blocks = self.config.num_kv_blocks
        elif self.device.type == "cuda":
            tokens = min(self.max_num_batched_tokens, self.max_model_len)
            num_blocks = self.executor.profile_num_blocks(per_block, tokens, block_size)
        else:
            num_blocks = fit.kv_budget_bytes // per_block
        holds = self._tokens_held(num_blocks + kv_disk.blocks)
        if self.config.max_model_len is None and 0 < holds < self.max_model_len:
            # Not set: as long as the cache holds (vLLM's estimated maximum model length).
            logger.warning(
                "max_model_len lowered from the model's %d to %d tokens: what the KV cache holds",
                self.max_model_len,
                holds,
            )
            self.max_model_len = holds
        check_blocks_hold_a_sequence(
            num_blocks + kv_disk.blocks,
            block_size,
            self.max_model_len,
            self._sequence_blocks(self.max_model_len),
        )
        return int(num_blocks)


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for but CUDA is not available")
    return resolved
