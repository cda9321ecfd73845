"""P50/P99 from Prometheus buckets (PromQL's histogram_quantile) and what `pagedllm top`
shows of them and of each client's admissions."""

from __future__ import annotations

import math
import random

import pytest
from prometheus_client import generate_latest

from pagedllm_integrations.engine.metrics import (
    FinishedRequestStats,
    IterationStats,
    SchedulerStats,
)
from pagedllm_integrations.server import top
from pagedllm_integrations.server.metrics import PrometheusStatLogger, prompt_size_class
from pagedllm_integrations.server.quantiles import bucket_delta, histogram_quantile


def test_quantile_interpolates_inside_the_bucket_as_promql_does():
    buckets = {0.1: 10.0, 0.2: 30.0, 0.5: 40.0, math.inf: 40.0}
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.15)  # rank 20 in (0.1, 0.2]
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.488)  # rank 39.6 in (0.2, 0.5]
    assert histogram_quantile(0.05, buckets) == pytest.approx(0.02)  # rank 2 of 10 in (0, 0.1]
    assert histogram_quantile(0.9, {0.1: 5.0, math.inf: 10.0}) == pytest.approx(0.1)
    assert histogram_quantile(0.5, {0.1: 0.0, math.inf: 0.0}) is None
    assert histogram_quantile(0.5, {}) is None
    with pytest.raises(ValueError, match="q must be"):
        histogram_quantile(1.5, buckets)


def test_bucket_delta_keeps_only_the_observations_between_scrapes():
    before = {0.1: 3.0, math.inf: 4.0}
    after = {0.1: 5.0, math.inf: 9.0}
    assert bucket_delta(after, before) == {0.1: 2.0, math.inf: 5.0}


def test_top_shows_p50_p99_and_clients_from_a_real_registry():
    logger = PrometheusStatLogger("m")
    rng = random.Random(0)
    ttfts = [rng.uniform(0.02, 0.09) for _ in range(99)] + [3.0]  # one slow outlier
    iteration = IterationStats(time_to_first_tokens=ttfts, inter_token_latencies=[0.03] * 50)
    iteration.finished.append(FinishedRequestStats("length", 2.0, 5000, 10, queue_time=1.0))
    logger.record(SchedulerStats(), iteration)
    logger.record_client("user:alice", 4)
    logger.record_client("user:bob", 16, refused="client_limit_exceeded")
    snapshot = top.parse_metrics(generate_latest(logger.registry).decode(), at=1.0)
    ttft = snapshot.buckets["pagedllm:time_to_first_token_seconds"]
    # 99 of 100 observations are in (0.01, 0.1]: P50 there, P99 at its top edge.
    assert 0.01 < histogram_quantile(0.5, ttft) < 0.1
    assert histogram_quantile(0.99, ttft) == pytest.approx(0.1)
    assert histogram_quantile(1.0, ttft) == pytest.approx(5.0)  # the outlier's bucket
    screen = top.render("http://x", None, snapshot)
    assert "TTFT P50" in screen and "P99 100 ms" in screen
    assert "inter-token P50" in screen and "queue P50" in screen
    alice = next(line for line in screen.splitlines() if "user:alice" in line)
    bob = next(line for line in screen.splitlines() if "user:bob" in line)
    assert "admitted       4" in alice and "refused      0" in alice
    assert "admitted       0" in bob and "refused     16" in bob
    text = generate_latest(logger.registry).decode()
    by_size = "request_queue_time_by_prompt_size_seconds_count"
    assert f'{by_size}{{model_name="m",prompt_size="<=8192"}} 1.0' in text


def test_prompt_size_classes_and_the_client_label_bound():
    assert [prompt_size_class(n) for n in (1, 128, 129, 1024, 8192, 8193)] == [
        "<=128", "<=128", "<=1024", "<=1024", "<=8192", ">8192",
    ]  # fmt: skip
    logger = PrometheusStatLogger("m")
    for i in range(150):  # a client may pick any name: the series stay bounded
        logger.record_client(f"user:u{i}", 1)
    text = generate_latest(logger.registry).decode()
    assert text.count("client_sequences_admitted_total{") == 101  # 100 names + "other"
    assert 'client="other"' in text


def test_swap_tiers_and_the_kv_disk_tier_reach_prometheus_and_top():
    logger = PrometheusStatLogger("m")
    before = top.parse_metrics(generate_latest(logger.registry).decode(), at=0.0)
    assert "swap " not in top.render("http://x", None, before)  # no swap: no line
    assert "kv disk" not in top.render("http://x", None, before)
    stats = SchedulerStats(
        swapped_blocks_host=3, swapped_blocks_disk=5, blocks_swapped_out=12, blocks_swapped_in=4,
        blocks_swap_read_ahead=6, kv_disk_blocks=7, kv_disk_blocks_taken=20, kv_disk_block_reads=90,
        kv_disk_blocks_demoted=33,
    )  # fmt: skip
    logger.record(stats, IterationStats())
    logger.record(stats, IterationStats())  # totals are not counted twice
    text = generate_latest(logger.registry).decode()
    assert 'pagedllm:kv_swapped_blocks_disk{model_name="m"} 5.0' in text
    assert 'pagedllm:kv_blocks_swapped_out_total{model_name="m"} 12.0' in text
    screen = top.render("http://x", None, top.parse_metrics(text, at=1.0))
    swap = next(line for line in screen.splitlines() if line.startswith("swap"))
    assert "host      3" in swap and "disk      5" in swap and "out 12, back in 4" in swap
    assert "(read ahead 6)" in swap
    assert 'pagedllm:kv_blocks_swap_read_ahead_total{model_name="m"} 6.0' in text
    assert 'pagedllm:kv_disk_tier_block_reads_total{model_name="m"} 90.0' in text
    tier = next(line for line in screen.splitlines() if line.startswith("kv disk"))
    assert "in use      7" in tier and "taken 20, read by steps 90" in tier
    assert 'pagedllm:kv_disk_tier_blocks_demoted_total{model_name="m"} 33.0' in text
    assert "cached blocks moved in 33" in tier
