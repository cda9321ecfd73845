"""Which settings of which library map onto which wrapper (see peer_settings.py).

ChatPagedLLM        <- ChatOllama, ChatHuggingFace, ChatLlamaCpp, ChatOpenAI
PagedLLM            <- VLLM (same fields), VLLMOpenAI, HuggingFacePipeline, OllamaLLM
PagedLlamaIndexLLM  <- LlamaIndex Ollama, Vllm, LlamaCPP, OpenAILike
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .chat.sampling import SAMPLING_FIELDS
from .engine.config import EngineConfig
from .peer_options import (
    IN_PROCESS,
    KEEP_ALIVE,
    LLAMA_CPP_LOADING,
    LLAMA_CPP_SAMPLING,
    LOGGING,
    MAX_RETRIES,
    NO_HTTP_CLIENT,
    NO_REASONING,
    OLLAMA_OPTIONS,
    OPENAI_REQUEST,
    context_length,
    extra_body,
    gbnf_grammar_file,
    logit_bias,
    max_tokens_from_ollama,
    structured_format,
)
from .peer_settings import (
    ENGINE_FIELDS,
    Custom,
    Filter,
    Mapped,
    Note,
    Refuse,
    Setting,
    apply_rule,
    map_options,
    rename,
    to_engine,
    to_sampling,
)

ONE_ANSWER = "LlamaIndex takes one answer per call; call again for more"
BATCHED = "every prompt of a call goes to the engine at once and is batched there"
NO_DOWNLOAD = (
    "pagedllm does not download model files at run time: download the file and pass its "
    "path (model_path=... or model=...)"
)
OPENAI_ONLY = "a feature of OpenAI's hosted API"


# ------------------------------------------------------------------ ChatPagedLLM
# ChatPagedLLM's own sampling fields, named as SamplingParams names them.
_CHAT_SAMPLING_FIELDS = frozenset(
    {"temperature", "max_tokens", "top_p", "top_k", "min_p", "presence_penalty",
     "frequency_penalty", "repetition_penalty", "seed", "stop"}
)  # fmt: skip


def _from_llm(llm: Any, mapped: Mapped) -> None:
    """ChatHuggingFace(llm=...): the chat model serves the LLM's model, and the LLM's engine
    and sampling settings are its defaults: the chat model's own explicit arguments win."""
    from .langchain import PagedLLM

    if not isinstance(llm, PagedLLM):
        raise ValueError(
            "ChatPagedLLM(llm=...) takes a PagedLLM (for example PagedLLM.from_model_id(...), "
            f"the stand-in for HuggingFacePipeline); got {type(llm).__name__}"
        )
    config = llm._config
    mapped.fields["model"] = config.model  # another model beside it is a contradiction
    mapped.wrapped_engine.update(
        {
            f.name: getattr(config, f.name)
            for f in dataclasses.fields(EngineConfig)
            if f.name != "model" and getattr(config, f.name) != f.default
        }
    )
    defaults = {k: v for k, v in llm._default_params().items() if k not in ("n", "best_of")}
    defaults.update(llm._sampling_extra)
    for key, value in defaults.items():
        if value is None:
            continue
        if key == "logprobs":  # PagedLLM's logprobs=k: the chat model's top_logprobs
            mapped.wrapped_fields["logprobs"] = True
            mapped.wrapped_fields["top_logprobs"] = value or None
        elif key in _CHAT_SAMPLING_FIELDS:
            mapped.wrapped_fields[key] = value
        else:
            mapped.wrapped_sampling[key] = value


def _tokenizer(value: Any, mapped: Mapped) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        raise ValueError(
            "tokenizer must be a path or Hugging Face id (the engine loads it); a tokenizer "
            f"object cannot be used, got {type(value).__name__}"
        )
    mapped.engine["tokenizer"] = value


