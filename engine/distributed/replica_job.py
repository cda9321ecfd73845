"""One request as the replica client tracks it: what the caller has seen, and how to resume.

When a replica dies mid-stream the request is retried once on another replica. If the caller
has seen nothing yet (FINAL_ONLY outputs, or a death before the first token) the request
simply runs again. If it has seen tokens, a single-sequence request without a grammar
continues where it stopped: the new replica gets prompt + the tokens generated so far as its
prompt and the remaining token budget, and the client stitches the new outputs onto what it
already delivered, so the stream the caller reads has no seam:

    delivered:      prompt | g0 g1 g2            (replica A dies)
    resumed on B:   prompt g0 g1 g2 | g3 g4 ...   -> caller sees g3 g4 ... after g2

Requests with n > 1 or a grammar cannot be resumed mid-stream (their other sequences and
grammar state died with the replica); they fail with a clear error if they had streamed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..async_engine import RequestStream
from ..engine_request import EngineRequest
from ..outputs import CompletionOutput, RequestOutput
from ..sampling_params import RequestOutputKind, SamplingParams


@dataclass(slots=True)
class _Seen:
    """What the caller has received for one completion index."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list | None = None
    cumulative_logprob: float | None = None


@dataclass(eq=False, slots=True)
class ReplicaJob:
    request: EngineRequest  # as the caller's thread validated it
    stream: RequestStream
    seen: dict[int, _Seen] = field(default_factory=dict)
    base: _Seen | None = None  # set while resumed: what the new replica does not know about
    pending_text: str = ""  # text of the base tokens the caller has not been shown yet
    replica: int | None = None
    aborted: bool = False
    attempts: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt(self) -> str | None:
        """The caller's text (None when it gave token ids)."""
        return self.request.prompt

    @property
    def prompt_token_ids(self) -> list[int]:
        return list(self.request.prompt_token_ids)

    @property
    def params(self) -> SamplingParams:
        assert isinstance(self.request.params, SamplingParams)
        return self.request.params

    # ------------------------------------------------------------- submission
    def next_request(self) -> EngineRequest:
        """The request for the next attempt: the caller's own, or, when the caller has seen
        tokens, one that resumes after them (prompt + those tokens, the budget left)."""
        if self.base is None:
            return self.request
        done = len(self.base.token_ids)
        changes: dict[str, Any] = {"min_tokens": max(self.params.min_tokens - done, 0)}
        if self.params.max_tokens is not None:
            changes["max_tokens"] = self.params.max_tokens - done
        return self.request.replace(
            prompt=None,
            prompt_token_ids=tuple(self.prompt_token_ids + self.base.token_ids),
            params=self.params.clone(**changes),
        )

    def prepare_retry(self, tokenizer) -> str | None:
        """Set up the next attempt; a reason string when this request cannot be retried."""
        if self.attempts >= 2:
            return "it was already retried once"
        seen = self.seen.get(0)
        if not self.seen or seen is None or not seen.token_ids:
            self.base, self.seen = None, {}
            return None  # nothing delivered: run it again from the start
        if self.params.n != 1 or self.params.structured_outputs is not None:
            return "a stream with n > 1 or a grammar cannot be resumed on another replica"
        # The text of the generated tokens as the new replica will see it (its detokenizer
        # starts after them); anything the caller has not been shown yet is sent first.
        text = _continuation_text(tokenizer, self.prompt_token_ids, seen.token_ids, self.params)
        if not text.startswith(seen.text):
            text = seen.text
        self.pending_text = text[len(seen.text) :]
        self.base = _Seen(
            list(seen.token_ids),
            text,
            list(seen.logprobs) if seen.logprobs is not None else None,
            seen.cumulative_logprob,
        )
        return None

    # ---------------------------------------------------------------- outputs
    def stitch(self, output: RequestOutput) -> RequestOutput:
        """The output as the caller must see it, and remember what it has now seen."""
        output.prompt = self.prompt
        output.prompt_token_ids = self.prompt_token_ids
        kind = self.params.output_kind
        completions = []
        for c in output.outputs:
            if self.base is not None:
                c = self._join(c, kind)
            seen = self.seen.setdefault(c.index, _Seen())
            if kind == RequestOutputKind.DELTA:
                seen.token_ids.extend(c.token_ids)
                seen.text += c.text
                if c.logprobs is not None:
                    seen.logprobs = (seen.logprobs or []) + list(c.logprobs)
            else:
                seen.token_ids = list(c.token_ids)
                seen.text = c.text
                seen.logprobs = list(c.logprobs) if c.logprobs is not None else None
            seen.cumulative_logprob = c.cumulative_logprob
            completions.append(c)
        output.outputs = completions
        return output

    def _join(self, c: CompletionOutput, kind: RequestOutputKind) -> CompletionOutput:
        base = self.base
        assert base is not None
        cumulative = c.cumulative_logprob
        if cumulative is not None and base.cumulative_logprob is not None:
            cumulative += base.cumulative_logprob
        if kind == RequestOutputKind.DELTA:
            # Text of the old tokens the caller has not seen (held back by the old replica,
            # e.g. a possible stop-string start): sent once, before the new text.
            missing, self.pending_text = self.pending_text, ""
            return dataclasses.replace(c, text=missing + c.text, cumulative_logprob=cumulative)
        logprobs = c.logprobs
        if logprobs is not None and base.logprobs is not None:
            logprobs = base.logprobs + list(logprobs)
        return dataclasses.replace(
            c,
            text=base.text + c.text,
            token_ids=base.token_ids + list(c.token_ids),
            logprobs=logprobs,
            cumulative_logprob=cumulative,
        )

    def abort_output(self) -> RequestOutput:
        """A final output for a request aborted while no replica held it."""
        delta = self.params.output_kind == RequestOutputKind.DELTA
        outputs = []
        for index in range(self.params.n):
            seen = self.seen.get(index, _Seen())
            outputs.append(
                CompletionOutput(
                    index=index,
                    text="" if delta else seen.text,
                    token_ids=[] if delta else list(seen.token_ids),
                    cumulative_logprob=seen.cumulative_logprob,
                    logprobs=None,
                    finish_reason="abort",
                )
            )
        return RequestOutput(
            self.request_id, self.prompt, self.prompt_token_ids, outputs, finished=True
        )


def _continuation_text(tokenizer, prompt_ids: list[int], generated: list[int], params) -> str:
    kwargs = {"skip_special_tokens": params.skip_special_tokens}
    before = tokenizer.decode(prompt_ids, **kwargs)
    full = tokenizer.decode(prompt_ids + generated, **kwargs)
    return full[len(before) :] if full.startswith(before) else tokenizer.decode(generated, **kwargs)
