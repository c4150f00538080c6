"""The draft board: chains, consistency with the context, budgets, bounded waits."""

from __future__ import annotations

import threading
import time

import numpy as np

from verifier.proposer import DraftBoard


def _board(wait_s: float = 0.0) -> DraftBoard:
    b = DraftBoard()
    b.wait_s = wait_s
    b.register("r", gamma=3, prompt_len=2, max_tokens=100)
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
    threading.Timer(0.05, b.offer, args=("r", 3, [4, 4, 4])).start()
    t0 = time.monotonic()
    assert b.propose_batch([("r", np.array([1, 2, 5]))], 8) == [[4, 4, 4]]
    assert time.monotonic() - t0 < 2.0


def test_does_not_wait_when_drafter_ended_or_has_nothing() -> None:
    b = _board(wait_s=5.0)
    b.end("r")
    t0 = time.monotonic()
    assert b.propose_batch([("r", np.array([1, 2, 5]))], 8) == [[]]
    b2 = _board(wait_s=5.0)
    b2.offer("r", 3, [])  # "nothing for position 3"
    assert b2.propose_batch([("r", np.array([1, 2, 5]))], 8) == [[]]
    assert time.monotonic() - t0 < 1.0


def test_wait_is_bounded() -> None:
    b = _board(wait_s=0.1)
    t0 = time.monotonic()
    assert b.propose_batch([("r", np.array([1, 2, 5]))], 8) == [[]]
    assert 0.09 < time.monotonic() - t0 < 1.0


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
    threading.Timer(0.05, b.offer, args=("r", 4, [5], False, 3)).start()
    threading.Timer(0.10, b.offer, args=("r", 5, [6], False, 3)).start()
    assert b.propose_batch([("r", np.array([1, 2, 5]))], 8) == [[4, 5, 6]]
    b.register("s", gamma=3, prompt_len=2, max_tokens=100)
    b.offer("s", 3, [4], final=False, committed=3)
    threading.Timer(0.05, b.offer, args=("s", 4, [5], True, 3)).start()  # the drafter stops at 2
    t0 = time.monotonic()
    assert b.propose_batch([("s", np.array([1, 2, 5]))], 8) == [[4, 5]]
    assert time.monotonic() - t0 < 2.0


def test_redraft_replaces_stale_drafts_before_it() -> None:
    b = _board(wait_s=0.5)
    b.offer("r", 3, [7, 8, 9])
    assert b.propose_batch([("r", np.array([1, 2, 5]))], 8) == [[7, 8, 9]]
    # the target rejected 7 and said 4; the re-draft for position 4 arrives before the next propose
    b.offer("r", 4, [6, 6, 6], committed=4)
    t0 = time.monotonic()
    assert b.propose_batch([("r", np.array([1, 2, 5, 4]))], 8) == [[6, 6, 6]]
    assert time.monotonic() - t0 < 0.2


def test_redraft_at_the_end_of_the_chain_is_not_an_extension() -> None:
    b = _board(wait_s=0.5)
    b.offer("r", 3, [7, 8, 9])
    assert b.propose_batch([("r", np.array([1, 2, 5]))], 8) == [[7, 8, 9]]
    # 7 and 8 accepted, 9 rejected for 4: the re-draft starts where the chain ended
    b.offer("r", 6, [1, 1, 1], committed=6)
    t0 = time.monotonic()
    assert b.propose_batch([("r", np.array([1, 2, 5, 7, 8, 4]))], 8) == [[1, 1, 1]]
    assert time.monotonic() - t0 < 0.2
