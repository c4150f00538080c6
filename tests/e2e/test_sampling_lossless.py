"""Sampling through the decoupled path has the target-only distribution.

For each configuration, thousands of seeded generations of a few tokens through the
gateway are compared with thousands from a plain vLLM engine (no speculation), by a
chi-square test of homogeneity on each generated position's token counts. Positions
after the first are the ones vLLM's rejection sampler decides when drafts are given.
The tiny vocabulary (512) and peaked tiny target keep the tables small.

This test failed before the CPU rejection-sampler fix (verifier/vllm_hooks.py, apply_cpu_sampler_fix).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import vllm_reference
from gen import generate_all, spec
from scipy.stats import chi2_contingency
from transformers import AutoTokenizer

N = 1500
MAX_TOKENS = 4
P_MIN = 1e-3  # per table; about 24 tables in this file
PROMPT = "def add(a, b):\n    return"


def homogeneity_p(a: list[int], b: list[int], min_count: int = 10) -> float:
    """Chi-square test that two samples of tokens share one distribution; rare tokens are pooled."""
    tokens = sorted(set(a) | set(b))
    table = np.array([[a.count(t) for t in tokens], [b.count(t) for t in tokens]])
    common = table.sum(0) >= min_count
    pooled = np.column_stack([table[:, common], table[:, ~common].sum(1)])
    pooled = pooled[:, pooled.sum(0) > 0]
    if pooled.shape[1] < 2:
        return 1.0
    return float(chi2_contingency(pooled)[1])


@pytest.fixture(scope="module")
def prompt_ids(tiny_target) -> list[int]:
    return list(AutoTokenizer.from_pretrained(tiny_target).encode(PROMPT))


@pytest.mark.parametrize("top_p", [1.0, 0.9])
@pytest.mark.parametrize("draft", ["same", "far"])
def test_sampling_matches_target_only(services, tiny_target, prompt_ids, draft: str, top_p: float) -> None:
    sampling = {"temperature": 1.0, "top_p": top_p, "ignore_eos": True}
    reference = vllm_reference(
        tiny_target,
        [{"prompt_token_ids": prompt_ids, "max_tokens": MAX_TOKENS, "seed": i, **sampling} for i in range(N)],
    )
    specs = [spec(prompt_ids, MAX_TOKENS, gamma=4, drafter="model", seed=10**6 + i, **sampling) for i in range(N)]
    responses = generate_all(services.gateways[draft].address, specs, concurrency=32)
    drafted = sum(r.stats.drafted_tokens for r in responses)
    accepted = sum(r.stats.accepted_tokens for r in responses)
    # the rejection sampler must really have decided many tokens: rejecting always, and
    # accepting often with the agreeing drafter
    assert drafted >= N and accepted < drafted, (drafted, accepted)
    if draft == "same":
        assert accepted > 0.2 * drafted, (drafted, accepted)
    for pos in range(MAX_TOKENS):
        ours = [r.token_ids[pos] for r in responses]
        theirs = [t[pos] for t in reference]
        p = homogeneity_p(ours, theirs)
        assert p > P_MIN, f"position {pos}: p = {p:.2e} (drafted {drafted}, accepted {accepted})"
