"""`pagedllm top`: a live terminal view of a running server, read from its /metrics.

    pagedllm top --url http://127.0.0.1:8000

Rates (tokens/s) are counter deltas between two scrapes divided by the time between them.
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from .metrics import PREFIX
from .quantiles import bucket_delta, histogram_quantile

_CLEAR = "\x1b[H\x1b[2J"


@dataclass(slots=True)
class Snapshot:
    at: float
    values: dict[str, float] = field(default_factory=dict)  # sample name -> sum over labels
    finished: dict[str, float] = field(default_factory=dict)  # finished_reason -> count
    model_names: set[str] = field(default_factory=set)
    # histogram name -> {upper bound: cumulative count}, summed over other labels
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)
    # client -> [sequences admitted, sequences refused]
    clients: dict[str, list[float]] = field(default_factory=dict)

    def get(self, name: str) -> float:
        return self.values.get(PREFIX + name, 0.0)


def parse_metrics(text: str, at: float) -> Snapshot:
    from prometheus_client.parser import text_string_to_metric_families

    snapshot = Snapshot(at)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith(PREFIX):
                continue
            snapshot.values[sample.name] = snapshot.values.get(sample.name, 0.0) + sample.value
            if "model_name" in sample.labels:
                snapshot.model_names.add(sample.labels["model_name"])
            if sample.name.endswith("_bucket") and "le" in sample.labels:
                histogram = snapshot.buckets.setdefault(sample.name[: -len("_bucket")], {})
                bound = float(sample.labels["le"])
                histogram[bound] = histogram.get(bound, 0.0) + sample.value
            if sample.name.startswith(PREFIX + "client_sequences_") and sample.name.endswith(
                "_total"
            ):
                counts = snapshot.clients.setdefault(sample.labels.get("client", "?"), [0.0, 0.0])
                counts[sample.name.endswith("refused_total")] += sample.value
            if sample.name == PREFIX + "request_success_total":
                reason = sample.labels.get("finished_reason", "?")
                snapshot.finished[reason] = snapshot.finished.get(reason, 0.0) + sample.value
    return snapshot


def scrape(url: str, api_key: str | None = None, timeout: float = 5.0) -> Snapshot:
    request = urllib.request.Request(url.rstrip("/") + "/metrics")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        text = response.read().decode("utf-8")
    return parse_metrics(text, time.monotonic())


def _rate(previous: Snapshot | None, current: Snapshot, name: str) -> float:
    if previous is None:
        return 0.0
    elapsed = current.at - previous.at
    return max(current.get(name) - previous.get(name), 0.0) / elapsed if elapsed > 0 else 0.0


def _mean_delta(previous: Snapshot | None, current: Snapshot, histogram: str) -> float | None:
    """Mean of the observations made between two scrapes (None when there were none)."""
    base = previous or Snapshot(0.0)
    count = current.get(histogram + "_count") - base.get(histogram + "_count")
    total = current.get(histogram + "_sum") - base.get(histogram + "_sum")
    return total / count if count > 0 else None


def _quantiles(previous: Snapshot | None, current: Snapshot, histogram: str) -> str:
    """'P50 x ms  P99 y ms' of the observations between two scrapes (since start on the
    first), or '-' when there were none."""
    name = PREFIX + histogram
    buckets = current.buckets.get(name, {})
    if previous is not None:
        buckets = bucket_delta(buckets, previous.buckets.get(name, {}))
    p50, p99 = histogram_quantile(0.5, buckets), histogram_quantile(0.99, buckets)
    if p50 is None or p99 is None:
        return "-"
    return f"P50 {1000 * p50:.0f} ms  P99 {1000 * p99:.0f} ms"


def _client_lines(current: Snapshot, limit: int = 5) -> list[str]:
    """The clients with the most sequences admitted: admitted and refused since start."""
    ranked = sorted(current.clients.items(), key=lambda item: -item[1][0])[:limit]
    return [
        f"client     {name[:40]:<40} admitted {int(admitted):>7}   refused {int(refused):>6}"
        for name, (admitted, refused) in ranked
    ]


def render(url: str, previous: Snapshot | None, current: Snapshot) -> str:
    queries = current.get("prefix_cache_queries_total")
    hit_rate = current.get("prefix_cache_hits_total") / queries if queries else 0.0
    ttft = _mean_delta(previous, current, "time_to_first_token_seconds")
    itl = _mean_delta(previous, current, "inter_token_latency_seconds")
    finished = ", ".join(f"{k} {int(v)}" for k, v in sorted(current.finished.items())) or "none"
    kv = current.get("kv_cache_usage_perc")
    bar = "#" * round(20 * kv) + "." * (20 - round(20 * kv))
    lines = [
        f"pagedllm top - {url} - {', '.join(sorted(current.model_names)) or '?'}",
        f"requests   running {int(current.get('num_requests_running')):>5}   "
        f"waiting {int(current.get('num_requests_waiting')):>5}   finished: {finished}",
        f"tokens/s   prompt {_rate(previous, current, 'prompt_tokens_total'):>8.1f}   "
        f"generation {_rate(previous, current, 'generation_tokens_total'):>8.1f}",
        f"KV cache   [{bar}] {100 * kv:5.1f}%   prefix-cache hits {100 * hit_rate:5.1f}%   "
        f"preemptions {int(current.get('num_preemptions_total'))}",
        "latency    TTFT "
        + (f"{1000 * ttft:.0f} ms" if ttft is not None else "-")
        + "   inter-token "
        + (f"{1000 * itl:.0f} ms" if itl is not None else "-"),
        "           TTFT " + _quantiles(previous, current, "time_to_first_token_seconds")
        + "   inter-token " + _quantiles(previous, current, "inter_token_latency_seconds"),
        "           queue " + _quantiles(previous, current, "request_queue_time_seconds"),
        *_client_lines(current),
    ]  # fmt: skip
    swapped_out = current.get("kv_blocks_swapped_out_total")
    if swapped_out:  # swap space is on and preemption has used it
        lines.append(
            f"swap       waiting blocks: host {int(current.get('kv_swapped_blocks_host')):>6}   "
            f"disk {int(current.get('kv_swapped_blocks_disk')):>6}   copied out "
            f"{int(swapped_out)}, back in {int(current.get('kv_blocks_swapped_in_total'))} "
            f"(read ahead {int(current.get('kv_blocks_swap_read_ahead_total') or 0)})"
        )
    taken = current.get("kv_disk_tier_blocks_taken_total")
    demoted = current.get("kv_disk_tier_blocks_demoted_total")
    if taken or demoted:  # the KV disk tier is on and memory has run out into it
        lines.append(
            f"kv disk    blocks in use {int(current.get('kv_disk_tier_blocks')):>6}   taken "
            f"{int(taken or 0)}, read by steps "
            f"{int(current.get('kv_disk_tier_block_reads_total'))}, cached blocks moved in "
            f"{int(demoted or 0)}"
        )
    drafted = current.get("spec_decode_num_draft_tokens_total")
    if drafted:  # speculative decoding is on and has drafted
        accepted = current.get("spec_decode_num_accepted_tokens_total")
        lines.append(
            f"drafts     {100 * accepted / drafted:5.1f}% of {int(drafted)} draft tokens accepted"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    parser.add_argument("--api-key", default=None)
    parser.add_argument(
        "--iterations", type=int, default=0, help="stop after this many refreshes (0: never)"
    )


def run(args: argparse.Namespace) -> int:
    if args.interval <= 0:
        print("pagedllm top: --interval must be > 0", file=sys.stderr)
        return 2
    interactive = sys.stdout.isatty()
    previous: Snapshot | None = None
    count = 0
    try:
        while True:
            try:
                current = scrape(args.url, args.api_key)
            except (urllib.error.URLError, OSError, ValueError) as error:
                print(f"pagedllm top: cannot read {args.url}/metrics: {error}", file=sys.stderr)
                return 1
            frame = render(args.url, previous, current)
            print((_CLEAR if interactive else "") + frame, flush=True)
            previous = current
            count += 1
            if args.iterations and count >= args.iterations:
                return 0
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
