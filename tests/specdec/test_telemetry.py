"""Spike detection, the span file format, `specdec traces` on synthetic spans, and each
service's metrics registry (its own families and the shared ones, nothing else)."""

from __future__ import annotations

import json

import prometheus_client
import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from specdec import __version__, telemetry
from specdec.telemetry import SPIKE_WARMUP, JsonLinesExporter, SpikeDetector
from specdec_cli import traces


def test_relative_spikes_after_warmup() -> None:
    d = SpikeDetector(factor=3.0, min_ms=5.0)
    for _ in range(SPIKE_WARMUP):
        assert d.check({"verify": 10.0, "draft": 2.0}) == {}  # warming up
    assert d.check({"verify": 11.0, "draft": 2.0}) == {}
    spiked = d.check({"verify": 100.0, "draft": 6.0})  # draft 6.0 is not above max(5, 3 x 2.0) = 6
    assert set(spiked) == {"verify"} and spiked["verify"] == 30.0
    assert set(d.check({"verify": 10.0, "draft": 7.0})) == {"draft"}


def test_absolute_threshold() -> None:
    d = SpikeDetector(absolute_ms=50.0)
    assert d.check({"network": 49.0}) == {} and d.check({"network": 51.0}) == {"network": 50.0}


def test_spike_log_lines_are_at_most_one_per_log_every_s() -> None:
    """A spike gets a line when log_every_s passed since the last line; the line after a quiet
    stretch counts the spikes that got none. 0: every spike gets one."""
    d = SpikeDetector(log_every_s=1.0)
    assert d.loggable(now=100.0) == 0
    assert [d.loggable(now=100.0 + t) for t in (0.1, 0.5, 0.99)] == [None, None, None]
    assert d.loggable(now=101.0) == 3
    assert d.loggable(now=101.5) is None and d.loggable(now=103.0) == 1
    every = SpikeDetector(log_every_s=0.0)
    assert [every.loggable(now=5.0) for _ in range(3)] == [0, 0, 0]


def _export(tmp_path):
    path = tmp_path / "spans.jsonl"
    provider = TracerProvider(resource=Resource.create({"service.name": "gateway"}))
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(str(path))))
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("specdec.generate", attributes={"specdec.request_id": "req-1"}):
        for i, verify_ms in enumerate([5.0, 80.0, 6.0], start=1):
            with tracer.start_as_current_span(
                "specdec.round",
                attributes={
                    "specdec.round": i,
                    "specdec.drafted": 4,
                    "specdec.accepted": 2,
                    "specdec.tokens": 3,
                    "specdec.stage.verify_ms": verify_ms,
                },
            ) as span:
                if verify_ms > 50:
                    span.add_event("latency_spike", {"specdec.spike.stage": "verify", "specdec.spike.ms": verify_ms})
                    span.set_attribute("specdec.spike.stage", "verify")
    return path


def test_exported_spans_and_trace_inspection(tmp_path) -> None:
    path = _export(tmp_path)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert {r["name"] for r in records} == {"specdec.generate", "specdec.round"}
    assert len({r["trace_id"] for r in records}) == 1 and all(r["service"] == "gateway" for r in records)
    spans = traces.load([path])
    assert [r["attributes"]["specdec.round"] for r in traces.spikes_by_stage(spans)["verify"]] == [2]
    text = traces.summary(spans)
    assert "3 rounds in 1 requests" in text and "verify" in text and "req-1" in text
    line = traces.timeline(spans, records[0]["trace_id"])
    assert "SPIKE: verify" in line and line.count("\n") >= 5


