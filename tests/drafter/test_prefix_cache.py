"""The drafter's prefix cache (drafter.prefix_cache): which entries it keeps and matches, and
that a session started from a match drafts what a session that prefilled its whole prompt
drafts, with fewer tokens through the model."""

from __future__ import annotations

import threading

import pytest
import torch

from drafter.prefix_cache import PrefixCache
from drafter.server import DraftWorker
from drafter.sessions import BlockOut, DraftSession, ModelDraftSession, NgramDraftSession, Ready

VOCAB = 512  # ids stay in the tiny tokenizer's range


def _layers(n: int, n_layers: int = 2, fill: float = 0.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Keys/values of n tokens per layer, [1, 2 heads, n, 4 dims] float32: 32 bytes a token a tensor."""
    return [(torch.full((1, 2, n, 4), fill), torch.full((1, 2, n, 4), fill)) for _ in range(n_layers)]


def _bytes(n: int, n_layers: int = 2) -> int:
    return n * 32 * 2 * n_layers


def test_a_lookup_answers_the_longest_common_prefix_and_never_the_prompts_last_token() -> None:
    cache = PrefixCache(1 << 20, min_tokens=4)
    a, b = list(range(100)), list(range(40)) + [999] * 60
    assert cache.store(a, _layers(100, fill=1.0)) and cache.store(b, _layers(100, fill=2.0))
    hit = cache.lookup(list(range(70)) + [5, 6])  # a's first 70
    assert hit is not None and hit.tokens == 70 and float(hit.layers[0][0][0, 0, 0, 0]) == 1.0
    hit = cache.lookup(list(range(40)) + [999] * 10)  # b's first 50, of which the last is the prompt's last
    assert hit is not None and hit.tokens == 49 and float(hit.layers[1][1][0, 0, 0, 0]) == 2.0
    assert cache.lookup(list(range(3)) + [7] * 20) is None  # 3 tokens: under min_tokens
    assert cache.lookup([7] * 50) is None


def test_the_budget_evicts_the_least_recently_used_and_a_longer_entry_replaces_its_prefix() -> None:
    cache = PrefixCache(_bytes(250), min_tokens=4)
    first, second = [1] * 100, [2] * 100
    cache.store(first, _layers(100))
    cache.store(second, _layers(100))
    assert cache.held_bytes == _bytes(200)
    assert cache.lookup(first + [0]) is not None  # first is now the more recently used
    cache.store([3] * 100, _layers(100))  # over the budget: second goes
    assert cache.lookup(second + [0]) is None and cache.lookup(first + [0]) is not None
    assert cache.held_bytes == _bytes(200) and len(cache) == 2
    # an entry that extends `first` replaces it; one that `first + ...` begins is not kept again
    assert cache.store(first + [4] * 20, _layers(120))
    assert len(cache) == 2 and cache.held_bytes == _bytes(220)
    assert not cache.store(first[:50], _layers(50))
    hit = cache.lookup(first + [4] * 20 + [9])
    assert hit is not None and hit.tokens == 120


def test_what_it_does_not_keep() -> None:
    assert not PrefixCache(0).store([1] * 100, _layers(100))  # off
    assert PrefixCache(0).lookup([1] * 100) is None
    small = PrefixCache(_bytes(50), min_tokens=4)
    assert not small.store([1] * 100, _layers(100))  # over the whole budget
    assert not small.store([1] * 3, _layers(3))  # under min_tokens
    assert not small.store([1] * 10, [])  # no layers (a cache that held nothing)
    assert len(small) == 0 and small.held_bytes == 0


def test_the_worker_retires_what_its_caller_removed_on_its_own_thread() -> None:
    """A session its caller removes goes to on_retire, on the worker's thread; one removed
    because its step failed, or removed twice, does not (go) again."""
    got: list[tuple[DraftSession, str]] = []
    done = threading.Event()

    def on_retire(session: DraftSession) -> None:
        got.append((session, threading.current_thread().name))
        done.set()

    worker = DraftWorker(batch=False, on_retire=on_retire)
    failed, ended = NgramDraftSession([1, 2, 3], 2, 0, 4, 1), NgramDraftSession([4, 5, 6], 2, 0, 4, 1)
    worker.add(failed, lambda item: None)
    worker.add(ended, lambda item: None)
    worker.remove(failed, retire=False)  # as the worker does when a step fails
    worker.remove(failed)  # the servicer's own removal after it
    worker.start()
    try:
        worker.remove(ended)
        worker.remove(ended)
        assert done.wait(timeout=60)
    finally:
        worker.stop()
        worker.join(timeout=60)
    assert got == [(ended, "draft-worker")]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    """The tiny draft with the lean forward the drafter runs on the CPU."""
    from transformers import AutoModelForCausalLM

    from specdec.models import resolve
    from specdec.models.lean import LeanDecoder

    return LeanDecoder(AutoModelForCausalLM.from_pretrained(resolve("tiny/draft-mid")).eval())


def _session(model: torch.nn.Module, prompt: list[int], **kw: object) -> ModelDraftSession:
    s = ModelDraftSession(model, prompt, 4, 0, 0.0, 0, 1.0, 0, 8, **kw)  # type: ignore[arg-type]
    s.flush_ms, s.branches = 1e9, 3  # branches: each draft's conf is the model's probability
    return s


def _until_ready(s: ModelDraftSession) -> tuple[Ready, int]:
    """Step `s` through its prefill: its Ready and the steps it took."""
    steps = 0
    while True:
        steps += 1
        out = s.step()
        if isinstance(out, Ready):
            return out, steps


def _draft(s: ModelDraftSession, token: int) -> BlockOut:
    """Commit the target's first token after the prompt and draft one block of gamma."""
    s.commit(len(s.context), [token])
    while True:
        out = s.step()
        if isinstance(out, BlockOut):
            return out


@pytest.mark.e2e  # the tiny draft model (tests/conftest.py tiers)
def test_a_session_from_a_match_drafts_what_a_whole_prefill_drafts(model: torch.nn.Module) -> None:
    """A session ends after its prompt and a few rounds; its cache goes to the prefix cache. A
    prompt that shares 200 tokens with it then prefills only the 99 after them (the copy is
    its first prefill step, reported as reused) and drafts the ids a session that prefilled
    all 299 drafts, with the same confidence to float tolerance; so does a prompt that is a
    prefix of the first (its last token is left to the first draft step)."""
    prompt = [(7 * j + 3) % VOCAB for j in range(300)]
    first = _session(model, prompt)
    _until_ready(first)
    block = _draft(first, 35)
    first.commit(len(prompt) + 1, [d.token_id for d in block.drafts[:2]] + [17])  # a rejection: a rollback
    first.step()
    first.close()
    tokens, layers = first.kv_prefix()
    assert tokens == first.context[: first.cached] and len(tokens) > len(prompt)
    cache = PrefixCache(1 << 30)
    assert cache.store(tokens, layers)

    for other in (prompt[:200] + [(5 * j + 1) % VOCAB for j in range(100)], prompt[:150]):
        match = cache.lookup(other)
        want = min(200, len(other) - 1)
        assert match is not None and match.tokens == want
        reused, fresh = _session(model, other, prefixes=lambda s, m=match: m), _session(model, other)
        (ready, steps), (fresh_ready, fresh_steps) = _until_ready(reused), _until_ready(fresh)
        assert (ready.reused_tokens, fresh_ready.reused_tokens) == (want, 0)
        assert ready.prefilled_tokens == fresh_ready.prefilled_tokens == len(other)
        assert reused.forward_tokens == len(other) - 1 - want and fresh.forward_tokens == len(other) - 1
        assert steps < fresh_steps
        got, expected = _draft(reused, 35), _draft(fresh, 35)
        assert [d.token_id for d in got.drafts] == [d.token_id for d in expected.drafts]
        torch.testing.assert_close(
            [d.conf for d in got.drafts], [d.conf for d in expected.drafts], rtol=1e-4, atol=1e-5
        )


@pytest.mark.e2e  # the tiny draft model (tests/conftest.py tiers)
def test_a_session_holds_its_prompts_keys_for_another_while_it_drafts(model: torch.nn.Module) -> None:
    """`prompt_prefix` answers the part of a live session's prompt it has computed and another
    prompt starts with, never its drafts or verified tokens (a commit may roll those back):
    while it prefills, what it has so far; after, the whole shared prompt; and its keys/values
    there are those a session that prefilled them itself holds, to float tolerance."""
    prompt = [(11 * j + 5) % VOCAB for j in range(300)]
    live = _session(model, prompt)
    assert live.prompt_prefix(prompt + [1]) is None  # nothing computed yet
    live.step()  # one chunk of 128 (the session's prefill_chunk)
    part = live.prompt_prefix(prompt)
    assert part is not None and part.tokens == 128
    _until_ready(live)
    _draft(live, 35)
    assert live.cached > len(prompt)  # it holds its drafts' keys too: they are not offered
    whole = live.prompt_prefix(prompt + [35] + [d for d in live.context[len(prompt) + 1 :]])
    assert whole is not None and whole.tokens == len(prompt)  # its whole prompt, none of what followed
    other = prompt[:250] + [3] * 20
    shared = live.prompt_prefix(other)
    assert shared is not None and shared.tokens == 250
    fresh = _session(model, other)
    _until_ready(fresh)
    for (k, v), layer in zip(shared.layers, fresh.cache.layers, strict=True):
        torch.testing.assert_close(k[:, :, :250], layer.keys[:, :, :250], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v[:, :, :250], layer.values[:, :, :250], rtol=1e-4, atol=1e-4)


def test_scopes_never_match_each_other() -> None:
    cache = PrefixCache(1 << 20, min_tokens=4)
    tokens = list(range(100))
    assert cache.store(tokens, _layers(100), scope="t1")
    assert cache.lookup(tokens + [1], scope="t2") is None and cache.lookup(tokens + [1]) is None
    hit = cache.lookup(tokens + [1], scope="t1")
    assert hit is not None and hit.tokens == 100
    assert cache.store(tokens[:50], _layers(50), scope="t2")  # another scope's prefix is an entry of its own
    assert len(cache) == 2
