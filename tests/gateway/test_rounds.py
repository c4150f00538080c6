"""Speculation statistics from a sequence of verdicts."""

from __future__ import annotations

import pytest

from gateway.rounds import Stats
from specdec.wire import pb


def _v(tokens: int, drafted: int = 0, accepted: int = 0, computed: int = 0) -> "pb.VerifyResponse":
    return pb.VerifyResponse(token_ids=[1] * tokens, drafted=drafted, accepted=accepted, computed_tokens=computed)


def test_stats_definitions() -> None:
    s = Stats(gamma=4, drafter="model")
    for v in (_v(1, computed=10), _v(5, 4, 4, 5), _v(2, 4, 1, 5), _v(1)):  # prefill, full accept, reject, plain
        s.add_verdict(v)
    p = s.to_pb()
    assert (p.target_steps, p.speculative_steps, p.drafted_tokens, p.accepted_tokens) == (3, 2, 8, 5)
    assert list(p.accepted_per_position) == [2, 1, 1, 1]
    assert p.acceptance_rate == pytest.approx(5 / 8)
    assert p.mean_accepted_length == pytest.approx(1 + 5 / 2)  # vLLM's definition
    assert p.tokens_per_step == pytest.approx((9 - 1) / 3)  # the prefill token excluded
    assert p.target_computed_tokens == 20 and not p.drafter_fallback


def test_fallback_is_reported() -> None:
    s = Stats(gamma=2, drafter="model")
    s.fallback_reason = "drafter UNAVAILABLE: connection refused"
    p = s.to_pb()
    assert p.drafter_fallback and "UNAVAILABLE" in p.fallback_reason
