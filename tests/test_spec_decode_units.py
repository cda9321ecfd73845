"""Speculative decoding by prompt lookup, piece by piece and without a model: the config,
the n-gram proposer against a brute-force search, the verifier's greedy rule and its
rejection sampling against the target distribution (chi-square), the KV accounting of
drafted slots, and the metrics."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm_integrations import EngineConfig, SamplingParams
from pagedllm_integrations.engine.kv_cache_manager import KVCacheManager
from pagedllm_integrations.engine.metrics import (
    EngineCounters,
    IterationStats,
    SchedulerStats,
    SpecDecodingStats,
)
from pagedllm_integrations.engine.output_step import commit_step
from pagedllm_integrations.engine.request import Request, RequestStatus
from pagedllm_integrations.engine.sampler import Sampler
from pagedllm_integrations.engine.scheduler import Scheduler
from pagedllm_integrations.engine.spec_decode.config import SpeculativeConfig
from pagedllm_integrations.engine.spec_decode.ngram import MAX_OCCURRENCES, NgramProposer
from pagedllm_integrations.engine.spec_decode.verifier import DraftVerifier

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}


# ------------------------------------------------------------------------ config
def test_speculative_config_reads_vllms_dict_and_its_defaults():
    both = SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 3})
    assert (both.prompt_lookup_min, both.prompt_lookup_max) == (5, 5)  # vLLM's defaults
    only_max = SpeculativeConfig.from_value(NGRAM)
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    only_min = SpeculativeConfig.from_value({**NGRAM, "prompt_lookup_min": 2})
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (2, 4)
    legacy = SpeculativeConfig.from_value({"model": "[ngram]", "num_speculative_tokens": 2})
    assert legacy.method == "ngram"
    # The CLI's JSON text, and a config already built, give the same thing.
    assert SpeculativeConfig.from_value(json.dumps(NGRAM)) == only_max
    assert SpeculativeConfig.from_value(only_max) is only_max
    assert SpeculativeConfig.from_value(None) is None
    # pagedllm's own key: drafts bounded by their match (1.0) unless null asks for vLLM's rule.
    assert only_max.max_spec_factor == 1.0
    fixed = SpeculativeConfig.from_value(json.dumps({**NGRAM, "max_spec_factor": None}))
    assert fixed.max_spec_factor is None and fixed.to_dict()["max_spec_factor"] is None
    assert SpeculativeConfig.from_value({**NGRAM, "max_spec_factor": 2}).max_spec_factor == 2


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "not supported"),
        ({"model": "some/draft-model", "num_speculative_tokens": 2}, "draft models"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2}, "method"),
        ({**NGRAM, "num_speculative_tokens": 0}, ">= 1"),
        ({**NGRAM, "num_speculative_tokens": 1000}, "<= 64"),
        ({**NGRAM, "prompt_lookup_min": 5}, r"prompt_lookup_min \(5\) must be <="),
        ({**NGRAM, "disable_by_batch_size": 8}, "disable_by_batch_size"),
        ({**NGRAM, "max_spec_factor": 0}, "max_spec_factor must be a number > 0"),
        ({**NGRAM, "max_spec_factor": "1"}, "max_spec_factor must be a number > 0"),
        ({**NGRAM, "max_spec_factor": float("nan")}, "max_spec_factor must be a number > 0"),
        ({**NGRAM, "max_spec_factor": True}, "max_spec_factor must be a number > 0"),
        ("{not json", "not valid JSON"),
        (4, "must be a dict"),
    ],
)
def test_a_speculative_config_it_cannot_honour_is_refused(value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=value)


def test_engine_config_is_off_by_default_and_keeps_the_checked_config():
    assert EngineConfig().speculation is None
    config = EngineConfig.from_kwargs(speculative_config=NGRAM)
    assert config.speculation == SpeculativeConfig(4, 4, 4)
    # One engine serves every wrapper with the same settings: equal configs, equal keys.
    assert config.cache_key() == EngineConfig(speculative_config=json.dumps(NGRAM)).cache_key()
    assert config.cache_key() != EngineConfig().cache_key()


# ---------------------------------------------------------------------- proposer
def brute_force_draft(
    tokens: list[int], k: int, low: int, high: int, factor: float | None = None
) -> list[int]:
    """The rule written as a scan: longest n first, earliest occurrence that ends before the
    last token, the k tokens after it (at most factor * n of them)."""
    length = len(tokens)
    for n in range(min(high, length - 1), low - 1, -1):
        tail = tokens[length - n :]
        for start in range(0, length - n):
            if tokens[start : start + n] == tail:
                count = k if factor is None else min(k, int(factor * n))
                return tokens[start + n : start + n + count]
    return []


def request_of(tokens: list[int], max_tokens: int | None = 64) -> Request:
    return Request("r", list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def vllm_rule(k: int, high: int, low: int) -> SpeculativeConfig:
    """vLLM's n-gram method: always k draft tokens (no bound by the match's length)."""
    return SpeculativeConfig(k, high, low, max_spec_factor=None)


def test_the_proposer_follows_vllms_example_and_prefers_the_longest_match():
    proposer = NgramProposer(vllm_rule(4, 3, 2))
    assert proposer.propose(request_of([1, 2, 3, 4, 2, 3])) == [4, 2, 3]
    # [9, 2, 3] matches at the end (n = 3): its continuation wins over the earlier [2, 3].
    assert proposer.propose(request_of([2, 3, 5, 9, 2, 3, 7, 7, 9, 2, 3])) == [7, 7, 9, 2]
    assert proposer.propose(request_of([1, 2, 3, 4])) == []  # nothing repeats
    assert proposer.propose(request_of([1, 2, 3, 4, 2, 3]), max_tokens=1) == [4]


def test_by_default_a_draft_is_no_longer_than_its_match():
    """max_spec_factor 1.0 (the default): a 2-token match drafts 2, a 3-token match 3."""
    proposer = NgramProposer(SpeculativeConfig(4, prompt_lookup_max=3, prompt_lookup_min=2))
    assert proposer.propose(request_of([1, 2, 3, 4, 2, 3])) == [4, 2]
    assert proposer.propose(request_of([2, 3, 5, 9, 2, 3, 7, 7, 9, 2, 3])) == [7, 7, 9]
    half = NgramProposer(SpeculativeConfig(4, 3, 2, max_spec_factor=0.5))
    assert half.propose(request_of([1, 2, 3, 4, 2, 3])) == [4]
    assert half.propose(request_of([2, 3, 5, 9, 2, 3, 7, 7, 9, 2, 3])) == [7]
    double = NgramProposer(SpeculativeConfig(4, 3, 2, max_spec_factor=2.0))
    assert double.propose(request_of([1, 2, 3, 4, 2, 3])) == [4, 2, 3]


def test_a_proposal_walks_a_bounded_number_of_occurrences():
    """A min-gram that occurs more than MAX_OCCURRENCES times: only the first that many are
    followed back, so a longer match beyond them is not seen (the draft differs from
    vLLM's; the outputs never depend on drafts)."""
    filler = iter(range(1000, 2000))
    tokens = []
    for _ in range(MAX_OCCURRENCES):
        tokens += [9, 5, next(filler)]
    tokens += [8, 5, 42, 43, 0, 8, 5]  # the only earlier "8 5" lies past the bound
    proposer = NgramProposer(SpeculativeConfig(2, 3, 1, max_spec_factor=None))
    assert brute_force_draft(tokens, 2, 1, 3) == [42, 43]
    assert proposer.propose(request_of(tokens)) == [1000, 9]  # the first "5", matched n=1
    assert proposer.propose(request_of([*tokens[:-2], 9, 5])) == [1000, 9]  # n=2, earliest


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=40),
    k=st.integers(1, 5),
    low=st.integers(1, 3),
    extra=st.integers(0, 2),
    factor=st.sampled_from([None, 0.5, 1.0, 1.5]),
)
def test_the_incremental_index_proposes_what_a_full_scan_finds(tokens, k, low, extra, factor):
    """The index is extended as tokens are appended; at every length it must give what a
    scan of the whole sequence gives."""
    proposer = NgramProposer(SpeculativeConfig(k, low + extra, low, max_spec_factor=factor))
    request = request_of(tokens[:1])
    for token in tokens[1:]:
        request.append_output_token(token)
        assert proposer.propose(request) == brute_force_draft(
            request.all_token_ids, k, low, low + extra, factor
        )


