"""Incremental detokenization and stop strings.

Text is decoded from a sliding window of token ids: `prefix_offset..read_offset` is text
already emitted, `read_offset..` is new. Decoding the window with and without the new
tokens and taking the difference handles tokenizers whose pieces depend on neighbours
(sentencepiece's leading spaces). A token that ends inside a UTF-8 character decodes to
U+FFFD; the text is held back until the character completes.

Stop strings are searched in the new text plus the tail that could start one. While a
request runs, the last `max(len(stop)) - 1` characters are held back from the streamed
text, so a caller never sees the beginning of a stop string that is then cut.
"""

from __future__ import annotations

from typing import Any

# Prompt tokens decoded with the first output tokens: enough context for a leading space.
_INITIAL_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        context = prompt_token_ids[-_INITIAL_CONTEXT_TOKENS:]
        self.token_ids: list[int] = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.output_text = ""
        self.stop = stop or []
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stop_buffer = max((len(s) for s in self.stop), default=1) - 1
        self.emitted_chars = 0  # characters handed to the caller so far

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def token_text(self, token_id: int) -> str:
        """One token on its own, as logprobs show it."""
        return self.tokenizer.decode([token_id])

    def add_token(self, token_id: int) -> str | None:
        """Append one token; returns the stop string matched, if any (text is then cut)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return None  # nothing printable yet (special token, or a split UTF-8 character)
        new_text = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        previous_len = len(self.output_text)
        self.output_text += new_text
        return self._check_stop(previous_len, len(new_text))

    def _check_stop(self, previous_len: int, new_len: int) -> str | None:
        if not self.stop:
            return None
        for stop in self.stop:
            # A stop string may begin in earlier text and end in the new text.
            start_search = max(0, previous_len - len(stop) + 1)
            index = self.output_text.find(stop, start_search)
            if index != -1:
                end = index + len(stop) if self.include_stop_str_in_output else index
                self.output_text = self.output_text[:end]
                return stop
        return None

    def flush(self) -> None:
        """At the end of a request: emit a held-back tail (e.g. a truncated UTF-8 character)."""
        if self.read_offset == len(self.token_ids):
            return
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        self.output_text += full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset = len(self.token_ids)

    def streamable_text(self, finished: bool) -> str:
        """Text safe to show now: all of it once finished, else minus a possible stop prefix."""
        if finished or not self.stop_buffer:
            return self.output_text
        return self.output_text[: max(len(self.output_text) - self.stop_buffer, 0)]
