"""A long prompt with the drafter's defaults: riding branch rows and the shared-prefix attention.

Every other end-to-end prompt is under drafter.rows.SHARE_MIN tokens, so there a batched
forward of the lean drafter (the CPU's default) gathers each row's cache. From SHARE_MIN
cached tokens on, the rows that read one session's cache (the session's own row and the branch
rows riding beside its lookahead, drafter.batch.draft_step) attend it where it lies, one
product for them all (drafter.rows, "Shared prefixes"). This module serves the long-prompt
bench's prompt (benchmarks/long_source_prompt.jsonl, a real source file) cut to PROMPT_TOKENS
of the tiny tokenizer's, above SHARE_MIN, through a drafter and a verifier with their default
settings (only the model and one thread set). The draft is draft-same (the target's copy), so a
session's draft that the shared attention got wrong is a rejected one: its acceptance tells
(weighing the shared prefix half drafted 88 % accepted, against 96 % right). A branch row's
length within the shared part (its mask) is checked by tests/drafter/test_batch.py, row by row:
here the few rejections leave branches little to show.

The verifier sleeps STEP_DELAY_MS in every engine step while the module runs (a fault, as in
tests/e2e/test_branches.py): a real target's step is long beside its drafter's token, while the
tiny target's is not, and rows ride only where the drafter drafts ahead of a pending verdict.
Shown, requests one at a time (so a forward of more than one row is a session with its branch
rows riding):
  - greedy output is token for token vLLM target-only's;
  - forwards with riding rows happened (the drafter's specdec:drafter_batch_rows above 1);
  - the drafts were the target's own: at least MIN_ACCEPTANCE of them accepted.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Services, injected, vllm_reference
from gen import generate_all, scrape, spec
from transformers import AutoTokenizer

from drafter.rows import SHARE_MIN
from specdec.models.tiny import MAX_POSITIONS

PROMPT_FILE = Path(__file__).parents[2] / "benchmarks" / "long_source_prompt.jsonl"
PROMPT_TOKENS = SHARE_MIN + 400  # past SHARE_MIN at the first draft, and room for MAX_TOKENS in the tiny context
STEP_DELAY_MS = 100  # >> the tiny drafter's token at this context (a few ms), also on a loaded host
MAX_TOKENS = 48
REQUESTS = 3
MIN_ACCEPTANCE = 0.9  # draft-same drafts the target's greedy tokens; int8 rounding may flip a near tie


@pytest.fixture(scope="module")
def stack(tiny_target: Path, log_dir: Path) -> Iterator[Services]:
    """A verifier, a draft-same drafter and a gateway, each with its defaults, the verifier's steps slowed."""
    own = Services(log_dir)
    own.defaults = True
    try:
        own.verifier = own._start("verifier", ["--model", "tiny/target", "--threads", "1"])
        own.drafters["same"] = own._start("drafter", ["--model", "tiny/draft-same", "--threads", "1"])
        own.gateways["same"] = own.start_gateway(own.drafters["same"].address, own.verifier.address)
        own.ready()
        with injected(own.verifier, step_delay_ms=STEP_DELAY_MS, step_every=1):
            yield own
    finally:
        own.stop()


@pytest.fixture(scope="module")
def long_prompts(tiny_target: Path) -> list[list[int]]:
    """REQUESTS prompts of PROMPT_TOKENS tokens: the source file's tokens from three offsets."""
    text = json.loads(PROMPT_FILE.read_text().splitlines()[0])["prompt"]
    ids = list(AutoTokenizer.from_pretrained(tiny_target).encode(text))
    assert len(ids) >= PROMPT_TOKENS + 2 * 50 and PROMPT_TOKENS + MAX_TOKENS < MAX_POSITIONS, len(ids)
    return [ids[50 * i : 50 * i + PROMPT_TOKENS] for i in range(REQUESTS)]


def test_a_long_prompt_at_the_defaults_is_exact_with_rows_riding(
    stack: Services, tiny_target: Path, long_prompts: list[list[int]]
) -> None:
    reference = vllm_reference(
        tiny_target, [{"prompt_token_ids": p, "max_tokens": MAX_TOKENS, "ignore_eos": True} for p in long_prompts]
    )
    responses = generate_all(
        stack.gateways["same"].address, [spec(p, MAX_TOKENS, ignore_eos=True) for p in long_prompts], concurrency=1
    )
    assert [list(r.token_ids) for r in responses] == reference
    drafter = stack.drafters["same"]
    assert drafter.metrics_port
    metrics = scrape(drafter.metrics_port)
    forwards = metrics["specdec:drafter_batch_rows_count"]
    alone = metrics["specdec:drafter_batch_rows_bucket{le=1.0}"]
    assert forwards > alone, f"no forward had rows riding ({forwards:g} forwards, all of one row)"
    drafted = sum(r.stats.drafted_tokens for r in responses)
    accepted = sum(r.stats.accepted_tokens for r in responses)
    assert drafted > 0 and accepted >= MIN_ACCEPTANCE * drafted, (accepted, drafted)
