"""Deterministic waits for draft-board tests: events happen *inside* the board's wait, no timers.

`during_wait(board, e1, e2, ...)` makes the board's k-th wait run event k instead of
sleeping (a block arriving, the drafter ending, a request arriving), as if it had happened
while the step waited; a wait with no event left sleeps for real. `never_waits(board)`
fails the test if the board waits at all. Both record the timeouts the waits were given.
"""

from __future__ import annotations

from collections.abc import Callable

from verifier.proposer import DraftBoard


def during_wait(board: DraftBoard, *events: Callable[[], object]) -> list[float]:
    real = board._cond.wait
    pending = list(events)
    timeouts: list[float] = []

    def wait(timeout: float | None = None) -> bool:
        timeouts.append(timeout)
        if pending:
            pending.pop(0)()  # the board's lock is re-entrant: offer()/end() take it again
            return True
        return real(timeout)

    board._cond.wait = wait  # type: ignore[method-assign]  # the test's instrumented wait
    return timeouts


def never_waits(board: DraftBoard) -> None:
    def wait(timeout: float | None = None) -> bool:
        raise AssertionError(f"the step waited (timeout {timeout} s)")

    board._cond.wait = wait  # type: ignore[method-assign]  # the test's instrumented wait
