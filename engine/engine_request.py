"""What crosses the EngineClient boundary: one frozen, picklable `EngineRequest`.

A front end's thread (or the Ray driver) tokenizes and validates a request once, with
`InputProcessor.process_inputs`, and gets an `EngineRequest`: plain data, no live state.
`EngineClient.submit` hands it to an engine thread, which builds its own state for it
(`engine/request_state.py`: the `Request`s with their detokenizers, grammar matchers and
seeded generators). A Ray replica receives the same object by pickle and does the same:
no second validation, tokenization or grammar compile.

    caller's thread                      engine thread
    process_inputs(prompt, params) ──>  EngineRequest ──submit──>  build_group ──> scheduler
                                          (frozen)                 (live Requests)

The compiled grammar of a constrained request travels with it (`CompiledStructure`): by
reference within one process, as xgrammar's serialized form across processes, where the
receiving engine deserializes it against its own tokenizer instead of compiling it again.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .pooling import PoolingParams
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .structured_outputs import CompiledStructure


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One validated request, as the engine receives it (vLLM's `EngineCoreRequest`).

    request_id: unique among the requests in flight on one engine.
    prompt: the caller's text, None when it gave token ids (outputs echo it).
    prompt_token_ids: the prompt as the model reads it.
    params: SamplingParams for generation (the model's defaults and EOS ids applied),
        PoolingParams for an embedding request.
    priority: lower runs first under scheduling_policy="priority".
    cache_salt: prefix-cache blocks are shared only between requests with the same salt.
    arrival_time: `time.monotonic()` when it was validated.
    client_id: who sent it (the server's per-client shares); None for the in-process caller.
    grammar: the compiled grammar of `params.structured_outputs`, None when unconstrained.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams | PoolingParams
    priority: int = 0
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    client_id: str | None = None
    grammar: CompiledStructure | None = None

    @classmethod
    def new(
        cls,
        prompt: str | None,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | PoolingParams,
        request_id: str | None = None,
        **fields: Any,
    ) -> EngineRequest:
        """A request under `request_id`, or a fresh random id when none is given."""
        return cls(
            request_id or uuid.uuid4().hex, prompt, tuple(prompt_token_ids), params, **fields
        )

    @property
    def is_embedding(self) -> bool:
        return isinstance(self.params, PoolingParams)

    @property
    def num_sequences(self) -> int:
        """The sequences it runs as: `n` samples of a generation, one for an embedding."""
        return 1 if isinstance(self.params, PoolingParams) else self.params.n

    def replace(self, **changes: Any) -> EngineRequest:
        """A copy with some fields changed (a client's id, a resumed prompt)."""
        return dataclasses.replace(self, **changes)
