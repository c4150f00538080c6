"""The draft board: chains, consistency with the context, budgets, bounded waits."""

from __future__ import annotations

import time

import numpy as np
import pytest
from board_waits import during_wait, never_waits

from verifier import proposer
from verifier.proposer import DraftBoard

# A drafter announced as this slow (ms per token) may be waited for the board's whole wait_s.
SLOW_PACE_MS = 10_000.0


def _board(wait_s: float = 0.0, pace_ms: float = SLOW_PACE_MS) -> DraftBoard:
    b = DraftBoard(wait_s=wait_s)
    b.register("r", gamma=3, prompt_len=2, max_tokens=100)
    b.ready("r", pace_ms)
    return b


def test_chain_is_proposed_when_consistent() -> None:
    b = _board()
    b.offer("r", 3, [7, 8, 9, 10])
    ctx = np.array([1, 2, 5])
    assert b.propose_batch([("r", ctx)], k_max=8) == [[7, 8, 9]]  # at most gamma
    assert b.take_proposal("r", 3) == [7, 8, 9]
    # the target accepted 7 and 8, then said 4: the rest of the chain is stale
    assert b.propose_batch([("r", np.array([1, 2, 5, 7, 8, 4]))], k_max=8) == [[]]


def test_extension_and_redraft() -> None:
    b = _board()
    b.offer("r", 3, [7])
    b.offer("r", 4, [8, 9], committed=3)  # contiguous, drafted before a commit: extends
    assert b.propose_batch([("r", np.array([1, 2, 5, 7]))], 8) == [[8, 9]]
    b.offer("r", 5, [6, 6])  # overlaps: replaces from its start
    assert b.propose_batch([("r", np.array([1, 2, 5, 7, 8]))], 8) == [[6, 6]]


def test_budget_stops_at_max_tokens() -> None:
    b = DraftBoard()
    b.register("r", gamma=8, prompt_len=2, max_tokens=4)
    b.offer("r", 3, [1, 1, 1, 1, 1])
    # context 3 = 2 prompt + 1 generated; 3 more to generate, the last is the bonus
    assert b.propose_batch([("r", np.array([1, 2, 3]))], 8) == [[1, 1]]


def test_waits_for_a_block_until_it_arrives() -> None:
    b = _board(wait_s=5.0)
    waits = during_wait(b, lambda: b.offer("r", 3, [4, 4, 4]))
    assert b.propose_batch([("r", np.array([1, 2, 5]))], 8) == [[4, 4, 4]]
    assert len(waits) == 1  # returned as soon as the block was there


def test_does_not_wait_when_drafter_ended_or_has_nothing() -> None:
    b = _board(wait_s=5.0)
    b.end("r")
    never_waits(b)
    assert b.propose_batch([("r", np.array([1, 2, 5]))], 8) == [[]]
    b2 = _board(wait_s=5.0)
    b2.offer("r", 3, [])  # "nothing for position 3"
    never_waits(b2)
    assert b2.propose_batch([("r", np.array([1, 2, 5]))], 8) == [[]]


def test_wait_is_bounded() -> None:
    b = _board(wait_s=0.1)
    waits = during_wait(b)  # nothing arrives: real waits
    t0 = time.monotonic()
    assert b.propose_batch([("r", np.array([1, 2, 5]))], 8) == [[]]
    assert time.monotonic() - t0 >= 0.09  # it did wait (Condition.wait may wake a little early)
    assert waits and all(0 < w <= 0.1 for w in waits)


def test_preview_reaches_the_session() -> None:
    b = DraftBoard()
    seen = []
    b.register("r", 2, 2, 10, on_preview=lambda start, toks: seen.append((start, toks)))
    b.preview("r", 2, [9])
    b.register("plain", 0, 2, 10, on_preview=lambda start, toks: seen.append("plain"))
    b.preview("plain", 2, [9])  # gamma 0: nobody drafts, no preview
    assert seen == [(2, [9])]


def test_partial_blocks_are_awaited_until_gamma_or_final() -> None:
    b = _board(wait_s=5.0)
    b.offer("r", 3, [4], final=False, committed=3)  # a slow drafter streams token by token
    during_wait(b, lambda: b.offer("r", 4, [5], False, 3), lambda: b.offer("r", 5, [6], False, 3))
    assert b.propose_batch([("r", np.array([1, 2, 5]))], 8) == [[4, 5, 6]]
    b.register("s", gamma=3, prompt_len=2, max_tokens=100)
    b.ready("s", SLOW_PACE_MS)
    b.offer("s", 3, [4], final=False, committed=3)
    waits = during_wait(b, lambda: b.offer("s", 4, [5], True, 3))  # the drafter stops at 2
    assert b.propose_batch([("s", np.array([1, 2, 5]))], 8) == [[4, 5]]
    assert len(waits) == 1  # `final`: no wait for the third


