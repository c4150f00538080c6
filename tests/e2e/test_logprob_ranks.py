"""Requests asking for logprobs, on a verifier without a C++ compiler (as the verifier-cpu image
ships: deploy/docker/Dockerfile installs none, and every verifier of the test stacks runs with CXX
naming none, tests/conftest.py NO_CXX).

vLLM 0.32 computes a logprob's rank (its place among the vocabulary, 1 = the likeliest) with a
function it compiles with torch.compile at its first call (`vllm/v1/sample/ops/logprobs.py:
batched_count_greater_than`), i.e. at the first request asking for logprobs. On the CPU inductor
builds C++ there: with no compiler that engine step raised and the verifier's engine died, taking
every request in flight with it; with one, the step stalled ~15 s. The verifier counts the ranks
eagerly instead (verifier/vllm_hooks.py, count_at_least). Run with SPECDEC_CPU_SAMPLER_FIX=0 to see
this module fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import NO_CXX, Services
from gen import generate_all, prompts, spec
from transformers import AutoTokenizer

from specdec.wire import pb

TOP = 5  # logprobs: the top-5 alternatives at each position
MAX_TOKENS = 24


def _rank_problems(r: pb.GenerateResponse) -> list[str]:
    """Where a position's rank disagrees with its top-TOP logprobs: a rank counts the entries at
    least as likely as the token (vLLM's rule), so it is the number of top logprobs >= the token's
    when that is under TOP, and more than TOP when the token is not among them."""
    out = []
    for i, lp in enumerate(r.logprobs):
        at_least = sum(1 for v in lp.top_logprobs if v >= lp.logprob)
        want_rank = at_least if at_least < TOP else None  # None: > TOP - 1, not pinned by the top TOP
        if lp.rank < 1 or (want_rank is not None and lp.rank != want_rank) or (want_rank is None and lp.rank < TOP):
            out.append(f"position {i}: token {lp.token_id} rank {lp.rank}, top logprobs {list(lp.top_logprobs)}")
    return out


def test_the_stacks_verifier_and_drafters_have_no_compiler(stack: Services) -> None:
    """The premise: the stack's verifier and drafters run with CXX naming no compiler."""
    for svc in (stack.verifier, *stack.drafters.values()):
        assert svc is not None
        environ = Path(f"/proc/{svc.proc.pid}/environ").read_bytes().split(b"\0")
        assert f"CXX={NO_CXX}".encode() in environ, svc.address


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprob_requests_get_ranks_and_the_verifier_serves_on(
    stack: Services, tiny_target: Path, temperature: float
) -> None:
    """Requests with logprobs (speculative, with the draft that agrees often; on the fixed-gamma
    stack drafts are verified), beside requests without, all at once: every logprobs request gets
    one entry per token with its rank (checked against its top-5), the others their tokens, and
    the verifier serves a request after them. A logprob's rank is computed with or without drafts
    (vLLM's sampler and its rejection sampler both call the same count)."""
    assert stack.verifier is not None
    ps = prompts(AutoTokenizer.from_pretrained(tiny_target), 8, seed=3)
    specs = [
        spec(p, MAX_TOKENS, gamma=4, temperature=temperature, seed=i, **({"logprobs": TOP} if i % 2 == 0 else {}))
        for i, p in enumerate(ps)
    ]
    responses = generate_all(stack.gateways["mid"].address, specs, concurrency=len(specs))
    problems = []
    for i, r in enumerate(responses):
        asked = i % 2 == 0
        if len(r.token_ids) != MAX_TOKENS and r.finish_reason != pb.FINISH_REASON_STOP:
            problems.append(f"request {i}: {len(r.token_ids)} tokens, finish {r.finish_reason}")
        if len(r.logprobs) != (len(r.token_ids) if asked else 0):
            problems.append(f"request {i}: {len(r.logprobs)} logprobs for {len(r.token_ids)} tokens (asked: {asked})")
        problems += [f"request {i}: {p}" for p in _rank_problems(r)]
    assert not problems, "\n".join(problems)
    if not stack.defaults:  # there adaptive gamma and the pace cap may rightly verify none at 8 at once
        assert sum(r.stats.accepted_tokens for r in responses) > 0, "the premise: drafts were verified"
    after = generate_all(stack.gateways["mid"].address, [spec(ps[0], 4, gamma=4, logprobs=1)])[0]
    assert len(after.token_ids) == 4 and len(after.logprobs) == 4
    assert stack.verifier.proc.poll() is None, "the verifier exited"
