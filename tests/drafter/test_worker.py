"""The draft worker: it observes each drafted token's compute in the drafter's metrics."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry

from drafter.server import DraftWorker
from drafter.sessions import BlockOut, DraftSession, NgramDraftSession
from specdec import telemetry


def _run(sessions: list[DraftSession]) -> telemetry.DrafterMetrics:
    """Run the sessions on a worker until each has sent its final block; its metrics."""
    metrics = telemetry.DrafterMetrics(CollectorRegistry())
    worker = DraftWorker(metrics=metrics)
    done = [threading.Event() for _ in sessions]

    def emit_to(event: threading.Event):
        def emit(item: object) -> None:
            assert not isinstance(item, BaseException), item
            if isinstance(item, BlockOut) and item.final:
                event.set()

        return emit

    worker.start()
    try:
        for session, event in zip(sessions, done, strict=True):
            worker.add(session, emit_to(event))
        assert all(event.wait(10) for event in done)
    finally:
        worker.stop()
        worker.join(10)
    return metrics


def test_each_drafted_token_is_observed_once() -> None:
    drafting = NgramDraftSession([1, 2, 3, 4, 1, 2], gamma=3, lookahead=0, ngram_max=3, ngram_min=1)
    drafting.commit(6, [3])  # drafts 4, 1, 2
    nothing = NgramDraftSession([5, 6], gamma=2, lookahead=0, ngram_max=2, ngram_min=1)
    nothing.commit(2, [7])  # no n-gram match: a step that drafts none, then an empty block
    metrics = _run([drafting, nothing])
    assert metrics.registry.get_sample_value("specdec:drafter_step_seconds_count") == 3
    assert drafting.last_token_ms > 0 and nothing.last_token_ms == 0
