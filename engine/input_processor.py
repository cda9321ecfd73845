"""Requests in: tokenize, validate and build the engine's `RequestGroup` (any thread).

This is the half of the engine a caller runs on its own thread, so a bad request fails
there with a ValueError, before it reaches the engine thread. It needs the tokenizer and a
few facts about the model (`ModelInfo`), not the model itself: the in-process engine and
the Ray replica engine (whose model lives in other processes) both use it.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import torch

from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .embedding_inputs import make_embedding_group, make_embedding_groups
from .model_info import ModelInfo, PromptType
from .output_processor import RequestGroup
from .pooling import PoolingParams
from .request import Request
from .request_limits import check_text
from .sampling_params import SamplingParams


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: Any, info: ModelInfo, device: torch.device):
        self.config = config
        self.tokenizer = tokenizer
        self.info = info
        self.device = device  # where seeded requests' generators live
        self._structured = None
        self._structured_lock = threading.Lock()

    def process_inputs(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> RequestGroup:
        """Tokenize and validate one request (any thread); raises ValueError when it is bad.

        With no params, the model's generation defaults (generation_config.json) apply on
        top of SamplingParams' own defaults.
        """
        if "generate" not in self.info.tasks:
            raise ValueError(
                f"{self.info.name} is an embedding model (runner 'pooling'): it does not "
                "generate text; call embed() (LLM.embed, PagedEmbeddings, /v1/embeddings)"
            )
        if params is None:
            params = SamplingParams(**self.info.generation_defaults)
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"sampling params must be a SamplingParams, got {type(params).__name__}"
            )
        default_stop = self.info.generation_defaults.get("stop")
        if default_stop and not params.stop:
            # The model's own stop strings (an Ollama Modelfile's PARAMETER stop). Front ends
            # hand a request's stops over as given, so the default is applied here, where
            # every request passes; a request with stops of its own replaces it, as in Ollama.
            params = params.clone(stop=list(default_stop))
        max_model_len, vocab_size = self.info.max_model_len, self.info.vocab_size
        text, token_ids = self._tokenize(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        if len(token_ids) >= max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens but max_model_len is {max_model_len}; "
                "the prompt and at least one generated token must fit"
            )
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"token ids {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})"
            )
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(
                f"logprobs {params.logprobs} exceeds max_logprobs {self.config.max_logprobs}"
            )
        self._check_token_ids(params, vocab_size)
        params = params.clone(_eos_token_ids=self.info.eos_token_ids)
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

    def process_embedding_inputs(
        self,
        prompt: PromptType,
        params: PoolingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> RequestGroup:
        """Tokenize and validate one embedding request (any thread); ValueError when bad."""
        return make_embedding_group(self.tokenizer, self.info, prompt, params, request_id, priority)

    def process_embedding_batch(
        self, prompts: list[PromptType], params: PoolingParams | None = None, priority: int = 0
    ) -> list[RequestGroup]:
        """Many embedding requests, texts tokenized together; ValueError naming a bad one."""
        return make_embedding_groups(self.tokenizer, self.info, prompts, params, priority)

    @staticmethod
    def _check_token_ids(params: SamplingParams, vocab_size: int) -> None:
        """Token ids in the sampling params index the logits row: outside the vocabulary
        they would raise inside a step (and fail every request in it)."""
        named = [
            ("stop_token_ids", params.stop_token_ids or []),
            ("logit_bias", params.logit_bias or {}),
        ]
        for name, ids in named:
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(
                    f"{name} token ids {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})"
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
            check_text(prompt, "the prompt")
            return prompt, list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, list | tuple) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
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
                    self.tokenizer, self.info.vocab_size, stop_token_ids=self.info.eos_token_ids
                )
            return self._structured

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(f"the tokenizer of {self.info.name} has no chat template")
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