def test_redraft_replaces_stale_drafts_before_it() -> None:
    b = _board(wait_s=0.5)
    b.offer("r", 3, [7, 8, 9])
    assert b.propose_batch([("r", np.array([1, 2, 5]))], 8) == [[7, 8, 9]]
    # the target rejected 7 and said 4; the re-draft for position 4 arrives before the next propose
    b.offer("r", 4, [6, 6, 6], committed=4)
    never_waits(b)
    assert b.propose_batch([("r", np.array([1, 2, 5, 4]))], 8) == [[6, 6, 6]]


def test_redraft_at_the_end_of_the_chain_is_not_an_extension() -> None:
    b = _board(wait_s=0.5)
    b.offer("r", 3, [7, 8, 9])
    assert b.propose_batch([("r", np.array([1, 2, 5]))], 8) == [[7, 8, 9]]
    # 7 and 8 accepted, 9 rejected for 4: the re-draft starts where the chain ended
    b.offer("r", 6, [1, 1, 1], committed=6)
    never_waits(b)
    assert b.propose_batch([("r", np.array([1, 2, 5, 7, 8, 4]))], 8) == [[1, 1, 1]]


def test_a_drafter_still_prefilling_is_waited_for_the_margin_only() -> None:
    """No `ready` yet: the drafter is still prefilling (or stalled), its pace is unknown."""
    b = DraftBoard(wait_s=5.0, wait_margin_s=0.05)
    b.register("r", gamma=3, prompt_len=2, max_tokens=100)
    waits = during_wait(b)  # nothing arrives: real waits
    assert b.propose_batch([("r", np.array([1, 2, 5]))], 8) == [[]]
    assert waits and all(0 < w <= 0.05 for w in waits)
    b.offer("r", 3, [4, 4, 4])  # a block proves the prefill done, whatever the order of arrival
    assert b.propose_batch([("r", np.array([1, 2, 5]))], 8) == [[4, 4, 4]]


def test_a_drafter_still_prefilling_costs_one_margin_then_none_until_its_ready() -> None:
    """A long prompt's prefill can outlast many target steps (a queue on a CPU drafter): after
    one expired margin the row is late, and steps do not wait for it, even at batch 1, until
    the drafter says `ready`; then it is waited for again."""
    b = DraftBoard(wait_s=5.0, wait_margin_s=0.05)
    b.register("r", gamma=3, prompt_len=2, max_tokens=100)
    waits = during_wait(b)  # nothing arrives: one real wait, the margin
    assert b.propose_batch([("r", np.array([1, 2, 5]))], 8) == [[]]
    assert waits and all(0 < w <= 0.05 for w in waits)
    never_waits(b)
    for ctx in ([1, 2, 5, 6], [1, 2, 5, 6, 7]):  # the next steps, the drafter still prefilling
        assert b.propose_batch([("r", np.array(ctx))], 8) == [[]]
    b.ready("r", 10.0)
    waits = during_wait(b, lambda: b.offer("r", 5, [4, 4, 4]))  # ready: waited for, and its block comes
    assert b.propose_batch([("r", np.array([1, 2, 5, 6, 7]))], 8) == [[4, 4, 4]]
    assert len(waits) == 1


def test_a_paused_drafter_is_not_waited_for_until_its_next_ready() -> None:
    """The drafter preempted the session for memory (VerifyRequest.pause): its chain is dropped
    (the drafter let go of it), and steps do not wait for it at all, not even the margin, until
    its next `ready`; then it is waited for again."""
    b = _board(wait_s=5.0)
    b.offer("r", 3, [4, 4, 4])
    b.pause("r")
    never_waits(b)
    for ctx in ([1, 2, 5], [1, 2, 5, 6]):  # the chain agreed with the first context: dropped
        assert b.propose_batch([("r", np.array(ctx))], 8) == [[]]
    b.ready("r", 10.0)
    waits = during_wait(b, lambda: b.offer("r", 5, [4, 4, 4]))
    assert b.propose_batch([("r", np.array([1, 2, 5, 6, 7]))], 8) == [[4, 4, 4]]
    assert len(waits) == 1


def test_the_wait_is_capped_by_the_drafters_pace() -> None:
    """3 missing drafts at 20 ms each: the step waits 3 x 20 x 1.5 + 50 = 140 ms, not wait_s (5 s)."""
    b = _board(wait_s=5.0, pace_ms=20.0)
    waits = during_wait(b)  # nothing arrives: real waits
    assert b.propose_batch([("r", np.array([1, 2, 5]))], 8) == [[]]
    assert 0 < waits[0] <= 0.14 and all(w <= 0.14 for w in waits)