METRICS = {
    "gateway": telemetry.GatewayMetrics,
    "drafter": telemetry.DrafterMetrics,
    "verifier": telemetry.VerifierMetrics,
}
# each service's families as exposed (counters with _total), the contract with dashboards and tests
FAMILIES = {
    "gateway": {
        "specdec:spec_decode_num_drafts_total",
        "specdec:spec_decode_num_draft_tokens_total",
        "specdec:spec_decode_num_accepted_tokens_total",
        "specdec:spec_decode_num_accepted_tokens_per_pos_total",
        "specdec:accepted_length",
        "specdec:rounds_total",
        "specdec:round_stage_seconds",
        "specdec:generation_tokens_total",
        "specdec:prompt_tokens_total",
        "specdec:requests_total",
        "specdec:requests_running",
        "specdec:latency_spikes_total",
        "specdec:drafter_fallbacks_total",
        "specdec:gateway_refused_total",
        "specdec:gateway_migrations_total",
        "specdec:gateway_replicas",
        "specdec:time_to_first_token_seconds",
        "specdec:e2e_request_latency_seconds",
        "specdec:gateway_stream_write_timeouts_total",
    },
    "drafter": {
        "specdec:drafter_sessions",
        "specdec:drafter_requests_total",
        "specdec:drafter_blocks_total",
        "specdec:drafter_tokens_total",
        "specdec:drafter_step_seconds",
        "specdec:drafter_batch_rows",
        "specdec:drafter_branches_total",
        "specdec:drafter_branch_breaks_total",
        "specdec:drafter_branch_hits_total",
        "specdec:drafter_branch_uncovered_total",
        "specdec:drafter_commit_seconds",
        "specdec:drafter_forwards_stopped_total",
        "specdec:drafter_loop_delay_seconds",
        "specdec:drafter_confidence_cuts_total",
        "specdec:drafter_block_tau",
        "specdec:drafter_prompt_tokens_total",
        "specdec:drafter_prefix_reused_tokens_total",
        "specdec:drafter_prefix_cache_bytes",
        "specdec:drafter_kv_cache_bytes",
        "specdec:drafter_kv_cache_budget_bytes",
        "specdec:drafter_kv_waits_total",
        "specdec:drafter_kv_overflows_total",
        "specdec:drafter_kv_preemptions_total",
    },
    "verifier": {
        "specdec:verifier_sessions",
        "specdec:verifier_requests_total",
        "specdec:verifier_engine_steps_total",
        "specdec:verifier_engine_running",
        "specdec:verifier_engine_waiting",
        "specdec:verifier_step_seconds",
        "specdec:verifier_batch_size",
        "specdec:verifier_computed_tokens_total",
        "specdec:verifier_withheld_draft_tokens_total",
        "specdec:verifier_step_cost_ms",
        "specdec:verifier_draft_wait_seconds_total",
        "specdec:verifier_branches_total",
        "specdec:verifier_branch_hits_total",
        "specdec:verifier_branch_misses_total",
    },
}


