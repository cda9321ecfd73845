"""Special-token strings inside message content stay text: no forged chat turns.

A chat template writes a conversation as text with the model's control tokens around each
turn (`<|im_start|>user ... <|im_end|>`), and tokenizing that text turns every such string
into its control token, also one that a user typed into a message: `<|im_start|>system` in
a user message would open a real system turn. With `split_special_tokens` (what the
tokenizers call it; on by default in the chat layer, so in every front end), the
special-token strings in message content (every role but the assistant's, whose text the
model wrote) and in the tool definitions are marked before rendering, and the marked ones
become plain-text tokens afterwards. The template's own tokens are untouched, and a
conversation without such strings tokenizes exactly as it always did.

The marks are ASCII with a random nonce, so they survive JSON dumps and templates, and
content cannot fake them.
"""

from __future__ import annotations

import contextlib
import re
import secrets
import weakref
from typing import Any

_PATTERNS: weakref.WeakKeyDictionary[Any, tuple[re.Pattern | None, frozenset[int]]] = (
    weakref.WeakKeyDictionary()
)


def _special_tokens(tokenizer: Any) -> tuple[re.Pattern | None, frozenset[int]]:
    """A pattern matching the tokenizer's special-token strings, and their ids (cached)."""
    try:
        return _PATTERNS[tokenizer]
    except (KeyError, TypeError):
        pass
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    tokens = {t.content: i for i, t in decoder.items() if getattr(t, "special", False)}
    if not tokens:  # a tokenizer without the added-token table: its named specials
        names = getattr(tokenizer, "all_special_tokens", None) or []
        tokens = {name: tokenizer.convert_tokens_to_ids(name) for name in names}
    strings = sorted((s for s in tokens if s), key=len, reverse=True)
    pattern = re.compile("|".join(map(re.escape, strings))) if strings else None
    found = (pattern, frozenset(tokens.values()))
    with contextlib.suppress(TypeError):  # not weak-referenceable: computed again next time
        _PATTERNS[tokenizer] = found
    return found


class ContentGuard:
    """Marks the special-token strings of one conversation, then tokenizes them as text."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.pattern, self.special_ids = _special_tokens(tokenizer)
        nonce = secrets.token_hex(8)
        self.open = f"[[pagedllm-text-{nonce}:"
        self.close = f":{nonce}]]"
        self._marks = re.compile(re.escape(self.open) + "(.*?)" + re.escape(self.close), re.S)

    # ------------------------------------------------------------------ marking
    def mark(self, text: str) -> str:
        if self.pattern is None or not isinstance(text, str):
            return text
        return self.pattern.sub(lambda m: self.open + m.group(0) + self.close, text)

    def mark_messages(self, messages: list[dict]) -> list[dict]:
        """Copies of the messages with the special-token strings in their content marked
        (and in tool-call arguments); assistant content is left as the model wrote it."""
        if self.pattern is None:
            return messages
        marked = []
        for message in messages:
            if not isinstance(message, dict):
                marked.append(message)
                continue
            out = dict(message)
            if message.get("role") != "assistant":
                out["content"] = self._mark_content(message.get("content"))
            if message.get("tool_calls"):
                out["tool_calls"] = self.mark_value(message["tool_calls"])
            marked.append(out)
        return marked

    def _mark_content(self, content: Any) -> Any:
        if isinstance(content, str):
            return self.mark(content)
        if isinstance(content, list):
            return [
                {**part, "text": self.mark(part["text"])}
                if isinstance(part, dict) and isinstance(part.get("text"), str)
                else self.mark(part)
                for part in content
            ]
        return content

    def mark_value(self, value: Any) -> Any:
        """Every string inside a JSON-like value (tools, call arguments), marked. The value
        passed the depth limits (engine/request_limits.py) before it gets here."""
        if self.pattern is None:
            return value
        if isinstance(value, str):
            return self.mark(value)
        if isinstance(value, dict):
            return {key: self.mark_value(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [self.mark_value(item) for item in value]
        return value

    # --------------------------------------------------------------- tokenizing
    def unmark(self, text: str) -> tuple[str, list[tuple[int, int]]]:
        """The text without marks, and the character spans that were marked."""
        spans: list[tuple[int, int]] = []
        pieces: list[str] = []
        length = position = 0
        for match in self._marks.finditer(text):
            before = text[position : match.start()]
            pieces.append(before)
            length += len(before)
            pieces.append(match.group(1))
            spans.append((length, length + len(match.group(1))))
            length += len(match.group(1))
            position = match.end()
        pieces.append(text[position:])
        # A template that cut a mark in two leaves halves behind: drop them as well.
        clean = "".join(pieces).replace(self.open, "").replace(self.close, "")
        return clean, spans

    def token_ids(self, text: str) -> list[int]:
        """Token ids of rendered text (no BOS added: the template holds it), the marked
        special-token strings as plain text."""
        tokenizer = self.tokenizer
        if self.open not in text and self.close not in text:
            return list(tokenizer(text, add_special_tokens=False).input_ids)
        clean, spans = self.unmark(text)
        try:
            encoded = tokenizer(clean, add_special_tokens=False, return_offsets_mapping=True)
            offsets = encoded["offset_mapping"]
        except (NotImplementedError, KeyError, TypeError, ValueError):
            return self._pieces(clean, spans)  # a slow tokenizer: no offsets
        ids: list[int] = []
        for token, (start, end) in zip(encoded["input_ids"], offsets):
            if token in self.special_ids and any(a < end and start < b for a, b in spans):
                ids.extend(self._as_text(clean[start:end]))
            else:
                ids.append(token)
        return ids

    def _as_text(self, text: str) -> list[int]:
        return list(
            self.tokenizer(text, add_special_tokens=False, split_special_tokens=True).input_ids
        )

    def _pieces(self, clean: str, spans: list[tuple[int, int]]) -> list[int]:
        ids: list[int] = []
        position = 0
        for start, end in spans:
            if start > position:
                ids.extend(
                    self.tokenizer(clean[position:start], add_special_tokens=False).input_ids
                )
            ids.extend(self._as_text(clean[start:end]))
            position = end
        if position < len(clean):
            ids.extend(self.tokenizer(clean[position:], add_special_tokens=False).input_ids)
        return ids
