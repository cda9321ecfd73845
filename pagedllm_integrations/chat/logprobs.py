"""Engine logprobs in OpenAI's two shapes: chat (`content` entries) and legacy completions
(parallel lists). Each engine entry holds the sampled token with its true rank and the top
tokens (ranks 1..k); the sampled token is among the top only if its rank is."""

from __future__ import annotations

from typing import Any

from ..engine.outputs import Logprob

MISSING_LOGPROB = -9999.0  # OpenAI's stand-in for a token whose logprob is unknown


def _ranked(entry: dict[int, Logprob], top: int) -> list[tuple[int, Logprob]]:
    """The `top` most likely tokens of one position, most likely first."""
    return sorted(entry.items(), key=lambda item: item[1].rank)[:top]


def _text(logprob: Logprob | None, token_id: int) -> str:
    if logprob is None or logprob.decoded_token is None:
        return f"<token {token_id}>"
    return logprob.decoded_token


def chat_logprobs(
    token_ids: list[int], entries: list[dict[int, Logprob]], top: int
) -> list[dict[str, Any]]:
    """Chat shape: the `content` list of {token, logprob, bytes, top_logprobs}."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry.get(token_id)
        text = _text(chosen, token_id)
        content.append(
            {
                "token": text,
                "logprob": chosen.logprob if chosen is not None else MISSING_LOGPROB,
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {
                        "token": _text(lp, tid),
                        "logprob": lp.logprob,
                        "bytes": list(_text(lp, tid).encode("utf-8")),
                    }
                    for tid, lp in _ranked(entry, top)
                ],
            }
        )
    return content


def completion_logprobs(
    token_ids: list[int], entries: list[dict[int, Logprob]], top: int, text_offset: int
) -> dict[str, Any]:
    """Legacy completions shape: parallel lists, text offsets counted from `text_offset`."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry.get(token_id)
        text = _text(chosen, token_id)
        tokens.append(text)
        token_logprobs.append(chosen.logprob if chosen is not None else None)
        top_logprobs.append(
            {_text(lp, tid): lp.logprob for tid, lp in _ranked(entry, top)} if top else None
        )
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }
