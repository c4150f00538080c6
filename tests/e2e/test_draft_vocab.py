"""A drafter serving with a draft vocabulary (`--draft-vocab`, made by `specdec draft-vocab`):
the output stays exact, token for token, when the target's tokens leave the vocabulary; a bad
file stops the drafter at start-up with one line naming the setting.

The drafter runs with its defaults otherwise (int8, batched drafts, branches), beside the
session's default-settings verifier (the configuration a user who turns the setting on gets)
and beside its fixed-gamma verifier (every step verifies its drafts: the mechanism, for sure).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Services, vllm_reference
from gen import generate_all, prompts, spec
from transformers import AutoTokenizer

from specdec.models.tiny import VOCAB_SIZE
from specdec.models.vocab import DraftVocab
from specdec_cli.launch import free_port

MAX_TOKENS = 32
N_PROMPTS = 8
SIZE = 256  # of the tiny pair's 512 ids: small enough that the target's outputs leave it


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory: pytest.TempPathFactory, tiny_target: Path) -> Path:
    """A draft vocabulary of the tiny draft, counted by the CLI over a few stdlib sources."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = tmp_path_factory.mktemp("vocab") / "tiny-vocab.json"
    run = subprocess.run(
        [sys.executable, "-m", "specdec_cli", "draft-vocab", "--model", "tiny/draft-same", "--size", str(SIZE)]
        + ["--out", str(out), *(str(stdlib / f) for f in ("textwrap.py", "heapq.py", "csv.py", "shlex.py"))],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "coverage of" not in run.stdout  # four files, every 10th held out: none
    kept = len(DraftVocab.load(out).token_ids)  # the SIZE most frequent and the special tokens
    assert SIZE <= kept < SIZE + 8 and f"draft vocabulary: {kept:,} of {VOCAB_SIZE} ids" in run.stdout
    return out


@pytest.fixture(scope="module")
def cut(services: Services, default_services: Services, vocab_file: Path, log_dir: Path) -> Iterator[Services]:
    """One drafter with the vocabulary (its other settings the defaults) and a gateway to each
    verifier: `fixed-gamma` (the session's verifier that verifies every step's gamma: the
    mechanism, drafts verified for sure) and `defaults` (the default-settings verifier: adaptive
    gamma and the pace cap decide how many drafts it verifies)."""
    s = Services(log_dir)
    try:
        drafter = s._start(
            "drafter", ["--model", "tiny/draft-same", "--threads", "1", "--draft-vocab", str(vocab_file)]
        )
        s.drafters["cut"] = drafter
        for name, stack in (("fixed-gamma", services), ("defaults", default_services)):
            assert stack.verifier is not None
            s.gateways[name] = s.start_gateway(drafter.address, stack.verifier.address)
        s.ready()
        yield s
    finally:
        s.stop()


@pytest.mark.parametrize("verifier", ["fixed-gamma", "defaults"])
def test_greedy_output_is_exact_with_a_draft_vocabulary(cut: Services, vocab_file: Path, tiny_target, verifier) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_target)
    ps = prompts(tok, N_PROMPTS)
    reference = vllm_reference(tiny_target, [{"prompt_token_ids": p, "max_tokens": MAX_TOKENS} for p in ps])
    inside = set(DraftVocab.load(vocab_file).token_ids)
    outside = sum(t not in inside for out in reference for t in out)
    assert outside > 0, "every target token is in the vocabulary: the test would not cover a cut draft"
    concurrency = 2 if verifier == "defaults" else 4  # as tests/e2e/test_greedy_lossless.py's stacks
    responses = generate_all(cut.gateways[verifier].address, [spec(p, MAX_TOKENS, gamma=4) for p in ps], concurrency)
    assert [list(r.token_ids) for r in responses] == reference
    drafted = sum(r.stats.drafted_tokens for r in responses)
    accepted = sum(r.stats.accepted_tokens for r in responses)
    held = sum(r.stats.held_steps for r in responses)
    if verifier == "fixed-gamma":  # drafts verified: accepted, and rejected where the target left the vocabulary
        assert 0 < accepted < drafted, (drafted, accepted)
    else:  # adaptive gamma's decision: drafts verified, or the drafter held (speculation decided, not skipped)
        assert drafted > 0 or held > 0, (drafted, held)
    log = cut.drafters["cut"].log_path.read_text()
    assert f"drafting {len(inside)} of them ({vocab_file})" in log  # the setting took effect


@pytest.mark.parametrize("verifier", ["fixed-gamma", "defaults"])
def test_sampled_requests_complete_with_a_draft_vocabulary(cut: Services, tiny_target, verifier: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_target)
    ps = prompts(tok, N_PROMPTS)
    specs = [spec(p, MAX_TOKENS, gamma=4, temperature=1.0, seed=i, ignore_eos=True) for i, p in enumerate(ps)]
    responses = generate_all(cut.gateways[verifier].address, specs, 2 if verifier == "defaults" else 4)
    assert [len(r.token_ids) for r in responses] == [MAX_TOKENS] * N_PROMPTS
    assert all(0 <= t < VOCAB_SIZE for r in responses for t in r.token_ids)
    if verifier == "fixed-gamma":  # q is 0 outside the vocabulary: the rejection sampler took the drafts
        assert sum(r.stats.drafted_tokens for r in responses) > 0


def test_a_bad_draft_vocabulary_stops_the_drafter_naming_the_setting(tmp_path: Path, tiny_target) -> None:
    bad = tmp_path / "bad.json"
    DraftVocab((1, 2), 4096).save(bad)  # made for another model's width
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "specdec_cli",
            "serve",
            "drafter",
            "--model",
            "tiny/draft-same",
            "--port",
            str(free_port()),
        ]
        + ["--draft-vocab", str(bad)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2, run.stderr[-2000:]
    line = f"--draft-vocab {bad}: made for an output layer 4096 ids wide, not the draft tiny/draft-same's {VOCAB_SIZE}"
    assert line in run.stderr
