"""benchmarks.systems: which baselines share a child process; the drafter's batch size read
from its /metrics."""

from __future__ import annotations

import pytest
from prometheus_client import start_http_server

from benchmarks.systems import BATCH_ROWS, Histogram, batch_rows, child_groups, scrape_histogram
from specdec import telemetry
from specdec_cli.launch import free_port


def _vllm(method: str | None = None) -> dict:
    return {"kind": "vllm", "speculative_config": {"method": method} if method else None}


def test_every_baseline_shares_one_child_with_an_ngram_job_last() -> None:
    jobs = [_vllm(), _vllm("ngram"), _vllm("draft_model"), {"kind": "hf-assisted"}, _vllm()]
    assert child_groups(jobs) == [[0, 2, 3, 4, 1]]


def test_a_second_ngram_job_starts_another_child() -> None:
    # vLLM 0.32 starts no engine in a process after an n-gram engine ran there
    jobs = [_vllm("ngram"), _vllm(), _vllm("ngram"), _vllm("draft_model")]
    assert child_groups(jobs) == [[1, 3, 0], [2]]
    assert child_groups([]) == []


def test_batch_rows_is_the_histograms_difference_over_the_workload() -> None:
    before = Histogram({1.0: 4.0, 2.0: 4.0, 3.0: 6.0, float("inf"): 6.0}, sum=10.0, count=6.0)
    # the workload: one forward of 1 row, three of 3 rows
    after = Histogram({1.0: 5.0, 2.0: 5.0, 3.0: 10.0, float("inf"): 10.0}, sum=20.0, count=10.0)
    assert batch_rows(before, after) == {"forwards": 4, "mean": 2.5, "max": 3, "histogram": {"1": 1, "3": 3}}
    assert batch_rows(after, after) == {"forwards": 0, "mean": None, "max": None, "histogram": {}}
    huge = Histogram({1.0: 5.0, 2.0: 5.0, 3.0: 10.0, float("inf"): 11.0}, sum=520.0, count=11.0)
    assert batch_rows(after, huge)["max"] is None  # more rows than the last finite bound: no max to give


def test_batch_rows_mean_is_exact_when_a_scrape_caught_an_observation_half_made() -> None:
    """prometheus_client adds to `_sum` before the bucket and reads the buckets before `_sum`: a
    scrape during an observation has its rows in `_sum` but not its bucket. The mean of forwards
    that all fell in one-integer buckets comes from the buckets, so it stays exact (a bench row
    read 51/52 rows per forward from `_sum`)."""
    before = Histogram({1.0: 4.0, 2.0: 4.0, 3.0: 4.0, float("inf"): 4.0}, sum=4.0 + 1.0, count=4.0)  # 1 row half-made
    after = Histogram({1.0: 56.0, 2.0: 56.0, 3.0: 56.0, float("inf"): 56.0}, sum=56.0, count=56.0)
    assert batch_rows(before, after) == {"forwards": 52, "mean": 1.0, "max": 1, "histogram": {"1": 52}}
    # forwards in a coarser bucket (rows in (3, 8]): the mean falls back to `_sum`
    coarse = {1.0: 0.0, 3.0: 0.0, 8.0: 2.0, float("inf"): 2.0}
    assert batch_rows(Histogram(dict.fromkeys(coarse, 0.0), 0.0, 0.0), Histogram(coarse, 11.0, 2.0))["mean"] == 5.5


def test_a_drafters_batch_rows_are_read_from_its_metrics_endpoint() -> None:
    """The drafter's own families on a real /metrics endpoint (what `specdec serve drafter`
    serves); the bench reads the histogram there, before and after a workload."""
    metrics = telemetry.DrafterMetrics(telemetry.service_registry("drafter"))
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=metrics.registry)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        before = scrape_histogram(url, BATCH_ROWS)
        assert before.count == 0 and before.buckets[1.0] == 0 and max(before.buckets) == float("inf")
        for rows in (3, 3, 1, 16, 40):
            metrics.batch_rows.observe(rows)
        after = scrape_histogram(url, BATCH_ROWS)
        assert batch_rows(before, after) == {
            "forwards": 5,
            "mean": 63 / 5,
            "max": 48,
            "histogram": {"1": 1, "3": 2, "16": 1, "48": 1},
        }
        with pytest.raises(RuntimeError, match="no histogram specdec:nothing"):
            scrape_histogram(url, "specdec:nothing")
    finally:
        server.shutdown()
        thread.join(10)
