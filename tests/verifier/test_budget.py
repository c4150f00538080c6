"""Adaptive gamma: the step-cost fit, acceptance tracking, budgets and wait limits."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from board_waits import during_wait, never_waits

from specdec.acceptance import expected_tokens
from verifier.budget import DECAY, Acceptance, StepCost, allocate, worth_waiting
from verifier.proposer import DraftBoard


def _cost(base: float, per_token: float, sizes: tuple[int, ...] = (1, 5, 16, 80, 300)) -> StepCost:
    c = StepCost()
    for n in sizes * 10:
        c.observe(n, base + per_token * n)
    return c


def test_step_cost_recovers_a_linear_model() -> None:
    c = _cost(800.0, 55.0)
    assert c.base_ms == pytest.approx(800.0, rel=0.02)
    assert c.per_token_ms == pytest.approx(55.0, rel=0.02)


def test_step_cost_uses_the_prior_slope_when_n_never_varies() -> None:
    c = StepCost()
    for _ in range(20):
        c.observe(5, 1000.0)
    assert 0 < c.per_token_ms < 1000.0 / 5
    assert c.predict_ms(5) == pytest.approx(1000.0)


BASE, PER_TOKEN = 400.0, 15.0  # qwen-coder's target on one core at 16 requests, roughly


def _true_ms(n: int) -> float:
    return BASE + PER_TOKEN * n


def test_one_cold_step_does_not_tilt_the_fit() -> None:
    """16 requests: the first decode step verified every row's 4 drafts (80 tokens) and ran
    cold (4x its cost); then steps of 16 tokens. A least-squares line through those points has
    base 0 (drafts as dear as the step); the median of slopes keeps the prior's, and drafts."""
    c = StepCost()
    c.observe(80, 4 * _true_ms(80))
    for _ in range(20):
        c.observe(16, _true_ms(16))
    assert c.base_ms > 0.5 * BASE
    assert sum(allocate([0.9] * 16, [4] * 16, c)) >= 16


def test_cold_steps_at_one_size_are_outvoted() -> None:
    """Five cold steps at 80 tokens against steps at 16 and 24: one size's time, its slopes
    outvoted by the prior's and the others'."""
    c = StepCost()
    for _ in range(5):
        c.observe(80, 4 * _true_ms(80))
    for n in (16, 24) * 20:
        c.observe(n, _true_ms(n))
    assert c.per_token_ms < 2 * PER_TOKEN and c.base_ms > 0.5 * BASE
    assert sum(allocate([0.9] * 16, [4] * 16, c)) >= 16


def test_a_stalled_step_does_not_move_the_budgets_of_a_measured_run() -> None:
    """The 87 decode steps of 16 requests measured here (tests/verifier/steps_c16.json), with the
    12.9 s step of a run in which the VM stalled added as the 9th: the fit keeps the run's own
    costs (least squares over its steps: base 244 ms, 31.4 ms a token), and the budgets the
    ones it gives without that step (least squares: 4 drafts per row instead of 1, for 20 steps)."""
    steps = json.loads((Path(__file__).parent / "steps_c16.json").read_text())["steps"]
    n, ms = np.array(steps, dtype=float).T
    per_token, base = np.polyfit(n, ms, 1)
    alphas, caps = [0.85] * 16, [4] * 16
    c, true = StepCost(), StepCost()
    differ = 0  # steps whose budgets the stalled step changed
    for i, (size, t) in enumerate(steps):
        if i == 8:
            c.observe(17, 12936.0)
        c.observe(size, t)
        true.observe(size, t)
        got, want = allocate(alphas, caps, c), allocate(alphas, caps, true)
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1, i
        differ += got != want
    assert differ <= 2  # a step where the budgets change anyway may come one step sooner or later
    assert c.per_token_ms == pytest.approx(per_token, rel=0.25) and c.base_ms == pytest.approx(base, rel=0.4)
    assert 1 <= sum(allocate(alphas, caps, c)) / 16 <= 2