def _exposed(registry: prometheus_client.CollectorRegistry) -> dict[str, list]:
    """{sample name: samples} in the registry's exposition (what /metrics serves)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = prometheus_client.generate_latest(registry).decode()
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def _families(names) -> set[str]:
    """specdec: sample names as family names: histograms without _bucket/_count/_sum,
    counters as X_total (their X_created left out)."""
    out = set()
    for name in names:
        if name.startswith("specdec:") and not name.endswith("_created"):
            for suffix in ("_bucket", "_count", "_sum"):
                name = name.removesuffix(suffix)
            out.add(name)
    return out


@pytest.mark.parametrize("service", sorted(METRICS))
def test_a_service_registry_exposes_its_own_families_and_the_shared_ones(service: str) -> None:
    registry = telemetry.service_registry(service)
    metrics = METRICS[service](registry)
    assert metrics.registry is registry
    # labelled families show up once a label value is used
    for labelled in (
        "accepted_per_pos",
        "requests",
        "spikes",
        "round_stage",
        "step_cost_ms",
        "refused",
        "branch_breaks",
        "branch_hits",
        "branch_uncovered",
    ):
        if getattr(getattr(metrics, labelled, None), "_labelnames", None):
            getattr(metrics, labelled).labels("0")
    exposed = _exposed(registry)
    own = _families(exposed) - {"specdec:build_info"}
    assert own == FAMILIES[service]
    for other, families in FAMILIES.items():
        if other != service:
            assert not own & families, f"{service} exposes {other}'s {own & families}"
    # the shared families
    (info,) = exposed["specdec:build_info"]
    assert info.labels == {"service": service, "version": __version__} and info.value == 1
    assert any(name.startswith("process_") for name in exposed)
    assert any(name.startswith("python_gc_") for name in exposed)
    assert "python_info" in exposed


def test_services_registries_are_independent_and_the_default_registry_holds_none() -> None:
    gateway = telemetry.GatewayMetrics(telemetry.service_registry("gateway"))
    again = telemetry.GatewayMetrics(telemetry.service_registry("gateway"))  # no duplicate-name clash
    gateway.rounds.inc(3)
    assert gateway.registry.get_sample_value("specdec:rounds_total") == 3
    assert again.registry.get_sample_value("specdec:rounds_total") == 0
    default = prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
    assert "specdec:" not in default


def test_labelled_counters_have_their_series_before_the_first_request() -> None:
    """A ratio panel or alert (aborted / all requests, spikes by stage, refusals) has its series
    at 0 from the start, not "no data" until each label value first happens."""
    exposed = _exposed(telemetry.GatewayMetrics(prometheus_client.CollectorRegistry()).registry)
    values = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for samples in exposed.values()
        for sample in samples
    }
    for label, names, family in (
        ("finish_reason", ("length", "stop", "abort"), "specdec:requests_total"),
        ("reason", ("unauthenticated", "rate_limited"), "specdec:gateway_refused_total"),
        ("stage", telemetry.STAGES, "specdec:latency_spikes_total"),
    ):
        for name in names:
            assert values[(family, ((label, name),))] == 0, (family, name)


def _round(trace: str, number: int, drafted: int, accepted: int, wait_ms: float, branch: bool = False) -> dict:
    """A gateway round span record (telemetry.span_record's shape), 200 ms long."""
    start = number * 200_000_000
    return {
        "name": "specdec.round",
        "service": "gateway",
        "trace_id": trace,
        "start_ns": start,
        "end_ns": start + 200_000_000,
        "events": [],
        "attributes": {
            "specdec.round": number,
            "specdec.drafted": drafted,
            "specdec.accepted": accepted,
            "specdec.branch": branch,
            "specdec.stage.draft_wait_ms": wait_ms,
        },
    }


def test_waits_group_each_rounds_wait_by_what_its_verdict_did() -> None:
    """A round's draft wait follows its own verdict (the verifier waits, after it, for the next
    step's drafts), and the next round says whether those drafts came from a branch."""
    spans = [
        _round("a", 1, 0, 0, 0.0),  # the prefill: left out
        _round("a", 2, 4, 4, 10.0),  # all accepted
        _round("a", 3, 4, 1, 0.0),  # rejected; round 4's drafts from a branch
        _round("a", 4, 4, 2, 150.0, branch=True),  # rejected; round 5's not
        _round("a", 5, 4, 4, 40.0),  # all accepted (the request's last round)
        _round("b", 1, 0, 0, 0.0),
        _round("b", 2, 0, 0, 0.0),  # plain decoding throughout: left out
    ]
    text = traces.waits(spans)
    lines = {line.split("  ")[1].strip(): line.split() for line in text.splitlines()[3:]}
    assert text.splitlines()[0] == (
        "4 rounds, 200.0 ms a round, of which 50.0 ms waiting for drafts (25% of the rounds' time)"
    )
    assert lines["all drafts accepted"][-4:] == ["2", "25.0", "25.0", "25%"]
    assert lines["a draft rejected, a branch hit"][-4:] == ["1", "0.0", "0.0", "0%"]
    assert lines["a draft rejected, no branch"][-4:] == ["1", "150.0", "150.0", "75%"]
    assert "plain step" not in lines
    assert traces.waits(spans[-2:]) == "no speculative rounds"
