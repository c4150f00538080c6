"""Drafts sized by confidence: where a draft session stops a block, and how it learns where.

Terms (positions count from `committed`, the verified context's length: draft 1 is the
drafter's token at position committed, draft j at committed + j - 1):
    conf_j      the draft model's probability of its own token j (greedy: of the argmax;
                sampled: of the sampled token), its estimate that the target agrees
    reach r_j   prod_{i <= j} conf_i: the draft model's estimate that the target accepts
                drafts 1..j all (a step accepts a prefix of its drafts, so draft j counts
                only when all before it do). r_0 = 1.
    survive_j   the event "drafts 1..j are all accepted" (what a verdict decides)
    f(r)        P(survive_j | r_j = r): the draft model's confidence, calibrated on this
                session's verdicts (`Calibration`); a calibrated draft model has f(r) = r
    tau         the cut threshold: the session drafts token j + 1 only while r_j >= tau.
                The token on which the reach fell below tau is kept (it is drafted already)
                and ends the block: the block goes out `final` (the verifier stops waiting)
                and the session drafts branches until the next commit.
    cost c      the smallest expected gain (in tokens) that pays for one more draft token:
                c = d * N / R, with d the session's compute per draft token (ms), N the
                tokens one commit verifies and R the time between two commits (ms), all
                measured by the session itself (decayed averages). It is the verifier's
                wait rule (verifier/budget.py `worth_waiting`) seen from the drafter: a round
                yields N tokens in R ms; drafting one more token adds about d ms to the round
                (the verifier waits for it) and f(r) expected tokens, which pays while
                f(r) / d > N / R.

Modes (DrafterConfig.draft_confidence): "off" (blocks of gamma, as before), a fixed tau
(a float in (0, 1]), or "auto": tau is learned, the smallest reach whose calibrated chance
of surviving beats the cost, tau = min{r : f(r') >= c for every r' >= r} over the
calibration's buckets (the lower edge of the lowest such bucket).

Exactness does not depend on any of this: the verifier's acceptance rule decides every
token; a shorter block only changes how many drafts a step verifies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Bucket edges of the reach r (each bucket is [edge_k, edge_{k+1})); the last holds r = 1.
EDGES: tuple[float, ...] = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
PRIOR_WEIGHT = 2.0  # the prior f(r) = r (a calibrated draft) is worth this many verdicts per bucket
DECAY = 0.98  # per decided draft in a bucket: old verdicts fade, so tau follows the text
COST_EWMA = 0.2  # weight of the newest measurement in d, N and R
PRIOR_COST = 0.1  # c before the session has measured d, N and R (cut only at a low reach)
MIN_TAU = EDGES[1]  # "auto" always cuts below this reach (a chain its own draft gives < 5 %)


def parse_mode(value: str) -> float | str:
    """`draft_confidence`'s value: "off", "auto" or a fixed tau in (0, 1] (returned as a float).
    Raises ValueError naming the setting otherwise."""
    text = value.strip().lower()
    if text in ("off", "auto"):
        return text
    try:
        tau = float(text)
    except ValueError:
        raise ValueError(f"draft_confidence: {value!r} is not off, auto or a number in (0, 1]") from None
    if not 0.0 < tau <= 1.0:
        raise ValueError(f"draft_confidence: {tau:g} is outside (0, 1]")
    return tau


@dataclass
class Calibration:
    """f(r) per reach bucket: decayed counts of decided drafts and of those that survived,
    pulled toward f(r) = r (the bucket's midpoint) by PRIOR_WEIGHT (see the module's terms)."""

    tried: list[float] = field(default_factory=lambda: [0.0] * (len(EDGES) - 1))
    survived: list[float] = field(default_factory=lambda: [0.0] * (len(EDGES) - 1))

    @staticmethod
    def bucket(reach: float) -> int:
        for k in range(len(EDGES) - 2, -1, -1):
            if reach >= EDGES[k]:
                return k
        return 0

    def record(self, reach: float, survived: bool) -> None:
        """A verdict decided a draft proposed at `reach`: it survived (it and every draft
        before it were accepted) or not."""
        k = self.bucket(reach)
        self.tried[k] = DECAY * self.tried[k] + 1.0
        self.survived[k] = DECAY * self.survived[k] + (1.0 if survived else 0.0)

    def estimate(self, k: int) -> float:
        """f over bucket k."""
        mid = (EDGES[k] + EDGES[k + 1]) / 2
        return (self.survived[k] + PRIOR_WEIGHT * mid) / (self.tried[k] + PRIOR_WEIGHT)

    def threshold(self, cost: float) -> float:
        """tau for cost c: the lower edge of the lowest bucket from which on every bucket's
        f is >= c (the top bucket's lower edge when none is: draft one token per round)."""
        tau = EDGES[-2]
        for k in range(len(EDGES) - 2, -1, -1):
            if self.estimate(k) < cost:
                break
            tau = EDGES[k]
        return max(MIN_TAU, tau)


class ConfidencePolicy:
    """One session's cut rule: a fixed tau, or "auto" (learned; see the module docstring).

    `observe_commit` feeds it each verdict's decided drafts and the round's measurements;
    `tau` is the threshold in force."""

    def __init__(self, mode: float | str) -> None:
        if mode == "off":
            raise ValueError("ConfidencePolicy: mode off has no policy (use None)")
        self.fixed: float | None = mode if isinstance(mode, float) else None
        self.calibration = Calibration()
        self.token_ms = 0.0  # d: compute per draft token, ms
        self.tokens_per_commit = 0.0  # N
        self.commit_ms = 0.0  # R: time between two commits, ms
        self._last_commit: float | None = None  # perf_counter of the previous commit, seconds
        self.tau = self.fixed if self.fixed is not None else self.calibration.threshold(PRIOR_COST)

    @property
    def cost(self) -> float:
        """c = d * N / R (PRIOR_COST until all three are measured)."""
        if not (self.token_ms and self.tokens_per_commit and self.commit_ms):
            return PRIOR_COST
        return self.token_ms * self.tokens_per_commit / self.commit_ms

    def observe_token(self, ms: float) -> None:
        """A draft token cost `ms` of compute."""
        if ms > 0:
            self.token_ms = ms if not self.token_ms else self.token_ms + COST_EWMA * (ms - self.token_ms)

    def observe_commit(self, now: float, tokens: int, decided: list[tuple[float, bool]]) -> None:
        """A commit of `tokens` tokens at perf_counter `now` (seconds) that decided the drafts
        `decided`: (the reach each was at, measured from this commit's start; survived)."""
        for reach, survived in decided:
            self.calibration.record(reach, survived)
        if tokens > 0:
            n = float(tokens)
            self.tokens_per_commit = (
                n if not self.tokens_per_commit else (self.tokens_per_commit + COST_EWMA * (n - self.tokens_per_commit))
            )
            if self._last_commit is not None:
                ms = (now - self._last_commit) * 1e3
                self.commit_ms = ms if not self.commit_ms else self.commit_ms + COST_EWMA * (ms - self.commit_ms)
            self._last_commit = now
        if self.fixed is None:
            self.tau = self.calibration.threshold(self.cost)
