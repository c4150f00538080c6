"""A slow target prefill or a queue never turns speculation off (issue: the first-block
deadline used to count the target's prefill and queueing against the drafter).

The session's verifier, while this module runs, sleeps PREFILL_DELAY_MS in every engine step
that starts a prompt (a long prompt or a queue, made deterministic; a fault switched on at run
time, tests/faultkit.py); this module's own gateway has a drafter deadline much shorter than
that. The drafter owes nothing until the target's first token, so
every request still speculates, and stays exact.
"""

from __future__ import annotations

import time

import pytest
from conftest import Services, injected, vllm_reference
from gen import generate_all, prompts, spec
from transformers import AutoTokenizer

PREFILL_DELAY_MS = 5000
DRAFTER_TIMEOUT_S = 2.0
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def slow_prefill(services):
    own = Services(services.log_dir)
    try:
        drafter = own._start("drafter", ["--model", "tiny/draft-mid", "--threads", "1", "--quantize", "none"])
        gateway = own.start_gateway(
            drafter.address, services.verifier.address, ("--drafter-timeout-s", str(DRAFTER_TIMEOUT_S))
        )
        own.ready()
        with injected(services.verifier, prefill_delay_ms=PREFILL_DELAY_MS):
            yield gateway
    finally:
        own.stop()


def _check(responses, reference) -> None:
    for r, ref in zip(responses, reference, strict=True):
        assert list(r.token_ids) == ref
        assert not r.stats.drafter_fallback, r.stats.fallback_reason
        assert r.stats.drafted_tokens > 0 and r.stats.speculative_steps > 0
        assert r.stats.drafter_prefill_ms > 0  # the drafter said `ready`


def test_a_prefill_longer_than_the_drafter_deadline_still_speculates(slow_prefill, tiny_target) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_target)
    prompt = prompts(tok, 1)[0]
    t0 = time.monotonic()
    (r,) = generate_all(slow_prefill.address, [spec(prompt, MAX_TOKENS, gamma=4, ignore_eos=True)], 1)
    assert time.monotonic() - t0 > DRAFTER_TIMEOUT_S  # the injected prefill alone outlasts the deadline
    reference = vllm_reference(
        tiny_target, [{"prompt_token_ids": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True}]
    )
    _check([r], reference)


def test_eight_requests_queued_behind_a_slow_prefill_all_speculate(slow_prefill, tiny_target) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_target)
    batch = prompts(tok, 8, seed=3)
    responses = generate_all(slow_prefill.address, [spec(p, MAX_TOKENS, gamma=4, ignore_eos=True) for p in batch], 8)
    reference = vllm_reference(
        tiny_target, [{"prompt_token_ids": p, "max_tokens": MAX_TOKENS, "ignore_eos": True} for p in batch]
    )
    _check(responses, reference)