def test_acceptance_tracks_and_fades_back_to_the_prior() -> None:
    a = Acceptance()
    for _ in range(30):
        a.record(4, 4)
    assert a.alpha > 0.95
    for _ in range(30):
        a.record(4, 0)
    assert a.alpha < 0.25
    for _ in range(60):
        a.record(0, 0)  # steps without drafts: history fades, the request gets re-tried
    assert a.alpha == pytest.approx(0.7, abs=0.05)


def test_batch_one_gets_its_whole_gamma() -> None:
    c = _cost(800.0, 55.0)  # Qwen2.5-Coder 1.5B on one core, roughly
    assert allocate([0.9], [8], c) == [8]
    assert allocate([0.9], [4], c) == [4]


def test_saturated_verifier_backs_off_to_plain_decoding() -> None:
    c = _cost(10.0, 50.0)  # per-token cost dominates: compute-bound
    assert allocate([0.8] * 16, [4] * 16, c) == [0] * 16


def test_budgets_favour_the_requests_that_accept() -> None:
    c = _cost(100.0, 10.0)
    k = allocate([0.95, 0.1], [8, 8], c)
    assert k[0] > k[1]
    assert k[1] == 0


def test_allocation_raises_expected_tokens_per_ms() -> None:
    c = _cost(300.0, 20.0)
    alphas, caps = [0.9, 0.6, 0.3, 0.8], [8, 8, 8, 8]
    k = allocate(alphas, caps, c)

    def rate(ks: list[int]) -> float:
        return sum(expected_tokens(a, x) for a, x in zip(alphas, ks, strict=True)) / c.predict_ms(
            sum(1 + x for x in ks)
        )

    assert rate(k) >= max(rate([0] * 4), rate(caps))
    for i in range(4):  # no single draft more or less does better
        for d in (-1, 1):
            other = list(k)
            other[i] += d
            if 0 <= other[i] <= caps[i]:
                assert rate(other) <= rate(k) + 1e-12


def test_waits_for_the_whole_block_of_a_good_drafter_at_batch_one() -> None:
    c = _cost(480.0, 30.0)  # Qwen2.5-Coder 1.5B on one core
    for have in range(4):  # even after waiting for 3 drafts, the 4th is worth its 130 ms
        assert worth_waiting([have], [4], [0.95], [130.0], c, waited_ms=130.0 * have)


def test_does_not_wait_for_a_poor_or_slow_drafter() -> None:
    c = _cost(480.0, 30.0)
    assert not worth_waiting([1], [4], [0.3], [130.0], c, waited_ms=130.0)  # rarely accepted
    assert not worth_waiting([1], [4], [0.95], [2000.0], c, waited_ms=0.0)  # drafts too slowly


def test_does_not_hold_a_full_batch_for_one_row() -> None:
    c = _cost(480.0, 30.0)
    assert not worth_waiting([4] * 15 + [0], [4] * 16, [0.9] * 16, [130.0] * 16, c, waited_ms=0.0)
    assert worth_waiting([0], [4], [0.9], [None], c, waited_ms=0.0)  # unmeasured drafter at batch 1: wait
    assert not worth_waiting([0] * 16, [4] * 16, [0.9] * 16, [None] * 16, c, waited_ms=0.0)  # ... not at 16


def test_a_new_request_ends_the_wait_for_drafts() -> None:
    b = DraftBoard(wait_s=5.0, adaptive=True)
    b.register("r", gamma=4, prompt_len=2, max_tokens=100)
    b.ready("r", 1000.0)
    waits = during_wait(b, b.arrival)
    assert b.propose_batch([("r", np.array([1, 2, 5]))], 8) == [[]]
    assert len(waits) == 1  # the arrival ended the wait
    # ... and until the engine has added it, no step waits: it arrived during a step, whose
    # own wait (at the step's end) would hold its prefill back
    never_waits(b)
    assert b.propose_batch([("r", np.array([1, 2, 5, 6]))], 8) == [[]]
    b.added()
    waits = during_wait(b, lambda: b.offer("r", 5, [7, 7]))
    assert b.propose_batch([("r", np.array([1, 2, 5, 6, 7]))], 8) == [[7, 7]]
    assert len(waits) == 1  # added: the next step waits for its drafts again
    b.queued = 1  # one waiting for its prefill: no wait at all
    never_waits(b)
    assert b.propose_batch([("r", np.array([1, 2, 5, 6, 7, 7, 7]))], 8) == [[]]  # past the chain


