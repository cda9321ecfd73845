"""Refuse a prompt that cannot fit before tokenizing it: a bound from its length in characters.

No token of a tokenizer covers more characters of the text than its longest vocabulary
entry (`token_chars`), so a text of C characters has at least ceil(C / token_chars) tokens.
When that alone reaches max_model_len the prompt cannot fit, and it is refused in
microseconds instead of after seconds of tokenizing (4 MiB of text took ~4 s, holding one of
the server's few prepare threads). The bound never refuses a prompt that fits.

It holds only for tokenizers that never shorten the text before matching tokens: a BPE
model (byte-level, or with byte fallback, or one unknown token per character), with no
normalizer that drops or merges characters (NFC, accent stripping, lowercasing to a shorter
form) and no pre-tokenizer that removes characters (whitespace splitting). Vocabulary
entries are measured in their stored form, never shorter than the text they stand for:
one character per byte for byte-level BPE, `<0x0A>` for one byte, `▁` for a space. Any
other tokenizer gets no bound (`token_chars` None): its prompts are tokenized and then
refused, as before.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import Any

from .errors import APIError

logger = logging.getLogger(__name__)

# Normalizers and pre-tokenizers that never make the text shorter.
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"}


@dataclass(slots=True, frozen=True)
class PromptBound:
    max_model_len: int
    token_chars: int | None  # characters the longest token covers; None: no bound

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, max_model_len: int) -> PromptBound:
        chars, reason = longest_token_chars(tokenizer)
        if chars is None:
            logger.info("no early length check for this tokenizer: %s", reason)
        return cls(max_model_len, chars)

    def min_tokens(self, chars: int) -> int:
        """Tokens a text of `chars` characters has at least (0 when there is no bound)."""
        if self.token_chars is None:
            return 0
        return math.ceil(chars / self.token_chars)

    def check(self, chars: int, wanted: int | None, param: str) -> None:
        """APIError 400 when a prompt of `chars` characters, plus `wanted` tokens to
        generate, surely does not fit the context."""
        if self.token_chars is None:
            return
        at_least = self.min_tokens(chars)
        limit = self.max_model_len
        if at_least >= limit:
            raise APIError(
                400,
                f"this model's maximum context length is {limit} tokens (max_model_len); the "
                f"prompt has {chars} characters, so at least {at_least} tokens (no token of "
                f"this tokenizer covers more than {self.token_chars} characters): the prompt "
                "and at least one generated token must fit; shorten the prompt",
                param=param,
                code="context_length_exceeded",
            )
        if wanted is not None and at_least + wanted > limit:
            raise APIError(
                400,
                f"this model's maximum context length is {limit} tokens (max_model_len); the "
                f"prompt has at least {at_least} tokens ({chars} characters) and {wanted} more "
                f"are asked for: lower max_tokens or shorten the prompt",
                param="max_tokens",
                code="context_length_exceeded",
            )


def longest_token_chars(tokenizer: Any) -> tuple[int | None, str]:
    """(characters of text the longest token covers at most, "") or (None, why no bound)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None, "not a fast (Rust) tokenizer"
    try:
        state = json.loads(backend.to_str())
    except (ValueError, AttributeError) as error:
        return None, f"its definition could not be read ({error})"
    model = state.get("model") or {}
    if model.get("type") != "BPE":
        return None, f"its model is {model.get('type')}, not BPE"
    if model.get("unk_token") is not None and model.get("fuse_unk"):
        return None, "it fuses runs of unknown characters into one token"
    problem = _shortening(state.get("normalizer"), "normalizer") or _shortening(
        state.get("pre_tokenizer"), "pre_tokenizer"
    )
    if problem:
        return None, problem
    lengths = [len(token) for token in tokenizer.get_vocab()]
    for added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        lengths.append(len(getattr(added, "content", "") or ""))
    longest = max(lengths, default=0)
    if longest < 1:
        return None, "its vocabulary is empty"
    return longest, ""


def _shortening(component: dict | None, kind: str) -> str | None:
    """Why a normalizer or pre-tokenizer may make the text shorter, or None if it never does."""
    if component is None:
        return None
    name = component.get("type")
    if name == "Sequence":
        parts = component.get("normalizers") or component.get("pretokenizers") or []
        for part in parts:
            problem = _shortening(part, kind)
            if problem:
                return problem
        return None
    if kind == "normalizer":
        if name == "Prepend":
            return None
        if name == "Replace":
            pattern = component.get("pattern") or {}
            old = pattern.get("String")
            if isinstance(old, str) and len(component.get("content") or "") >= len(old):
                return None
        return f"its normalizer {name} may shorten the text"
    if name in _KEEPING_PRE_TOKENIZERS:
        return None
    if name == "Split" and component.get("behavior") != "Removed":
        return None
    return f"its pre-tokenizer {name} may drop characters"
