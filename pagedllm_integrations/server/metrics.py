"""Prometheus metrics fed by the engine: vLLM's names after a `pagedllm:` prefix.

`PrometheusStatLogger.record` runs on the engine thread once per step, so it only bumps
counters and observes histograms (prometheus-client's are thread-safe and cheap). The engine
reports cumulative prefix-cache (memory and disk) and preemption totals; they become
counters through deltas.
Aborted requests never pass through an engine step's finished list, so the server reports
them itself with `record_aborted` (finished_reason="abort").

Speculative decoding (vLLM's names): spec_decode_num_drafts, _num_draft_tokens and
_num_accepted_tokens counters, _num_accepted_tokens_per_pos and _num_draft_tokens_per_pos
by `position` (0 = the first draft token), and the acceptance rate since start as gauges
(spec_decode_acceptance_rate, and _acceptance_rate_per_pos by `position`).
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..engine.metrics import IterationStats, SchedulerStats, SpecDecodingStats

PREFIX = "pagedllm:"

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)  # fmt: skip
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
# Queue time by prompt size: the upper bounds (tokens) of the `prompt_size` label's classes.
_PROMPT_SIZES = (128, 1024, 8192)
# Distinct client labels kept; later clients are counted as "other" (a client can pick any
# `user` name, and each label is a time series the scraper keeps).
MAX_CLIENT_LABELS = 100


def prompt_size_class(num_prompt_tokens: int) -> str:
    for bound in _PROMPT_SIZES:
        if num_prompt_tokens <= bound:
            return f"<={bound}"
    return f">{_PROMPT_SIZES[-1]}"


class PrometheusStatLogger:
    """Owns one registry (one per app, so several apps in one process never collide)."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        label = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, label, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, label, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(PREFIX + name, doc, label, buckets=buckets, registry=r).labels(
                model_name
            )

        self.running = gauge("num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).")
        self.prefix_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Sequences preempted for lack of KV blocks.")
        self.disk_loaded = counter(
            "prefix_cache_disk_loaded_tokens",
            "Prompt tokens whose KV blocks were read from the prefix-cache directory.",
        )
        self.disk_written = counter(
            "prefix_cache_disk_written_tokens",
            "Tokens whose KV blocks were written to the prefix-cache directory.",
        )
        self.swapped_host = gauge(
            "kv_swapped_blocks_host", "KV blocks of preempted requests waiting in host memory."
        )
        self.swapped_disk = gauge(
            "kv_swapped_blocks_disk", "KV blocks of preempted requests waiting on disk."
        )
        self.swapped_out = counter(
            "kv_blocks_swapped_out", "KV blocks copied from the cache to swap space."
        )
        self.swapped_in = counter(
            "kv_blocks_swapped_in", "KV blocks copied from swap space back to the cache."
        )
        self.swap_read_ahead = counter(
            "kv_blocks_swap_read_ahead",
            "Disk swap blocks read ahead of their request's resumption.",
        )
        self.kv_disk_blocks = gauge(
            "kv_disk_tier_blocks", "KV blocks of running requests in the KV disk tier's file."
        )
        self.kv_disk_taken = counter(
            "kv_disk_tier_blocks_taken",
            "KV blocks handed out from the disk tier (memory had none free).",
        )
        self.kv_disk_reads = counter(
            "kv_disk_tier_block_reads", "KV blocks of the disk tier read by steps' attention."
        )
        self.kv_disk_demoted = counter(
            "kv_disk_tier_blocks_demoted",
            "Cold prefix-cache blocks moved from memory into the disk tier, not dropped.",
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self._success = Counter(
            PREFIX + "request_success",
            "Finished sequences by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.ttft = histogram(
            "time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between two tokens.", _LATENCY_BUCKETS
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Arrival to finish of a sequence.", _E2E_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first schedule.", _E2E_BUCKETS
        )
        self._queue_time_by_size = Histogram(
            PREFIX + "request_queue_time_by_prompt_size_seconds",
            "Arrival to first schedule, by the prompt's size class in tokens.",
            ["model_name", "prompt_size"],
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self._client_admitted = Counter(
            PREFIX + "client_sequences_admitted",
            "Sequences (prompts x n) admitted, by client (server/clients.py).",
            ["model_name", "client"],
            registry=r,
        )
        self._client_refused = Counter(
            PREFIX + "client_sequences_refused",
            "Sequences refused, by client and reason (client_limit_exceeded: larger than a "
            "client may have; client_queue_full: the client's limit is taken; queue_full: "
            "the server's; too_large: larger than the server admits).",
            ["model_name", "client", "reason"],
            registry=r,
        )
        self._client_labels: set[str] = set()
        self.request_prompt = histogram(
            "request_prompt_tokens", "Prompt tokens per finished sequence.", _TOKEN_BUCKETS
        )
        self.request_generation = histogram(
            "request_generation_tokens", "Generated tokens per finished sequence.", _TOKEN_BUCKETS
        )
        self.spec_drafts = counter(
            "spec_decode_num_drafts", "Sequences that verified speculative draft tokens."
        )
        self.spec_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Speculative draft tokens verified."
        )
        self.spec_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Speculative draft tokens accepted."
        )
        by_position = ["model_name", "position"]
        self._spec_accepted_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft (0 = first).",
            by_position,
            registry=r,
        )
        self._spec_drafted_per_pos = Counter(
            PREFIX + "spec_decode_num_draft_tokens_per_pos",
            "Draft tokens verified, by position in the draft (0 = first).",
            by_position,
            registry=r,
        )
        self.spec_acceptance = gauge(
            "spec_decode_acceptance_rate", "Accepted / verified draft tokens since start (0-1)."
        )
        self._spec_acceptance_per_pos = Gauge(
            PREFIX + "spec_decode_acceptance_rate_per_pos",
            "Accepted / verified draft tokens at each draft position since start (0-1).",
            by_position,
            registry=r,
        )
        self._spec_total = SpecDecodingStats()
        self._lock = threading.Lock()
        # prefix queries, prefix hits, preemptions, disk-loaded and disk-written tokens,
        # blocks swapped out, in and read ahead, disk-tier blocks taken, read and demoted
        self._last_cumulative: tuple[int, ...] = (0,) * 11

    # ----------------------------------------------------- engine thread, every step
    def record(self, scheduler: SchedulerStats, iteration: IterationStats) -> None:
        self.update_scheduler(scheduler)
        if iteration.num_prompt_tokens:
            self.prompt_tokens.inc(iteration.num_prompt_tokens)
        if iteration.num_generation_tokens:
            self.generation_tokens.inc(iteration.num_generation_tokens)
        if iteration.spec is not None:
            self._record_spec(iteration.spec)
        for value in iteration.time_to_first_tokens:
            self.ttft.observe(value)
        for value in iteration.inter_token_latencies:
            self.itl.observe(value)
        for finished in iteration.finished:
            self._success.labels(self.model_name, finished.finish_reason).inc()
            self.e2e.observe(finished.e2e_latency)
            self.queue_time.observe(finished.queue_time)
            size = prompt_size_class(finished.num_prompt_tokens)
            self._queue_time_by_size.labels(self.model_name, size).observe(finished.queue_time)
            self.request_prompt.observe(finished.num_prompt_tokens)
            self.request_generation.observe(finished.num_generation_tokens)

    def _record_spec(self, spec: SpecDecodingStats) -> None:
        self.spec_drafts.inc(spec.num_drafts)
        self.spec_draft_tokens.inc(spec.num_draft_tokens)
        self.spec_accepted_tokens.inc(spec.num_accepted_tokens)
        for position, (drafted, accepted) in enumerate(
            zip(spec.draft_tokens_per_position, spec.accepted_tokens_per_position)
        ):
            label = str(position)
            self._spec_drafted_per_pos.labels(self.model_name, label).inc(drafted)
            self._spec_accepted_per_pos.labels(self.model_name, label).inc(accepted)
        total = self._spec_total
        total.add(spec)
        self.spec_acceptance.set(total.acceptance_rate)
        for position, rate in enumerate(total.acceptance_rate_per_position):
            self._spec_acceptance_per_pos.labels(self.model_name, str(position)).set(rate)

    def update_scheduler(self, scheduler: SchedulerStats) -> None:
        """Gauges and the engine's cumulative totals (also called at scrape time)."""
        self.running.set(scheduler.num_running)
        self.waiting.set(scheduler.num_waiting)
        self.kv_usage.set(scheduler.kv_cache_usage)
        self.swapped_host.set(scheduler.swapped_blocks_host)
        self.swapped_disk.set(scheduler.swapped_blocks_disk)
        self.kv_disk_blocks.set(scheduler.kv_disk_blocks)
        current = (
            scheduler.prefix_cache_queries,
            scheduler.prefix_cache_hits,
            scheduler.num_preemptions,
            scheduler.prefix_cache_disk_loaded,
            scheduler.prefix_cache_disk_written,
            scheduler.blocks_swapped_out,
            scheduler.blocks_swapped_in,
            scheduler.blocks_swap_read_ahead,
            scheduler.kv_disk_blocks_taken,
            scheduler.kv_disk_block_reads,
            scheduler.kv_disk_blocks_demoted,
        )
        with self._lock:
            # max(): a total never goes back, even if two snapshots arrive out of order.
            deltas = [max(c - last, 0) for c, last in zip(current, self._last_cumulative)]
            self._last_cumulative = tuple(
                max(c, last) for c, last in zip(current, self._last_cumulative)
            )
        cumulative = (
            self.prefix_queries, self.prefix_hits, self.preemptions,
            self.disk_loaded, self.disk_written, self.swapped_out, self.swapped_in,
            self.swap_read_ahead,
            self.kv_disk_taken, self.kv_disk_reads, self.kv_disk_demoted,
        )  # fmt: skip
        for metric, delta in zip(cumulative, deltas):
            if delta:
                metric.inc(delta)

    # ------------------------------------------------------------ server, any thread
    def record_client(self, client: str, sequences: int, refused: str | None = None) -> None:
        """A request's sequences admitted for `client`, or refused for reason `refused`."""
        with self._lock:
            if client not in self._client_labels:
                if len(self._client_labels) >= MAX_CLIENT_LABELS:
                    client = "other"
                else:
                    self._client_labels.add(client)
        if refused is None:
            self._client_admitted.labels(self.model_name, client).inc(sequences)
        else:
            self._client_refused.labels(self.model_name, client, refused).inc(sequences)

    def record_aborted(self, num_prompt_tokens: int, generated_per_sequence: list[int]) -> None:
        """An aborted request (its client went away): counted as finished_reason 'abort'."""
        for generated in generated_per_sequence:
            self._success.labels(self.model_name, "abort").inc()
            self.request_prompt.observe(num_prompt_tokens)
            self.request_generation.observe(generated)