# ---------------------------------------------------------------------- verifier
def verify(logits: torch.Tensor, requests: list[Request], drafts: list[list[int]], seed=0):
    sampler = Sampler(logits.shape[1], torch.device("cpu"), seed=seed)
    return DraftVerifier(sampler)(logits.clone(), requests, drafts)


def greedy_request(**params) -> Request:
    params.setdefault("max_tokens", 32)
    return Request("g", [0], SamplingParams(temperature=0, **params))


def test_greedy_verification_keeps_drafts_while_they_are_the_argmax():
    rows = torch.tensor(
        [
            [0.0, 5.0, 1.0, 0.0],  # argmax 1 = d1: kept
            [0.0, 0.0, 5.0, 1.0],  # argmax 2 = d2: kept
            [3.0, 0.0, 1.0, 0.0],  # argmax 0 != d3 = 3: rejected, 0 is emitted
            [0.0, 0.0, 0.0, 9.0],
        ]
    )
    out = verify(rows, [greedy_request()], [[1, 2, 3]])
    assert out.token_ids == [[1, 2, 0]] and out.num_accepted == [2]
    out = verify(rows[[0, 1, 3]], [greedy_request()], [[1, 2]])  # all kept: bonus token 3
    assert out.token_ids == [[1, 2, 3]] and out.num_accepted == [2]


