"""Round tracing across the three services, with latency spikes on the right stage.

Own services (so the delays injected here touch no other test): the drafter sleeps in
every 25th draft step, the verifier in every 40th engine step. Those are too frequent
for a relative threshold (they make up the rolling p95 themselves), so this gateway uses
the absolute threshold (`--spike-ms`); the relative one is unit-tested. Spans from all
three services go to one JSON-lines file (SPECDEC_TRACE_FILE).
"""

from __future__ import annotations

import time

import pytest
from conftest import Services
from gen import generate_all, prompts, spec
from transformers import AutoTokenizer

from specdec import traces

DELAY_MS = 250
SPIKE_MS = 150


@pytest.fixture(scope="module")
def traced(tmp_path_factory, tiny_target):
    root = tmp_path_factory.mktemp("traced")
    path = root / "spans.jsonl"
    s = Services(root, env={"SPECDEC_TRACE_FILE": str(path)})
    try:
        verifier = s._start("verifier", ["--model", "tiny/target", "--threads", "1",
                                         "--inject-delay-ms", str(DELAY_MS), "--inject-every", "40"])
        drafter = s._start("drafter", ["--model", "tiny/draft-mid", "--threads", "1",
                                       "--inject-delay-ms", str(DELAY_MS), "--inject-every", "25"])
        gateway = s.start_gateway(drafter.address, verifier.address, ("--spike-ms", str(SPIKE_MS)))
        for svc in (verifier, drafter, gateway):
            svc.wait_ready(300)
        tok = AutoTokenizer.from_pretrained(tiny_target)
        responses = generate_all(gateway.address, [spec(p, 120, gamma=4, ignore_eos=True) for p in prompts(tok, 6)], 1)
        time.sleep(1.0)  # spans of the last sessions are exported when they end
        yield traces.load([path]), responses
    finally:
        s.stop()


def test_one_trace_links_the_three_services(traced) -> None:
    spans, responses = traced
    by_request = {s["attributes"]["specdec.request_id"]: s["trace_id"] for s in spans if s["name"] == "specdec.generate"}
    assert set(by_request) == {r.request_id for r in responses}
    for trace_id in by_request.values():
        names = {(s["service"], s["name"]) for s in spans if s["trace_id"] == trace_id}
        assert {("gateway", "specdec.generate"), ("gateway", "specdec.round"),
                ("drafter", "specdec.draft_session"), ("verifier", "specdec.verify_session")} <= names


def test_round_spans_carry_speculation_attributes(traced) -> None:
    spans, responses = traced
    rounds = traces.rounds(spans)
    assert len(rounds) == sum(r.stats.target_steps + 1 for r in responses)
    assert sum(r["attributes"]["specdec.accepted"] for r in rounds) == sum(r.stats.accepted_tokens for r in responses)
    generate = [s for s in spans if s["name"] == "specdec.generate"]
    assert all(s["attributes"]["gen_ai.usage.output_tokens"] == 120 for s in generate)
    assert all(s["attributes"]["specdec.queue_ms"] >= 0 for s in generate)
    first = [r for r in rounds if r["attributes"]["specdec.round"] == 1]
    assert len(first) == len(responses) and all("specdec.stage.verify_ms" in r["attributes"] for r in first)


def test_spikes_name_the_slow_stage(traced) -> None:
    spans, _ = traced
    spikes = traces.spikes_by_stage(spans)
    verify = [r["attributes"]["specdec.stage.verify_ms"] for r in spikes.get("verify", [])]
    draft = [r["attributes"]["specdec.stage.draft_ms"] for r in spikes.get("draft", [])]
    # each injected delay shows up as a spike of its own stage
    assert len([ms for ms in verify if ms >= DELAY_MS]) >= 5, spikes.keys()
    assert len([ms for ms in draft if ms >= DELAY_MS]) >= 5, spikes.keys()
    for stage, rs in spikes.items():  # the named stage is the slow one
        for r in rs:
            assert r["attributes"][f"specdec.stage.{stage}_ms"] > SPIKE_MS
    # a slow engine step alone does not blame the drafter (both delays can meet in one round)
    alone = [r for r in spikes["verify"] if r["attributes"]["specdec.stage.draft_ms"] < SPIKE_MS]
    assert len(alone) >= 3 and all("draft" not in r["attributes"]["specdec.spike.stage"].split(",") for r in alone)
    text = traces.summary(spans)
    assert "spikes by stage:" in text and "verify" in text and "draft" in text
