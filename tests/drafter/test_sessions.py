"""Draft sessions: KV cache kept across rounds and rolled back, never recomputed."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from drafter.sessions import BlockOut, ModelDraftSession, NgramDraftSession, Ready
from specdec.models import resolve


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(resolve("tiny/draft-mid")).eval()


def _greedy(model: torch.nn.Module, context: list[int], n: int) -> list[int]:
    ids = torch.tensor([context])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(context) :].tolist()


def _drain(session) -> list[BlockOut]:
    """Step until the session has no work; the blocks it sent (a `Ready` comes before any)."""
    blocks = []
    while session.wants_work():
        b = session.step()
        if isinstance(b, Ready):
            assert not blocks
        elif b is not None:
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
    assert s.cached == len(prompt) - 1 and not s.started and s.ready
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


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafts_stay_in_allowed_token_ids(model, temperature: float) -> None:
    """The target samples among allowed_token_ids only; so does the drafter (its greedy pick is
    the best allowed token). Ids past the model's rows are ignored."""
    prompt = [3, 14, 15, 92, 65]
    free = _session(model, prompt, gamma=6)
    free.commit(len(prompt), [35])
    _, unconstrained = _drafted(free)
    allowed = [t for t in range(0, 512, 3) if t not in unconstrained[:2]] + [10**6]
    s = ModelDraftSession(
        model, prompt, 6, 0, temperature=temperature, top_k=0, top_p=1.0, seed=0, q_top_k=8, allowed_token_ids=allowed
    )
    s.commit(len(prompt), [35])
    _, drafts = _drafted(s)
    assert len(drafts) == 6 and set(drafts) <= set(allowed)
    if temperature == 0:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + [35]])).logits[0, -1]  # [vocab]
        best = max(allowed[:-1], key=lambda t: float(logits[t]))
        assert drafts[0] == best


def test_ngram_lookup_and_empty_block() -> None:
    s = NgramDraftSession([1, 2, 3, 4, 1, 2], gamma=3, lookahead=0, ngram_max=3, ngram_min=1)
    s.commit(6, [3])
    blocks = _drain(s)
    assert [d.token_id for d in blocks[0].drafts] == [4, 1, 2]
    s2 = NgramDraftSession([5, 6], gamma=2, lookahead=0, ngram_max=2, ngram_min=1)
    s2.commit(2, [7])
    (empty,) = _drain(s2)
    assert empty.drafts == [] and empty.start_position == 3


def test_prefill_runs_in_chunks_before_the_first_commit_then_ready(model) -> None:
    prompt = list(range(1, 42))
    s = ModelDraftSession(model, prompt, 4, 5, temperature=0.0, top_k=0, top_p=1.0, seed=0, q_top_k=8, prefill_chunk=16)
    assert s.wants_work() and not s.urgent()  # a prefill overlaps the target's: not urgent
    outs = [s.step() for _ in range(3)]
    assert outs[:2] == [None, None] and s.cached == 40  # 16 + 16 + 8 tokens: all but the last
    assert isinstance(outs[2], Ready) and outs[2].prefilled_tokens == 41 and outs[2].prefill_ms > 0
    assert not s.wants_work()  # nothing to draft before the target's first token
    s.commit(41, [7])
    assert s.urgent()
    start, drafts = _drafted(s)
    assert start == 42 and drafts == _greedy(model, prompt + [7], 9)


def test_a_commit_before_the_prefill_ends_finishes_it_first(model) -> None:
    """The target was faster than the drafter: the session is urgent, finishes its prefill
    (the committed tokens included), says ready, then drafts."""
    prompt = list(range(1, 30))
    s = ModelDraftSession(model, prompt, 3, 0, temperature=0.0, top_k=0, top_p=1.0, seed=0, q_top_k=8, prefill_chunk=8)
    assert s.step() is None
    s.commit(29, [5])
    assert s.urgent()
    outs = []
    while not isinstance(outs[-1] if outs else None, Ready):
        outs.append(s.step())
    assert outs[-1].prefilled_tokens == 30
    start, drafts = _drafted(s)
    assert start == 30 and drafts == _greedy(model, prompt + [5], 3)


# ---- pre-drafted branches ----------------------------------------------------------------------
def _branchy(model, prompt, gamma=3, branches=3):
    s = ModelDraftSession(model, prompt, gamma, gamma + 1, temperature=0.0, top_k=0, top_p=1.0, seed=0, q_top_k=8)
    s.branches = branches
    return s


def _branch_blocks(session) -> list[BlockOut]:
    """Branch work until none is left (the window is full): the branch blocks sent."""
    blocks = []
    while session.wants_branch():
        blocks.extend(session.branch_step())
    return blocks


