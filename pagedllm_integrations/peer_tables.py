"""Which settings of which library map onto which wrapper (see peer_settings.py).

ChatPagedLLM        <- ChatOllama, ChatHuggingFace
PagedLLM            <- VLLM (same fields), VLLMOpenAI, HuggingFacePipeline
PagedLlamaIndexLLM  <- LlamaIndex Ollama, LlamaIndex Vllm
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .engine.config import EngineConfig
from .peer_settings import (
    IN_PROCESS,
    KEEP_ALIVE,
    OLLAMA_OPTIONS,
    Custom,
    Mapped,
    Note,
    Refuse,
    Setting,
    context_length,
    logit_bias,
    max_tokens_from_ollama,
    ollama_options,
    rename,
    structured_format,
    to_engine,
    to_sampling,
)

NO_HTTP_CLIENT = "there is no HTTP client: the model runs in this process"
ONE_ANSWER = "LlamaIndex takes one answer per call; call again for more"
MAX_RETRIES = "an in-process engine has no transient errors to retry"
BATCHED = "every prompt of a call goes to the engine at once and is batched there"


# ------------------------------------------------------------------ ChatPagedLLM
def _from_llm(llm: Any, mapped: Mapped) -> None:
    """ChatHuggingFace(llm=...): the chat model takes the LLM's model and settings."""
    from .langchain import PagedLLM

    if not isinstance(llm, PagedLLM):
        raise ValueError(
            "ChatPagedLLM(llm=...) takes a PagedLLM (for example PagedLLM.from_model_id(...), "
            f"the stand-in for HuggingFacePipeline); got {type(llm).__name__}"
        )
    config = llm._config
    mapped.fields["model"] = config.model
    mapped.engine.update(
        {
            f.name: getattr(config, f.name)
            for f in dataclasses.fields(EngineConfig)
            if f.name != "model" and getattr(config, f.name) != f.default
        }
    )
    defaults = {k: v for k, v in llm._default_params().items() if k not in ("n", "best_of")}
    defaults.update(llm._sampling_extra)
    mapped.sampling.update({k: v for k, v in defaults.items() if v is not None})


def _tokenizer(value: Any, mapped: Mapped) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        raise ValueError(
            "tokenizer must be a path or Hugging Face id (the engine loads it); a tokenizer "
            f"object cannot be used, got {type(value).__name__}"
        )
    mapped.engine["tokenizer"] = value


CHAT_PEERS: dict[str, Setting] = {
    # ChatOllama: its fields are Ollama's options.
    **OLLAMA_OPTIONS,
    "num_predict": rename("max_tokens", max_tokens_from_ollama),
    "repeat_penalty": rename("repetition_penalty"),
    "format": to_sampling("structured_outputs", structured_format),
    "keep_alive": Note(KEEP_ALIVE),
    "base_url": Note(IN_PROCESS),
    "reasoning": Refuse("pagedllm has no reasoning mode", (None, False)),
    "client_kwargs": Refuse(NO_HTTP_CLIENT, (None, {})),
    "sync_client_kwargs": Refuse(NO_HTTP_CLIENT, (None, {})),
    "async_client_kwargs": Refuse(NO_HTTP_CLIENT, (None, {})),
    # ChatHuggingFace.
    "llm": Custom(_from_llm),
    "model_id": rename("model"),
    "tokenizer": Custom(_tokenizer),
    "stop_sequences": rename("stop"),
    "logit_bias": to_sampling("logit_bias", logit_bias),
    "stream_usage": Refuse("usage is always reported, streaming or not", (None, True)),
}
for _name in ("temperature", "top_k", "top_p", "seed", "stop", "presence_penalty",
              "frequency_penalty", "min_p"):  # fmt: skip
    CHAT_PEERS.pop(_name)  # ChatPagedLLM's own fields


# --------------------------------------------------------------------- PagedLLM
_HF_LOADING = {"torch_dtype", "dtype", "trust_remote_code", "revision", "device_map"}


def _model_kwargs(value: dict | None, mapped: Mapped) -> None:
    """VLLMOpenAI's model_kwargs are request parameters; HuggingFacePipeline's are
    from_pretrained arguments. Each key is routed by what it is."""
    from .chat.sampling import SAMPLING_FIELDS

    for key, item in (value or {}).items():
        if key in SAMPLING_FIELDS:
            mapped.sampling[key] = logit_bias(item) if key == "logit_bias" else item
        elif key in ("torch_dtype", "dtype"):
            mapped.engine["dtype"] = str(item).removeprefix("torch.")
        elif key in ("trust_remote_code", "revision"):
            mapped.engine[key] = item
        elif key == "device_map":
            if item not in (None, "auto"):
                raise ValueError(
                    f"model_kwargs['device_map']={item!r}: the engine places the model itself; "
                    "choose the device with engine_kwargs={'device': ...}"
                )
        else:
            raise ValueError(
                f"model_kwargs[{key!r}] is neither a sampling parameter nor a loading argument "
                f"pagedllm knows (sampling: {sorted(SAMPLING_FIELDS)}; loading: "
                f"{sorted(_HF_LOADING)})"
            )


