"""Spike detection, the span file format, and `specdec traces` on synthetic spans."""

from __future__ import annotations

import json

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from specdec import traces
from specdec.telemetry import SPIKE_WARMUP, JsonLinesExporter, SpikeDetector


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


def _export(tmp_path):
    path = tmp_path / "spans.jsonl"
    provider = TracerProvider(resource=Resource.create({"service.name": "gateway"}))
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(str(path))))
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("specdec.generate", attributes={"specdec.request_id": "req-1"}):
        for i, verify_ms in enumerate([5.0, 80.0, 6.0], start=1):
            with tracer.start_as_current_span("specdec.round", attributes={
                "specdec.round": i, "specdec.drafted": 4, "specdec.accepted": 2, "specdec.tokens": 3,
                "specdec.stage.verify_ms": verify_ms,
            }) as span:
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
