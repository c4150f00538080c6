"""Draft sessions: KV cache kept across rounds and rolled back, never recomputed."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from drafter.sessions import ModelDraftSession, NgramDraftSession
from specdec.models import resolve


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(resolve("tiny/draft-mid")).eval()


def _greedy(model: torch.nn.Module, context: list[int], n: int) -> list[int]:
    ids = torch.tensor([context])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(context) :].tolist()


def _drain(session) -> list:
    blocks = []
    while session.wants_work():
        b = session.step()
        if b is not None:
            blocks.append(b)
    return blocks


def _drafted(session) -> tuple[int, list[int]]:
    """Draft until the window is full; (start position, tokens) of the contiguous blocks sent."""
    blocks = _drain(session)
    tokens = [d.token_id for b in blocks for d in b.drafts]
    pos = blocks[0].start_position
    for b in blocks:  # each block continues the previous one
        assert b.start_position == pos
        pos += len(b.drafts)
    assert blocks[-1].final and all(b.committed_length == blocks[0].start_position for b in blocks)
    return blocks[0].start_position, tokens


def _session(model, prompt, gamma=4):
    return ModelDraftSession(model, prompt, gamma, 0, temperature=0.0, top_k=0, top_p=1.0, seed=0, q_top_k=8)


def test_drafts_after_commits_equal_fresh_greedy(model) -> None:
    prompt = [3, 14, 15, 92, 65]
    s = _session(model, prompt)
    _drain(s)  # warm-up: the prompt's KV cache before the first commit
    assert s.cached == len(prompt) - 1 and not s.started
    s.commit(len(prompt), [35])  # the target's first token
    start, drafts = _drafted(s)
    context = prompt + [35]
    assert start == len(context)
    assert drafts == _greedy(model, context, 4)
    # the target accepts two drafts, then corrects the third
    correction = (drafts[2] + 1) % 512
    s.commit(len(context), drafts[:2] + [correction])
    context = context + drafts[:2] + [correction]
    start, drafts = _drafted(s)
    assert start == len(context)
    assert drafts == _greedy(model, context, 4)
    # work: each context token went through the model once, plus each draft once
    assert s.forward_tokens <= len(context) + 8


def test_all_accepted_keeps_cache_and_goes_on(model) -> None:
    prompt = [1, 2, 3]
    s = _session(model, prompt, gamma=3)
    s.commit(3, [7])
    _, drafts = _drafted(s)
    before = s.forward_tokens
    s.commit(4, drafts + [9])  # all accepted + bonus
    start, _ = _drafted(s)
    assert start == 4 + 3 + 1
    assert s.forward_tokens - before == 3 + 1  # the bonus and the last draft, then 2 new drafts


def test_sampled_drafts_carry_q(model) -> None:
    s = ModelDraftSession(model, [1, 2, 3], 2, 0, temperature=1.0, top_k=0, top_p=1.0, seed=5, q_top_k=8)
    s.commit(3, [4])
    for d in [d for b in _drain(s) for d in b.drafts]:
        ids, q = d.support
        assert len(ids) == 8 and abs(sum(q) - 1) < 1e-5 and d.token_id in ids
        assert d.prob == pytest.approx(q[ids.index(d.token_id)])


def test_ngram_lookup_and_empty_block() -> None:
    s = NgramDraftSession([1, 2, 3, 4, 1, 2], gamma=3, lookahead=0, ngram_max=3, ngram_min=1)
    s.commit(6, [3])
    blocks = _drain(s)
    assert [d.token_id for d in blocks[0].drafts] == [4, 1, 2]
    s2 = NgramDraftSession([5, 6], gamma=2, lookahead=0, ngram_max=2, ngram_min=1)
    s2.commit(2, [7])
    (empty,) = _drain(s2)
    assert empty.drafts == [] and empty.start_position == 3
