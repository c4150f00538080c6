"""Adaptive gamma: how many of each request's drafts one target step verifies.

Terms:
    step cost   T(n) = base_ms + per_token_ms * n, the measured time of an engine step that
                computes n new tokens (every request's 1 + drafts, plus prefill chunks);
                fitted online by `StepCost` from the engine's own steps.
    alpha_i     request i's recent per-token acceptance rate (`Acceptance`) of the drafts the
                steps asked for: a step that waited for the row's drafts and got none counts as
                one rejected draft (`Acceptance.miss`), since drafts that come after their step
                yield nothing. So a drafter too slow for its target (a loaded drafter host, a
                queue of sessions) is backed off like an unrelated one, and held. Only a drafter
                that has drafted since its request started or was released from a hold is
                counted so (verifier.proposer: before that it had no draft to send late).
    gain        verifying request i's j-th draft adds alpha_i^j expected tokens: it counts
                only when drafts 1..j are all accepted.
    k_i         request i's budget: the number of its drafts the step verifies (<= gamma_i).

A step with budgets k_i yields N = sum_i sum_{j=0..k_i} alpha_i^j expected tokens (j = 0 is
the target's own token) in T(n) ms, n = sum_i (1 + k_i). `allocate` adds drafts best gain
first while each one raises the step's expected tokens per ms, N / T:

    (N + g) / (T + per_token_ms) > N / T   <=>   g > per_token_ms * N / T

At batch 1 the right side is small (T is mostly the per-step base cost: reading the weights),
so a request gets its whole gamma. When the verifier is saturated (many requests, the
per-token cost dominates T) the threshold rises above alpha and the budgets fall to 0:
the step is plain decoding, so speculation backs off before it costs throughput.

The fit is robust to single slow steps (a cold first decode step, a stall of a shared VM):
each step size's median time, then the median of the slopes between sizes (Theil-Sen), with
the prior slope as PRIOR_VOTES more slopes. A least-squares line through a narrow range of
sizes is moved arbitrarily far by one such step at a size of its own, down to a base of 0,
where drafts look as dear as the step itself, every budget is 0, and no step of another size
comes to correct it while that step stays in the window. Replaying the 87 decode steps of a
c = 16 run here with the 12.9 s step of a stalled run added (tests/verifier/test_budget.py),
least squares allocated 4 drafts per row for the next 20 steps and 2 or 3 for
the rest of the run, where without that step it allocated 1; the median of slopes allocated the
same in every step with it as without it.

The same rule decides whether a step waits for drafts that have not arrived
(`worth_waiting`). Waiting is a renewal problem: a step's cycle is wait + T and yields N
tokens, so the step waits for the next draft token only while that token's expected gain per
ms, alpha^(h+1) / (draft time per token + per_token_ms), beats the cycle's rate so far,
N / (T + waited). At batch 1 with a good drafter that means waiting for the whole block; when
many requests share the step (N large) or the request's drafts are rarely accepted, it means
verifying what is there now.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from specdec.acceptance import expected_tokens  # E(alpha, k): expected tokens of a step verifying k drafts

# Prior slope of the step cost, as a fraction of the median step time per token, used until
# the engine has run steps of different sizes (vLLM on one CPU core, Qwen2.5-Coder 1.5B:
# verifying 5 tokens costs ~1.3x a 1-token step).
PRIOR_PER_TOKEN_FRACTION = 0.07
PRIOR_VOTES = 4  # that prior's weight in the fit: as many slopes between steps of different sizes
REFIT_AFTER, REFIT_EVERY = 32, 8  # past REFIT_AFTER steps in the window, the fit is redone every REFIT_EVERY
PRIOR_ALPHA = 0.7  # acceptance assumed for a request with no history
PRIOR_ALPHA_WEIGHT = 2.0  # ... worth this many observed draft tokens
UNMEASURED_DRAFT_FRACTION = 0.3  # a drafter's time per token before it is measured, x the step (c ~ 0.3)
DECAY = 0.9  # per verdict: acceptance history fades, so a request that stopped drafting is re-tried


class StepCost:
    """Online robust fit of T(n) = base_ms + per_token_ms * n over the last `window` engine steps
    (the median of slopes between step sizes: see the module docstring)."""

    def __init__(self, window: int = 256) -> None:
        self._n: deque[float] = deque(maxlen=window)
        self._ms: deque[float] = deque(maxlen=window)
        self.base_ms = 0.0
        self.per_token_ms = 0.0
        # a prompt token's share of a full-budget prefill step, measured by the verifier's
        # warm-up (vllm_hooks.warm_up; 0: not measured). Not from the fit: at batch sizes the
        # fit sees, a step reads the weights once for a few tokens (~0.6 ms a token on the CPU),
        # where a prefill chunk computes hundreds (~3.5 ms a token there).
        self.prefill_ms_per_token = 0.0
        self._observed = 0  # steps observed in all

    def observe(self, n_tokens: int, step_ms: float) -> None:
        """One engine step that computed `n_tokens` tokens in `step_ms` (draft waits excluded)."""
        if n_tokens <= 0 or step_ms <= 0:
            return
        self._n.append(float(n_tokens))
        self._ms.append(float(step_ms))
        self._observed += 1
        if len(self._n) > REFIT_AFTER and self._observed % REFIT_EVERY:
            return  # a full window moves slowly: refit every REFIT_EVERY steps (~1 ms a fit at 150 sizes)
        n, ms = np.asarray(self._n), np.asarray(self._ms)  # [W], [W]
        n_mid, ms_mid = float(np.median(n)), float(np.median(ms))
        prior = PRIOR_PER_TOKEN_FRACTION * ms_mid / (1.0 + PRIOR_PER_TOKEN_FRACTION * n_mid)
        # Theil-Sen over the sizes seen (the module docstring): each size's median time, then the
        # median of the slopes between sizes and PRIOR_VOTES prior slopes
        order = np.lexsort((ms, n))  # by size, then time
        n_sorted, ms_sorted = n[order], ms[order]  # [W], [W]
        sizes, first, count = np.unique(n_sorted, return_index=True, return_counts=True)  # [S] each
        times = (ms_sorted[first + (count - 1) // 2] + ms_sorted[first + count // 2]) / 2  # [S]: medians
        dn = sizes[None, :] - sizes[:, None]  # [S, S]
        apart = dn > 0
        slopes = ((times[None, :] - times[:, None])[apart] / dn[apart]).tolist()
        slope = max(0.0, float(np.median(slopes + [prior] * PRIOR_VOTES)))
        self.per_token_ms = slope
        self.base_ms = max(0.0, float(np.median(ms - slope * n)))

    @property
    def ready(self) -> bool:
        return len(self._n) > 0

    def predict_ms(self, n_tokens: float) -> float:
        return self.base_ms + self.per_token_ms * n_tokens


class Acceptance:
    """A request's recent acceptance rate alpha, from its verdicts (decayed counts + prior)."""

    def __init__(self) -> None:
        self.accepted = 0.0  # decayed sum of accepted drafts
        self.tried = 0.0  # decayed sum of drafts whose acceptance was decided

    def record(self, drafted: int, accepted: int) -> None:
        """A verdict: `accepted` of `drafted` drafts; the first rejected one was tried too."""
        self.accepted = DECAY * self.accepted + accepted
        self.tried = DECAY * self.tried + accepted + (1 if accepted < drafted else 0)

    def miss(self) -> None:
        """A step waited for the request's drafts and none came in time: one rejected draft."""
        self.record(1, 0)

    @property
    def alpha(self) -> float:
        return (self.accepted + PRIOR_ALPHA * PRIOR_ALPHA_WEIGHT) / (self.tried + PRIOR_ALPHA_WEIGHT)


