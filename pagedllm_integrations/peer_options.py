"""The option sets other libraries share between their classes, as rules (peer_settings.py):
Ollama's options, llama.cpp's loading and sampling arguments, and the OpenAI request body
(with vLLM's extras in `extra_body`). peer_tables.py builds each wrapper's table from these.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .chat.sampling import SAMPLING_FIELDS
from .engine.sampling_params import StructuredOutputsParams
from .peer_settings import (
    Custom,
    Mapped,
    Note,
    Refuse,
    Setting,
    map_options,
    note_once,
    to_engine,
    to_sampling,
)

IN_PROCESS = "pagedllm runs the model in this process; there is no server to reach"
KEEP_ALIVE = (
    "the engine runs in this process and stays loaded until close() or shutdown_shared_engines()"
)
NO_HTTP_CLIENT = "there is no HTTP client: the model runs in this process"
MAX_RETRIES = "an in-process engine has no transient errors to retry"
LOGGING = "pagedllm logs through Python's logging (the 'pagedllm_integrations' logger)"
NO_REASONING = "pagedllm has no reasoning mode"


# ------------------------------------------------------------------ conversions
def max_tokens_from_ollama(value: int | None) -> int | None:
    """num_predict: -1 (no limit) and -2 (fill the context) are our default, no limit."""
    if value is None or value in (-1, -2):
        return None
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"num_predict must be a positive integer, -1 or -2; got {value!r}")
    return value


def context_length(value: int | None) -> int | None:
    """num_ctx / context_window / n_ctx; None, -1 or 0 (llama.cpp's "from the model"): the
    model's own context length."""
    return None if value in (None, -1, 0) else value


def structured_format(value: Any) -> StructuredOutputsParams | None:
    """Ollama's `format`: "json" for any JSON object, or a JSON schema."""
    if value in (None, ""):
        return None
    if value == "json":
        return StructuredOutputsParams(json_object=True)
    if isinstance(value, dict):
        return StructuredOutputsParams(json=value)
    raise ValueError(f"format must be '', 'json' or a JSON schema dict; got {value!r}")


def logit_bias(value: dict | None) -> dict[int, float] | None:
    """Token id (int or its string, as OpenAI sends it) -> bias."""
    if not value:
        return None
    return {int(k): float(v) for k, v in value.items()}


def llama_cpp_seed(value: int | None) -> int | None:
    """llama.cpp's seed; -1 and 0xFFFFFFFF (its default) mean a random one."""
    return None if value in (None, -1, 0xFFFFFFFF) else value


def gbnf_grammar(value: Any) -> StructuredOutputsParams | None:
    """llama.cpp's `grammar`: GBNF text (a LlamaGrammar object cannot be read back)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(
            f"grammar must be the GBNF text, got a {type(value).__name__}: pass its text"
        )
    return StructuredOutputsParams(grammar=value)


def gbnf_grammar_file(value: str | None) -> StructuredOutputsParams | None:
    """llama.cpp's `grammar_path`: a .gbnf file, read now."""
    if value is None:
        return None
    try:
        return StructuredOutputsParams(grammar=Path(value).read_text(encoding="utf-8"))
    except OSError as error:
        raise ValueError(f"grammar_path={value!r} cannot be read: {error}") from None


def gpu_layers(value: int | None, mapped: Mapped) -> None:
    """llama.cpp's n_gpu_layers: 0 runs on the CPU; other counts cannot split the model."""
    if value is None:
        return
    if value == 0:
        mapped.engine["device"] = "cpu"
        mapped.names["device"] = "n_gpu_layers"
        return
    note_once(
        mapped.owner,
        "n_gpu_layers",
        value,
        "the engine runs the whole model on one device, the GPU when there is one "
        "(choose with engine_kwargs={'device': 'cpu' | 'cuda'}); n_gpu_layers=0 is the CPU",
    )


# --------------------------------------------------------------- Ollama's options
# ChatOllama's and OllamaLLM's fields and LlamaIndex Ollama's `additional_kwargs`.
OLLAMA_OPTIONS: dict[str, Setting] = {
    "num_predict": to_sampling("max_tokens", max_tokens_from_ollama),
    "num_ctx": to_engine("max_model_len", context_length),
    "repeat_penalty": to_sampling("repetition_penalty"),
    "temperature": to_sampling("temperature"),
    "top_k": to_sampling("top_k"),
    "top_p": to_sampling("top_p"),
    "min_p": to_sampling("min_p"),
    "seed": to_sampling("seed"),
    "stop": to_sampling("stop"),
    "presence_penalty": to_sampling("presence_penalty"),
    "frequency_penalty": to_sampling("frequency_penalty"),
    "num_thread": to_engine("num_threads"),
    "repeat_last_n": Refuse("the repetition penalty covers the whole text; drop repeat_last_n"),
    "mirostat": Refuse("Mirostat sampling is not implemented; use top_p / min_p", (None, 0)),
    "mirostat_eta": Refuse("Mirostat sampling is not implemented"),
    "mirostat_tau": Refuse("Mirostat sampling is not implemented"),
    "tfs_z": Refuse("tail-free sampling is not implemented; use min_p", (None, 1, 1.0)),
    "num_gpu": Refuse("choose the device with engine_kwargs={'device': 'cuda' | 'cpu'}"),
}


def ollama_options(options: dict | None, mapped: Mapped, where: str) -> None:
    """Each Ollama option onto the engine or sampling settings (ValueError if refused)."""
    map_options(options, OLLAMA_OPTIONS, mapped, where, "an Ollama option")


# ------------------------------------------------------------------ llama.cpp
# llama_cpp.Llama(...)'s arguments: ChatLlamaCpp's fields, the `model_kwargs` of LlamaIndex
# LlamaCPP and ChatLlamaCpp.
LLAMA_CPP_LOADING: dict[str, Setting] = {
    "n_ctx": to_engine("max_model_len", context_length),
    "n_batch": to_engine("max_num_batched_tokens"),
    "n_threads": to_engine("num_threads"),
    "n_gpu_layers": Custom(gpu_layers),
    "seed": to_sampling("seed", llama_cpp_seed),
    "verbose": Note(LOGGING),
    "n_ubatch": Note("a step's tokens are max_num_batched_tokens (n_batch)"),
    "n_threads_batch": Note("prompt and generation steps share num_threads (n_threads)"),
    "use_mmap": Note("the engine reads the weights into memory"),
    "use_mlock": Note("the engine reads the weights into memory"),
    "f16_kv": Note("the KV cache is bfloat16 on the CPU fast path (engine kv_cache_dtype)"),
    "offload_kqv": Note("the KV cache lives on the model's device"),
    "flash_attn": Note("the engine runs its own paged attention kernels"),
    "lora_path": Refuse("LoRA adapters are not supported: merge the adapter into the weights"),
    "lora_base": Refuse("LoRA adapters are not supported: merge the adapter into the weights"),
    "chat_format": Refuse("the chat template stored with the model is used"),
    "chat_handler": Refuse("the chat template stored with the model is used"),
    "rope_freq_base": Refuse("rotary settings come from the model's config", (None, 0, 0.0)),
    "rope_freq_scale": Refuse("rotary settings come from the model's config", (None, 0, 0.0)),
    "n_parts": Refuse("the model is one file or folder", (None, -1)),
    "vocab_only": Refuse("the engine loads the whole model", (None, False)),
    "logits_all": Refuse("use logprobs / top_logprobs for per-token logprobs", (None, False)),
    "embedding": Refuse("pagedllm generates text; use an embedding model", (None, False)),
}

# llama.cpp's sampling arguments (`Llama.__call__`): ChatLlamaCpp's fields and LlamaIndex
# LlamaCPP's `generate_kwargs`.
LLAMA_CPP_SAMPLING: dict[str, Setting] = {
    "temperature": to_sampling("temperature"),
    "top_p": to_sampling("top_p"),
    "top_k": to_sampling("top_k"),
    "min_p": to_sampling("min_p"),
    "max_tokens": to_sampling("max_tokens"),
    "stop": to_sampling("stop"),
    "repeat_penalty": to_sampling("repetition_penalty"),
    "presence_penalty": to_sampling("presence_penalty"),
    "frequency_penalty": to_sampling("frequency_penalty"),
    "seed": to_sampling("seed", llama_cpp_seed),
    "logprobs": to_sampling("logprobs"),
    "logit_bias": to_sampling("logit_bias", logit_bias),
    "grammar": to_sampling("structured_outputs", gbnf_grammar),
    "typical_p": Refuse("locally typical sampling is not implemented", (None, 1, 1.0)),
    "tfs_z": Refuse("tail-free sampling is not implemented; use min_p", (None, 1, 1.0)),
    "mirostat_mode": Refuse("Mirostat sampling is not implemented", (None, 0)),
    "mirostat_tau": Refuse("Mirostat sampling is not implemented"),
    "mirostat_eta": Refuse("Mirostat sampling is not implemented"),
    "echo": Refuse("completions never repeat the prompt", (None, False)),
    "suffix": Refuse("fill-in-the-middle suffixes are not supported"),
}


# ------------------------------------------------------------- OpenAI's request body
def extra_body(value: dict | None, mapped: Mapped) -> None:
    """ChatOpenAI's `extra_body`: the vLLM server's extra request fields, which are sampling
    parameters by the same names here."""
    map_options(value, VLLM_EXTRA_BODY, mapped, "extra_body", "a vLLM request field")


def _openai_logprobs(value: bool | None, mapped: Mapped) -> None:
    """OpenAI's logprobs (a flag): the sampled tokens' logprobs (top_logprobs may add more)."""
    if value:
        mapped.sampling.setdefault("logprobs", 0)


def _openai_top_logprobs(value: int | None, mapped: Mapped) -> None:
    if value:
        mapped.sampling["logprobs"] = value


# The chat request fields of OpenAI's API that mean a sampling setting here: ChatOpenAI's
# `model_kwargs`, LlamaIndex OpenAILike's `additional_kwargs`.
OPENAI_REQUEST: dict[str, Setting] = {
    "max_tokens": to_sampling("max_tokens"),
    "max_completion_tokens": to_sampling("max_tokens"),
    "temperature": to_sampling("temperature"),
    "top_p": to_sampling("top_p"),
    "stop": to_sampling("stop"),
    "seed": to_sampling("seed"),
    "presence_penalty": to_sampling("presence_penalty"),
    "frequency_penalty": to_sampling("frequency_penalty"),
    "logit_bias": to_sampling("logit_bias", logit_bias),
    "logprobs": Custom(_openai_logprobs),
    "top_logprobs": Custom(_openai_top_logprobs),
    "extra_body": Custom(extra_body),
    "user": Note("there is no account to attribute the request to"),
    "stream_options": Note("usage is always reported, streaming or not"),
    "response_format": Refuse(
        "use with_structured_output(...) (LangChain) or structured_predict / json_mode (LlamaIndex)"
    ),
}

# vLLM's extra request fields (ChatOpenAI's extra_body): SamplingParams fields by name.
VLLM_EXTRA_BODY: dict[str, Setting] = {
    **{name: to_sampling(name) for name in sorted(SAMPLING_FIELDS - {"output_kind", "n"})},
    "logit_bias": to_sampling("logit_bias", logit_bias),
    "guided_json": to_sampling("structured_outputs", lambda v: StructuredOutputsParams(json=v)),
    "use_beam_search": Refuse("beam search is not implemented", (None, False)),
    "best_of": Refuse("a chat call returns its n answers; best_of is not supported", (None, 1)),
}
