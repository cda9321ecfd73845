"""The offline API, shaped like vLLM's: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

import queue
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from .async_engine import RequestStream
from .client import PromptType
from .config import EngineConfig
from .factory import create_engine
from .outputs import EmbeddingRequestOutput, RequestOutput
from .pooling import PoolingParams
from .sampling_params import RequestOutputKind, SamplingParams

Conversation = list[dict[str, Any]]


class LLM:
    """Load a model once and generate for batches of prompts.

    `LLM()` with no model runs the embedded SmolLM2-135M-Instruct. Every engine argument
    of `EngineConfig` is accepted by name (`max_model_len`, `block_size`, `dtype`, ...);
    an unknown name is a ValueError.
    """

    def __init__(self, model: str | None = None, **engine_args: Any):
        self.config = EngineConfig.from_kwargs(model=model, **engine_args)
        self.engine = create_engine(self.config)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (temperature,
        top_p, top_k, min_p, repetition_penalty, max_tokens), used when none are given."""
        return SamplingParams(**self.engine.model_info.generation_defaults)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt, batched by the engine; outputs in the prompts' order.

        A prompt is a string, a list of token ids, or a dict with `prompt` or
        `prompt_token_ids`. All prompts are validated before any is submitted.
        """
        prompt_list = _as_prompt_list(prompts)
        params_list = self._params_for(sampling_params, len(prompt_list), "prompts")
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        # Only final outputs are needed here: no per-step output objects.
        params_list = [p.clone(output_kind=RequestOutputKind.FINAL_ONLY) for p in params_list]
        requests = [
            self.engine.process_inputs(p, sp, priority=prio)
            for p, sp, prio in zip(prompt_list, params_list, priorities)
        ]
        done: queue.Queue = queue.Queue()
        streams: list[RequestStream] = []
        try:
            streams.extend(self.engine.submit_many(requests, sink=done))
            results: dict[str, RequestOutput] = {}
            with tqdm(
                total=len(streams), desc="generate", disable=not use_tqdm, unit="req"
            ) as progress:
                while len(results) < len(streams):
                    item = done.get()
                    if isinstance(item, BaseException):
                        raise item
                    if item.finished:
                        results[item.request_id] = item
                        progress.update(1)
        except BaseException:
            for stream in streams:
                self.engine.abort(stream.request_id)
            raise
        ordered = [results[s.request_id] for s in streams]
        for output, request in zip(ordered, requests):
            output.prompt = request.prompt
            if output.error is not None:
                raise RuntimeError(f"request {output.request_id} failed: {output.error}")
        return ordered

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`outputs[i].outputs.embedding`, as vLLM's), batched by
        the engine. A prompt is a string, a list of token ids, or a dict with `prompt` or
        `prompt_token_ids`. All are validated before any is submitted: an input longer
        than max_model_len is a ValueError unless pooling_params says truncate=True."""
        prompt_list = _as_prompt_list(prompts)
        with tqdm(total=len(prompt_list), desc="embed", disable=not use_tqdm, unit="req") as bar:
            outputs = self.engine.embed_sync(prompt_list, pooling_params)
            bar.update(len(outputs))
        return outputs

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, via the chat template.

        `tools` (OpenAI-style) are described in the prompt by the model's template when it
        takes tools, else by pagedllm's tool prompt; read calls back with
        `pagedllm_integrations.chat.tool_calls.parse_tool_calls`.
        """
        from ..chat.prepare import ChatOptions, prepare_chat  # a front end over the chat layer

        if not messages:
            raise ValueError("messages is empty")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        params_list = self._params_for(sampling_params, len(conversations), "conversations")
        prompts = []
        for conversation, params in zip(conversations, params_list):
            if not conversation:
                raise ValueError("a conversation is empty")
            prompts.append(
                prepare_chat(
                    self.engine,
                    list(conversation),  # type: ignore[arg-type]
                    params,
                    ChatOptions(tools=tools, structured=params.structured_outputs),
                    add_generation_prompt=add_generation_prompt,
                    template_kwargs=chat_template_kwargs,
                )
            )
        outputs = self.generate(
            [p.engine_prompt for p in prompts],  # type: ignore[misc]
            [p.params for p in prompts],
            use_tqdm=use_tqdm,
        )
        for output, prompt in zip(outputs, prompts):
            output.prompt = prompt.text
        return outputs

    def _params_for(
        self, sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int,
        what: str,
    ) -> list[SamplingParams]:  # fmt: skip
        """One SamplingParams per prompt: the given one for all, or one each (the model's
        defaults when none are given)."""
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            return [sampling_params or self.get_default_sampling_params()] * count
        params_list = list(sampling_params)
        if len(params_list) != count:
            raise ValueError(f"{len(params_list)} sampling params for {count} {what}")
        return params_list

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def save_prefix(self, prompt: PromptType, cache_salt: str | None = None) -> int:
        """Compute a prompt and write its full KV blocks to `prefix_cache_dir`, so that a
        later process starts from them; returns the prompt tokens on disk (see
        `EngineClient.save_prefix`)."""
        return self.engine.save_prefix(prompt, cache_salt)

    def shutdown(self) -> None:
        """Stop the engine and free its weights and KV cache."""
        self.engine.shutdown()

    def close(self) -> None:
        """The same as `shutdown()`."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str | dict):
        return [prompts]
    if isinstance(prompts, list | tuple):
        if not prompts:
            raise ValueError("no prompts given")
        if all(isinstance(t, int) for t in prompts):
            return [list(prompts)]  # type: ignore[arg-type]
        return list(prompts)
    raise ValueError(
        f"prompts must be a string, token ids, or a list of them; got {type(prompts).__name__}"
    )
