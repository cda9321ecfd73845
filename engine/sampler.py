"""Batched sampling: one [N, vocab] tensor of logits in, one token per row out.

Order of processing (as vLLM): logit bias, min_tokens and grammar masks -> penalties ->
(greedy rows take the argmax here) -> temperature -> min_p -> top_k / top_p -> a draw from
each row's distribution by its inverse CDF, one uniform number per row, from the row's own
generator when the request is seeded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .request import Request


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    # Per row: (sampled token logprob, its rank, top-k ids, top-k logprobs), or None.
    logprobs: list[tuple[float, int, list[int], list[float]] | None]


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0):
        self.vocab_size = vocab_size
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    @torch.inference_mode()  # logits come from the model's inference-mode forward pass
    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """logits [N, V] float32 (one row per request), may be modified in place."""
        num_rows = logits.shape[0]
        params = [r.sampling_params for r in requests]
        want_logprobs = [p.logprobs is not None for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

        self.process_logits(logits, requests)

        greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        sampled = greedy_argmax(logits)
        if not bool(greedy.all()):
            random_rows = (~greedy).nonzero().flatten().tolist()
            sub = logits[random_rows]
            sub_requests = [requests[i] for i in random_rows]
            sampled[random_rows] = self._sample(sub, sub_requests)

        token_ids = sampled.tolist()
        logprobs: list = [None] * num_rows
        if raw_logprobs is not None:
            for row, request in enumerate(requests):
                k = request.sampling_params.logprobs
                if k is not None:
                    logprobs[row] = logprob_info(raw_logprobs[row], token_ids[row], k)
        return SamplerOutput(token_ids, logprobs)

    # ------------------------------------------------------------------ masks
    def process_logits(self, logits: torch.Tensor, requests: list) -> None:
        """Logit bias, min_tokens and grammar masks, then penalties, in place: what the rows
        are chosen from. logits [N, V]; requests[i] (or a view with the same attributes:
        sampling_params, num_output_tokens, output_token_ids, prompt_token_ids, structured)
        is row i's."""
        self._apply_masks(logits, requests)
        self._apply_penalties(logits, requests)

    def _apply_masks(self, logits: torch.Tensor, requests: list[Request]) -> None:
        constrained: list[int] = []
        for row, request in enumerate(requests):
            params = request.sampling_params
            if params.logit_bias:
                ids = torch.tensor(list(params.logit_bias), device=logits.device)
                bias = torch.tensor(list(params.logit_bias.values()), device=logits.device)
                valid = (ids >= 0) & (ids < logits.shape[1])
                logits[row, ids[valid]] += bias[valid].to(logits.dtype)
            if request.num_output_tokens < params.min_tokens:
                banned = list(params.stop_token_ids or [])
                if not params.ignore_eos:
                    banned += list(params._eos_token_ids)
                if banned:
                    logits[row, banned] = float("-inf")
            if request.structured is not None:
                constrained.append(row)
        if constrained:
            # All grammar rows in one packed bitmask and one masking op.
            from .structured_outputs import apply_grammar_masks

            apply_grammar_masks(logits, constrained, [requests[i].structured for i in constrained])

    def _apply_penalties(self, logits: torch.Tensor, requests: list[Request]) -> None:
        rows = [
            i
            for i, r in enumerate(requests)
            if r.sampling_params.repetition_penalty != 1.0
            or r.sampling_params.presence_penalty
            or r.sampling_params.frequency_penalty
        ]
        if not rows:
            return
        device, vocab = logits.device, logits.shape[1]
        counts = torch.zeros(len(rows), vocab, device=device)
        seen = torch.zeros(len(rows), vocab, dtype=torch.bool, device=device)
        for j, i in enumerate(rows):
            request = requests[i]
            out = torch.tensor(request.output_token_ids, dtype=torch.long, device=device)
            out = out[out < vocab]
            counts[j].index_add_(0, out, torch.ones(out.shape[0], device=device))
            prompt = torch.tensor(request.prompt_token_ids, dtype=torch.long, device=device)
            seen[j, prompt[prompt < vocab]] = True
        seen |= counts > 0
        params = [requests[i].sampling_params for i in rows]
        rep = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
        freq = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
        pres = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
        sub = logits[rows]
        penalised = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalised, sub)
        sub = sub - freq * counts - pres * (counts > 0).to(sub.dtype)
        logits[rows] = sub

    # --------------------------------------------------------------- sampling
    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        params = [r.sampling_params for r in requests]
        if _cpu_sampling(logits) and all(_temperature_only(p, logits.shape[1]) for p in params):
            # Softmax and the inverse-CDF draw per row in C++ on the kernels' threads: the
            # same rule and the same uniforms (one per row, from the same generators), up to
            # float32 rounding at a token boundary; torch's softmax, cumulative sums and
            # searches on one thread took ~10 ms a step at 64 rows of a 49k vocabulary.
            temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
            return torch.ops.pagedllm.sample_rows(
                logits, temperature, _uniforms(requests, self.generator)
            )
        probs = self.probabilities(logits, params)
        return _draw(probs, requests, self.generator)

    def probabilities(self, logits: torch.Tensor, params: list) -> torch.Tensor:
        """What each row samples from, [N, V]: temperature, softmax, min_p, top-k / top-p.

        A row is proportional to its distribution (min_p cuts without renormalising).
        logits: [N, V] after masks and penalties; params: the rows' SamplingParams.
        """
        device = logits.device
        temperature = torch.tensor([p.temperature for p in params], device=device)[:, None]
        logits = logits / temperature
        min_p = torch.tensor([p.min_p for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        vocab = logits.shape[1]  # a top_k beyond the vocabulary keeps all of it
        top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params],
                             device=device)  # fmt: skip
        probs = torch.softmax(logits, dim=-1)
        if bool((min_p > 0).any()):
            threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        if bool((top_p < 1.0).any()) or bool((top_k < logits.shape[1]).any()):
            probs = _top_k_top_p(probs, top_k, top_p)
        return probs

    def draw(self, probs: torch.Tensor, requests: list) -> torch.Tensor:
        """One token per row of probs [N, V] (proportional to a distribution), with each
        seeded request's own generator (see `_draw`)."""
        return _draw(probs, requests, self.generator)


