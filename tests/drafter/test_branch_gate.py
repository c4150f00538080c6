"""The branch gate: a branch batch starts only when it can end before the next commit
(a session with the gate: tests/drafter/test_sessions.py)."""

from __future__ import annotations

import pytest

from drafter.branch_gate import BranchGate


class Clock:
    """A settable clock (seconds)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_unmeasured_fits_and_the_round_and_step_are_decayed_averages() -> None:
    clock = Clock()
    gate = BranchGate(clock)
    assert gate.fits(100)  # nothing measured: the first job measures the step
    gate.on_commit(0.0)
    gate.on_step(40.0)
    assert gate.fits(100)  # one commit: no round yet
    gate.on_commit(0.2)
    assert gate.round_ms == pytest.approx(200.0) and gate.step_ms == 40.0
    gate.on_commit(0.7)  # a 500 ms round: 200 + 0.2 x 300
    assert gate.round_ms == pytest.approx(260.0)
    gate.on_step(90.0)  # 40 + 0.2 x 50
    assert gate.step_ms == pytest.approx(50.0)


def test_a_job_fits_while_the_time_since_the_commit_and_its_steps_stay_within_the_round() -> None:
    clock = Clock()
    gate = BranchGate(clock)
    gate.on_commit(0.0)
    gate.on_commit(0.2)  # round 200 ms
    gate.on_step(40.0)
    clock.now = 0.2 + 0.039  # 39 ms after the commit: 39 + 4 x 40 <= 200
    assert gate.fits(4)
    clock.now = 0.2 + 0.041
    assert not gate.fits(4) and gate.fits(3)
    clock.now = 0.2 + 0.190
    assert not gate.fits(1)
