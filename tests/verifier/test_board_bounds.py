"""The draft board under an untrusted drafter: garbage offers (positions in the past or far
future, huge blocks, floods) leave it bounded, and what it proposes stays valid drafts."""

from __future__ import annotations

import random

import numpy as np
from board_waits import never_waits

from specdec.validation import draft_horizon, max_blocks_per_commit
from verifier.proposer import MAX_PROPOSALS, DraftBoard

GAMMA = 3
PROMPT_LEN = 2
HORIZON = draft_horizon(GAMMA)


def _board() -> DraftBoard:
    b = DraftBoard(wait_s=0.0)
    b.register("r", gamma=GAMMA, prompt_len=PROMPT_LEN, max_tokens=10_000)
    b.ready("r", 10.0)
    return b


def _chain_bounded(b: DraftBoard) -> None:
    e = b._entries["r"]
    assert len(e.chain) <= 2 * HORIZON
    if e.chain:
        assert e.chain_start + len(e.chain) <= e.committed + HORIZON


def test_a_huge_block_is_kept_only_up_to_the_horizon() -> None:
    b = _board()
    b.offer("r", 3, [7] * 100_000, committed=3)
    e = b._entries["r"]
    assert e.chain_start == 3 and len(e.chain) == PROMPT_LEN + HORIZON - 3  # ends at committed + horizon
    _chain_bounded(b)
    assert b.propose_batch([("r", np.array([1, 2, 5]))], 8) == [[7, 7, 7]]  # at most gamma


def test_extensions_never_grow_the_chain_past_the_horizon() -> None:
    b = _board()
    for i in range(1000):  # contiguous continuations, as if the drafter drafted ahead forever
        if i % 10 == 0:
            b.preview("r", 2, [5])  # a new step: the flood cap starts again
        b.offer("r", 3 + i * GAMMA, [4] * GAMMA, final=False, committed=3)
        _chain_bounded(b)


def test_blocks_far_in_the_future_or_the_past_leave_the_chain_alone() -> None:
    b = _board()
    b.offer("r", 3, [7, 8, 9], committed=3)
    before = list(b._entries["r"].chain)
    b.offer("r", 2**31, [1, 1, 1], committed=2**31)  # far future
    b.offer("r", PROMPT_LEN + HORIZON + 1, [1], committed=3)  # just past the horizon
    b.preview("r", 9, [5, 5, 5])  # the context is 12 long now
    b.offer("r", 0, [1, 1, 1], committed=0)  # wholly in the past (inside the prompt, even)
    b.offer("r", 9, [1, 1, 1], committed=9)  # wholly verified context by now
    assert b._entries["r"].chain == before and b._entries["r"].chain_start == 3
    b.offer("r", 12 - HORIZON - 1, [1] * (HORIZON + 3), committed=0)  # starts too far back to be a draft
    assert b._entries["r"].chain == before


def test_a_partly_stale_block_is_kept_for_its_part_ahead() -> None:
    """A block drafted before the target moved on is a normal race, not garbage: the context
    decides what of it is still usable."""
    b = _board()
    b.preview("r", 2, [5, 7])  # the target verified position 3 (7) while the drafter drafted from 3
    b.offer("r", 3, [7, 8, 9], committed=3)
    assert b.propose_batch([("r", np.array([1, 2, 5, 7]))], 8) == [[8, 9]]


def test_a_flood_between_two_previews_is_cut_at_the_cap_without_waking_a_step() -> None:
    b = _board()
    cap = max_blocks_per_commit(GAMMA)
    for _ in range(cap):
        b.offer("r", 3, [7, 8, 9], committed=3)
    wakes = []
    real = b._cond.notify_all
    b._cond.notify_all = lambda: (wakes.append(1), real())  # type: ignore[method-assign]  # counts the wake-ups
    for _ in range(10_000):
        b.offer("r", 3, [1, 1, 1], committed=3)  # dropped: no chain change, no wake-up
    assert wakes == [] and b._entries["r"].chain == [7, 8, 9]
    b.preview("r", 2, [5])  # the next step: the drafter may send blocks again
    b.offer("r", 3, [4, 4, 4], committed=3)
    assert wakes == [1] and b._entries["r"].chain == [4, 4, 4]


def test_proposals_are_bounded_without_verdicts() -> None:
    b = _board()
    for length in range(3, 200):
        b.preview("r", length - 1, [5])
        b.offer("r", length, [6, 6, 6], committed=length)
        assert b.propose_batch([("r", np.arange(length))], 8) == [[6, 6, 6]]
        assert len(b._entries["r"].proposals) <= MAX_PROPOSALS
    assert b.take_proposal("r", 199) == [6, 6, 6]  # the newest ones are kept


def test_garbage_reported_times_are_ignored() -> None:
    b = DraftBoard(wait_s=5.0)
    b.register("r", gamma=GAMMA, prompt_len=PROMPT_LEN, max_tokens=100)
    b.ready("r", float("inf"))
    assert b._entries["r"].pace_ms == 0.0
    b.offer("r", 3, [7], final=False, draft_ms=float("nan"))
    b.offer("r", 4, [8], final=False, committed=3, draft_ms=-1e30)
    assert b._entries["r"].draft_ms_per_token is None


def test_random_garbage_keeps_the_board_bounded_and_its_proposals_valid() -> None:
    """A fuzzed drafter over a growing context: the chain stays within the horizon, proposals
    within gamma, and every proposal is tokens some offer carried at those positions."""
    rng = random.Random(1234)
    b = _board()
    never_waits(b)  # wait_s 0: a step never waits, whatever arrives
    context = [1, 2]
    offered: dict[int, set[int]] = {}  # position -> tokens some block put there
    for step in range(400):
        for _ in range(rng.choice([0, 1, 3, 50, 500])):
            kind = rng.random()
            if kind < 0.3:
                start = len(context) + rng.randrange(-3, 2 * GAMMA)  # plausible, stale or ahead
            elif kind < 0.5:
                start = rng.randrange(0, len(context))  # the past
            elif kind < 0.7:
                start = len(context) + rng.randrange(HORIZON, 2**31)  # far future
            else:
                start = rng.randrange(0, 2**31)
            n = rng.choice([0, 1, GAMMA, 10 * GAMMA, 5000])
            head = [rng.randrange(0, 1000) for _ in range(min(n, 2 * GAMMA))]
            tokens = head + [rng.randrange(0, 1000)] * (n - len(head))
            committed = rng.choice([start, len(context), 0, rng.randrange(0, 2**31)])
            for i, t in enumerate(tokens[: 2 * HORIZON]):
                offered.setdefault(start + i, set()).add(t)
            b.offer("r", start, tokens, final=rng.random() < 0.5, committed=committed)
            _chain_bounded(b)
        [proposal] = b.propose_batch([("r", np.array(context))], 8)
        assert len(proposal) <= GAMMA
        assert all(t in offered.get(len(context) + i, ()) for i, t in enumerate(proposal))
        assert len(b._entries["r"].proposals) <= MAX_PROPOSALS
        sampled = [rng.randrange(0, 1000) for _ in range(rng.randrange(1, GAMMA + 2))]
        context += sampled
        b.preview("r", len(context) - len(sampled), sampled)
        if step % 3:
            b.take_proposal("r", len(context) - len(sampled))