def logprob_info(
    row_logprobs: torch.Tensor, token_id: int, k: int
) -> tuple[float, int, list[int], list[float]]:
    """(the token's logprob, its rank, the top-k ids, the top-k logprobs) of one row [V]."""
    chosen = row_logprobs[token_id]
    rank = int((row_logprobs > chosen).sum().item()) + 1
    top = torch.topk(row_logprobs, k) if k > 0 else None
    return (
        float(chosen),
        rank,
        top.indices.tolist() if top is not None else [],
        top.values.tolist() if top is not None else [],
    )


def _temperature_only(params, vocab: int) -> bool:
    """Whether a row samples from softmax(logits / temperature) with no cut (min_p, top-k,
    top-p)."""
    return params.min_p <= 0 and params.top_p >= 1.0 and not 0 < params.top_k < vocab


def _cpu_sampling(logits: torch.Tensor) -> bool:
    """Whether the C++ kernels can take these [N, V] logits (argmax_rows, sample_rows)."""
    return (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and _cpu_kernels()
    )


def _uniforms(requests: list, generator: torch.Generator) -> torch.Tensor:
    """One uniform in [0, 1) per row, from the row's own generator when the request is
    seeded (as `_draw` takes them)."""
    return torch.cat([torch.rand(1, generator=r.generator or generator) for r in requests])


def _draw(probs: torch.Tensor, requests: list[Request], generator: torch.Generator) -> torch.Tensor:
    """One token per row of probs [N, V] (rows need not sum to 1), by the inverse of its
    cumulative distribution: the first token whose cumulative mass exceeds u * total, u
    uniform in [0, 1). Tokens of zero probability are never chosen (their cumulative mass
    does not rise). One uniform per row, drawn from the row's own generator when the
    request is seeded: ~0.1 ms a row, where exponential noise over the vocabulary costs 1.5.

    Each row's cumulative sum is taken on its own: torch sums a batch of rows in another
    order than a single row, and a seeded request must draw the same token whatever shares
    its step."""
    chosen = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    for i, request in enumerate(requests):
        row = probs[i]
        cdf = row.cumsum(dim=0)
        u = torch.rand(1, generator=request.generator or generator, device=probs.device)
        index = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
        if index >= row.shape[0]:  # u * total rounded up to the total
            index = int(row.nonzero()[-1])  # the last token of positive mass
        chosen[i] = index
    return chosen


def greedy_argmax(x: torch.Tensor) -> torch.Tensor:
    """The index of each row's first maximum, as argmax: `max(dim).indices` is the same
    index and, on CPU, 2-4x faster than torch's argmax (15 ms against 3 for 64 rows of a
    49k vocabulary); the C++ kernel, where it is loaded, another ~20x (its own threads,
    vectorised)."""
    if _cpu_sampling(x):
        return torch.ops.pagedllm.argmax_rows(x)
    return x.max(dim=-1).indices


def _cpu_kernels() -> bool:
    """Whether the C++ CPU kernels are loaded (never builds them: the fast path does)."""
    from ..kernels import cpu_ext

    return cpu_ext.is_loaded()


# The top candidates taken first for top-k / top-p; the width doubles while some row's
# nucleus does not fit. A full sort of the vocabulary costs ~6 ms a row on CPU.
_FIRST_WIDTH = 64


def _top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero the probabilities outside each row's top-k and its top-p nucleus.

    probs [N, V] (rows sum to 1), top_k [N] (V = no limit), top_p [N]. The kept tokens are
    renormalised within the top-k before the nucleus cut, as applying the two in sequence
    does. Rows with neither limit pass unchanged. Only each row's largest `width`
    probabilities are sorted: enough once every row's top-k fits in them and its nucleus
    closes inside them (the width grows until it does)."""
    vocab = probs.shape[1]
    limited = top_k < vocab
    active = limited | (top_p < 1.0)
    if not bool(active.all()):
        rows = active.nonzero().flatten()
        out = probs.clone()
        if rows.numel():
            out[rows] = _top_k_top_p(probs[rows], top_k[rows], top_p[rows])
        return out
    width = max(_FIRST_WIDTH, int(top_k[limited].max()) if bool(limited.any()) else 0)
    while True:
        width = min(width, vocab)
        sorted_probs, order = probs.topk(width, dim=-1)  # descending
        rank = torch.arange(width, device=probs.device)[None, :]
        keep = rank < top_k[:, None]
        sorted_probs = sorted_probs * keep
        # Renormalise over the top-k (a row without top-k: over its whole vocabulary).
        total = torch.where(limited, sorted_probs.sum(dim=-1), probs.sum(dim=-1))[:, None]
        sorted_probs = sorted_probs / total
        mass = sorted_probs.cumsum(dim=-1)
        closed = limited | (mass[:, -1] >= top_p)  # no token past `width` could be kept
        if width == vocab or bool(closed.all()):
            break
        width *= 4
    keep &= (mass - sorted_probs) < top_p[:, None]
    keep[:, 0] = True  # never drop the most likely token
    filtered = torch.zeros_like(probs)
    filtered.scatter_(1, order, sorted_probs * keep)
    return filtered
