"""Sampling through the decoupled path has the target-only distribution.

For each configuration, N seeded generations of MAX_TOKENS tokens through the gateway are
compared with N from a plain vLLM engine (no speculation) by ONE chi-square test of
homogeneity on the joint outcome: each generation's whole token sequence is one category
(`joint_homogeneity_p`). Testing the sequences, not each position alone, also catches a bug
that correlates positions (say a rejection at position 2 that depends on position 1's token)
while every position's marginal stays right. Positions after the first are the ones vLLM's
rejection sampler decides when drafts are given. The tiny vocabulary (512) and the peaked
tiny target keep the table small; sequences seen fewer than MIN_COUNT times in both samples
together are pooled into one category, which keeps the chi-square approximation valid
(expected count >= 5 per cell).

Configurations: (draft same | far) x (top_p 1.0 | 0.9) x (stack fixed-gamma | defaults) = 8
tables here, plus 1 in tests/e2e/test_branches.py and 1 in
tests/e2e/test_confidence_drafts.py: 10 tables per CI run, each failing at p < P_MIN = 5e-6.
Under the null (the path is exact) each table fails with probability at most 5e-6, so a
run's family-wise false-failure rate is at most 10 x 5e-6 = 5e-5 < 1e-4 (Bonferroni, valid
whatever the tables' dependence). Seeds are fixed (reference i: seed i; gateway i: seed
10**6 + i), so a run's draws are fixed as far as vLLM's seeded sampling is deterministic
across batch compositions.

On the default stack the generations run DEFAULTS_CONCURRENCY (2) at a time. Whether a draft
is verified there is adaptive gamma's decision, made from the step costs it measures: a step
waits for a missing draft only while that draft's expected gain per ms beats the step's own
rate (verifier/budget.py), and on the tiny target a step costs ~3.2 ms + 0.22 ms a token. At 8
at a time a step yields ~1.6 tokens a ms, no draft beats that, and only drafts that happened to
arrive before their step were verified: 22, 9, 3 and 0 drafts in the four tables of one run
(the 0 failed `drafted > 0 or held > 0`), which left the rejection sampler nearly untested on
the defaults. At 2 at a time the drafter keeps ahead of the steps: 3,517, 3,623, 562 and 272
drafts verified (1,313 and 1,560 accepted with the agreeing draft); the four tables took 246 s
in all, against 99 s at 8; with a busy loop taking one of the two cores, 2,923, 3,329, 2,347 and
3,684 (a slower step makes drafts worth waiting for). The fixed stack is the one that
exercises the rejection sampler at a known gamma, and only there is "some drafts rejected"
asserted.

This test failed before the CPU rejection-sampler fix (verifier/vllm_hooks.py, apply_cpu_sampler_fix).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import Services, vllm_reference
from gen import generate_all, scrape, spec
from scipy.stats import chi2_contingency
from transformers import AutoTokenizer

from specdec.wire import pb

N = 1500
MAX_TOKENS = 4
P_MIN = 5e-6  # per table; 10 tables per run (module docstring): family-wise <= 5e-5 < 1e-4
MIN_COUNT = 10
DEFAULTS_CONCURRENCY = 2  # requests at once on the default stack (module docstring: why 2)
PROMPT = "def add(a, b):\n    return"


def joint_homogeneity_p(a: list[tuple[int, ...]], b: list[tuple[int, ...]], min_count: int = MIN_COUNT) -> float:
    """Chi-square test that two samples of token sequences share one joint distribution.

    Each distinct sequence is one category; those with fewer than `min_count` occurrences in
    both samples together are pooled into one. Returns the p-value (1.0 with a single category).
    """
    ca, cb = Counter(a), Counter(b)
    seqs = sorted(set(ca) | set(cb))
    table = np.array([[ca[s] for s in seqs], [cb[s] for s in seqs]])  # [2, distinct sequences]
    common = table.sum(0) >= min_count
    pooled = np.column_stack([table[:, common], table[:, ~common].sum(1)])
    pooled = pooled[:, pooled.sum(0) > 0]
    if pooled.shape[1] < 2:
        return 1.0
    return float(chi2_contingency(pooled)[1])


def sampled_against_vllm(
    model: Path, address: str, n: int, max_tokens: int, gamma: int, concurrency: int
) -> tuple[list[pb.GenerationResponse], float]:
    """`n` seeded generations of PROMPT (temperature 1, top_p 1, ignore_eos) through the gateway
    at `address`, and the p-value of their joint sequences against `n` from plain vLLM
    (`joint_homogeneity_p`; seeds as in the module docstring). For the modules with one table
    of their own (test_branches.py, test_confidence_drafts.py)."""
    prompt = list(AutoTokenizer.from_pretrained(model).encode(PROMPT))
    sampling = {"temperature": 1.0, "top_p": 1.0, "ignore_eos": True}
    reference = vllm_reference(
        model, [{"prompt_token_ids": prompt, "max_tokens": max_tokens, "seed": i, **sampling} for i in range(n)]
    )
    specs = [spec(prompt, max_tokens, gamma=gamma, drafter="model", seed=10**6 + i, **sampling) for i in range(n)]
    responses = generate_all(address, specs, concurrency=concurrency)
    p = joint_homogeneity_p([tuple(r) for r in reference], [tuple(r.token_ids) for r in responses])
    return responses, p


@pytest.fixture(scope="module")
def prompt_ids(tiny_target) -> list[int]:
    return list(AutoTokenizer.from_pretrained(tiny_target).encode(PROMPT))


@pytest.fixture(scope="module")
def references(tiny_target, prompt_ids) -> dict[float, list[tuple[int, ...]]]:
    """Plain vLLM's N sequences for each top_p (one reference run for all configurations)."""
    requests, index = [], {}
    for top_p in (1.0, 0.9):
        index[top_p] = len(requests)
        requests += [
            {
                "prompt_token_ids": prompt_ids,
                "max_tokens": MAX_TOKENS,
                "seed": i,
                "temperature": 1.0,
                "top_p": top_p,
                "ignore_eos": True,
            }
            for i in range(N)
        ]
    out = vllm_reference(tiny_target, requests)
    return {top_p: [tuple(t) for t in out[i : i + N]] for top_p, i in index.items()}