def allocate(alphas: list[float], caps: list[int], cost: StepCost, extra_tokens: int = 0) -> list[int]:
    """Budgets k_i <= caps[i] maximising expected tokens per ms (see the module docstring).

    alphas[i]: row i's acceptance rate; caps[i]: drafts row i could verify (gamma, room left);
    extra_tokens: other tokens the step computes anyway (prefill chunks).
    """
    k = [0] * len(alphas)
    if not cost.ready or cost.per_token_ms <= 0:
        return list(caps)  # nothing measured yet: speculate fully
    n_tokens = len(alphas) + extra_tokens
    expected = float(len(alphas))  # N: each row's own token
    step_ms = cost.predict_ms(n_tokens)  # T
    while True:
        best, best_gain = -1, 0.0
        for i, a in enumerate(alphas):
            if k[i] < caps[i]:
                gain = a ** (k[i] + 1)  # the next draft's expected tokens
                if gain > best_gain:
                    best, best_gain = i, gain
        # add the draft only if it raises N / T:  g > per_token_ms * N / T
        if best < 0 or best_gain <= cost.per_token_ms * expected / step_ms:
            return k
        k[best] += 1
        expected += best_gain
        step_ms += cost.per_token_ms


def worth_waiting(
    have: list[int],
    want: list[int],
    alphas: list[float],
    draft_ms: list[float | None],
    cost: StepCost,
    waited_ms: float,
) -> bool:
    """Whether the step should wait for one more draft token (see the module docstring).

    have[i]: drafts row i has now; want[i]: its budget; draft_ms[i]: its drafter's measured
    time per draft token (None: not measured yet, assumed UNMEASURED_DRAFT_FRACTION of the
    step's cost). The step's rate so far, waits
    included, is N / (T + waited); one more draft of row i adds alpha_i^(have_i + 1) expected
    tokens for draft_ms_i + per_token_ms. Waiting pays when some row's next draft beats that rate.
    """
    missing = [i for i, (h, w) in enumerate(zip(have, want)) if h < w]
    if not missing:
        return False
    if not cost.ready:
        return True
    n_now = sum(expected_tokens(a, h) for a, h in zip(alphas, have))
    step_ms = cost.predict_ms(sum(1 + h for h in have))
    rate_now = n_now / (step_ms + waited_ms)
    for i in missing:
        measured = draft_ms[i]
        d = measured if measured is not None else UNMEASURED_DRAFT_FRACTION * step_ms
        if alphas[i] ** (have[i] + 1) / (d + cost.per_token_ms) > rate_now:
            return True
    return False
