"""The draft worker: it observes each drafted token's compute, and the rows of each draft
forward (its batch size), in the drafter's metrics."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from drafter.server import DraftWorker, Emit, emitter, work_order
from drafter.sessions import BlockOut, DraftSession, ModelDraftSession, NgramDraftSession, Progress, Ready
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


def _greedy(model: torch.nn.Module, prompt: list[int], seed: int, lookahead: int, **kw: Any) -> ModelDraftSession:
    """A greedy model session at gamma 4."""
    return ModelDraftSession(
        model, prompt, 4, lookahead, temperature=0.0, top_k=0, top_p=1.0, seed=seed, q_top_k=4, **kw
    )


@pytest.mark.parametrize("batched", [True, False])
def test_each_draft_forward_is_observed_with_its_rows(batched: bool) -> None:
    """Three model sessions of different prompt lengths (and an n-gram one, which makes no
    forward): prefill steps observe nothing; each step where all three draft is one forward of
    3 rows when batched, three of 1 row when not; a step where one session drafts alone is 1."""
    model = _tiny_llama()
    metrics = telemetry.DrafterMetrics(CollectorRegistry())
    worker = DraftWorker(metrics=metrics, batch=batched)
    sessions: list[DraftSession] = [
        _greedy(model, [3 + i + j for j in range(5 + 7 * i)], seed=i, lookahead=100) for i in range(3)
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


def _session(ready: bool, started: bool, drafted: int) -> DraftSession:
    """A session at gamma 4 (window 9) with `drafted` drafts past its committed context."""
    s = DraftSession(list(range(8)), gamma=4, lookahead=5)
    s.ready, s.started = ready, started
    s.context += list(range(drafted))
    return s


def test_rows_drafting_ahead_join_the_urgent_rows_forward_and_prefills_wait() -> None:
    """While a verifier waits for some sessions' drafts (urgent), the batched worker steps them
    and, in the same forward, every session drafting ahead (a row costs little beside the
    weights a forward reads); a prefill waits for a step with nothing urgent. One session at a
    time, only the urgent ones. Of the prefills, only the oldest."""
    urgent = _session(ready=True, started=True, drafted=1)  # fewer than gamma drafts
    ahead = _session(ready=True, started=True, drafted=4)  # gamma drafts: it drafts its lookahead
    first, second = _session(ready=False, started=False, drafted=0), _session(ready=False, started=False, drafted=0)
    assert urgent.urgent() and ahead.wants_work() and not ahead.urgent() and not first.urgent()

    def order(sessions: list[DraftSession], batched: bool) -> list[DraftSession]:
        return [s for s, _ in work_order([(s, _no_error) for s in sessions], batched)]

    assert order([first, urgent, second, ahead], batched=True) == [urgent, ahead]
    assert order([first, urgent, second, ahead], batched=False) == [urgent]
    for batched in (True, False):  # nothing urgent: drafting ahead, and the oldest prefill
        assert order([first, second, ahead], batched) == [first, ahead]
    # the target's first token came before this session's prefill ended: urgent, prefilled now
    late = _session(ready=False, started=True, drafted=0)
    assert late.urgent()
    assert order([first, late, ahead], batched=True) == [late, ahead]
    assert order([first, late, ahead], batched=False) == [late]


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


def _queued_sessions(n: int, report: bool = True) -> list[ModelDraftSession]:
    """`n` sessions of 40-token prompts, prefilled in chunks of 8 (39 tokens: 8, 8, 8, 8, 7)."""
    model = _tiny_llama()
    sessions = []
    for i in range(n):
        s = _greedy(model, [3 + i + j % 50 for j in range(40)], seed=i, lookahead=0, prefill_chunk=8)
        s.report_progress = report
        sessions.append(s)
    return sessions


def _prefill_all(
    worker: DraftWorker, sessions: list[ModelDraftSession], readies: list[tuple[int, list[int]]] | None = None
) -> list[list[object]]:
    """Add the sessions together (before the worker starts), run it until each is ready; what
    each session's emit got, in order. `readies` gets (session, every session's `cached`) at
    each `Ready`, in the order they came."""
    got: list[list[object]] = [[] for _ in sessions]
    done = threading.Event()

    def emit_for(i: int) -> Emit:
        def emit(item: object) -> None:  # on the worker's thread, between steps
            assert not isinstance(item, BaseException), item
            got[i].append(item)
            if isinstance(item, Ready) and readies is not None:
                readies.append((i, [s.cached for s in sessions]))
            if all(any(isinstance(x, Ready) for x in g) for g in got):
                done.set()

        return emit

    for i, s in enumerate(sessions):
        worker.add(s, emit_for(i))
    worker.start()
    try:
        assert done.wait(30)
    finally:
        worker.stop()
        worker.join(10)
    return got


def test_a_session_waiting_for_its_prefill_hears_the_queue_ahead_go_down() -> None:
    """Each session waiting for its `Ready` gets a `Progress` whenever the prompt tokens left
    before it is ready (its own and those of the sessions ahead) went down: one per prefill
    chunk here (no interval), strictly fewer each time, its own prefilled count, and none
    after its `Ready`. A hung drafter sends none, so a gateway tells the two apart."""
    sessions = _queued_sessions(3)
    got = _prefill_all(DraftWorker(progress_interval_s=0.0), sessions)
    own = [31, 23, 15, 7]  # 39 tokens to prefill, in chunks of 8; ready after the fifth
    for i, items in enumerate(got):
        assert isinstance(items[-1], Ready) and items[-1].prefilled_tokens == 40
        reports = items[:-1]
        assert all(isinstance(p, Progress) for p in reports)
        queued = [p.queued_tokens for p in reports]  # type: ignore[attr-defined]
        assert queued == sorted(set(queued), reverse=True), f"session {i}: not strictly down: {queued}"
        assert queued[-len(own) :] == own
        assert [p.prefilled_tokens for p in reports[-len(own) :]] == [8, 16, 24, 32]  # type: ignore[attr-defined]
    assert [p.queued_tokens for p in got[1][: -len(own) - 1]] == [70, 62, 54, 46, 39]  # type: ignore[attr-defined]
    assert [p.queued_tokens for p in got[2][: -len(own) - 1]][:5] == [109, 101, 93, 85, 78]  # type: ignore[attr-defined]


def test_progress_goes_only_to_sessions_that_asked_and_at_most_once_an_interval() -> None:
    sessions = _queued_sessions(2)
    sessions[0].report_progress = False
    got = _prefill_all(DraftWorker(progress_interval_s=3600.0), sessions)
    assert [type(x) for x in got[0]] == [Ready]
    assert [type(x) for x in got[1]] == [Progress, Ready]  # the first report, then none within the hour
    assert got[1][0].queued_tokens == 31 + 39  # type: ignore[attr-defined]


def test_prompts_are_prefilled_one_at_a_time_in_arrival_order() -> None:
    """Three sessions with long prompts arrive together: the first is prefilled to its end
    (its `Ready`) before the second starts, as the target's scheduler takes them; the later
    ones wait (their prefill chunks are not interleaved), and each is prefilled in turn."""
    readies: list[tuple[int, list[int]]] = []
    _prefill_all(DraftWorker(), _queued_sessions(3, report=False), readies)
    assert [i for i, _ in readies] == [0, 1, 2]
    assert readies[0][1][1:] == [0, 0]  # the later prompts untouched until the first is done
    assert readies[1][1][2] == 0
