"""Requests in: tokenize, validate and make the frozen `EngineRequest` (any thread).

This is the half of the engine a caller runs on its own thread, so a bad request fails
there with a ValueError, before it reaches the engine thread; a constraint's grammar is
compiled here, once. It needs the tokenizer and a few facts about the model (`ModelInfo`),
not the model itself: the in-process engine and the Ray replica engine (whose model lives
in other processes) both use it. The engine thread builds its own live state for what it
receives (`engine/request_state.py`).
"""

from __future__ import annotations

import threading
from typing import Any

from .config import EngineConfig
from .embedding_inputs import make_embedding_request, make_embedding_requests
from .engine_request import EngineRequest
from .model_info import ModelInfo, PromptType, check_in_vocabulary, prompt_text_or_ids
from .pooling import PoolingParams
from .request_limits import check_text
from .sampling_params import SamplingParams


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: Any, info: ModelInfo):
        self.config = config
        self.tokenizer = tokenizer
        self.info = info
        self._structured = None
        self._structured_lock = threading.Lock()

    def process_inputs(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> EngineRequest:
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
        check_in_vocabulary(token_ids, vocab_size)
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(
                f"logprobs {params.logprobs} exceeds max_logprobs {self.config.max_logprobs}"
            )
        self._check_token_ids(params, vocab_size)
        params = params.clone(_eos_token_ids=self.info.eos_token_ids)
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.structured_outputs.compile(params.structured_outputs)
        return EngineRequest.new(
            text, token_ids, params, request_id, priority=priority, cache_salt=cache_salt,
            grammar=grammar,
        )  # fmt: skip

    def process_embedding_inputs(
        self,
        prompt: PromptType,
        params: PoolingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> EngineRequest:
        """Tokenize and validate one embedding request (any thread); ValueError when bad."""
        return make_embedding_request(
            self.tokenizer, self.info, prompt, params, request_id, priority
        )

    def process_embedding_batch(
        self, prompts: list[PromptType], params: PoolingParams | None = None, priority: int = 0
    ) -> list[EngineRequest]:
        """Many embedding requests, texts tokenized together; ValueError naming a bad one."""
        return make_embedding_requests(self.tokenizer, self.info, prompts, params, priority)

    @staticmethod
    def _check_token_ids(params: SamplingParams, vocab_size: int) -> None:
        """Token ids in the sampling params index the logits row: outside the vocabulary
        they would raise inside a step (and fail every request in it)."""
        named = [
            ("stop_token_ids", params.stop_token_ids or []),
            ("logit_bias", params.logit_bias or {}),
        ]
        for name, ids in named:
            check_in_vocabulary(list(ids), vocab_size, f"{name} token ids")

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        prompt = prompt_text_or_ids(prompt, "prompt")
        if not isinstance(prompt, str):
            return None, prompt
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token")
        check_text(prompt, "the prompt")
        return prompt, list(self.tokenizer(prompt).input_ids)

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

    @property
    def grammar_compiles(self) -> int:
        """Constraints compiled for this engine so far (0 before the first)."""
        return 0 if self._structured is None else self._structured.compiles

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(f"the tokenizer of {self.info.name} has no chat template")
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