def _adaptive_board(base_ms: float, per_token_ms: float, sizes: tuple[int, ...]) -> DraftBoard:
    """An adaptive board with a measured step cost and one request "r" (gamma 4)."""
    b = DraftBoard(wait_s=5.0, adaptive=True)
    for n in sizes * 5:
        b.cost.observe(n, base_ms + per_token_ms * n)
    b.register("r", gamma=4, prompt_len=2, max_tokens=100)
    b.ready("r", 100.0)  # 100 ms per draft token: 4 missing drafts may be waited for 4 x 100 x 1.5 + 50 ms
    return b


def test_adaptive_board_does_not_wait_for_drafts_that_are_not_worth_it() -> None:
    b = _adaptive_board(1.0, 10.0, (1, 2, 3, 40))  # 1 ms base, 10 ms per token: saturated at once
    never_waits(b)
    assert b.propose_batch([("r", np.array([1, 2, 5]))], 8) == [[]]


def test_adaptive_board_proposes_a_full_block_at_batch_one() -> None:
    b = _adaptive_board(800.0, 55.0, (1, 5, 9))
    during_wait(b, lambda: b.offer("r", 3, [4, 4, 4, 4]))
    assert b.propose_batch([("r", np.array([1, 2, 5]))], 8) == [[4, 4, 4, 4]]


def test_a_backed_off_request_holds_its_drafter_until_it_is_retried() -> None:
    """Budget 0 with drafts possible: `holding` (the verdicts' hold_drafts) until the budget
    comes back; the step that releases it does not wait (its drafter has not drafted)."""
    b = _adaptive_board(100.0, 10.0, (1, 5, 16, 40))
    b.register("low", gamma=4, prompt_len=2, max_tokens=100)
    b.ready("low", 100.0)
    for _ in range(20):
        b.record("low", 4, 0)  # alpha ~ 0: its drafts do not pay for themselves
    ctx = np.array([1, 2, 5])
    assert b.propose_batch([("r", ctx), ("low", ctx)], 8) == [[], []]
    assert b.holding("low") and not b.holding("r")
    steps = 0
    while b.holding("low"):  # steps without its drafts: its history fades back to the prior
        b.take_proposal("low", 3)
        b.record("low", 0, 0)
        never_waits(b)
        b.propose_batch([("r", ctx), ("low", ctx)], 8)
        steps += 1
        assert steps < 100
    assert not b.holding("low")  # re-tried, and that step did not wait for it (never_waits)


def test_a_drafter_too_slow_for_the_steps_is_held() -> None:
    """Its blocks always arrive after their step (stale): each step that waited for them and got
    none counts as a rejected draft, so adaptive gamma holds it as it would an unrelated drafter.
    A step that gets its drafts counts nothing of the kind."""
    b = _adaptive_board(20.0, 10.0, (1, 2, 5, 9))  # batch 1: a first draft pays while alpha > 1/3
    b.wait_s, b.wait_margin_s = 0.02, 0.01  # real, short waits
    b.offer("r", 3, [4, 4, 4, 4])  # in time
    assert b.propose_batch([("r", np.array([1, 2, 5]))], 8) == [[4, 4]]  # the budget at the prior alpha
    assert b._entries["r"].acceptance.tried == 0 and not b.holding("r")
    ctx = [1, 2, 5, 4, 4, 9]  # the target took both and added its own token
    steps = 0
    while not b.holding("r"):
        b.offer("r", len(ctx) - 2, [7, 7], final=False, committed=len(ctx) - 2)  # for an old context; more to come
        assert b.propose_batch([("r", np.array(ctx))], 8) == [[]]
        ctx.append(9)
        steps += 1
        assert steps < 20, b._entries["r"].acceptance.alpha
    assert b._entries["r"].acceptance.alpha < 1 / 3