def _pipeline_kwargs(value: dict | None, mapped: Mapped) -> None:
    """HuggingFacePipeline's pipeline_kwargs: transformers' generate() arguments."""
    value = dict(value or {})
    if value.pop("do_sample", True) is False and "temperature" not in value:
        mapped.sampling["temperature"] = 0.0  # greedy
    if value.pop("return_full_text", False):
        raise ValueError(
            "pipeline_kwargs['return_full_text']=True: completions never repeat the prompt"
        )
    names = {"max_new_tokens": "max_tokens", "num_return_sequences": "n"}
    for key, item in value.items():
        if key == "max_new_tokens":
            mapped.fields["max_new_tokens"] = item
        elif key in ("temperature", "top_k", "top_p", "repetition_penalty", "num_return_sequences"):
            mapped.sampling[names.get(key, key)] = item
        else:
            raise ValueError(
                f"pipeline_kwargs[{key!r}] is not supported; supported: max_new_tokens, "
                "do_sample, temperature, top_k, top_p, repetition_penalty, num_return_sequences"
            )


LLM_PEERS: dict[str, Setting] = {
    # VLLMOpenAI (and the OpenAI LLM it extends).
    "model_name": rename("model"),
    "model_id": rename("model"),  # HuggingFacePipeline
    "max_tokens": rename("max_new_tokens"),
    "request_timeout": rename("timeout"),
    "openai_api_key": Note(IN_PROCESS),
    "api_key": Note(IN_PROCESS),
    "openai_api_base": Note(IN_PROCESS),
    "base_url": Note(IN_PROCESS),
    "max_retries": Note(MAX_RETRIES),
    "streaming": Note("call .stream() for tokens as they come; invoke() returns the same text"),
    "batch_size": Note(BATCHED),
    "model_kwargs": Custom(_model_kwargs),
    "logit_bias": to_sampling("logit_bias", logit_bias),
    "seed": to_sampling("seed"),
    "repetition_penalty": to_sampling("repetition_penalty"),
    "min_p": to_sampling("min_p"),
    "openai_organization": Refuse(IN_PROCESS),
    "organization": Refuse(IN_PROCESS),
    "openai_proxy": Refuse(IN_PROCESS),
    "default_headers": Refuse(NO_HTTP_CLIENT),
    "default_query": Refuse(NO_HTTP_CLIENT),
    "http_client": Refuse(NO_HTTP_CLIENT),
    "http_async_client": Refuse(NO_HTTP_CLIENT),
    "tiktoken_model_name": Refuse("the model's own tokenizer counts tokens"),
    "allowed_special": Refuse("the model's own tokenizer counts tokens", (None, set())),
    "disallowed_special": Refuse("the model's own tokenizer counts tokens", (None, "all")),
    # HuggingFacePipeline.
    "pipeline": Refuse("a transformers pipeline object cannot be served; give model_id / model"),
    "pipeline_kwargs": Custom(_pipeline_kwargs),
}


# ------------------------------------------------------------ PagedLlamaIndexLLM
def _additional_kwargs(value: dict | None, mapped: Mapped) -> None:
    ollama_options(value, mapped, "additional_kwargs")


def _vllm_kwargs(value: dict | None, mapped: Mapped) -> None:
    from .owner import split_settings

    engine, sampling = split_settings(value or {}, "vllm_kwargs")
    mapped.engine.update(engine)
    mapped.sampling.update(sampling)


LLAMA_INDEX_PEERS: dict[str, Setting] = {
    # LlamaIndex Ollama.
    "model_name": rename("model"),
    "base_url": Note(IN_PROCESS),
    "context_window": to_engine("max_model_len", context_length),
    "request_timeout": rename("timeout"),
    "prompt_key": Refuse("an Ollama API detail with no meaning in process", (None, "prompt")),
    "additional_kwargs": Custom(_additional_kwargs),
    "keep_alive": Note(KEEP_ALIVE),
    "thinking": Refuse("pagedllm has no thinking mode", (None, False)),
    "headers": Refuse(NO_HTTP_CLIENT, (None, {})),
    # LlamaIndex Vllm.
    "tensor_parallel_size": to_engine("tensor_parallel_size"),
    "trust_remote_code": to_engine("trust_remote_code"),
    "dtype": to_engine("dtype"),
    "download_dir": to_engine("download_dir"),
    "vllm_kwargs": Custom(_vllm_kwargs),
    "n": Refuse(ONE_ANSWER, (None, 1)),
    "best_of": Refuse(ONE_ANSWER, (None, 1)),
    "use_beam_search": Refuse("beam search is not implemented", (None, False)),
    "presence_penalty": to_sampling("presence_penalty"),
    "frequency_penalty": to_sampling("frequency_penalty"),
    "repetition_penalty": to_sampling("repetition_penalty"),
    "ignore_eos": to_sampling("ignore_eos"),
    "logprobs": to_sampling("logprobs"),
    "api_url": Note(IN_PROCESS),
}
