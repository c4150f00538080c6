"""SpecStats, the one accumulator of a generation's speculation figures: the definitions, and
that every reader (the wire's SpeculationStats, the span, vLLM's per-request metrics,
Prometheus) says the same thing."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from specdec import telemetry
from specdec.stats import SpecStats, branch_hits_by_gamma
from specdec.wire import pb


def _v(tokens: int, drafted: int = 0, accepted: int = 0, computed: int = 0, **kw) -> "pb.Verdict":
    return pb.Verdict(token_ids=[1] * tokens, drafted=drafted, accepted=accepted, computed_tokens=computed, **kw)


# prefill, full accept, reject, plain, a branch hit, a step after a miss
VERDICTS = (
    _v(1, computed=10),
    _v(5, 4, 4, 5),
    _v(2, 4, 1, 5),
    _v(1),
    _v(3, 4, 2, 5, branch=True),
    _v(1, branch_miss=True, hold_drafts=True),
)


def _observed() -> SpecStats:
    s = SpecStats(num_spec_tokens=4, drafter=pb.DRAFT_METHOD_MODEL)
    for v in VERDICTS:
        s.observe(v)
    return s


def test_stats_definitions() -> None:
    s = _observed()
    assert (s.target_steps, s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (5, 3, 12, 7)
    assert s.num_accepted_tokens_per_pos == [3, 2, 1, 1]
    assert s.acceptance_rate == pytest.approx(7 / 12)
    assert s.mean_acceptance_length == pytest.approx(1 + 7 / 3)  # vLLM's definition
    assert s.tokens_per_step == pytest.approx((13 - 1) / 5)  # the prefill token excluded
    assert s.rejected_steps == 2 and s.computed_tokens == 25 and s.held_steps == 1
    assert (s.branches_used, s.branch_misses, s.branch_hit_rate) == (1, 1, 0.5)
    assert s.acceptance_histogram == [0, 1, 1, 0, 1]  # one step each accepted 1, 2 and 4 of its drafts


def test_the_wire_the_span_and_vllms_names_read_the_same_figures() -> None:
    s = _observed()
    assert s.drafter_preempted() == 1
    p = s.to_pb()
    assert (p.speculative_steps, p.drafted_tokens, p.accepted_tokens) == (3, 12, 7)
    assert list(p.accepted_per_position) == s.num_accepted_tokens_per_pos
    assert p.acceptance_rate == pytest.approx(s.acceptance_rate)
    assert p.mean_accepted_length == pytest.approx(s.mean_acceptance_length)
    span = s.span_attributes()
    for name in (
        "target_steps",
        "speculative_steps",
        "drafted_tokens",
        "accepted_tokens",
        "held_steps",
        "branches_used",
        "migrations",
        "drafter_preemptions",
    ):
        assert span[f"specdec.{name}"] == getattr(p, name), name
    assert span["specdec.acceptance_rate"] == pytest.approx(p.acceptance_rate)
    # the REST bridge reads a response's stats back through from_pb: nothing it reports is lost
    back = SpecStats.from_pb(p)
    assert back.vllm_metrics() == s.vllm_metrics()
    assert back.to_pb().acceptance_rate == p.acceptance_rate and back.target_steps == s.target_steps
    assert back.drafter_preemptions == p.drafter_preemptions == 1
    vllm = s.vllm_metrics()
    assert (vllm["num_spec_steps"], vllm["num_draft_tokens"], vllm["num_accepted_draft_tokens"]) == (3, 12, 7)
    assert sum(vllm["acceptance_histogram"]) == vllm["num_spec_steps"]


def test_prometheus_reads_each_step_as_the_accumulator_counted_it() -> None:
    metrics = telemetry.GatewayMetrics(CollectorRegistry())
    s = SpecStats(num_spec_tokens=4, drafter=pb.DRAFT_METHOD_MODEL)
    for v in VERDICTS:
        metrics.observe(s.observe(v), {"verify": 1.0})
    r = metrics.registry
    assert r.get_sample_value("specdec:spec_decode_num_drafts_total") == s.num_drafts
    assert r.get_sample_value("specdec:spec_decode_num_draft_tokens_total") == s.num_draft_tokens
    assert r.get_sample_value("specdec:spec_decode_num_accepted_tokens_total") == s.num_accepted_tokens
    for i, n in enumerate(s.num_accepted_tokens_per_pos):
        assert r.get_sample_value("specdec:spec_decode_num_accepted_tokens_per_pos_total", {"position": str(i)}) == n
    assert r.get_sample_value("specdec:generation_tokens_total") == s.completion_tokens
    assert r.get_sample_value("specdec:rounds_total") == s.num_verdicts


def test_fallback_is_reported_once_with_its_first_reason() -> None:
    """drafter_fallback is derived from the reason: set exactly when there is one."""
    s = SpecStats(num_spec_tokens=2, drafter=pb.DRAFT_METHOD_MODEL)
    p = s.to_pb()
    assert not p.drafter_fallback and p.fallback_reason == ""
    assert s.fell_back("drafter UNAVAILABLE: connection refused")
    assert not s.fell_back("a later reason")  # the first reason stays
    p = s.to_pb()
    assert p.drafter_fallback and p.fallback_reason == "drafter UNAVAILABLE: connection refused"
    assert s.span_attributes()["specdec.fallback_reason"] == p.fallback_reason


def test_drafter_side_figures() -> None:
    s = SpecStats(num_spec_tokens=2, drafter=pb.DRAFT_METHOD_MODEL)
    s.observe_ready(pb.DraftReady(prefill_ms=3.0))
    s.observe_block(pb.DraftBlock(token_ids=[1, 2], draft_ms=1.5))
    s.observe_block(pb.DraftBlock(token_ids=[3, 4, 5], draft_ms=0.5, branch=True))
    step = s.observe(_v(1))
    # the round's draft stage is the chain's drafting since the previous step; branches, drafted
    # beside the step while the drafter is idle, are counted apart (never a draft spike)
    assert (step.draft_ms, step.branch_draft_ms) == (1.5, 0.5)
    later = s.observe(_v(1))
    assert (later.draft_ms, later.branch_draft_ms) == (0.0, 0.0)
    assert (s.blocks_received, s.tokens_received, s.branches_drafted, s.draft_ms) == (2, 5, 1, 2.0)
    assert s.drafter_prefill_ms == 3.0 and s.invalid_reply() == 1 and s.migrated() == 1


def test_confidence_cuts_and_mean_tau_come_from_the_blocks() -> None:
    s = SpecStats(num_spec_tokens=6, drafter=pb.DRAFT_METHOD_MODEL)
    s.observe_block(pb.DraftBlock(token_ids=[1, 2], final=True, confidence_cut=True, tau=0.25))
    s.observe_block(pb.DraftBlock(token_ids=[3], tau=0.75))
    s.observe_block(pb.DraftBlock(token_ids=[4]))  # no tau: confidence off for it (not averaged)
    assert s.confidence_cuts == 1 and s.mean_tau == pytest.approx(0.5)
    p = s.to_pb()
    assert (p.confidence_cuts, p.mean_tau) == (1, pytest.approx(0.5))
    assert s.span_attributes()["specdec.confidence_cuts"] == 1
    back = SpecStats.from_pb(p)
    assert (back.confidence_cuts, back.mean_tau) == (1, pytest.approx(0.5))


def test_branch_hit_rate_per_gamma_sums_hits_and_breaks_over_generations() -> None:
    def gen(gamma: int, hits: int, misses: int) -> SpecStats:
        s = SpecStats(num_spec_tokens=gamma, drafter=pb.DRAFT_METHOD_MODEL if gamma else pb.DRAFT_METHOD_NONE)
        s.observe(_v(1))
        for _ in range(hits):
            s.observe(_v(2, 3, 1, 4, branch=True))
        for _ in range(misses):
            s.observe(_v(1, branch_miss=True))
        return s

    rows = branch_hits_by_gamma([gen(8, 1, 3), gen(4, 2, 1), gen(8, 1, 1), gen(0, 0, 0), gen(4, 0, 0)])
    assert [(r.gamma, r.hits, r.breaks) for r in rows] == [(4, 2, 3), (8, 2, 6)]
    assert [r.rate for r in rows] == [pytest.approx(2 / 3), pytest.approx(2 / 6)]
