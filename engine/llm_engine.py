"""The synchronous engine core: add requests, `step()`, read outputs.

It is not thread-safe by design: exactly one thread (the `AsyncEngine`'s engine thread)
calls `add_group`, `abort_request` and `step`. `process_inputs` is the exception: it
only tokenizes and validates, so callers run it on their own thread and a bad request
fails there, before it reaches the engine.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from .compute_plan import choose_plan
from .config import EngineConfig, GiB
from .detokenizer import IncrementalDetokenizer
from .executor import build_executor
from .kv_cache_manager import KVCacheManager
from .metrics import EngineCounters, IterationStats, LoggingStatLogger, SchedulerStats, StatLogger
from .model_loader import load_tokenizer, read_config, resolve_model
from .model_runner import kv_bytes_per_block
from .models.config import ModelConfig
from .models.layers import LinearFactory, dense_linear
from .output_processor import RequestGroup, finished_request_stats, make_request_output
from .outputs import RequestOutput
from .request import Request, RequestStatus
from .sampler import Sampler
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .tool_formats import ToolCallFormat, tool_format_for

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict[str, Any]
_DEFAULT_CPU_KV_BYTES = 1 * GiB
_DEFAULT_MAX_MODEL_LEN_CAP = 8192


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        started = time.perf_counter()
        self.device = _resolve_device(config.device)
        source = resolve_model(config.model, config.revision, config.download_dir)
        self.model_name = config.served_model_name or source.name
        self.model_folder = source.folder
        hf_config = read_config(source.folder)
        self.model_config = ModelConfig.from_hf_dict(hf_config)
        self.plan = choose_plan(
            self.device,
            config.dtype,
            config.kv_cache_dtype,
            config.attention_backend,
            hf_config,
            self.model_config.torch_dtype,
            config.tensor_parallel_size,
        )
        self.dtype = self.plan.dtype
        self.max_model_len = self._resolve_max_model_len()
        self.tokenizer = load_tokenizer(config.tokenizer or source.folder, config.revision)
        self.eos_token_ids = self._eos_token_ids(source.folder)
        self.executor = build_executor(
            config,
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

        block_size = config.block_size
        if config.max_num_batched_tokens is not None:
            self.max_num_batched_tokens = config.max_num_batched_tokens
        else:
            self.max_num_batched_tokens = (
                2048 if config.enable_chunked_prefill else self.max_model_len
            )
        if not config.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len}) so every prompt fits in a step"
            )
        self.num_blocks = self._determine_num_blocks(block_size)
        bytes_per_block = kv_bytes_per_block(self.model, block_size, self.plan.kv_cache_dtype)
        num_swap_blocks = int(config.swap_space * GiB) // bytes_per_block
        self.kv_cache_bytes = self.num_blocks * bytes_per_block
        self.kv_manager = KVCacheManager(
            self.num_blocks, block_size, config.enable_prefix_caching, model_identity=source.origin
        )
        self.scheduler = Scheduler(
            self.kv_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            policy=config.scheduling_policy,
            num_swap_blocks=num_swap_blocks,
        )
        self.executor.allocate(self.num_blocks, block_size, num_swap_blocks)
        self.sampler = Sampler(self.vocab_size, self.device, seed=config.seed)
        self.groups: dict[str, RequestGroup] = {}
        self.counters = EngineCounters()
        self.stat_loggers: list[StatLogger] = [self.counters]
        if not config.disable_log_stats:
            self.stat_loggers.append(LoggingStatLogger(config.log_stats_interval))
        self._structured = None
        self._structured_lock = threading.Lock()
        self.load_time = time.perf_counter() - started
        logger.info(
            "loaded %s (%s, %s) in %.1fs: %d KV blocks of %d tokens (%.2f GiB), max_model_len %d",
            self.model_name,
            self.plan.describe(),
            self.device,
            self.load_time,
            self.num_blocks,
            block_size,
            self.kv_cache_bytes / GiB,
            self.max_model_len,
        )

    # ------------------------------------------------------------ model setup
    def _resolve_max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        if self.config.max_model_len is None:
            return min(limit, _DEFAULT_MAX_MODEL_LEN_CAP)
        if self.config.max_model_len > limit and not self.model_config.rope_scaling:
            raise ValueError(
                f"max_model_len {self.config.max_model_len} exceeds the model's context "
                f"length {limit} (max_position_embeddings)"
            )
        return self.config.max_model_len

    def _eos_token_ids(self, folder: Path) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        generation_config = folder / "generation_config.json"
        if generation_config.exists():
            eos = json.loads(generation_config.read_text()).get("eos_token_id")
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
                from ..quant.packed_linear import packed_linear

                return packed_linear
            return dense_linear
        if method == "awq":
            from ..quant.awq_linear import awq_linear_factory

            kernel = "packed" if self.plan.fused_cpu else "auto"
            return awq_linear_factory(hf_config["quantization_config"], folder, kernel)
        raise ValueError(f"unsupported quantization method {method!r} (pagedllm runs AWQ)")

    def _determine_num_blocks(self, block_size: int) -> int:
        per_block = kv_bytes_per_block(self.model, block_size, self.plan.kv_cache_dtype)
        if self.config.num_kv_blocks is not None:
            num_blocks = self.config.num_kv_blocks
        elif self.device.type == "cuda":
            tokens = min(self.max_num_batched_tokens, self.max_model_len)
            num_blocks = self.executor.profile_num_blocks(per_block, tokens, block_size)
        else:
            budget = self.config.kv_cache_memory or _DEFAULT_CPU_KV_BYTES
            num_blocks = budget // per_block
        min_blocks = -(-self.max_model_len // block_size)
        if num_blocks < min_blocks:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks ({num_blocks * block_size} tokens) but one "
                f"sequence of max_model_len {self.max_model_len} needs {min_blocks}; raise "
                "kv_cache_memory / gpu_memory_utilization or lower max_model_len"
            )
        return int(num_blocks)

    # ------------------------------------------------------------------ inputs
    def process_inputs(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> RequestGroup:
        """Tokenize and validate one request (any thread); raises ValueError when it is bad."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"sampling params must be a SamplingParams, got {type(params).__name__}"
            )
        text, token_ids = self._tokenize(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len}; "
                "the prompt and at least one generated token must fit"
            )
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"token ids {bad[:5]} are outside the vocabulary (0..{self.vocab_size - 1})"
            )
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(
                f"logprobs {params.logprobs} exceeds max_logprobs {self.config.max_logprobs}"
            )
        params = params.clone(_eos_token_ids=self.eos_token_ids)
        compiled = None
        if params.structured_outputs is not None:
            compiled = self.structured_outputs.compile(params.structured_outputs)
        request_id = request_id or uuid.uuid4().hex
        now = time.monotonic()
        children = []
        for index in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            seed = None if params.seed is None else params.seed + index
            generator = None
            if seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(seed)
            child = Request(
                request_id=child_id,
                prompt_token_ids=token_ids,
                sampling_params=params,
                priority=priority,
                cache_salt=cache_salt,
                arrival_time=now,
                parent_id=request_id,
                sample_index=index,
                generator=generator,
                logprobs=[] if params.logprobs is not None else None,
            )
            child.detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                token_ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
                stop=list(params.stop or []),
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
            if compiled is not None:
                child.structured = self.structured_outputs.new_matcher(compiled)
            children.append(child)
        return RequestGroup(
            request_id, text, token_ids, params, children, now, sent=[(0, 0)] * params.n
        )

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty: give at least one token")
            return prompt, list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, list | tuple) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(
            f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}"
        )

    @property
    def structured_outputs(self):
        # Created on first use, from whichever caller thread submits a constrained request.
        with self._structured_lock:
            if self._structured is None:
                from .structured_outputs import StructuredOutputManager

                self._structured = StructuredOutputManager(
                    self.tokenizer, self.vocab_size, stop_token_ids=self.eos_token_ids
                )
            return self._structured

    # ----------------------------------------------------------- request flow
    def add_group(self, group: RequestGroup) -> None:
        if group.request_id in self.groups:
            raise ValueError(f"request id {group.request_id!r} is already running")
        self.groups[group.request_id] = group
        for child in group.children:
            self.scheduler.add_request(child)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request now; its blocks are freed. Returns its final output (or None)."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        for child in group.children:
            self.scheduler.finish_request(child, RequestStatus.FINISHED_ABORTED)
        return self._make_output(group)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample, and return the outputs of requests that changed."""
        out = self.scheduler.schedule()
        iteration = IterationStats(
            num_batched_tokens=out.num_batched_tokens, num_seqs=len(out.scheduled)
        )
        touched: dict[str, RequestGroup] = {}
        if not out.is_empty:
            self._run(out, iteration, touched)
        outputs = []
        for group in touched.values():
            output = self._make_output(group)
            if output is not None:
                outputs.append(output)
            if group.finished:
                self.groups.pop(group.request_id, None)
                self._record_finished(group, iteration)
        self._log_stats(iteration)
        return outputs

    def _run(self, out: SchedulerOutput, iteration: IterationStats, touched: dict) -> None:
        """execute -> sample -> update, for one scheduled step."""
        block_ids = [
            self.kv_manager.get_block_ids(item.request.request_id) for item in out.scheduled
        ]
        try:
            logits, sampled_rows = self.executor.execute(out, block_ids)
            sampled = self.sampler(logits, [out.scheduled[i].request for i in sampled_rows])
        except Exception as error:  # the whole step failed: fail its requests, keep serving
            logger.exception(
                "engine step failed; failing the %d requests in it", len(out.scheduled)
            )
            for item in out.scheduled:
                self._fail(item.request, f"{type(error).__name__}: {error}", touched, uncache=True)
            return
        tokens: list[list[int]] = [[] for _ in out.scheduled]
        logprobs: list[list] = [[] for _ in out.scheduled]
        for row, index in enumerate(sampled_rows):
            tokens[index] = [sampled.token_ids[row]]
            logprobs[index] = [sampled.logprobs[row]]
        update = self.scheduler.update_from_output(out, tokens, logprobs, iteration)
        for request, message in update.failed:
            self._fail(request, message, touched)
        for request in update.changed:
            group = self.groups.get(request.parent_id or request.request_id)
            if group is not None:
                touched[group.request_id] = group

    def _fail(self, request: Request, message: str, touched: dict, uncache: bool = False) -> None:
        request.error = message
        self.scheduler.finish_request(request, RequestStatus.FINISHED_ERROR, uncache=uncache)
        group = self.groups.get(request.parent_id or request.request_id)
        if group is not None:
            group.error = message
            for sibling in group.children:
                self.scheduler.finish_request(
                    sibling, RequestStatus.FINISHED_ERROR, uncache=uncache
                )
            touched[group.request_id] = group

    # ----------------------------------------------------------------- outputs
    def _make_output(self, group: RequestGroup) -> RequestOutput | None:
        return make_request_output(group)

    def _record_finished(self, group: RequestGroup, iteration: IterationStats) -> None:
        iteration.finished.extend(finished_request_stats(group))

    def scheduler_stats(self) -> SchedulerStats:
        running, kv, block_size = self.scheduler.running, self.kv_manager, self.config.block_size
        return SchedulerStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv_manager.usage,
            prefix_cache_queries=self.kv_manager.prefix_cache_queries,
            prefix_cache_hits=self.kv_manager.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            kv_tokens_held=sum(r.num_computed_tokens for r in running),
            kv_slots_reserved=block_size * sum(kv.num_blocks_of(r.request_id) for r in running),
        )

    def _log_stats(self, iteration: IterationStats) -> None:
        stats = self.scheduler_stats()
        for stat_logger in self.stat_loggers:
            stat_logger.record(stats, iteration)

    def reset_prefix_cache(self) -> bool:
        return self.kv_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        """Release what outlives the object: the tensor-parallel ranks, if any."""
        self.executor.shutdown()

    @property
    def tool_format(self) -> ToolCallFormat:
        """The tool-call markup this model was trained on (chosen once, from its chat
        template, else its architecture): what front ends render, force and parse."""
        chosen = getattr(self, "_tool_format", None)
        if chosen is None:
            architecture = getattr(getattr(self, "model_config", None), "architecture", None)
            chosen = self._tool_format = tool_format_for(self.tokenizer, architecture)
        return chosen

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs
    ) -> str:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(f"the tokenizer of {self.model_name} has no chat template")
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for but CUDA is not available")
    return resolved
