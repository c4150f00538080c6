"""When a draft session's idle time can hold a batch of branches (drafter.sessions: branch).

A session drafts branches only when its window is full, in the time left before the next
commit. A branch batch is a job of about gamma draft steps (one batched forward each: the
first feeds each row's context after the shared cache and its correction, each later one a
token a row) and gives nothing until its last step: the verifier can use a branch only once
it is sent. A job the next commit cuts short therefore drafted nothing usable, and it held
that commit up by the step in flight: a commit waits for the session's lock, which a step
holds for its whole forward, so the re-draft after a rejection (the round's critical path
when no branch covers it) starts that much later. Measured on a 2-core EPYC VM at batch 1,
γ 4 (docs/performance.md, "A branch batch only where it can end"): the window filled about
when the verdict came, no branch job ever finished, and a commit waited 34.6 ms on average
for the session's lock (up to 113 ms, behind a job's first step); with the gate, 15.0 ms.

Terms:
    round       the time between two commits of the session (the target's step, and any wait
                for drafts around it): a decayed average of the measured intervals
    step        one branch step's time (one batched forward of the branch rows, the first with
                the batch's setup): a decayed average of the measured steps
    fits(n)     whether n more steps end before the next commit is due: the time since the
                latest commit + n x step <= round. Unknown (no round or no step measured yet):
                it fits, so the first job measures the step.

The gate only decides whether a job starts; a job under way goes on (its cost was judged
when it started, and every step of it is measured). Exactness does not depend on it: a
branch is a draft like any other, and the verifier's acceptance rule decides every token.
"""

from __future__ import annotations

import time
from collections.abc import Callable

EWMA = 0.2  # weight of the newest measurement in round and step


class BranchGate:
    """Per session: the round and the branch step, measured (see the module's terms).
    `clock`: monotonic seconds (time.perf_counter; tests pass their own)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.round_ms = 0.0  # 0: not measured yet
        self.step_ms = 0.0  # 0: not measured yet
        self._commit_at: float | None = None  # clock() at the latest commit

    def on_commit(self, at: float) -> None:
        """A commit arrived at clock() `at`: one more round measured (from the previous commit)."""
        if self._commit_at is not None:
            self.round_ms = _ewma(self.round_ms, (at - self._commit_at) * 1e3)
        self._commit_at = at

    def on_step(self, ms: float) -> None:
        """A branch step took `ms`."""
        self.step_ms = _ewma(self.step_ms, ms)

    def fits(self, steps: int) -> bool:
        """Whether `steps` more branch steps end before the next commit is due (see the terms)."""
        if not self.round_ms or not self.step_ms or self._commit_at is None:
            return True
        since_ms = (self.clock() - self._commit_at) * 1e3
        return since_ms + steps * self.step_ms <= self.round_ms


def _ewma(old: float, new: float) -> float:
    return new if not old else old + EWMA * (new - old)
