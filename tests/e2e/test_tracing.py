"""Round tracing across the three services, with latency spikes on the right stage.

The session's verifier, and drafters and gateways of this module's own, with a fault
schedule that does not depend on the machine's speed (switched on at run time for this
module only, tests/faultkit.py): the verifier sleeps in every 10th engine step; one
drafter ("clean") never sleeps, another ("slow") sleeps in every 15th draft step.
Requests through the clean drafter's gateway run first, then those through the slow
one's, one at a time, so a verify spike of the first phase can never coincide with a draft
delay (it used to depend on how the two delays interleaved). The delays are too frequent
for a relative threshold (they make up the rolling p95 themselves), so the gateways use
the absolute threshold (`--spike-ms`); the relative one is unit-tested. The draft stage is
the chain's drafting only: the branches a drafter drafts while a slow step runs (the
default drafter drafts them) are `specdec.branch_draft_ms`, so they never make a draft spike
(counted in the stage, they did on a loaded CI machine, beside a verify delay). Spans from all
services go to one JSON-lines file: the module's drafters and gateways write it from the
start (SPECDEC_TRACE_FILE), the shared verifier while this module runs (faultkit's trace_file).

Counts that hold on any machine (greedy, gamma 4, 120 tokens, full gamma verified):
each request takes >= 1 + ceil(119 / 5) = 25 engine steps, so 3 requests take >= 75 steps
and >= 7 of them sleep, at most 3 of those being prefill steps (not checked for spikes);
each slow-drafter session drafts >= 4 tokens per target step (>= 96 draft steps), so it
sleeps >= 6 times, at most one of them after its last verdict.
"""

from __future__ import annotations

import time

import pytest
from conftest import Services, injected
from gen import generate_all, prompts, spec
from transformers import AutoTokenizer

from specdec_cli import traces

# the threshold is > 10x a round's usual draft stage here (median 44 ms, p99 120 ms, max 193 ms
# over a run of this module on the 2-core AVX2 EPYC) and the injected delays well above it
DELAY_MS = 1000
SPIKE_MS = 600
PER_PHASE = 3


@pytest.fixture(scope="module")
def traced(tmp_path_factory, tiny_target, services):
    root = tmp_path_factory.mktemp("traced")
    path = root / "spans.jsonl"
    s = Services(root, env={"SPECDEC_TRACE_FILE": str(path)})
    # the session's verifier verifies full gamma every step (no adaptive back-off), and a step
    # waits out a draft delay (its draft-wait margin is longer than it), so the counts above hold
    verifier = services.verifier
    try:
        drafter_args = ["--model", "tiny/draft-mid", "--threads", "1", "--quantize", "none"]
        clean = s._start("drafter", drafter_args)
        slow = s._start("drafter", drafter_args)
        gateways = [s.start_gateway(d.address, verifier.address, ("--spike-ms", str(SPIKE_MS))) for d in (clean, slow)]
        s.ready()
        tok = AutoTokenizer.from_pretrained(tiny_target)
        with (
            injected(verifier, step_delay_ms=DELAY_MS, step_every=10, trace_file=str(path)),
            injected(slow, draft_delay_ms=DELAY_MS, draft_every=15),
        ):
            phases = []
            for gateway, batch in zip(
                gateways,
                (prompts(tok, 2 * PER_PHASE)[:PER_PHASE], prompts(tok, 2 * PER_PHASE)[PER_PHASE:]),
                strict=True,
            ):
                phases.append(generate_all(gateway.address, [spec(p, 120, gamma=4, ignore_eos=True) for p in batch], 1))
            # spans of a session are exported when it ends (each service in its own process): wait,
            # bounded, until every request's rounds and the three services' session spans are in
            responses = [r for phase in phases for r in phase]
            deadline = time.monotonic() + 60
            while _missing(traces.load([path]), responses) and time.monotonic() < deadline:
                time.sleep(0.2)
            missing = _missing(traces.load([path]), responses)
            if missing:
                pytest.fail(f"spans not in {path} 60 s after the last request: {missing}")
        yield traces.load([path]), phases
    finally:
        s.stop()