def test_each_row_sees_the_drafts_before_it_as_outputs():
    """min_tokens and penalties at row j count the j drafts before it, as sequential
    decoding would have counted them as outputs."""
    eos = 3
    rows = torch.tensor([[0.0, 5.0, 0.0, 10.0]] * 3)
    request = greedy_request(min_tokens=1)
    request.sampling_params = request.sampling_params.clone(_eos_token_ids=(eos,))
    # Row 0 (no output yet) may not end: 1. Row 1 (one output: the draft) may: EOS, kept.
    assert verify(rows, [request], [[1, eos]]).token_ids == [[1, eos, eos]]
    rows = torch.tensor([[0.0, 3.0, 2.5, 0.0]] * 2)
    penalised = greedy_request(frequency_penalty=1.0)
    # Row 1 sees token 1 once already: 3 - 1 < 2.5, so the draft 1 is rejected for 2.
    assert verify(rows, [penalised], [[1]]).token_ids == [[1, 2]]


def chi_square_p_value(observed: list[int], expected: list[float]) -> float:
    """Pearson's goodness of fit over the cells with expected > 0 (P(chi2 >= statistic))."""
    cells = [(o, e) for o, e in zip(observed, expected) if e > 0]
    assert all(o == 0 for o, e in zip(observed, expected) if e == 0), (observed, expected)
    statistic = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(statistic / 2)))


