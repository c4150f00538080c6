"""Drafts sized by confidence on the real services: exact output, with cuts and branches.

Drafters run with `--draft-confidence` (docs/confidence-drafts.md): "auto" (tau learned from
the verdicts) beside the agreeing draft (mid) and the unrelated one (far, alpha ~ 0: its tau
rises and its blocks are cut short), and a fixed tau with mid. They share the session's
fixed-gamma verifier, which, while this module runs, sleeps STEP_DELAY_MS in every engine
step (as in tests/e2e/test_branches.py: the tiny target otherwise steps faster than the tiny
drafter drafts, and a cut would free no time for branches). Shown:
  - greedy output is token for token vLLM target-only's, at gamma 4 and 8, while blocks were
    cut by confidence and branches drafted in the freed steps;
  - sampled output keeps the target-only distribution (one chi-square table on the joint
    sequences, counted in test_sampling_lossless.py's family-wise level).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Services, injected, vllm_reference
from gen import generate_all, prompts, scrape, spec
from test_sampling_lossless import P_MIN, sampled_against_vllm
from transformers import AutoTokenizer

from specdec.stats import SpecStats, branch_hits_by_gamma

STEP_DELAY_MS = 150  # >> the tiny drafter's token (~5 ms): a cut frees steps for branches, also on a loaded host
BRANCHES = 4
GAMMAS = (4, 8)
MAX_TOKENS = 40
N_SAMPLED = 600
SAMPLED_TOKENS = 4
# name -> (draft model, --draft-confidence)
DRAFTERS = {
    "mid-auto": ("tiny/draft-mid", "auto"),
    "far-auto": ("tiny/draft-far", "auto"),
    "mid-fixed": ("tiny/draft-mid", "0.5"),
}


@pytest.fixture(scope="module")
def stack(services: Services) -> Iterator[Services]:
    """Confidence-sized drafters with branches and their gateways, on the session's verifier with slow steps."""
    own = Services(services.log_dir)
    own.verifier = services.verifier
    try:
        for name, (draft, mode) in DRAFTERS.items():
            own.drafters[name] = own._start(
                "drafter",
                [
                    "--model",
                    draft,
                    "--threads",
                    "1",
                    "--quantize",
                    "none",
                    "--branches",
                    str(BRANCHES),
                    "--draft-confidence",
                    mode,
                ],
            )
            own.gateways[name] = own.start_gateway(own.drafters[name].address, own.verifier.address)
        own.ready()
        with injected(own.verifier, step_delay_ms=STEP_DELAY_MS, step_every=1):
            yield own
    finally:
        own.stop()


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_greedy_with_confidence_cuts_is_exact(stack: Services, tiny_target: Path, name: str) -> None:
    ps = prompts(AutoTokenizer.from_pretrained(tiny_target), 6, seed=5)
    reference = vllm_reference(
        tiny_target, [{"prompt_token_ids": p, "max_tokens": MAX_TOKENS, "ignore_eos": True} for p in ps]
    )
    specs = [spec(p, MAX_TOKENS, gamma=g, ignore_eos=True) for g in GAMMAS for p in ps]
    responses = generate_all(stack.gateways[name].address, specs, concurrency=2)
    wrong = [i for i, r in enumerate(responses) if list(r.token_ids) != reference[i % len(ps)]]
    assert not wrong, f"{len(wrong)}/{len(specs)} outputs differ; first: request {wrong[0]}"
    stats = [SpecStats.from_pb(r.stats) for r in responses]
    drafted = sum(s.num_draft_tokens for s in stats)
    accepted = sum(s.num_accepted_tokens for s in stats)
    cuts = sum(s.confidence_cuts for s in stats)
    per_gamma = {h.gamma: (h.hits, h.breaks) for h in branch_hits_by_gamma(stats)}
    diagnosis = {
        "drafted": drafted,
        "accepted": accepted,
        "cuts": cuts,
        "branch hits per gamma": per_gamma,
        "fallbacks": {s.fallback_reason for s in stats if s.fallback_reason},
    }
    assert not diagnosis["fallbacks"], diagnosis
    # the drafts were really verified (accepted and rejected), and confidence really cut blocks
    assert drafted > 0 and accepted < drafted and cuts > 0, diagnosis
    if name.startswith("mid"):
        assert accepted > 0, diagnosis
    assert all(0 < s.mean_tau <= 1 for s in stats if s.blocks_received), diagnosis
    if name.endswith("fixed"):
        assert all(s.mean_tau == pytest.approx(0.5) for s in stats if s.blocks_received), diagnosis
    # every block the drafter cut went out to a gateway; branches were drafted beside them
    assert sum(s.branches_drafted for s in stats) > 0, diagnosis
    assert set(per_gamma) == set(GAMMAS), diagnosis
    drafter = scrape(stack.drafters[name].metrics_port)
    assert drafter["specdec:drafter_confidence_cuts_total"] >= cuts
    assert drafter["specdec:drafter_block_tau_count"] > 0


def test_sampling_with_confidence_cuts_keeps_the_target_distribution(stack: Services, tiny_target: Path) -> None:
    responses, p = sampled_against_vllm(
        tiny_target, stack.gateways["mid-fixed"].address, N_SAMPLED, SAMPLED_TOKENS, gamma=4, concurrency=32
    )
    drafted = sum(r.stats.drafted_tokens for r in responses)
    cuts = sum(r.stats.confidence_cuts for r in responses)
    assert drafted > 0 and cuts > 0, (drafted, cuts)
    # one test on the joint sequences, at the family-wise level of test_sampling_lossless.py
    assert p > P_MIN, f"joint sequences: p = {p:.2e} (drafted {drafted}, cuts {cuts})"