SESSION_SPANS = {
    ("gateway", "specdec.generate"),
    ("drafter", "specdec.draft_session"),
    ("verifier", "specdec.verify_session"),
}


def _missing(spans: list, responses: list) -> str:
    """What is not in the file yet of every request's round spans and its session span from
    each service ("": all of it is)."""
    rounds = len(traces.rounds(spans))
    expected = sum(r.stats.target_steps + 1 for r in responses)
    if rounds < expected:
        return f"{rounds} of {expected} round spans"
    traced = traces.request_ids(spans)  # trace id -> request id
    absent = {r.request_id for r in responses} - set(traced.values())
    if absent:
        return f"no specdec.generate span for requests {sorted(absent)}"
    names: dict[str, set] = {}
    for s in spans:
        names.setdefault(s["trace_id"], set()).add((s["service"], s["name"]))
    lacking = {traced[tid]: sorted(SESSION_SPANS - names.get(tid, set())) for tid in traced}
    return "; ".join(f"request {rid} lacks {spans}" for rid, spans in lacking.items() if spans)


def test_one_trace_links_the_three_services(traced) -> None:
    spans, phases = traced
    responses = [r for phase in phases for r in phase]
    by_request = {
        s["attributes"]["specdec.request_id"]: s["trace_id"] for s in spans if s["name"] == "specdec.generate"
    }
    assert set(by_request) == {r.request_id for r in responses}
    for trace_id in by_request.values():
        names = {(s["service"], s["name"]) for s in spans if s["trace_id"] == trace_id}
        assert {
            ("gateway", "specdec.generate"),
            ("gateway", "specdec.round"),
            ("drafter", "specdec.draft_session"),
            ("verifier", "specdec.verify_session"),
        } <= names


def test_round_spans_carry_speculation_attributes(traced) -> None:
    spans, phases = traced
    responses = [r for phase in phases for r in phase]
    rounds = traces.rounds(spans)
    assert len(rounds) == sum(r.stats.target_steps + 1 for r in responses)
    assert sum(r["attributes"]["specdec.accepted"] for r in rounds) == sum(r.stats.accepted_tokens for r in responses)
    generate = [s for s in spans if s["name"] == "specdec.generate"]
    assert all(s["attributes"]["gen_ai.usage.output_tokens"] == 120 for s in generate)
    assert all(s["attributes"]["specdec.queue_ms"] >= 0 for s in generate)
    first = [r for r in rounds if r["attributes"]["specdec.round"] == 1]
    assert len(first) == len(responses) and all("specdec.stage.verify_ms" in r["attributes"] for r in first)
    # the drafters draft branches (the default) while a step runs: counted apart from the draft stage
    assert any(r["attributes"]["specdec.branch_draft_ms"] > 0 for r in rounds)


def test_spikes_name_the_slow_stage(traced) -> None:
    spans, (clean_phase, _) = traced
    spikes = traces.spikes_by_stage(spans)
    verify = [r["attributes"]["specdec.stage.verify_ms"] for r in spikes.get("verify", [])]
    draft = [r["attributes"]["specdec.stage.draft_ms"] for r in spikes.get("draft", [])]
    # each injected delay shows up as a spike of its own stage
    assert len([ms for ms in verify if ms >= DELAY_MS]) >= 5, spikes.keys()
    assert len([ms for ms in draft if ms >= DELAY_MS]) >= 5, spikes.keys()
    for stage, rs in spikes.items():  # the named stage is the slow one
        for r in rs:
            assert r["attributes"][f"specdec.stage.{stage}_ms"] > SPIKE_MS
    # a slow engine step alone does not blame the drafter: the clean drafter's rounds never
    # have a draft delay, so their verify spikes stand alone
    clean_traces = {tid for tid, rid in traces.request_ids(spans).items() if rid in {r.request_id for r in clean_phase}}
    alone = [r for r in spikes["verify"] if r["trace_id"] in clean_traces]
    assert len(alone) >= 4
    blamed = [r["attributes"] for r in alone if "draft" in r["attributes"]["specdec.spike.stage"].split(",")]
    assert not blamed, blamed
    text = traces.summary(spans)
    assert "spikes by stage:" in text and "verify" in text and "draft" in text
