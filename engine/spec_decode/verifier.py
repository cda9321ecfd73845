"""Verify draft tokens: the target's logits at every drafted position decide which stay.

A sequence with last token t and drafts d_1 .. d_k ran k + 1 query rows in the step, so it
has k + 1 logits rows: row j is the target's distribution p_j of the token after
t, d_1 .. d_j. Each row is processed exactly as sequential decoding would process it (logit
bias, min_tokens, the grammar's mask and the penalties as of d_1 .. d_j, then temperature,
min_p, top-k / top-p), so p_j is the distribution the token would be drawn from without
speculation.

    greedy:  keep d_{j+1} while it is the argmax of row j; the first row whose argmax
             differs (or row k, when every draft was kept) gives one more token.
    sampled: rejection sampling (Leviathan et al. 2023, Chen et al. 2023). A prompt-lookup
             draft is a point mass q = delta(d), so the acceptance min(1, p(d) / q(d)) is
             p_j(d_{j+1}): keep d_{j+1} when u < p_j(d_{j+1}), u ~ U[0, 1). At the first
             rejection draw from the residual max(0, p_j - q), that is p_j without
             d_{j+1}, renormalised; when all k were kept, draw the bonus token from p_k.

Each emitted token is distributed as p: P(x) = p(d) [x = d] + (1 - p(d)) p(x) / (1 - p(d))
[x != d] = p(x). Greedy verification gives the argmax sequence itself, and with the CPU fast
path's batch-invariant rows (a row's logits do not depend on how many query rows its step
carries) exactly the tokens decoding without speculation gives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..request import LogprobInfo, Request
from ..sampler import Sampler, greedy_argmax, logprob_info
from ..sampling_params import SamplingParams


@dataclass(slots=True)
class VerifiedDrafts:
    """Per verified sequence: the accepted drafts then one more token, and their logprobs."""

    token_ids: list[list[int]]
    logprobs: list[list[LogprobInfo | None]]
    num_accepted: list[int]


class _RowView:
    """A request as the sampler's masks and penalties see it at logits row j: the request
    with its first j drafts appended. The grammar is masked separately (its state moves
    along the drafts), so `structured` is None here."""

    __slots__ = ("_drafts", "_request", "sampling_params")
    structured = None

    def __init__(self, request: Request, drafts: list[int]):
        self._request = request
        self._drafts = drafts
        self.sampling_params: SamplingParams = request.sampling_params

    @property
    def num_output_tokens(self) -> int:
        return self._request.num_output_tokens + len(self._drafts)

    @property
    def output_token_ids(self) -> list[int]:
        return self._request.output_token_ids + self._drafts

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._request.prompt_token_ids


class DraftVerifier:
    """Turns the logits of drafting sequences into their committed tokens."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    @torch.inference_mode()
    def __call__(
        self, logits: torch.Tensor, requests: list[Request], drafts: list[list[int]]
    ) -> VerifiedDrafts:
        """logits [sum(1 + len(d)), V] float32: sequence i's 1 + len(drafts[i]) rows in
        order, sequences back to back (modified in place)."""
        first_rows: list[int] = []
        views: list[_RowView] = []
        for request, tokens in zip(requests, drafts):
            first_rows.append(len(views))
            views.extend(_RowView(request, tokens[:j]) for j in range(len(tokens) + 1))
        raw_logprobs = None
        if any(r.sampling_params.logprobs is not None for r in requests):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        limits = self._grammar_masks(logits, requests, drafts, first_rows)
        self.sampler.process_logits(logits, views)

        num_accepted = [0] * len(requests)
        emitted = [0] * len(requests)
        greedy = [i for i, r in enumerate(requests) if r.sampling_params.greedy]
        if greedy:
            choice = greedy_argmax(logits).tolist()  # the sampler's greedy pick
            for i in greedy:
                first, tokens = first_rows[i], drafts[i]
                accepted = 0
                while accepted < limits[i] and choice[first + accepted] == tokens[accepted]:
                    accepted += 1
                num_accepted[i], emitted[i] = accepted, choice[first + accepted]
        sampled = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if sampled:
            self._rejection_sample(
                logits, requests, drafts, first_rows, limits, sampled, num_accepted, emitted
            )

        token_ids: list[list[int]] = []
        logprobs: list[list[LogprobInfo | None]] = []
        for i, request in enumerate(requests):
            tokens = [*drafts[i][: num_accepted[i]], emitted[i]]
            token_ids.append(tokens)
            k = request.sampling_params.logprobs
            if raw_logprobs is None or k is None:
                logprobs.append([None] * len(tokens))
                continue
            rows = raw_logprobs[first_rows[i] : first_rows[i] + len(tokens)]
            logprobs.append([logprob_info(row, t, k) for row, t in zip(rows, tokens)])
        return VerifiedDrafts(token_ids, logprobs, num_accepted)

    def _grammar_masks(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        drafts: list[list[int]],
        first_rows: list[int],
    ) -> list[int]:
        """Mask constrained rows along their drafts; per sequence, the most drafts that
        can be accepted (a draft its grammar refuses, and every one after it, cannot)."""
        limits = [len(tokens) for tokens in drafts]
        constrained = [i for i, r in enumerate(requests) if r.structured is not None]
        if constrained:
            from ..structured_outputs import apply_draft_grammar_masks

            allowed = apply_draft_grammar_masks(
                logits,
                [first_rows[i] for i in constrained],
                [requests[i].structured for i in constrained],
                [drafts[i] for i in constrained],
            )
            for i, limit in zip(constrained, allowed):
                limits[i] = limit
        return limits

    def _rejection_sample(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        drafts: list[list[int]],
        first_rows: list[int],
        limits: list[int],
        sampled: list[int],
        num_accepted: list[int],
        emitted: list[int],
    ) -> None:
        """The sampled sequences' accepted drafts and emitted token (see the module doc)."""
        rows = [first_rows[i] + j for i in sampled for j in range(len(drafts[i]) + 1)]
        params = [requests[i].sampling_params for i in sampled for _ in range(len(drafts[i]) + 1)]
        chosen = logits if len(rows) == logits.shape[0] else logits[rows]
        probs = self.sampler.probabilities(chosen, params)  # [rows, V], unnormalised
        starts = [0]  # each sequence's first row in probs
        for i in sampled:
            starts.append(starts[-1] + len(drafts[i]) + 1)
        # p_j(d_{j+1}) for every draft at once: the draft's share of its row.
        draft_rows = [starts[n] + j for n, i in enumerate(sampled) for j in range(len(drafts[i]))]
        draft_tokens = [t for i in sampled for t in drafts[i]]
        index = torch.tensor(draft_rows, dtype=torch.long, device=probs.device)
        token_index = torch.tensor(draft_tokens, dtype=torch.long, device=probs.device)
        draft_probs = (probs[index, token_index] / probs[index].sum(dim=-1)).tolist()
        uniforms = self._uniforms([requests[i] for i in sampled], [len(drafts[i]) for i in sampled])
        emit_rows, rejected, rejected_tokens = [], [], []
        offset = 0  # this sequence's first draft in draft_probs
        for n, i in enumerate(sampled):
            tokens, u = drafts[i], uniforms[n]
            accepted = 0
            while accepted < limits[i] and u[accepted] < draft_probs[offset + accepted]:
                accepted += 1
            num_accepted[i] = accepted
            emit_rows.append(starts[n] + accepted)
            if accepted < len(tokens):  # rejected: draw from p without the draft
                rejected.append(n)
                rejected_tokens.append(tokens[accepted])
            offset += len(tokens)
        emission = probs[emit_rows]  # [len(sampled), V], a copy
        if rejected:
            emission[rejected, rejected_tokens] = 0.0
        drawn = self.sampler.draw(emission, [requests[i] for i in sampled]).tolist()
        for i, token in zip(sampled, drawn):
            emitted[i] = token

    def _uniforms(self, requests: list[Request], counts: list[int]) -> list[list[float]]:
        """U[0, 1) draws, counts[i] for requests[i]: a seeded request's from its own
        generator, the others' from the engine's."""
        unseeded = sum(c for r, c in zip(requests, counts) if r.generator is None)
        engine = self.sampler.generator
        shared = (
            torch.rand(unseeded, generator=engine, device=engine.device).tolist()
            if unseeded
            else []
        )
        out, used = [], 0
        for request, count in zip(requests, counts):
            if request.generator is not None:
                g = request.generator
                out.append(torch.rand(count, generator=g, device=g.device).tolist())
            else:
                out.append(shared[used : used + count])
                used += count
        return out