def _chat_model_kwargs(value: dict | None, mapped: Mapped) -> dict | None:
    """ChatPagedLLM's model_kwargs: sampling and engine settings by our names stay (they are
    its own); llama.cpp's loading arguments (ChatLlamaCpp) and OpenAI's request fields
    (ChatOpenAI) are mapped; anything else stays, and is refused by name at validation."""
    if not isinstance(value, dict):
        return value
    kept = {}
    for key, item in value.items():
        ours = key in SAMPLING_FIELDS or key in ENGINE_FIELDS
        rule = LLAMA_CPP_LOADING.get(key) or OPENAI_REQUEST.get(key)
        if ours or rule is None:
            kept[key] = item
        else:
            apply_rule(rule, f"model_kwargs[{key!r}]", item, mapped)
    return kept


CHAT_PEERS: dict[str, Setting] = {
    # ChatOllama: its fields are Ollama's options.
    **OLLAMA_OPTIONS,
    "num_predict": rename("max_tokens", max_tokens_from_ollama),
    "repeat_penalty": rename("repetition_penalty"),
    "format": to_sampling("structured_outputs", structured_format),
    "keep_alive": Note(KEEP_ALIVE),
    "base_url": Note(IN_PROCESS),
    "reasoning": Refuse(NO_REASONING, (None, False)),
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
    # ChatLlamaCpp: llama.cpp's loading arguments are its fields.
    **LLAMA_CPP_LOADING,
    "model_path": rename("model"),
    "grammar": LLAMA_CPP_SAMPLING["grammar"],
    "grammar_path": to_sampling("structured_outputs", gbnf_grammar_file),
    "echo": LLAMA_CPP_SAMPLING["echo"],
    "suffix": LLAMA_CPP_SAMPLING["suffix"],
    "last_n_tokens_size": Note("the repetition penalty covers the whole text"),
    # ChatOpenAI (pointed at a vLLM server): model_kwargs below, the rest here.
    "model_kwargs": Filter(_chat_model_kwargs),
    "extra_body": Custom(extra_body),
    "max_completion_tokens": rename("max_tokens"),
    "request_timeout": rename("timeout"),
    "openai_api_key": Note(IN_PROCESS),  # a key is never written to the log
    "openai_api_base": Note(IN_PROCESS),
    "organization": Note(IN_PROCESS),
    "openai_organization": Note(IN_PROCESS),
    "openai_proxy": Refuse(NO_HTTP_CLIENT),
    "default_headers": Refuse(NO_HTTP_CLIENT),
    "default_query": Refuse(NO_HTTP_CLIENT),
    "http_client": Refuse(NO_HTTP_CLIENT),
    "http_async_client": Refuse(NO_HTTP_CLIENT),
    "tiktoken_model_name": Refuse("the model's own tokenizer counts tokens"),
    "reasoning_effort": Refuse(NO_REASONING),
    "use_responses_api": Refuse("the chat completions interface is what runs", (None, False)),
    "service_tier": Refuse(OPENAI_ONLY),
    "store": Refuse(OPENAI_ONLY, (None, False)),
}
for _name in ("temperature", "top_k", "top_p", "seed", "stop", "presence_penalty",
              "frequency_penalty", "min_p", "verbose"):  # fmt: skip
    CHAT_PEERS.pop(_name)  # ChatPagedLLM's own fields (verbose: LangChain's)


# --------------------------------------------------------------------- PagedLLM
_HF_LOADING = {"torch_dtype", "dtype", "trust_remote_code", "revision", "device_map"}


def _model_kwargs(value: dict | None, mapped: Mapped) -> None:
    """VLLMOpenAI's model_kwargs are request parameters; HuggingFacePipeline's are
    from_pretrained arguments. Each key is routed by what it is."""
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


