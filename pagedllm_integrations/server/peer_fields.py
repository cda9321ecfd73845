"""Request fields of OpenAI's, vLLM's and llama.cpp's servers that pagedllm does not declare
(protocol.py declares the ones it honours): each is refused with a 400 naming it, unless its
value asks for nothing (the field's neutral value, as clients that send every default do).

A field no server defines is refused too (it may be a typo, or a setting the client counts
on), unless the server runs with --allow-unknown-fields; the fields listed here are refused
either way, since pagedllm knows what they ask for and cannot do it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import APIError

Neutral = Callable[[Any, dict[str, Any]], bool]  # (value, the request's fields) -> asks nothing


@dataclass(slots=True, frozen=True)
class Refused:
    reason: str  # why pagedllm cannot honour the field
    neutral: Neutral  # when its value asks for nothing, so it is accepted


def values(*allowed: Any) -> Neutral:
    """Neutral when the value is one of `allowed` (None always is; true is not 1)."""
    return lambda value, fields: value is None or any(_same(value, a) for a in allowed)


def _same(value: Any, allowed: Any) -> bool:
    if isinstance(value, bool) or isinstance(allowed, bool):
        return value is allowed
    return bool(value == allowed)


def empty(value: Any, fields: dict[str, Any]) -> bool:
    return value is None or value in ([], {}, "", False)


def anything(value: Any, fields: dict[str, Any]) -> bool:
    return True


def off_unless(switch: str, *off: Any) -> Neutral:
    """Neutral whatever its value while the setting `switch` is off (None or in `off`):
    llama.cpp's mirostat_tau means nothing while mirostat is 0."""
    return lambda value, fields: fields.get(switch) is None or fields.get(switch) in off


NO_BEAM = "beam search is not implemented; sample n completions instead"
NO_REASONING = "pagedllm has no reasoning mode or reasoning parser"
NO_SAMPLER = (
    "this sampler is not implemented (pagedllm has temperature, top_p, top_k, min_p, "
    "penalties, logit_bias and seed)"
)
NO_PROMPT_LOGPROBS = "the engine computes logits for generated positions only"

PEER_FIELDS: dict[str, Refused] = {
    # OpenAI
    "audio": Refused("audio output is not supported", empty),
    "modalities": Refused("only text output is supported", values(["text"])),
    "prediction": Refused("predicted outputs are not supported", empty),
    "web_search_options": Refused("web search is not supported", empty),
    "store": Refused("completions are not stored", values(False)),
    "metadata": Refused("metadata is kept only with store, which is not supported", empty),
    "service_tier": Refused("there is one service tier", values("auto", "default")),
    "reasoning_effort": Refused(NO_REASONING, empty),
    "verbosity": Refused("verbosity is not supported", empty),
    # Hints with no effect on the output: the prefix cache is shared automatically, and the
    # identifiers are for a provider's abuse monitoring.
    "prompt_cache_key": Refused("", anything),
    "prompt_cache_retention": Refused(
        "the prefix cache keeps blocks while memory lasts", values("in_memory")
    ),
    "safety_identifier": Refused("", anything),
    # vLLM
    "best_of": Refused(
        "best_of other than n is not supported", lambda v, f: v is None or v == f.get("n", 1)
    ),
    "use_beam_search": Refused(NO_BEAM, values(False)),
    "length_penalty": Refused(
        NO_BEAM + " (length_penalty is a beam-search setting)", values(1, 1.0)
    ),
    "prompt_logprobs": Refused(NO_PROMPT_LOGPROBS, empty),
    "allowed_token_ids": Refused(
        "use logit_bias or a structured output (guided_choice, "
        "guided_regex) to restrict the tokens",
        empty,
    ),
    "bad_words": Refused("use logit_bias -100 on their tokens", empty),
    "mm_processor_kwargs": Refused("the server serves text models only", empty),
    "logits_processors": Refused("custom logits processors cannot be loaded by a client", empty),
    "return_tokens_as_token_ids": Refused("token ids in logprobs are not supported", empty),
    "return_token_ids": Refused("token ids in the response are not supported", empty),
    "kv_transfer_params": Refused("disaggregated serving is not supported", empty),
    "vllm_xargs": Refused("there are no extensions to pass arguments to", empty),
    "guided_whitespace_pattern": Refused("the JSON grammar's whitespace is fixed", empty),
    "structural_tag": Refused("structural tags are not supported", empty),
    "include_reasoning": Refused(NO_REASONING, values(True)),
    "max_repetition_pattern_size": Refused("repetition detection is not supported", values(0)),
    "min_repetition_pattern_size": Refused("repetition detection is not supported", values(0)),
    "repetition_min_count": Refused("repetition detection is not supported", values(0)),
    "prompt_embeds": Refused("prompts are text or token ids", empty),
    # llama.cpp
    "n_probs": Refused("use logprobs (completions) or logprobs/top_logprobs (chat)", values(0)),
    "post_sampling_probs": Refused("use logprobs", values(False)),
    "cache_prompt": Refused("", anything),  # prefix caching never changes the output
    "id_slot": Refused("there are no slots to choose", values(-1)),
    "samplers": Refused("the sampler order is fixed", empty),
    "typical_p": Refused(NO_SAMPLER, values(1, 1.0)),
    "tfs_z": Refused(NO_SAMPLER, values(1, 1.0)),
    "top_n_sigma": Refused(NO_SAMPLER, values(-1, -1.0)),
    "dynatemp_range": Refused(NO_SAMPLER, values(0, 0.0)),
    "dynatemp_exponent": Refused(NO_SAMPLER, off_unless("dynatemp_range", 0, 0.0)),
    "mirostat": Refused(NO_SAMPLER, values(0)),
    "mirostat_tau": Refused(NO_SAMPLER, off_unless("mirostat", 0)),
    "mirostat_eta": Refused(NO_SAMPLER, off_unless("mirostat", 0)),
    "dry_multiplier": Refused(NO_SAMPLER, values(0, 0.0)),
    "dry_base": Refused(NO_SAMPLER, off_unless("dry_multiplier", 0, 0.0)),
    "dry_allowed_length": Refused(NO_SAMPLER, off_unless("dry_multiplier", 0, 0.0)),
    "dry_penalty_last_n": Refused(NO_SAMPLER, off_unless("dry_multiplier", 0, 0.0)),
    "dry_sequence_breakers": Refused(NO_SAMPLER, off_unless("dry_multiplier", 0, 0.0)),
    "xtc_probability": Refused(NO_SAMPLER, values(0, 0.0)),
    "xtc_threshold": Refused(NO_SAMPLER, off_unless("xtc_probability", 0, 0.0)),
    # The penalties apply to the whole context (vLLM's way), which is llama.cpp's -1.
    "repeat_last_n": Refused(
        "penalties apply to the whole context (repeat_last_n -1)",
        lambda v, f: v is None or v == -1 or _no_penalty(f),
    ),
    "penalize_nl": Refused(
        "newlines are penalized like any token (penalize_nl true)",
        lambda v, f: v is None or v is True or _no_penalty(f),
    ),
    "min_keep": Refused(NO_SAMPLER, values(0)),
    "n_keep": Refused("a prompt that does not fit is refused, never shifted", values(0, -1)),
    "n_indent": Refused("indentation control is not supported", values(0)),
    "t_max_predict_ms": Refused("use max_tokens to bound a generation", values(0)),
    "image_data": Refused("the server serves text models only", empty),
    "return_tokens": Refused("token ids in the response are not supported", values(False)),
    "timings_per_token": Refused("timings are in /metrics", values(False)),
    "response_fields": Refused("responses have OpenAI's fields", empty),
    "lora": Refused("LoRA adapters are not supported", empty),
    "n_cmpl": Refused("use n", lambda v, f: v is None or v == f.get("n", 1)),
    "reasoning_format": Refused(NO_REASONING, values("none")),
}


