"""The draft worker: it observes each drafted token's compute, and the rows of each draft
forward (its batch size), in the drafter's metrics."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from prometheus_client import CollectorRegistry

from drafter.server import DraftWorker, Emit, emitter
from drafter.sessions import BlockOut, DraftSession, ModelDraftSession, NgramDraftSession, Ready
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


def _tiny_llama() -> torch.nn.Module:
    """A random-init two-layer Llama (hidden 32): a draft model that costs nothing to build."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(config).eval()


def _rows(metrics: telemetry.DrafterMetrics) -> dict[int, float]:
    """specdec:drafter_batch_rows as {rows: forwards observed with that many rows} (buckets
    up to 32 are the integers, so a bucket's own count is the count of that batch size)."""
    cumulative = {
        le: metrics.registry.get_sample_value("specdec:drafter_batch_rows_bucket", {"le": f"{le:.1f}"}) or 0.0
        for le in range(1, 33)
    }
    return {n: c - cumulative.get(n - 1, 0.0) for n, c in cumulative.items() if c - cumulative.get(n - 1, 0.0)}


@pytest.mark.parametrize("batched", [True, False])
def test_each_draft_forward_is_observed_with_its_rows(batched: bool) -> None:
    """Three model sessions of different prompt lengths (and an n-gram one, which makes no
    forward): prefill steps observe nothing; each step where all three draft is one forward of
    3 rows when batched, three of 1 row when not; a step where one session drafts alone is 1."""
    model = _tiny_llama()
    metrics = telemetry.DrafterMetrics(CollectorRegistry())
    worker = DraftWorker(metrics=metrics, batch=batched)
    sessions: list[DraftSession] = [
        ModelDraftSession(
            model,
            [3 + i + j for j in range(5 + 7 * i)],
            gamma=4,
            lookahead=100,
            temperature=0.0,
            top_k=0,
            top_p=1.0,
            seed=i,
            q_top_k=4,
        )
        for i in range(3)
    ]
    ngram = NgramDraftSession([1, 2, 3, 4, 1, 2], gamma=3, lookahead=100, ngram_max=3, ngram_min=1)
    ngram.commit(6, [3])
    active: list[tuple[DraftSession, Emit]] = [(s, _no_error) for s in [*sessions, ngram]]
    worker.advance(active[:3])  # the prefills (one chunk each): no draft forward
    assert all(isinstance(s, ModelDraftSession) and s.ready for s in sessions)
    assert metrics.registry.get_sample_value("specdec:drafter_batch_rows_count") == 0
    for i, s in enumerate(sessions):
        s.commit(len(s.context), [10 + i])
    rounds = 5
    for _ in range(rounds):
        worker.advance(active)
    worker.advance(active[:1])  # one session drafts alone
    assert all(s.steps == rounds + (i == 0) for i, s in enumerate(sessions))
    if batched:
        assert _rows(metrics) == {3: rounds, 1: 1}
    else:
        assert _rows(metrics) == {1: 3 * rounds + 1}
    assert metrics.registry.get_sample_value("specdec:drafter_batch_rows_sum") == 3 * rounds + 1


def _no_error(item: object) -> None:
    assert not isinstance(item, BaseException), item


def test_an_item_made_after_the_calls_loop_closed_is_dropped_not_raised() -> None:
    """The worker may finish a step for a session whose call's event loop has already closed
    (the server stopping mid-step): the item has no reader and is dropped; the worker thread
    must not die on "Event loop is closed" (seen as an unhandled thread exception)."""
    loop = asyncio.new_event_loop()
    out: asyncio.Queue[BlockOut | Ready | BaseException | None] = asyncio.Queue()
    emit = emitter(loop, out)
    emit(RuntimeError("delivered"))  # while the loop is open: scheduled onto it
    loop.run_until_complete(asyncio.sleep(0))
    assert out.qsize() == 1
    loop.close()
    emit(RuntimeError("after close"))  # must not raise
    assert out.qsize() == 1