def test_a_drafter_that_has_not_drafted_yet_counts_no_miss() -> None:
    """A step that finds none of a ready row's drafts counts a miss only once its drafter has
    sent drafts: before its first block the drafter has had no draft to send late. Then the
    first step that finds none counts one, as for any drafter too slow for its steps."""
    b = _adaptive_board(20.0, 10.0, (1, 2, 5, 9))
    never_waits(b)  # at these costs a step does not wait for a 100 ms-a-token drafter
    ctx = [1, 2, 5]
    for _ in range(5):
        assert b.propose_batch([("r", np.array(ctx))], 8) == [[]]
        ctx.append(9)
    assert b._entries["r"].acceptance.tried == 0 and not b.holding("r")
    b.offer("r", len(ctx), [4, 4], committed=len(ctx))  # its first block, in time
    assert b.propose_batch([("r", np.array(ctx))], 8) == [[4, 4]]
    b.record("r", 2, 2)
    ctx += [4, 4, 9]
    tried = b._entries["r"].acceptance.tried
    assert b.propose_batch([("r", np.array(ctx))], 8) == [[]]  # none for this context: a miss now
    assert b._entries["r"].acceptance.tried == pytest.approx(DECAY * tried + 1)


def test_a_released_drafter_is_not_held_again_before_it_could_draft() -> None:
    """A drafter released from a hold first catches up on the tokens it was held through, so the
    steps right after the release find none of its drafts. Those steps count no miss: counting
    them held it again at once, and for good (measured: a c = 16 run on a compute-bound CPU whose
    early misses held 14 of the 16 rows for the whole run, 0.91x target-only's throughput)."""
    b = _adaptive_board(100.0, 10.0, (1, 5, 16, 40))
    b.register("low", gamma=4, prompt_len=2, max_tokens=100)
    b.ready("low", 100.0)
    b.offer("low", 2, [5], committed=2)  # it has drafted before (for a context now verified)
    for _ in range(20):
        b.record("low", 4, 0)
    ctx = np.array([1, 2, 5])
    never_waits(b)
    b.propose_batch([("r", ctx), ("low", ctx)], 8)
    assert b.holding("low")
    b.offer("low", 2, [5, 7], committed=2)  # a block already on its way when the hold came
    while b.holding("low"):  # its history fades until it is re-tried
        b.take_proposal("low", 3)
        b.record("low", 0, 0)
        b.propose_batch([("r", ctx), ("low", ctx)], 8)
    context = [1, 2, 5]
    for _ in range(3):  # released, the target goes on: no drafts yet, and no miss (alpha only fades up)
        alpha = b._entries["low"].acceptance.alpha
        b.take_proposal("low", len(context))
        b.record("low", 0, 0)
        context.append(9)
        now = np.array(context)
        assert b.propose_batch([("r", now), ("low", now)], 8)[1] == []
        assert not b.holding("low")
        assert b._entries["low"].acceptance.alpha > alpha


def test_a_row_at_its_end_is_not_held() -> None:
    b = _adaptive_board(1.0, 10.0, (1, 2, 3, 40))
    b.register("end", gamma=4, prompt_len=2, max_tokens=1)  # nothing left to draft for
    never_waits(b)
    b.propose_batch([("end", np.array([1, 2, 5]))], 8)
    assert not b.holding("end")
    b.propose_batch([("r", np.array([1, 2, 5]))], 8)
    assert b.holding("r")  # saturated: 1 ms base, 10 ms per token