def test_branches_are_the_likeliest_verdicts_drafted_from_their_context(model) -> None:
    prompt = [3, 14, 15, 92, 65]
    s = _branchy(model, prompt)
    s.commit(len(prompt), [35])
    _drain(s)  # the block and the full-accept lookahead come first
    assert not s.wants_work() and s.wants_branch()
    candidates = s.branch_candidates()
    assert len(candidates) == 3 and [c[0] for c in candidates] == sorted((c[0] for c in candidates), reverse=True)
    committed, context = s.committed, list(s.context)
    # P(p, t) = prod_{j<p} conf(j) * q_p(t): the model's own probabilities
    with torch.no_grad():
        for prob, p, t in candidates:
            assert committed <= p <= committed + s.gamma and t != context[p]
            logits = model(torch.tensor([context[:p]])).logits[0, -1]
            probs = torch.softmax(logits, -1)
            reach = 1.0
            for j in range(committed, p):
                reach *= float(torch.softmax(model(torch.tensor([context[:j]])).logits[0, -1], -1)[context[j]])
            assert prob == pytest.approx(reach * float(probs[t]), rel=1e-4)
    blocks = _branch_blocks(s)
    assert sorted((b.start_position, b.drafts[0].token_id) for b in blocks) == sorted((p, t) for _, p, t in candidates)
    for b in blocks:
        assert b.branch and b.committed_length == committed and len(b.drafts) == s.gamma + 1
        # the branch's drafts are the draft model's greedy continuation of context[:p] + [t]
        p, t = b.start_position, b.drafts[0].token_id
        assert [d.token_id for d in b.drafts[1:]] == _greedy(model, context[:p] + [t], s.gamma)
    assert s.branches_drafted == 3 and s.context == context  # the chain is untouched
    assert not s.wants_branch()


def test_a_verdict_that_matches_a_branch_adopts_it_without_drafting(model) -> None:
    prompt = [3, 14, 15, 92, 65]
    s = _branchy(model, prompt)
    s.commit(len(prompt), [35])
    _drain(s)
    blocks = {(b.start_position, b.drafts[0].token_id): b for b in _branch_blocks(s)}
    (p, t), block = next(iter(blocks.items()))
    committed, context = s.committed, list(s.context)
    before = s.forward_tokens
    s.commit(committed, context[committed:p] + [t])  # accepted up to p, then the correction t
    assert s.branches_adopted == 1 and s.breaks == 1 and s.uncovered == 0
    assert s.context == context[:p] + [t] + [d.token_id for d in block.drafts[1:]]
    resent = s.step()  # the branch's drafts go out again at once, as a fresh block
    assert isinstance(resent, BlockOut) and not resent.branch
    assert resent.start_position == resent.committed_length == p + 1
    assert [d.token_id for d in resent.drafts] == [d.token_id for d in block.drafts[1:]]
    assert s.forward_tokens == before  # no draft step spent on them
    # drafting goes on from the branch's end, as from any context
    rest = [d.token_id for b in _drain(s) for d in b.drafts]
    assert rest == _greedy(model, s.context[: p + 1 + s.gamma], len(rest))


def test_a_verdict_no_branch_matches_redrafts_and_branches_are_forgotten(model) -> None:
    prompt = [3, 14, 15, 92, 65]
    s = _branchy(model, prompt, branches=1)
    s.commit(len(prompt), [35])
    _drain(s)
    [(_, p, t)] = s.branch_candidates()
    _branch_blocks(s)
    committed, context = s.committed, list(s.context)
    other = next(x for x in range(512) if x not in (t, context[p]))
    s.commit(committed, context[committed:p] + [other])
    assert s.branches_adopted == 0 and s.context == context[:p] + [other]
    assert s.breaks == 1 and s.uncovered == 1  # `other` was no candidate: no branch could have covered it
    assert not s.wants_branch()  # forgotten: they were for the previous verdict
    start, drafts = _drafted(s)
    assert start == p + 1 and drafts == _greedy(model, s.context[: p + 1], len(drafts))


