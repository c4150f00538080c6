"""A commit that rejects the context stops the draft forward under way (drafter.sessions,
`superseded`): the forward ends at its next layer, drafts nothing and leaves the session's
state and cache as they were, so the commit waits a layer for the session's lock instead of a
forward, and the drafts after it are exactly the ones drafted without the stop."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from transformers import AutoModelForCausalLM

from drafter import batch
from drafter.kvcache import GrowingCache
from drafter.sessions import BlockOut, ModelDraftSession, Ready
from specdec.models import resolve
from specdec.models.lean import LeanDecoder, Stopped

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
