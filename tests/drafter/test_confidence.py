"""Drafts sized by confidence (drafter.confidence): where a block is cut, how tau is learned,
and that the freed steps go to branches."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from drafter.confidence import EDGES, MIN_TAU, PRIOR_COST, Calibration, ConfidencePolicy, parse_mode
from drafter.sessions import BlockOut, Draft, DraftSession, ModelDraftSession, Ready
from specdec.models import resolve


class ScriptedSession(DraftSession):
    """A session whose draft model is a script: the i-th token past the prompt and the target's
    first token (i = 0, 1, ...) is 101 + i with conf confs[i] (a fake of the model, for this
    component's unit tests only)."""

    def __init__(self, prompt: list[int], gamma: int, lookahead: int, confs: list[float]) -> None:
        super().__init__(prompt, gamma, lookahead)
        self.confs = confs
        self.prompt_len = len(prompt)

    def _next_token(self) -> Draft | None:
        i = len(self.context) - self.prompt_len - 1
        conf = self.confs[i] if i < len(self.confs) else 1.0
        return Draft(101 + i, 1.0, None, conf, ((7, 1.0 - conf),))


def _drain(session: DraftSession) -> list[BlockOut]:
    blocks = []
    while session.wants_work():
        out = session.step()
        if isinstance(out, BlockOut):
            blocks.append(out)
    return blocks


def test_parse_mode_reads_off_auto_and_a_fixed_tau_and_names_the_setting() -> None:
    assert parse_mode("off") == "off" and parse_mode(" AUTO ") == "auto" and parse_mode("0.25") == 0.25
    for bad in ("sometimes", "0", "1.5", "-0.1"):
        with pytest.raises(ValueError, match="draft_confidence"):
            parse_mode(bad)


def test_a_block_is_cut_where_the_reach_falls_below_tau() -> None:
    # reach after each draft: 0.9, 0.72, 0.36 (< 0.5: cut here), ...
    s = ScriptedSession([1, 2, 3], gamma=6, lookahead=7, confs=[0.9, 0.8, 0.5, 0.9, 0.9])
    s.confidence = ConfidencePolicy(0.5)
    s.commit(3, [4])  # the target's first token: drafting starts at position 4
    blocks = _drain(s)
    assert len(blocks) == 1
    [block] = blocks
    assert block.start_position == 4 and [d.token_id for d in block.drafts] == [101, 102, 103]
    assert block.final and block.confidence_cut and block.tau == 0.5
    assert s.confidence_cuts == 1 and not s.wants_work() and not s.urgent()
    # a commit that accepts the first draft: the reach is measured from the new committed context
    s.commit(4, [101])
    assert s.reach() == pytest.approx(0.8 * 0.5) and not s.wants_work()  # still below tau: no more drafts
    s.commit(5, [102, 103])  # the drafts past it accepted: the reach starts over at 1
    blocks = _drain(s)
    assert [d.token_id for b in blocks for d in b.drafts][:2] == [104, 105]


def test_off_drafts_the_whole_window_and_a_window_end_is_not_a_cut() -> None:
    s = ScriptedSession([1, 2, 3], gamma=3, lookahead=0, confs=[0.1, 0.1, 0.1])
    s.commit(3, [4])
    blocks = _drain(s)
    assert [len(b.drafts) for b in blocks] == [3] and not blocks[0].confidence_cut and blocks[0].tau == 0.0
    # the reach falls below tau on the window's last draft: the window ended it, not confidence
    s = ScriptedSession([1, 2, 3], gamma=3, lookahead=0, confs=[0.9, 0.9, 0.1])
    s.confidence = ConfidencePolicy(0.5)
    s.commit(3, [4])
    blocks = _drain(s)
    assert [len(b.drafts) for b in blocks] == [3] and not blocks[0].confidence_cut and s.confidence_cuts == 0


def test_a_commit_decides_drafts_at_their_reach() -> None:
    s = ScriptedSession([1, 2, 3], gamma=4, lookahead=0, confs=[0.9, 0.8, 0.5, 0.5])
    s.confidence = ConfidencePolicy("auto")
    s.commit(3, [4])
    _drain(s)  # drafts 101..104 at positions 4..7
    decided: list[tuple[float, bool]] = []
    policy = s.confidence
    assert policy is not None
    spy = lambda reach, survived: decided.append((reach, survived))  # noqa: E731
    policy.calibration.record = spy  # type: ignore[method-assign]  # a spy on what the calibration is told
    s.commit(4, [101, 102, 9])  # two accepted, the third rejected: the fourth dies with it
    assert [ok for _, ok in decided] == [True, True, False, False]
    assert [r for r, _ in decided] == pytest.approx([0.9, 0.72, 0.36, 0.18])
    assert s.breaks == 1


def test_commits_that_accept_everything_are_undecided_past_the_verdict() -> None:
    s = ScriptedSession([1, 2, 3], gamma=2, lookahead=3, confs=[0.9] * 5)
    s.confidence = ConfidencePolicy("auto")
    s.commit(3, [4])
    _drain(s)  # 5 drafts: positions 4..8
    decided: list[tuple[float, bool]] = []
    policy = s.confidence
    assert policy is not None
    spy = lambda reach, survived: decided.append((reach, survived))  # noqa: E731
    policy.calibration.record = spy  # type: ignore[method-assign]  # a spy on what the calibration is told
    s.commit(4, [101, 102, 103])  # two drafts accepted, the bonus equals the third draft
    assert decided == [(pytest.approx(0.9), True), (pytest.approx(0.81), True), (pytest.approx(0.729), True)]
    assert s.breaks == 0


def _trained(accept: float, cost_ms: tuple[float, float, float]) -> ConfidencePolicy:
    """A policy after 200 rounds of a draft whose every token has conf 0.8 and is accepted with
    probability `accept` (deterministically interleaved); cost_ms: (d, N, R) as measured."""
    policy = ConfidencePolicy("auto")
    d, n, r = cost_ms
    for i in range(200):
        reach, decided, alive = 1.0, [], True
        for j in range(6):
            reach *= 0.8
            alive = alive and ((i * 7 + j * 3) % 100) < accept * 100
            decided.append((reach, alive))
        policy.observe_token(d)
        policy.observe_commit(i * r / 1e3, int(n), decided)
    return policy


def test_tau_rises_when_acceptance_is_low_and_falls_when_it_is_high() -> None:
    cost = (5.0, 3.0, 60.0)  # c = 5 * 3 / 60 = 0.25
    low, high = _trained(0.4, cost), _trained(0.95, cost)
    assert low.cost == pytest.approx(0.25, rel=0.05) and high.cost == pytest.approx(0.25, rel=0.05)
    assert low.tau > high.tau
    # a draft accepted less than its conf says: cut at a higher reach than a calibrated one would (tau = c)
    assert low.tau > 0.25 and high.tau < 0.25
    # the rule: every bucket from tau up is worth a token, the one below is not
    for policy in (low, high):
        k = Calibration.bucket(policy.tau)
        assert all(policy.calibration.estimate(b) >= policy.cost for b in range(k, len(EDGES) - 1))
        assert k == 0 or policy.tau == MIN_TAU or policy.calibration.estimate(k - 1) < policy.cost


def test_tau_rises_with_the_cost_of_a_draft_token() -> None:
    cheap, dear = _trained(0.8, (2.0, 3.0, 60.0)), _trained(0.8, (15.0, 3.0, 60.0))
    assert dear.cost > cheap.cost and dear.tau > cheap.tau


def test_before_any_measurement_auto_cuts_at_the_prior_cost_and_a_fixed_tau_never_moves() -> None:
    assert ConfidencePolicy("auto").tau == pytest.approx(max(MIN_TAU, PRIOR_COST))
    fixed = ConfidencePolicy(0.3)
    fixed.observe_commit(1.0, 3, [(0.9, False)] * 50)
    assert fixed.tau == 0.3


# ---- on the tiny draft model ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(resolve("tiny/draft-mid")).eval()


def _confident(model: torch.nn.Module, tau: float, branches: int) -> ModelDraftSession:
    s = ModelDraftSession(model, [3, 14, 15, 92, 65], 6, 7, temperature=0.0, top_k=0, top_p=1.0, seed=0, q_top_k=8)
    s.branches = branches
    s.confidence = ConfidencePolicy(tau)
    while not isinstance(s.step(), Ready):
        pass
    s.commit(5, [35])
    return s


def test_model_session_cuts_where_its_own_softmax_says_and_drafts_branches_in_the_freed_steps(model) -> None:
    s = _confident(model, 1.0, branches=3)  # tau 1: every draft with conf < 1 ends the block
    blocks = _drain(s)
    [block] = blocks
    assert len(block.drafts) == 1 and block.final and block.confidence_cut
    # conf is the draft model's own probability of its greedy token
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([s.context[:6]])).logits[0, -1], -1)
    assert block.drafts[0].token_id == int(probs.argmax()) and block.drafts[0].conf == pytest.approx(float(probs.max()))
    # the main line is done for this round: the freed steps go to branches at the cut position
    assert not s.wants_work() and s.wants_branch()
    branch_blocks: list[BlockOut] = []
    while s.wants_branch():
        branch_blocks.extend(s.branch_step())
    assert {b.start_position for b in branch_blocks} == {6} and len(branch_blocks) == 3
    assert all(b.branch for b in branch_blocks)
    top = [t for t, _ in block.drafts[0].alts]
    assert sorted(b.drafts[0].token_id for b in branch_blocks) == sorted(top)