def test_end_releases_a_waiting_step_at_once() -> None:
    b = _board(wait_s=5.0)
    waits = during_wait(b, lambda: b.end("r"))
    assert b.propose_batch([("r", np.array([1, 2, 5]))], 8) == [[]]
    assert len(waits) == 1  # no second wait after `end`


def test_pace_is_measured_from_arrivals(monkeypatch) -> None:
    """A block's time since the drafter last had reason to draft (a preview, or the previous
    block), over its tokens, updates the drafter's pace (a running mean, weight 0.2)."""
    now = [100.0]
    monkeypatch.setattr(proposer.time, "monotonic", lambda: now[0])
    b = _board(pace_ms=40.0)
    b.preview("r", 2, [5])  # the commit leaves at t = 100 s
    now[0] += 0.4
    b.offer("r", 3, [7, 8, 9, 10])  # 400 ms for 4 tokens: 100 ms per token
    assert b._entries["r"].pace_ms == pytest.approx(0.8 * 40.0 + 0.2 * 100.0)
    now[0] += 0.1
    b.offer("r", 7, [1], committed=3)  # a continuation, 100 ms after the previous block
    assert b._entries["r"].pace_ms == pytest.approx(0.8 * (0.8 * 40.0 + 0.2 * 100.0) + 0.2 * 100.0)
    # the expected wait for 2 missing drafts: 2 x pace x (1 + slack) + margin, at most wait_s
    b.wait_s = 5.0
    expected = 2 * b._entries["r"].pace_ms / 1e3 * 1.5 + 0.05
    assert b._expected_wait_s("r", 2) == pytest.approx(expected)
    b.wait_s = 0.1
    assert b._expected_wait_s("r", 2) == 0.1


# ---- pre-drafted branches ----------------------------------------------------------------------
def _branched_board() -> DraftBoard:
    """The chain [7, 8, 9, 10] after context [1, 2, 5] (committed 3), proposed; then two branches:
    the rejection of 8 (position 4) with 6, and of 7 (position 3) with 4."""
    b = _board()
    b.offer("r", 3, [7, 8, 9, 10], committed=3)
    assert b.propose_batch([("r", np.array([1, 2, 5]))], 8) == [[7, 8, 9]]
    assert b.take_proposal_info("r", 3) == ([7, 8, 9], False, False)
    b.offer("r", 4, [6, 11, 12, 13], committed=3, branch=True)
    b.offer("r", 3, [4, 21, 22, 23], committed=3, branch=True)
    return b


def test_a_rejection_that_matches_a_branch_is_proposed_in_step() -> None:
    b = _branched_board()
    hits = b.metrics.branch_hits._value.get()
    # the target accepted 7, rejected 8 and sampled 6: the branch's drafts, with no wait
    assert b.propose_batch([("r", np.array([1, 2, 5, 7, 6]))], 8) == [[11, 12, 13]]
    assert b.take_proposal_info("r", 5) == ([11, 12, 13], True, False)  # a hit
    assert b.metrics.branch_hits._value.get() == hits + 1
    # the branch is the chain now: it goes on as one
    b.offer("r", 8, [14], committed=5)
    assert b.propose_batch([("r", np.array([1, 2, 5, 7, 6, 11, 12]))], 8) == [[13, 14]]


def test_a_rejection_no_branch_matches_is_a_miss() -> None:
    b = _branched_board()
    misses = b.metrics.branch_misses._value.get()
    assert b.propose_batch([("r", np.array([1, 2, 5, 7, 3]))], 8) == [[]]  # 8 rejected for 3: no branch
    assert b.take_proposal_info("r", 5) == ([], False, True)
    assert b.metrics.branch_misses._value.get() == misses + 1
    b.offer("r", 5, [30, 31], committed=5)  # the re-draft
    assert b.propose_batch([("r", np.array([1, 2, 5, 7, 3]))], 8) == [[30, 31]]


def test_a_late_branch_ends_the_wait_after_a_rejection() -> None:
    b = _board(wait_s=5.0)
    b.offer("r", 3, [7, 8, 9, 10], committed=3)
    b.propose_batch([("r", np.array([1, 2, 5]))], 8)
    waits = during_wait(b, lambda: b.offer("r", 3, [4, 21, 22, 23], committed=3, branch=True))
    assert b.propose_batch([("r", np.array([1, 2, 5, 4]))], 8) == [[21, 22, 23]]
    assert len(waits) == 1 and b.take_proposal_info("r", 4)[1]


