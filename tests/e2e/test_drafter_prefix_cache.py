"""The drafter's prefix cache (drafter.prefix_cache, on by default) through the real services.

A prompt that starts with tokens the drafter has already computed (a previous request's prompt
and output: a chat's next turn; a prompt of a queue that shares a system prompt with one ahead
of it) has their draft keys/values copied instead of prefilled, and the response says how many
(SpeculationStats.drafter_reused_tokens). Shown on both stacks (fixed gamma, and the defaults a
user gets):
  - greedy output is token for token vLLM target-only's, with and without a reused prefix;
  - the same prompt again reuses all of it but its last token (fed with the first draft step);
  - a chat's next turn (the prompt, the first turn's output, new tokens) reuses at least the
    prompt; on the fixed-gamma stack, whose drafter drafts every round, some of the output too;
  - prompts sent at once that share a system prompt: all but the first prefilled reuse it
    (the drafter prefills in arrival order, so the others find it in the first's cache);
  - the drafter counts the reused tokens (specdec:drafter_prefix_reused_tokens_total).
"""

from __future__ import annotations

import random
from pathlib import Path

from conftest import Services, vllm_reference
from gen import generate_all, scrape, spec
from transformers import AutoTokenizer

from drafter.prefix_cache import MIN_REUSE_TOKENS

PROMPT_TOKENS = 300
SYSTEM_TOKENS = 200  # the shared start of the queued prompts
QUEUED = 4
MAX_TOKENS = 48  # long enough that each request hears its drafter's `ready` (which carries the reused count)


def _ids(tiny_target: Path, n: int, seed: int) -> list[int]:
    """n seeded random token ids (a prompt no other test sends: the seed is this module's)."""
    rng = random.Random(seed)
    vocab = AutoTokenizer.from_pretrained(tiny_target).vocab_size
    return [rng.randrange(1, vocab) for _ in range(n)]


def _reused(stack: Services) -> float:
    return scrape(stack.drafters["same"].metrics_port).get("specdec:drafter_prefix_reused_tokens_total", 0.0)


def test_a_repeated_prompt_and_a_chats_next_turn_reuse_the_drafters_keys(stack: Services, tiny_target: Path) -> None:
    seed = 9100 + stack.defaults  # each stack its own prompt: the stacks' drafters differ, but not by chance
    prompt = _ids(tiny_target, PROMPT_TOKENS, seed)
    address = stack.gateways["same"].address
    before = _reused(stack)
    (first,) = generate_all(address, [spec(prompt, MAX_TOKENS, ignore_eos=True)], concurrency=1)
    (again,) = generate_all(address, [spec(prompt, MAX_TOKENS, ignore_eos=True)], concurrency=1)
    turn = prompt + list(first.token_ids) + _ids(tiny_target, 20, seed + 1)
    (second_turn,) = generate_all(address, [spec(turn, MAX_TOKENS, ignore_eos=True)], concurrency=1)

    reference = vllm_reference(
        tiny_target, [{"prompt_token_ids": p, "max_tokens": MAX_TOKENS, "ignore_eos": True} for p in (prompt, turn)]
    )
    assert list(first.token_ids) == list(again.token_ids) == reference[0]
    assert list(second_turn.token_ids) == reference[1]
    for r in (first, again, second_turn):
        assert not r.stats.drafter_fallback, r.stats.fallback_reason
        assert r.stats.drafter_prefill_ms > 0  # the drafter's `ready` came: its reused count is its own
    assert first.stats.drafter_reused_tokens == 0  # a prompt the drafter has not seen
    assert again.stats.drafter_reused_tokens == PROMPT_TOKENS - 1
    assert second_turn.stats.drafter_reused_tokens >= PROMPT_TOKENS - 1
    if not stack.defaults:  # the drafter drafted every round: its cache held output tokens too
        assert first.stats.drafted_tokens > 0
        assert second_turn.stats.drafter_reused_tokens > PROMPT_TOKENS
    got = again.stats.drafter_reused_tokens + second_turn.stats.drafter_reused_tokens
    assert _reused(stack) - before >= got


def test_prompts_of_a_queue_reuse_the_system_prompt_they_share(stack: Services, tiny_target: Path) -> None:
    seed = 9200 + stack.defaults
    system = _ids(tiny_target, SYSTEM_TOKENS, seed)
    ps = [system + _ids(tiny_target, 40 + 10 * i, seed + 1 + i) for i in range(QUEUED)]
    responses = generate_all(
        stack.gateways["same"].address, [spec(p, MAX_TOKENS, ignore_eos=True) for p in ps], concurrency=QUEUED
    )
    reference = vllm_reference(
        tiny_target, [{"prompt_token_ids": p, "max_tokens": MAX_TOKENS, "ignore_eos": True} for p in ps]
    )
    assert [list(r.token_ids) for r in responses] == reference
    assert all(r.stats.drafter_prefill_ms > 0 for r in responses)  # every `ready` came
    reused = sorted(r.stats.drafter_reused_tokens for r in responses)
    # the first prompt prefilled shares under MIN_REUSE_TOKENS by chance with anything else
    assert reused[0] < MIN_REUSE_TOKENS <= SYSTEM_TOKENS
    assert reused[1:] == [SYSTEM_TOKENS] * (QUEUED - 1), reused