def target(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """The distribution sequential decoding samples each row from, computed here by hand."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    cut = probs.topk(top_k, dim=-1).values[:, -1:]
    probs = torch.where(probs >= cut, probs, torch.zeros_like(probs))
    return probs / probs.sum(dim=-1, keepdim=True)


@pytest.mark.parametrize(("temperature", "top_k", "seeded"), [(1.0, 0, False), (0.7, 4, True)])
def test_rejection_sampling_keeps_the_target_distribution(temperature, top_k, seeded):
    """N sequences verify the same two drafts against the same three rows: the first
    token must follow p0, the second (where the first draft was kept) p1, and the bonus
    token (both kept) p2. Chi-square goodness of fit for each, and the same test must
    reject a distribution a little off the target (the test has the power to fail)."""
    vocab, n = 6, 20_000
    generator = torch.Generator().manual_seed(1)
    rows = torch.randn(3, vocab, generator=generator) * 1.5
    drafts = [int(rows[0].argsort()[-2]), int(rows[1].argmax())]  # likely, not certain
    params = SamplingParams(temperature=temperature, top_k=top_k, max_tokens=8)
    requests = []
    for i in range(n):
        request = Request(f"s{i}", [0], params)
        if seeded:
            request.generator = torch.Generator().manual_seed(i)
        requests.append(request)
    out = verify(rows.repeat(n, 1), requests, [drafts] * n)
    p = target(rows, temperature, top_k if top_k else vocab)
    first = Counter(tokens[0] for tokens in out.token_ids)
    kept_one = [tokens for tokens in out.token_ids if tokens[0] == drafts[0]]
    second = Counter(tokens[1] for tokens in kept_one)
    kept_two = [tokens for tokens in kept_one if tokens[1] == drafts[1]]
    third = Counter(tokens[2] for tokens in kept_two)
    assert len(kept_two) > 1000  # every position was exercised
    for counts, total, row in (
        (first, n, 0),
        (second, len(kept_one), 1),
        (third, len(kept_two), 2),
    ):
        observed = [counts[t] for t in range(vocab)]
        expected = [total * float(q) for q in p[row]]
        assert chi_square_p_value(observed, expected) > 1e-3, (row, observed, expected)
    # Power: 10% of mass moved onto the draft token is rejected outright at this N.
    off = 0.9 * p[0] + 0.1 * torch.nn.functional.one_hot(torch.tensor(drafts[0]), vocab)
    observed = [first[t] for t in range(vocab)]
    assert chi_square_p_value(observed, [n * float(q) for q in off]) < 1e-6
    # The acceptance counts say the same: draft 1 is kept with probability p0(d1).
    assert abs(len(kept_one) / n - float(p[0, drafts[0]])) < 4 * math.sqrt(0.25 / n)


def test_a_seeded_sequence_verifies_the_same_way_every_time():
    rows = torch.randn(3, 8, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0, max_tokens=8)

    def run(batch_seed: int) -> list[int]:
        request = Request("s", [0], params)
        request.generator = torch.Generator().manual_seed(42)
        return verify(rows, [request], [[1, 2]], seed=batch_seed).token_ids[0]

    assert all(run(batch_seed) == run(0) for batch_seed in range(1, 6))


# --------------------------------------------------------------- KV accounting
def test_drafted_slots_are_allocated_but_never_hashed_and_rejected_ones_come_back():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    request = Request("r", list(range(7)), SamplingParams(max_tokens=8))
    assert kv.allocate_slots(request, 7)
    request.num_computed_tokens = 7
    request.append_output_token(100)  # 8 tokens; the 8th is computed next, with 5 drafts
    assert kv.allocate_slots(request, 1, num_draft_tokens=5)
    assert kv.num_blocks_of("r") == 4  # slots for 13 tokens
    # Only block 1 (tokens 4..7, all the request's own) is newly hashed; the drafts' are not.
    hashed = [b.block_hash is not None for b in kv.req_blocks["r"][0]]
    assert hashed == [True, True, False, False]
    request.num_computed_tokens = 8 + 1  # one draft accepted
    kv.free_unused_slots(request)
    assert kv.num_blocks_of("r") == 3 and kv.pool.num_free_blocks == 5
    kv.pool.check_consistency()


def test_drafts_use_free_room_only_and_never_preempt():
    """Two decoding requests and blocks for their next token but not for drafts: both run,
    without drafts, and nobody is preempted."""
    proposer = NgramProposer(vllm_rule(4, 2, 1))
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=False)
    scheduler = Scheduler(kv, 8, 64, max_model_len=64, proposer=proposer)
    requests = [Request(f"r{i}", [5, 6, 5, 6, 5, 6, 5], SamplingParams(max_tokens=8)) for i in "ab"]
    for request in requests:
        scheduler.add_request(request)
    out = scheduler.schedule()  # both prompts: 7 tokens, 2 blocks each, all blocks used
    commit_step(scheduler, out, [[6], [6]])
    out = scheduler.schedule()  # token 8 fits in block 2 of each; drafts would need more
    assert [item.draft_token_ids for item in out.scheduled] == [[], []]
    assert not out.preempted and len(out.scheduled) == 2
    commit_step(scheduler, out, [[5], [5]])
    scheduler.finish_request(requests[1], RequestStatus.FINISHED_ABORTED)
    out = scheduler.schedule()  # now there is room: r_a drafts [6, 5, 6, 5]
    assert out.scheduled[0].draft_token_ids == [6, 5, 6, 5]
    assert out.num_draft_tokens == 4 and out.num_batched_tokens == 5


def test_drafts_stop_at_max_tokens_and_the_context_length():
    proposer = NgramProposer(vllm_rule(8, 2, 1))
    kv = KVCacheManager(num_blocks=32, block_size=4, enable_caching=False)
    scheduler = Scheduler(kv, 8, 64, max_model_len=12, proposer=proposer)
    request = Request("r", [1, 2, 1, 2, 1, 2], SamplingParams(max_tokens=4, ignore_eos=True))
    scheduler.add_request(request)
    commit_step(scheduler, scheduler.schedule(), [[1]])
    out = scheduler.schedule()
    # 1 output of 4: the last token needs no draft, so 2 drafts (not 8).
    assert out.scheduled[0].draft_token_ids == [2, 1]
    request.sampling_params = request.sampling_params.clone(max_tokens=100)
    commit_step(scheduler, out, [[2, 1, 2]])  # both drafts kept, then one more
    assert (request.num_tokens, request.num_computed_tokens) == (10, 9)
    out = scheduler.schedule()
    # Position 9 is computed anyway; max_model_len 12 leaves positions 10 and 11 for drafts.
    assert out.scheduled[0].draft_token_ids == [1, 2]


# ------------------------------------------------------------------------ metrics
def test_counters_and_prometheus_report_drafts_and_acceptance_per_position():
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from pagedllm_integrations.server.metrics import PrometheusStatLogger

    iteration = IterationStats()
    iteration.record_drafts([3, 2, 3], [3, 0, 1])
    counters, prometheus = EngineCounters(), PrometheusStatLogger("m")
    for logger in (counters, prometheus):
        logger.record(SchedulerStats(), iteration)
    snapshot = counters.snapshot()
    assert snapshot["spec_decode_num_drafts"] == 3
    assert snapshot["spec_decode_num_draft_tokens"] == 8
    assert snapshot["spec_decode_num_accepted_tokens"] == 4
    assert snapshot["spec_decode_acceptance_rate"] == 0.5
    assert snapshot["spec_decode_draft_tokens_per_position"] == [3, 3, 2]
    assert snapshot["spec_decode_accepted_tokens_per_position"] == [2, 1, 1]
    assert snapshot["spec_decode_acceptance_rate_per_position"] == [2 / 3, 1 / 3, 0.5]
    values = {}
    for family in text_string_to_metric_families(generate_latest(prometheus.registry).decode()):
        for sample in family.samples:
            values[(sample.name, sample.labels.get("position"))] = sample.value
    assert values[("pagedllm:spec_decode_num_draft_tokens_total", None)] == 8
    assert values[("pagedllm:spec_decode_num_accepted_tokens_total", None)] == 4
    assert values[("pagedllm:spec_decode_num_accepted_tokens_per_pos_total", "0")] == 2
    assert values[("pagedllm:spec_decode_num_draft_tokens_per_pos_total", "2")] == 2
    assert values[("pagedllm:spec_decode_acceptance_rate", None)] == 0.5
    assert values[("pagedllm:spec_decode_acceptance_rate_per_pos", "1")] == pytest.approx(1 / 3)
    # Replicas' snapshots add up (Ray data parallelism sums them and recomputes the rates).
    total = SpecDecodingStats.from_dict(snapshot)
    total.add(SpecDecodingStats.from_dict(snapshot))
    assert total.as_dict()["spec_decode_draft_tokens_per_position"] == [6, 6, 4]
    assert (
        total.acceptance_rate_per_position == snapshot["spec_decode_acceptance_rate_per_position"]
    )


def test_the_cli_flag_reaches_the_engine_config():
    import argparse

    from pagedllm_integrations.cli import main
    from pagedllm_integrations.cli_generate import add_engine_arguments, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--speculative-config", json.dumps(NGRAM)])
    assert EngineConfig.from_kwargs(**engine_kwargs(args)).speculation == SpeculativeConfig(4, 4, 4)
    assert EngineConfig.from_kwargs(**engine_kwargs(parser.parse_args([]))).speculation is None
    # A config that cannot be honoured stops `serve` with a message before any model loads.
    assert main(["serve", "--speculative-config", '{"method": "eagle"}']) == 2
