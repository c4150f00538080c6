"""Pre-drafted branches on the real services: exact output, with hits.

The session's verifier, while this module runs, sleeps STEP_DELAY_MS in every engine step
(a fault switched on at run time, tests/faultkit.py), so its steps take about as long as a
real target's do next to this drafter: the drafter, its
window full, has time to pre-draft branches while a step runs (on the session's services
the tiny target steps faster than the tiny drafter drafts, so branches rarely get a turn).
With branches sent ahead and picked by the verifier in-step:
  - greedy output is token for token vLLM target-only's, and some steps took their drafts
    from a branch (hits), counted the same way in the stats, /metrics and round spans;
  - sampled output keeps the target-only distribution (chi-square, as in
    test_sampling_lossless.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Services, injected, vllm_reference
from gen import generate_all, prompts, scrape, spec
from test_sampling_lossless import P_MIN, sampled_against_vllm
from transformers import AutoTokenizer

STEP_DELAY_MS = 300  # >> the tiny drafter's whole window plus a branch batch (~50 ms), also on a loaded CI host
BRANCHES = 4
MAX_TOKENS = 48
N_SAMPLED = 600
SAMPLED_TOKENS = 4


@pytest.fixture(scope="module")
def stack(services: Services) -> Iterator[Services]:
    """A drafter with branches and its gateway, on the session's verifier with slow steps."""
    own = Services(services.log_dir)
    own.verifier = services.verifier
    try:
        drafter = own._start(
            "drafter",
            ["--model", "tiny/draft-mid", "--threads", "1", "--quantize", "none", "--branches", str(BRANCHES)],
        )
        own.drafters["mid"] = drafter
        own.gateways["mid"] = own.start_gateway(drafter.address, own.verifier.address)
        own.ready()
        with injected(own.verifier, step_delay_ms=STEP_DELAY_MS, step_every=1):
            yield own
    finally:
        own.stop()


def test_greedy_with_branches_is_exact_and_hits(stack: Services, tiny_target: Path) -> None:
    ps = prompts(AutoTokenizer.from_pretrained(tiny_target), 6, seed=11)
    reference = vllm_reference(
        tiny_target, [{"prompt_token_ids": p, "max_tokens": MAX_TOKENS, "ignore_eos": True} for p in ps]
    )
    responses = generate_all(
        stack.gateways["mid"].address, [spec(p, MAX_TOKENS, gamma=4, ignore_eos=True) for p in ps], concurrency=2
    )
    assert [list(r.token_ids) for r in responses] == reference
    drafted = sum(r.stats.branches_drafted for r in responses)
    used = sum(r.stats.branches_used for r in responses)
    misses = sum(r.stats.branch_misses for r in responses)
    assert drafted > 0 and used > 0, (drafted, used, misses)
    assert not any(r.stats.drafter_fallback for r in responses)
    for r in responses:
        s = r.stats
        assert s.branches_used <= s.speculative_steps
        breaks = s.branches_used + s.branch_misses
        assert s.branch_hit_rate == pytest.approx(s.branches_used / breaks if breaks else 0.0)
    # the same counts on /metrics: the drafter's branches sent, the verifier's hits
    drafter, verifier = scrape(stack.drafters["mid"].metrics_port), scrape(stack.verifier.metrics_port)
    assert drafter["specdec:drafter_branches_total"] >= drafted
    assert verifier["specdec:verifier_branches_total"] >= drafted
    assert verifier["specdec:verifier_branch_hits_total"] >= used


def test_sampling_with_branches_keeps_the_target_distribution(stack: Services, tiny_target: Path) -> None:
    responses, p = sampled_against_vllm(
        tiny_target, stack.gateways["mid"].address, N_SAMPLED, SAMPLED_TOKENS, gamma=2, concurrency=32
    )
    assert sum(r.stats.branches_used for r in responses) > 0
    # one test on the joint sequences, at the family-wise level of test_sampling_lossless.py
    assert p > P_MIN, f"joint sequences: p = {p:.2e}"
