"""allowed_token_ids reaches vLLM through the served path (gateway -> verifier -> vLLM's rejection
sampler), and speculation keeps the output exact under it.

Greedy: the served output equals plain vLLM's with the same allowed_token_ids, token for token,
and differs from the unconstrained output (so the constraint did reach the engine). The set is
half the tokens the unconstrained outputs use plus random others: the draft model (which ignores
the set, docs/adding-a-sampling-field.md) still has drafts accepted. Sampled: every token lies in
the set.
"""

from __future__ import annotations

import random

import pytest
from conftest import Services, vllm_reference
from gen import generate_all, prompts, spec
from transformers import AutoTokenizer

MAX_TOKENS = 24
N_PROMPTS = 8


@pytest.fixture(scope="module")
def case(tiny_target) -> tuple[list[list[int]], list[int], list[list[int]], list[list[int]]]:
    """(prompts, the allowed set, unconstrained reference outputs, constrained reference outputs)."""
    tok = AutoTokenizer.from_pretrained(tiny_target)
    ps = prompts(tok, N_PROMPTS)
    free = vllm_reference(tiny_target, [{"prompt_token_ids": p, "max_tokens": MAX_TOKENS} for p in ps])
    rng = random.Random(0)
    used = sorted({t for out in free for t in out})
    allowed = sorted(set(rng.sample(used, len(used) // 2)) | set(rng.sample(range(tok.vocab_size), 64)))
    constrained = vllm_reference(
        tiny_target, [{"prompt_token_ids": p, "max_tokens": MAX_TOKENS, "allowed_token_ids": allowed} for p in ps]
    )
    return ps, allowed, free, constrained


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_greedy_with_allowed_token_ids_equals_plain_vllm(services: Services, case, drafter: str) -> None:
    ps, allowed, free, constrained = case
    assert constrained != free  # the set changes the output: a test that can fail
    specs = [spec(p, MAX_TOKENS, gamma=4, drafter=drafter, allowed_token_ids=allowed) for p in ps]
    responses = generate_all(services.gateways["mid"].address, specs, concurrency=4)
    assert [list(r.token_ids) for r in responses] == constrained
    drafted = sum(r.stats.drafted_tokens for r in responses)
    accepted = sum(r.stats.accepted_tokens for r in responses)
    changed = sum(a != b for a, b in zip(free, constrained, strict=True))
    # the figures docs/adding-a-sampling-field.md quotes (pytest -s shows them)
    print(
        f"\n{drafter}: {len(allowed)} allowed ids, {changed}/{len(ps)} outputs changed by them, "
        f"{accepted}/{drafted} drafts accepted"
    )
    assert drafted > 0, "no draft was verified: the test would not cover the rejection sampler"
    if drafter == "model":
        assert accepted > 0


def test_sampled_tokens_stay_in_the_set(services: Services, case) -> None:
    ps, allowed, _, _ = case
    specs = [
        spec(
            p, MAX_TOKENS, gamma=4, drafter="model", temperature=1.0, seed=i, ignore_eos=True, allowed_token_ids=allowed
        )
        for i, p in enumerate(ps)
    ]
    responses = generate_all(services.gateways["mid"].address, specs, concurrency=4)
    tokens = [t for r in responses for t in r.token_ids]
    assert len(tokens) == MAX_TOKENS * len(ps) and set(tokens) <= set(allowed)