@pytest.mark.parametrize("top_p", [1.0, 0.9])
@pytest.mark.parametrize("draft", ["same", "far"])
def test_sampling_matches_target_only(stack: Services, references, prompt_ids, draft: str, top_p: float) -> None:
    sampling = {"temperature": 1.0, "top_p": top_p, "ignore_eos": True}
    specs = [spec(prompt_ids, MAX_TOKENS, gamma=4, drafter="model", seed=10**6 + i, **sampling) for i in range(N)]
    # with the defaults, adaptive gamma verifies drafts only where they pay on the tiny target:
    # at DEFAULTS_CONCURRENCY, not at 8 or 32 at once (module docstring)
    concurrency = DEFAULTS_CONCURRENCY if stack.defaults else 32
    responses = generate_all(stack.gateways[draft].address, specs, concurrency=concurrency)
    drafted = sum(r.stats.drafted_tokens for r in responses)
    accepted = sum(r.stats.accepted_tokens for r in responses)
    held = sum(r.stats.held_steps for r in responses)
    reasons = Counter(r.stats.fallback_reason for r in responses if r.stats.drafter_fallback)
    diagnosis = {
        "drafted": drafted,
        "accepted": accepted,
        "held": held,
        "fallbacks": dict(reasons),
        "drafter": {
            k: v
            for k, v in scrape(stack.drafters[draft].metrics_port).items()
            if k.startswith(("specdec:drafter_sessions", "specdec:drafter_requests"))
        },
    }
    # the rejection sampler must really have decided tokens: rejecting always, and accepting
    # often with the agreeing drafter. With the defaults adaptive gamma decides how many drafts
    # are verified: some, or (it backed the drafter off) a hold; either way speculation was
    # decided, not skipped (a request whose drafter missed its deadline on a loaded host rightly
    # falls back; every one falling back is a broken drafter, and fails here).
    if stack.defaults:
        assert drafted > 0 or held > 0, diagnosis
    else:  # every step verifies its gamma: enough drafts that accepting them all would be a bug
        assert drafted >= N, diagnosis
        assert accepted < drafted, diagnosis
    if draft == "same" and not stack.defaults:
        assert accepted > 0.2 * drafted, (drafted, accepted)
    ours = [tuple(r.token_ids) for r in responses]
    assert all(len(s) == MAX_TOKENS for s in ours)
    p = joint_homogeneity_p(ours, references[top_p])
    assert p > P_MIN, f"joint sequences: p = {p:.2e} (drafted {drafted}, accepted {accepted})"