def test_branches_are_dropped_once_the_chain_holds() -> None:
    b = _branched_board()
    # all accepted and the bonus guessed right: the branches were for verdicts not given
    assert b.propose_batch([("r", np.array([1, 2, 5, 7, 8, 9, 10]))], 8) == [[]]
    assert b._entries["r"].branches == []


def test_a_branch_from_another_context_or_a_flood_is_not_kept() -> None:
    b = _board()
    b.offer("r", 3, [7, 8, 9, 10], committed=3)
    b.propose_batch([("r", np.array([1, 2, 5]))], 8)
    b.offer("r", 4, [6, 11], committed=2, branch=True)  # drafted from a context the chain left
    b.offer("r", 9, [6, 11], committed=3, branch=True)  # does not branch off the chain
    assert b._entries["r"].branches == []
    for t in range(40):
        b.offer("r", 4, [t, 1, 1], committed=3, branch=True)
    assert len(b._entries["r"].branches) <= proposer.MAX_BRANCHES


def test_one_rows_missing_drafts_cost_the_others_the_margin_once() -> None:
    """A row whose drafter answers with nothing usable (here: an empty, non-final block) never
    holds a batch whose other rows have their drafts longer than the margin, and once its wait
    expired empty it is not waited for again until its drafter sends drafts."""
    b = DraftBoard(wait_s=5.0, wait_margin_s=0.05)
    for rid in ("good", "polite"):
        b.register(rid, gamma=3, prompt_len=2, max_tokens=100)
        b.ready(rid, SLOW_PACE_MS)  # alone, either would be waited for the whole wait_s
    ctx = np.array([1, 2, 5])
    b.offer("good", 3, [7, 8, 9])
    b.offer("polite", 3, [], final=False)  # "more to come", and nothing ever comes
    waits = during_wait(b)  # real waits
    assert b.propose_batch([("good", ctx), ("polite", ctx)], 8) == [[7, 8, 9], []]
    assert waits and all(0 < w <= 0.05 for w in waits), waits  # the margin, not wait_s
    # the next step: the polite row is late, the step does not wait for it at all
    ctx2 = np.array([1, 2, 5, 7, 8, 9, 4])
    b.offer("good", 7, [1, 1, 1])
    b.offer("polite", 7, [], final=False)
    never_waits(b)
    assert b.propose_batch([("good", ctx2), ("polite", ctx2)], 8) == [[1, 1, 1], []]
    # drafts from it again: it is worth waiting for again (here it has them already)
    b.offer("polite", 7, [3, 3], final=False)
    waits = during_wait(b, lambda: b.offer("polite", 9, [3], committed=7))
    assert b.propose_batch([("good", ctx2), ("polite", ctx2)], 8) == [[1, 1, 1], [3, 3, 3]]
    assert len(waits) == 1 and waits[0] <= 0.05


def test_a_batch_of_one_is_still_waited_for_as_expected() -> None:
    """With no other row to hold up, a late row is waited for as before (its own step only)."""
    b = _board(wait_s=5.0)
    b.offer("r", 3, [], final=False)
    during_wait(b, lambda: None)  # one wait that ends with nothing, then a real one
    b.wait_s = 0.05
    assert b.propose_batch([("r", np.array([1, 2, 5]))], 8) == [[]]
    b.wait_s = 5.0
    waits = during_wait(b, lambda: b.offer("r", 4, [4, 4], committed=3))
    assert b.propose_batch([("r", np.array([1, 2, 5, 6]))], 8) == [[4, 4]]
    assert waits == [pytest.approx(waits[0])] and waits[0] > 1.0  # the drafter's expected pace, not 0


def test_a_late_row_is_not_waited_for_beside_others_still_missing_theirs() -> None:
    """Both rows miss drafts; the late one (its last wait expired empty) adds nothing to the
    step's wait: the step waits only for the other row's expected arrival."""
    b = DraftBoard(wait_s=5.0, wait_margin_s=0.05)
    b.register("polite", gamma=3, prompt_len=2, max_tokens=100)
    b.ready("polite", SLOW_PACE_MS)
    b.offer("polite", 3, [], final=False)
    b.wait_s = 0.01
    assert b.propose_batch([("polite", np.array([1, 2, 5]))], 8) == [[]]  # alone: waited, expired empty
    b.wait_s = 5.0
    b.register("honest", gamma=3, prompt_len=2, max_tokens=100)
    b.ready("honest", 10.0)  # 3 drafts x 10 ms x 1.5 + the margin: 0.095 s
    waits = during_wait(b)  # real waits: nothing arrives
    assert b.propose_batch([("polite", np.array([1, 2, 5])), ("honest", np.array([1, 2, 5]))], 8) == [[], []]
    assert waits and all(w <= 0.1 for w in waits), waits  # not the polite row's 5 s