def test_model_session_with_a_low_tau_drafts_what_an_unsized_session_drafts(model) -> None:
    sized = _confident(model, 1e-9, branches=0)
    plain = ModelDraftSession(model, [3, 14, 15, 92, 65], 6, 7, temperature=0.0, top_k=0, top_p=1.0, seed=0, q_top_k=8)
    plain.commit(5, [35])
    tokens = [[d.token_id for b in _drain(s) for d in b.drafts] for s in (sized, plain)]
    assert tokens[0] == tokens[1]
    assert sized.confidence_cuts == 0


def test_an_adopted_branch_below_tau_is_still_sent_at_once_and_final(model) -> None:
    s = _confident(model, 1.0, branches=3)  # every draft's conf < 1: the reach of any draft is below tau
    [block] = _drain(s)
    branches: list[BlockOut] = []
    while s.wants_branch():
        branches.extend(s.branch_step())
    branch = branches[0]
    p, t = branch.start_position, branch.drafts[0].token_id
    s.commit(s.committed, [t])  # the target rejects the draft at p with the branch's correction
    assert s.branches_adopted == 1 and s.reach() < 1.0
    # the adopted drafts go out at once (a verifier may be waiting for them), as a final block
    assert s.wants_work()
    resent = s.step()
    assert isinstance(resent, BlockOut) and resent.final and resent.start_position == p + 1
    assert [d.token_id for d in resent.drafts] == [d.token_id for d in branch.drafts[1:]]
    assert not s.wants_work() and s.wants_branch()


def test_branches_are_sized_by_confidence_too(model) -> None:
    s = _confident(model, 1.0, branches=3)  # tau 1: every branch ends at its first draft after the correction
    _drain(s)
    steps, blocks = 0, []
    while s.wants_branch():
        steps += 1
        blocks.extend(s.branch_step())
    assert steps == 1 and len(blocks) == 3
    assert all(len(b.drafts) == 2 for b in blocks)  # the correction, then one draft
    loose = _confident(model, 1e-9, branches=3)
    while loose.wants_work():  # tau ~ 0: the window fills, and branches run their whole gamma
        loose.step()
    blocks = []
    while loose.wants_branch():
        blocks.extend(loose.branch_step())
    assert blocks and all(len(b.drafts) == loose.gamma + 1 for b in blocks)
