"""The target at bfloat16 on a CPU with bfloat16 instructions: what `--dtype auto` runs for a
bfloat16 checkpoint there (the pulled qwen-coder pair, most published models), as `vllm serve`
untold does.

The tiny pair's checkpoint is float32, which `auto` keeps (vLLM's own auto would downcast it), so
the session's stacks run float32. This module isolates the bfloat16 path: a verifier started with
`--dtype bfloat16`, every other setting its default, and a default drafter; the reference is a
plain vLLM engine at bfloat16. Skipped on a CPU without bfloat16 instructions, where `auto` never
picks bfloat16 (and vLLM's bfloat16 is far slower).

vLLM 0.32's bfloat16 CPU attention runs AMX instructions without asking Linux for the AMX state,
so a verifier whose first AMX use was that kernel died of SIGILL on a prompt of a few tokens (the
gRPC fuzz suite found it: exit -4 on a 1-token prompt). `test_short_prompts_are_served` holds the
fix (verifier.vllm_hooks.request_cpu_amx, asked before the engine's first step).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Services, one_setting_stack, vllm_reference
from gen import generate_all, prompts, spec
from transformers import AutoTokenizer

from verifier.vllm_hooks import cpu_computes_bf16

pytestmark = pytest.mark.skipif(not cpu_computes_bf16(), reason="this CPU has no bfloat16 instructions")

MAX_TOKENS = 40
GAMMA = 4
CONCURRENCY = 2  # as the default stacks of the exactness suites (test_greedy_lossless.DEFAULTS_CONCURRENCY)


@pytest.fixture(scope="module")
def bf16_stack(tiny_target: Path, log_dir: Path) -> Iterator[Services]:
    with one_setting_stack(log_dir, "--dtype", "bfloat16") as s:
        yield s


def test_the_verifier_says_it_runs_bf16(bf16_stack: Services) -> None:
    assert bf16_stack.verifier is not None
    log = bf16_stack.verifier.log_path.read_text()
    assert "target dtype bfloat16 (--dtype bfloat16 on cpu)" in log, log[-2000:]


def test_bf16_greedy_outputs_equal_target_only(bf16_stack: Services, tiny_target: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_target)
    ps = prompts(tok, 20)
    reference = vllm_reference(tiny_target, [{"prompt_token_ids": p, "max_tokens": MAX_TOKENS} for p in ps], "bfloat16")
    responses = generate_all(
        bf16_stack.gateways["mid"].address, [spec(p, MAX_TOKENS, gamma=GAMMA) for p in ps], CONCURRENCY
    )
    mismatches = [
        (i, list(r.token_ids), reference[i]) for i, r in enumerate(responses) if list(r.token_ids) != reference[i]
    ]
    assert not mismatches, f"{len(mismatches)}/{len(ps)} outputs differ; first: {mismatches[0]}"
    drafted = sum(r.stats.drafted_tokens for r in responses)
    held = sum(r.stats.held_steps for r in responses)
    assert drafted > 0 or held > 0, (drafted, held)  # speculation was decided, not skipped


def test_short_prompts_are_served(bf16_stack: Services) -> None:
    """Prompts of 1-3 tokens, greedy and sampled with penalties (the fuzz suite's crashing case):
    each answered in full, and the verifier still running."""
    specs = [
        spec([0], 1, presence_penalty=-2.0, frequency_penalty=-2.0),
        spec([0, 5, 6], 8),
        spec([7], 8, temperature=0.8, top_p=0.9, seed=3, repetition_penalty=1.3),
    ]
    responses = generate_all(bf16_stack.gateways["mid"].address, specs, CONCURRENCY)
    assert [len(r.token_ids) for r in responses] == [1, 8, 8]
    assert bf16_stack.verifier is not None and bf16_stack.verifier.proc.poll() is None