def test_a_verdict_matching_a_branch_under_way_adopts_its_drafts_so_far(model) -> None:
    """The verdict comes while the branch batch for it has drafted one token a row: the row's
    draft is adopted (sent as a fresh block: the verifier never saw it) and drafting goes on
    after it, as from any context."""
    prompt = [3, 14, 15, 92, 65]
    s = _branchy(model, prompt)
    s.commit(len(prompt), [35])
    _drain(s)
    _, p, t = s.branch_candidates()[0]
    assert s.branch_step() == []  # one forward of the batch: under way, nothing sent
    committed, context = s.committed, list(s.context)
    first = _greedy(model, context[:p] + [t], 1)  # what the row has drafted so far
    s.commit(committed, context[committed:p] + [t])
    assert s.branches_adopted == 1 and s.breaks == 1 and s.uncovered == 0
    assert s.context == context[:p] + [t] + first
    resent = s.step()
    assert isinstance(resent, BlockOut) and not resent.branch
    assert resent.start_position == p + 1 and [d.token_id for d in resent.drafts] == first
    rest = [d.token_id for b in _drain(s) for d in b.drafts]
    assert rest == _greedy(model, s.context[: p + 2], len(rest))


def test_a_candidate_verdict_not_drafted_in_time_is_a_miss_a_branch_could_have_covered(model) -> None:
    prompt = [3, 14, 15, 92, 65]
    s = _branchy(model, prompt)
    s.commit(len(prompt), [35])
    _drain(s)
    _, p, t = s.branch_candidates()[-1]  # no branch work done: not drafted
    committed, context = s.committed, list(s.context)
    s.commit(committed, context[committed:p] + [t])
    assert s.branches_adopted == 0 and s.breaks == 1 and s.uncovered == 0
    assert s.context == context[:p] + [t]


def test_branches_wait_for_drafting_and_are_off_at_zero(model) -> None:
    s = _branchy(model, [1, 2, 3], branches=0)
    s.commit(3, [4])
    _drain(s)
    assert not s.wants_branch() and s.branch_candidates() == []
    s = _branchy(model, [1, 2, 3])
    s.commit(3, [4])
    assert s.wants_work() and not s.wants_branch()  # the chain first


def test_a_held_session_drafts_nothing_until_released(model) -> None:
    s = _branchy(model, [1, 2, 3])
    _drain(s)  # the prefill is not held: it is the prompt's, needed either way
    s.commit(3, [4], hold=True)  # the verifier backed the request off
    assert not s.wants_work() and not s.wants_branch() and not s.urgent()
    before = s.forward_tokens
    s.commit(4, [5], hold=True)
    assert not s.wants_work() and s.forward_tokens == before
    s.commit(5, [6])  # released: drafts from the verified context, at once
    assert s.urgent()
    start, drafts = _drafted(s)
    assert start == 6 and drafts[: s.gamma] == _greedy(model, [1, 2, 3, 4, 5, 6], s.gamma)


def test_branches_at_different_positions_are_one_batch_each_its_own_greedy_continuation(model) -> None:
    prompt = [3, 14, 15, 92, 65]
    s = _branchy(model, prompt, gamma=3, branches=6)
    s.branch_alts = 2
    s.commit(len(prompt), [35])
    _drain(s)
    candidates = s.branch_candidates()
    positions = {p for _, p, _ in candidates}
    assert len(positions) >= 2, candidates  # the batch mixes positions (rows left-padded after the earliest)
    context = list(s.context)
    steps, blocks = 0, []
    while s.wants_branch():
        steps += 1
        blocks.extend(s.branch_step())
    assert steps == s.gamma  # one batched draft step per branch token, for every position at once
    assert sorted((b.start_position, b.drafts[0].token_id) for b in blocks) == sorted((p, t) for _, p, t in candidates)
    for b in blocks:
        p, t = b.start_position, b.drafts[0].token_id
        assert [d.token_id for d in b.drafts[1:]] == _greedy(model, context[:p] + [t], s.gamma), (p, t)


def test_a_branch_past_the_cache_is_drafted_from_its_whole_context(model) -> None:
    """A branch at the bonus position (after the last draft, which is not in the draft model's
    cache yet) is the continuation of the whole context + [t], the last draft included."""
    prompt = [3, 14, 15, 92, 65]
    s = ModelDraftSession(model, prompt, 3, 0, temperature=0.0, top_k=0, top_p=1.0, seed=0, q_top_k=8)
    s.branches = 1
    s.commit(len(prompt), [35])
    _drain(s)  # lock-step: the block of 3, its last draft not fed yet
    context = list(s.context)
    assert s.cached == len(context) - 1
    t = next(x for x in range(512) if x != context[-1])
    rows = [(len(context), t), (len(context) - 1, t)]  # the bonus position, and a ragged batch with it
    for batch in (rows[:1], rows):
        s._branch_job = s._begin_branch_rows(batch)
        done = None
        while done is None:
            done = s._advance_branches()
        s._branch_job = None
        for (p, token), cont in zip(*done[:2], strict=True):
            assert [d.token_id for d in cont] == _greedy(model, context[:p] + [token], s.gamma), (p, batch)