def _no_penalty(fields: dict[str, Any]) -> bool:
    penalty = fields.get("repetition_penalty", fields.get("repeat_penalty"))
    return penalty is None or penalty == 1


def check_fields(body: Any, allow_unknown: bool) -> None:
    """APIError 400 naming the first field of `body` (a protocol request model) that a peer
    server defines and pagedllm cannot honour with the value given, or (unless
    `allow_unknown`) that no server defines."""
    extra = body.model_extra or {}
    if not extra:
        return
    declared = ("n", "repetition_penalty", "repeat_penalty")
    fields = {**{name: getattr(body, name, None) for name in declared}, **extra}
    for name, value in extra.items():
        refused = PEER_FIELDS.get(name)
        if refused is not None:
            if not refused.neutral(value, fields):
                raise APIError(
                    400,
                    f"{name}={value!r:.80} is not supported: {refused.reason}",
                    param=name,
                    code="unsupported_field",
                )
        elif not allow_unknown:
            raise APIError(
                400,
                f"unknown field {name!r}: this server does not define it, and ignoring it "
                "could change what you get; remove it (or start the server with "
                "--allow-unknown-fields)",
                param=name,
                code="unknown_field",
            )


# Fields of a chat message besides role, content, name, tool_calls, tool_call_id and the
# legacy function_call: what OpenAI's responses carry (and clients send back in the history)
# is accepted when empty; reasoning text is not passed to the template, so it is refused.
NO_REASONING_HISTORY = "reasoning in the history is not passed to the template"
MESSAGE_FIELDS: dict[str, Refused] = {
    "refusal": Refused("a refusal in the history is not passed to the template", empty),
    "audio": Refused("audio is not supported", empty),
    "annotations": Refused("annotations are not passed to the template", empty),
    "reasoning_content": Refused(NO_REASONING_HISTORY, empty),
    "reasoning": Refused(NO_REASONING_HISTORY, empty),
}


def check_message_fields(messages: list[Any], allow_unknown: bool) -> None:
    """APIError 400 naming the first message field that is not honoured (see check_fields)."""
    for index, message in enumerate(messages):
        for name, value in (message.model_extra or {}).items():
            where = f"messages[{index}].{name}"
            refused = MESSAGE_FIELDS.get(name)
            if refused is not None:
                if not refused.neutral(value, {}):
                    raise APIError(400, f"{where} is not supported: {refused.reason}",
                                   param=where, code="unsupported_field")  # fmt: skip
            elif not allow_unknown:
                raise APIError(
                    400,
                    f"unknown field {where}: remove it (or start the server with "
                    "--allow-unknown-fields)",
                    param=where,
                    code="unknown_field",
                )
