"""A commit that rejects the context stops the draft forward under way (drafter.sessions,
`superseded`): the forward ends at its next layer, drafts nothing and leaves the session's
state and cache as they were, so the commit waits a layer for the session's lock instead of a
forward, and the drafts after it are exactly the ones drafted without the stop."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry
from transformers import AutoModelForCausalLM

from drafter import batch, server
from drafter.kvcache import GrowingCache
from drafter.sessions import BlockOut, ModelDraftSession, Ready
from specdec.models import resolve
from specdec.models.lean import LeanDecoder, Stopped
from specdec.telemetry import DrafterMetrics

pytestmark = pytest.mark.e2e  # the tiny draft model (tests/conftest.py tiers)


@pytest.fixture(scope="module")
def loaded() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(resolve("tiny/draft-mid")).eval()


@pytest.fixture
def model(loaded: torch.nn.Module) -> LeanDecoder:
    """A lean forward of its own per test (a test may wrap one of its layers' modules)."""
    return LeanDecoder(loaded)


def _greedy(model: torch.nn.Module, context: list[int], n: int) -> list[int]:
    """n greedy tokens after `context`, one full forward each (no cache)."""
    out = list(context)
    with torch.inference_mode():
        for _ in range(n):
            out.append(int(model(input_ids=torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(context) :]


def _session(model: torch.nn.Module, prompt: list[int], gamma: int = 3, lookahead: int = 2) -> ModelDraftSession:
    s = ModelDraftSession(model, prompt, gamma, lookahead, temperature=0.0, top_k=0, top_p=1.0, seed=0, q_top_k=8)
    while s.wants_work():  # the prompt's cache, and its Ready
        s.step()
    return s


def _drafts(session: ModelDraftSession) -> list[int]:
    """Draft until the window is full; the tokens of the blocks sent."""
    out = []
    while session.wants_work():
        b = session.step()
        assert not isinstance(b, Ready)
        if isinstance(b, BlockOut):
            out += [d.token_id for d in b.drafts]
    return out


def test_a_stopped_forward_leaves_the_cache_as_it_was(model: LeanDecoder) -> None:
    """Stopped after its first layer (of the tiny draft's two), then truncated: the next
    forward's logits are bit for bit an unstopped forward's from the same cache."""
    prompt = torch.tensor([[3, 14, 15, 92, 65, 35]])
    stopped, plain = GrowingCache(), GrowingCache()
    with torch.inference_mode():
        for cache in (stopped, plain):
            model(input_ids=prompt, past_key_values=cache)
        asked = iter([False, True])
        with pytest.raises(Stopped):
            model(input_ids=torch.tensor([[7]]), past_key_values=stopped, stop=lambda: next(asked))
        # the layer it reached holds the step's token, the other does not
        assert [layer.get_seq_length() for layer in stopped.layers] == [7, 6]
        stopped.truncate(6)
        assert all(layer.get_seq_length() == 6 for layer in stopped.layers)
        a = model(input_ids=torch.tensor([[7]]), past_key_values=stopped).logits
        b = model(input_ids=torch.tensor([[7]]), past_key_values=plain).logits
    assert torch.equal(a, b)


def test_a_superseded_session_drafts_nothing_then_drafts_from_its_commit(model: LeanDecoder) -> None:
    prompt = [3, 14, 15, 92, 65]
    s = _session(model, prompt)
    s.commit(len(prompt), [35])
    s.step()  # one draft of the window
    context, cached, steps = list(s.context), s.cached, s.steps
    s.superseded = True  # as a commit that rejects the context sets it while it waits for the lock
    assert s.step() is None
    assert (s.context, s.cached, s.steps, s.forwards_stopped) == (context, cached, steps, 1)
    correction = (context[-1] + 1) % 512
    s.commit(len(prompt) + 1, [correction])  # rejects that draft
    assert not s.superseded
    assert _drafts(s) == _greedy(model, prompt + [35, correction], s.window)


def _stop_counts(sessions: list[ModelDraftSession]) -> list[int]:
    return [s.forwards_stopped for s in sessions]


def test_a_batched_forward_stops_only_when_every_session_in_it_is_superseded(model: LeanDecoder) -> None:
    prompts = [[3, 14, 15, 92, 65], [2, 71, 82, 81]]
    sessions = [_session(model, p) for p in prompts]
    for s, p in zip(sessions, prompts, strict=True):
        s.commit(len(p), [35])
    sessions[0].superseded = True
    batch.draft_step(sessions)  # one of two superseded: the forward runs, both draft
    assert [len(s.context) for s in sessions] == [len(p) + 2 for p in prompts]
    assert _stop_counts(sessions) == [0, 0]
    sessions[1].superseded = True
    contexts = [list(s.context) for s in sessions]
    results = batch.draft_step(sessions)
    assert results == [(None, None, []), (None, None, [])]  # nothing drafted, nothing failed
    assert [s.context for s in sessions] == contexts and [s.cached for s in sessions] == [len(c) - 1 for c in contexts]
    assert _stop_counts(sessions) == [1, 1]
    for s, c in zip(sessions, contexts, strict=True):  # the commits that superseded them: drafts as from scratch
        s.commit(len(c) - 1, [(c[-1] + 1) % 512])
        assert _drafts(s) == _greedy(model, s.context[: len(c)], s.window)


class _Contended:
    """A session lock that tells when another thread waits for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.waiting = threading.Event()

    def __enter__(self) -> bool:
        if not self._lock.acquire(blocking=False):
            self.waiting.set()
            self._lock.acquire()
        return True

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


class _Pausing(torch.nn.Module):
    """A module in another's place that, on its first call, sets `paused` and returns only
    once `until()` has."""

    def __init__(self, inner: torch.nn.Module, until: Callable[[], object]) -> None:
        super().__init__()
        self.inner, self.until = inner, until
        self.paused = threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.paused.is_set():
            self.paused.set()
            self.until()
        out: torch.Tensor = self.inner(x)
        return out


def _pause_mid_forward(model: LeanDecoder, until: Callable[[], object]) -> threading.Event:
    """Make the model's next forward pause in its first layer until `until()` returns; the
    event is set once it has paused there."""
    layer = model.layers[0]
    pausing = _Pausing(layer.o, until)
    layer.o = pausing
    return pausing.paused


@pytest.mark.parametrize("rejects", [True, False])
def test_a_commit_arriving_mid_forward_stops_it_only_when_it_rejects_the_context(
    model: LeanDecoder, rejects: bool
) -> None:
    """A real commit from another thread while the worker's forward is in its first layer:
    a rejection stops the forward (it drafts nothing, the commit goes ahead); a verdict that
    accepts the drafts lets it finish, and its draft is kept."""
    prompt = [3, 14, 15, 92, 65]
    s = _session(model, prompt)
    s.commit(len(prompt), [35])
    s.step()
    lock = _Contended()
    s.lock = lock  # type: ignore[assignment]  # the same protocol as threading.Lock's `with`
    paused = _pause_mid_forward(model, lambda: lock.waiting.wait(timeout=60))
    drafted = s.context[-1]
    verdict = [(drafted + 1) % 512] if rejects else [drafted]
    result: list[object] = []
    worker = threading.Thread(target=lambda: result.append(s.step()))
    worker.start()
    assert paused.wait(timeout=60)
    s.commit(len(prompt) + 1, verdict)  # waits for the lock, which the paused step holds
    worker.join(timeout=60)
    assert not worker.is_alive() and not s.superseded
    context = prompt + [35] + verdict
    if rejects:
        assert result == [None] and s.forwards_stopped == 1 and s.context == context
        assert _drafts(s) == _greedy(model, context, s.window)
    else:
        assert s.forwards_stopped == 0 and s.context == context + _greedy(model, context, 1)


class _Watched(ModelDraftSession):
    """A session that tells when a thread other than the one that made it reads `superseded`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.read_elsewhere = threading.Event()
        self._maker = threading.get_ident()
        super().__init__(*args, **kwargs)

    @property
    def superseded(self) -> bool:
        if threading.get_ident() != self._maker:
            self.read_elsewhere.set()
        return self._superseded

    @superseded.setter
    def superseded(self, value: bool) -> None:
        self._superseded = value


def test_the_worker_lets_a_superseded_sessions_commit_apply_before_its_next_step(
    model: LeanDecoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between steps the worker holds no session's lock, so a commit waiting for one applies at
    once: the worker waits for it (up to SUPERSEDED_WAIT_S) before its next forward, and the
    session drafts from the verdict in that forward beside the others, with no forward started
    on the rejected context and none without it."""
    monkeypatch.setattr(server, "SUPERSEDED_WAIT_S", 60.0)  # this test's commit comes when it comes
    prompts = [[3, 14, 15, 92, 65], [2, 71, 82, 81, 8]]
    rejected = _Watched(model, prompts[0], 3, 2, temperature=0.0, top_k=0, top_p=1.0, seed=0, q_top_k=8)
    other = _session(model, prompts[1])
    for s, p in zip((rejected, other), prompts, strict=True):
        while s.wants_work():
            s.step()
        s.commit(len(p), [35])
        s.step()  # one draft each
    other.commit(len(prompts[1]) + 1, [other.context[-1]])  # accepts its draft: it drafts on
    rejected.superseded = True  # as a rejecting commit sets it, while it waits for the lock
    blocks: dict[int, list[BlockOut]] = {id(rejected): [], id(other): []}
    cond = threading.Condition()

    def emit_to(s: ModelDraftSession) -> Callable[[object], None]:
        def emit(item: object) -> None:
            with cond:
                if isinstance(item, BlockOut):
                    blocks[id(s)].append(item)
                cond.notify_all()

        return emit

    registry = CollectorRegistry()
    worker = server.DraftWorker(metrics=DrafterMetrics(registry), batch=True)
    for s in (rejected, other):
        worker.add(s, emit_to(s))
    worker.start()
    try:
        assert rejected.read_elsewhere.wait(timeout=60)  # the worker has seen the session superseded
        correction = (rejected.context[-1] + 1) % 512
        rejected.commit(len(prompts[0]) + 1, [correction])  # the commit the flag stood for
        worker.wake()
        with cond:
            assert cond.wait_for(lambda: all(any(b.final for b in bs) for bs in blocks.values()), timeout=60)
    finally:
        worker.stop()
        worker.join(timeout=60)
    assert rejected.forwards_stopped == 0  # no forward on the rejected context
    # both drafted their windows in the same forwards: none had one row (the other's alone)
    assert registry.get_sample_value("specdec:drafter_batch_rows_bucket", {"le": "1.0"}) == 0
    assert registry.get_sample_value("specdec:drafter_batch_rows_count") == rejected.window
    context = prompts[0] + [35, correction]
    assert [d.token_id for b in blocks[id(rejected)] for d in b.drafts] == _greedy(model, context, rejected.window)
