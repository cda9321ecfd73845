"""Engine thread: from a frozen `EngineRequest` to the live state that runs it.

The caller's thread validated the request (`engine/input_processor.py`); what is built here
is mutable and belongs to the engine thread alone: one `Request` per sample with its
incremental detokenizer, its grammar matcher and its seeded `torch.Generator`, or the
pooling state of an embedding request, gathered in the `RequestGroup` that outputs are
made from. Nothing here can fail on a request the input processor accepted, except a
grammar received from another process that does not fit this engine's tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .detokenizer import IncrementalDetokenizer
from .engine_request import EngineRequest
from .output_processor import RequestGroup
from .pooling import PoolerConfig, PoolingParams, PoolingState
from .request import Request
from .sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from .structured_outputs import StructuredOutputManager

# What an embedding request's Request carries in place of sampling settings (it samples
# nothing).
NO_SAMPLING = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)


class RequestStateBuilder:
    """Builds `RequestGroup`s for one engine (its tokenizer, device and pooler).

    structured_outputs: gives the engine's grammar manager (made on first use: an engine
    that never sees a constraint never loads the grammar library).
    """

    def __init__(
        self,
        tokenizer: Any,
        device: torch.device,
        pooler: PoolerConfig,
        structured_outputs: Callable[[], StructuredOutputManager],
    ):
        self.tokenizer = tokenizer
        self.device = device  # where seeded requests' generators live
        self.pooler = pooler
        self._structured_outputs = structured_outputs

    def build(self, request: EngineRequest) -> RequestGroup:
        if isinstance(request.params, PoolingParams):
            return self._embedding_group(request, request.params)
        return self._generation_group(request, request.params)

    def _generation_group(self, request: EngineRequest, params: SamplingParams) -> RequestGroup:
        token_ids = list(request.prompt_token_ids)
        grammar = None
        if request.grammar is not None:
            grammar = self._structured_outputs().adopt(request.grammar)
        children = []
        for index in range(params.n):
            child = _sequence(
                request,
                token_ids,
                params,
                request.request_id if params.n == 1 else f"{request.request_id}#{index}",
                sample_index=index,
                generator=self._generator(params, index),
                logprobs=[] if params.logprobs is not None else None,
            )
            child.detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                token_ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
                stop=list(params.stop or []),
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
            if grammar is not None:
                child.structured = self._structured_outputs().new_matcher(grammar)
            children.append(child)
        return RequestGroup(
            request.request_id,
            request.prompt,
            token_ids,
            params,
            children,
            request.arrival_time,
            sent=[(0, 0)] * params.n,
        )

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        """Sample `index`'s own random stream when the request is seeded (seed + index)."""
        if params.seed is None:
            return None
        generator = torch.Generator(device=self.device)
        generator.manual_seed(params.seed + index)
        return generator

    def _embedding_group(self, request: EngineRequest, params: PoolingParams) -> RequestGroup:
        token_ids = list(request.prompt_token_ids)
        pooler = self.pooler
        state = PoolingState(params, pooler.pooling_type, pooler.normalize, pooler.dense)
        child = _sequence(request, token_ids, NO_SAMPLING, request.request_id, pooling=state)
        return RequestGroup(
            request.request_id,
            request.prompt,
            token_ids,
            NO_SAMPLING,
            [child],
            request.arrival_time,
            sent=[(0, 0)],
        )


def _sequence(
    request: EngineRequest,
    token_ids: list[int],
    params: SamplingParams,
    sequence_id: str,
    **state: Any,
) -> Request:
    """One sequence of `request` (a sample, or the embedding request itself)."""
    return Request(
        request_id=sequence_id,
        prompt_token_ids=token_ids,
        sampling_params=params,
        priority=request.priority,
        cache_salt=request.cache_salt,
        arrival_time=request.arrival_time,
        client_id=request.client_id,
        parent_id=request.request_id,
        **state,
    )