# PagedLLM's own sampling fields (VLLM's), which OllamaLLM's options of these names are.
_LLM_OWN_SAMPLING = ("temperature", "top_k", "top_p", "stop", "presence_penalty",
                     "frequency_penalty")  # fmt: skip

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
    "openai_organization": Note(IN_PROCESS),
    "organization": Note(IN_PROCESS),
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
    # OllamaLLM: its fields are Ollama's options.
    **{k: v for k, v in OLLAMA_OPTIONS.items() if k not in _LLM_OWN_SAMPLING},
    "num_predict": rename("max_new_tokens", max_tokens_from_ollama),
    "format": to_sampling("structured_outputs", structured_format),
    "keep_alive": Note(KEEP_ALIVE),
    "reasoning": Refuse(NO_REASONING, (None, False)),
    "client_kwargs": Refuse(NO_HTTP_CLIENT, (None, {})),
    "sync_client_kwargs": Refuse(NO_HTTP_CLIENT, (None, {})),
    "async_client_kwargs": Refuse(NO_HTTP_CLIENT, (None, {})),
}


# ------------------------------------------------------------ PagedLlamaIndexLLM
# LlamaIndex Ollama's additional_kwargs are Ollama's options; OpenAILike's are fields of the
# OpenAI request. The names they share mean the same.
_ADDITIONAL_KWARGS = {**OLLAMA_OPTIONS, **OPENAI_REQUEST}


def _additional_kwargs(value: dict | None, mapped: Mapped) -> None:
    map_options(
        value, _ADDITIONAL_KWARGS, mapped, "additional_kwargs",
        "an Ollama option or an OpenAI request field",
    )  # fmt: skip


def _llama_cpp_model_kwargs(value: dict | None, mapped: Mapped) -> None:
    map_options(value, LLAMA_CPP_LOADING, mapped, "model_kwargs", "a llama.cpp Llama() argument")


def _llama_cpp_generate_kwargs(value: dict | None, mapped: Mapped) -> None:
    map_options(
        value, LLAMA_CPP_SAMPLING, mapped, "generate_kwargs", "a llama.cpp sampling argument"
    )


def _logprobs_flag_or_count(value: bool | int | None, mapped: Mapped) -> None:
    """OpenAILike's logprobs is a flag (with top_logprobs for more), Vllm's a count."""
    if isinstance(value, bool):
        apply_rule(OPENAI_REQUEST["logprobs"], "logprobs", value, mapped)
    else:
        apply_rule(to_sampling("logprobs"), "logprobs", value, mapped)


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
    "logprobs": Custom(_logprobs_flag_or_count),
    "api_url": Note(IN_PROCESS),
    # LlamaIndex LlamaCPP.
    "model_path": rename("model"),
    "model_url": Refuse(NO_DOWNLOAD),
    "model_kwargs": Custom(_llama_cpp_model_kwargs),
    "generate_kwargs": Custom(_llama_cpp_generate_kwargs),
    "verbose": Note(LOGGING),
    # LlamaIndex OpenAILike (pointed at a vLLM server).
    "max_tokens": rename("max_new_tokens"),
    "api_base": Note(IN_PROCESS),
    "api_key": Note(IN_PROCESS),
    "api_version": Note(IN_PROCESS),
    "max_retries": Note(MAX_RETRIES),
    "reuse_client": Note(NO_HTTP_CLIENT),
    "top_logprobs": OPENAI_REQUEST["top_logprobs"],
    "tokenizer": Note("the model's own tokenizer counts tokens"),
    "should_use_structured_outputs": Note(
        "structured_predict always decodes under the schema's constraint"
    ),
    "strict": Note("constrained decoding always follows the schema exactly"),
    "default_headers": Refuse(NO_HTTP_CLIENT, (None, {})),
    "http_client": Refuse(NO_HTTP_CLIENT),
    "async_http_client": Refuse(NO_HTTP_CLIENT),
    "reasoning_effort": Refuse(NO_REASONING),
    "modalities": Refuse("pagedllm models read and write text", (None, ["text"])),
    "audio_config": Refuse("pagedllm models read and write text"),
}
