"""`specdec eval-draft`: the round simulation on hand-made match sequences, and the tiny pair end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdec_cli import evaldraft
from specdec_cli import main as cli
from specdec_cli.evaldraft import (
    Prompt,
    VocabMismatch,
    acceptance_by_offset,
    check_same_vocab,
    simulate_rounds,
)

T, F = True, False
GAMMAS = (1, 2, 4, 8)
PROMPTS = [Prompt("a", "def add(a, b):\n    return"), Prompt("b", "class Stack:\n    def __init__(self):\n")]


# ---------------------------------------------------------------- pure functions


@pytest.mark.parametrize(
    ("matches", "gamma", "accepted"),
    [
        ([T] * 10, 4, [4, 4]),  # rounds at 0 and 5; at 10 no positions remain
        ([T] * 9, 4, [4, 4]),  # the round at 5 checks positions 5..8: complete (its bonus lies past the end)
        ([T] * 8, 4, [4]),  # the round at 5 would need positions 5..8: incomplete, not counted
        ([F] * 5, 2, [0, 0, 0, 0]),  # each round rejects its first draft and advances by 1
        ([T, T, F, T, T, T, F, T], 3, [2, 3]),  # 0: TTF -> 2, 3: TTT -> 3, 7: incomplete
        ([T, F, T, T], 3, [1]),  # 0: TF -> 1; round at 2 is incomplete
        ([T, F], 1, [1]),  # 0: T -> 1, advances to 2
        ([], 1, []),
    ],
)
def test_simulate_rounds(matches: list[bool], gamma: int, accepted: list[int]) -> None:
    assert simulate_rounds(matches, gamma) == accepted


def test_acceptance_by_offset() -> None:
    # rounds accepted 0, 1, 3, 3 of gamma 3: offset 0 reached 4 accepted 3; offset 1 reached 3
    # accepted 2; offset 2 reached 2 accepted 2
    assert acceptance_by_offset([0, 1, 3, 3], 3) == [0.75, 2 / 3, 1.0]
    assert acceptance_by_offset([0, 0], 2) == [0.0, None]


def test_vocab_mismatch_is_an_error() -> None:
    check_same_vocab({"a": 0, "b": 1}, {"b": 1, "a": 0})
    with pytest.raises(VocabMismatch, match="differs from the target"):
        check_same_vocab({"a": 0, "b": 1}, {"a": 1, "b": 0})


def test_builtin_prompts() -> None:
    prompts = evaldraft.load_prompts()
    assert len(prompts) >= 10
    assert len({p.id for p in prompts}) == len(prompts)
    assert all(p.prompt.strip() for p in prompts)
    assert len(evaldraft.load_prompts(limit=3)) == 3


def test_bad_prompt_file_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "prompt": "ok"}\n\n{"id": "y"}\n')
    with pytest.raises(evaldraft.EvalDraftError, match=r"bad.jsonl:3"):
        evaldraft.load_prompts(bad)
    assert cli.main(["eval-draft", "--target", "tiny/target", "--draft", "tiny/draft-same", "--prompts", str(bad)]) == 2
    assert "bad.jsonl:3" in capsys.readouterr().err


# ---------------------------------------------------------------- the tiny pair


def _evaluate(draft: str, max_new_tokens: int = 96) -> evaldraft.Report:
    return evaldraft.evaluate("tiny/target", draft, PROMPTS, GAMMAS, max_new_tokens, timing_steps=2, progress=False)


@pytest.mark.e2e  # the tiny pair, loaded with transformers
def test_identical_draft_accepts_everything() -> None:
    r = _evaluate("tiny/draft-same")
    assert r.alpha == 1.0
    assert r.acceptance_by_offset == [1.0] * max(GAMMAS)
    for g in r.per_gamma:
        assert g.rounds > 0
        assert g.tokens_per_step == g.gamma + 1 == g.expected_tokens
        assert g.speedup_colocated_measured == g.speedup_colocated_formula


@pytest.mark.e2e  # the tiny pair, loaded with transformers
def test_unrelated_draft_accepts_almost_nothing() -> None:
    r = _evaluate("tiny/draft-far")
    assert r.alpha < 0.05
    for g in r.per_gamma:
        assert g.tokens_per_step < 1.1
        # the speedup's definition, not its timing: tokens per round over the round's cost in
        # target steps (gamma draft steps at c each, one verify); c > 0, so below tokens_per_step
        assert r.costs.c > 0
        assert g.speedup_colocated_measured == pytest.approx(g.tokens_per_step / (g.gamma * r.costs.c + 1.0))
        assert g.speedup_colocated_measured < g.tokens_per_step


@pytest.mark.e2e  # the tiny pair, loaded with transformers
def test_json_has_every_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": p.id, "prompt": p.prompt}) + "\n" for p in PROMPTS))
    out = tmp_path / "report.json"
    argv = [
        "eval-draft",
        "--target",
        "tiny/target",
        "--draft",
        "tiny/draft-mid",
        "--prompts",
        str(prompts),
        "--gammas",
        "1,3",
        "--max-new-tokens",
        "24",
        "--timing-steps",
        "2",
        "--json",
        str(out),
    ]
    assert cli.main(argv) == 0
    assert "co-located speedup" in capsys.readouterr().out
    d = json.loads(out.read_text())
    assert set(d) == {
        "target",
        "draft",
        "max_new_tokens",
        "gammas",
        "prompts",
        "positions",
        "alpha",
        "acceptance_gamma",
        "acceptance_by_offset",
        "costs",
        "per_gamma",
        "per_prompt",
        "seconds",
        "branch_coverage",
    }
    assert d["gammas"] == [1, 3] and d["prompts"] == 2 and d["acceptance_gamma"] == 3
    cover = d["branch_coverage"]
    assert (
        len(cover) == 3 and all(0 <= x <= 1 for x in cover) and cover == sorted(cover)
    )  # more alternatives, more cover
    assert len(d["acceptance_by_offset"]) == 3
    assert set(d["costs"]) == {
        "context_tokens",
        "target_decode_ms",
        "draft_decode_ms",
        "c",
        "verify_ms",
        "verify_over_decode",
    }
    assert set(d["costs"]["verify_over_decode"]) == {"1", "3"}
    assert d["costs"]["c"] > 0
    assert [g["gamma"] for g in d["per_gamma"]] == [1, 3]
    assert set(d["per_gamma"][0]) == {
        "gamma",
        "rounds",
        "mean_accepted",
        "tokens_per_step",
        "expected_tokens",
        "verify_over_decode",
        "speedup_colocated_measured",
        "speedup_colocated_formula",
        "speedup_overlapped_measured",
        "speedup_overlapped_formula",
    }
    assert [p["id"] for p in d["per_prompt"]] == ["a", "b"]
    assert set(d["per_prompt"][0]) == {"id", "prompt_tokens", "continuation_tokens", "alpha"}
    assert 0.0 <= d["alpha"] <= 1.0
    assert d["positions"] == sum(p["continuation_tokens"] for p in d["per_prompt"])


@pytest.mark.e2e  # the tiny pair, loaded with transformers
def test_json_to_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "eval-draft",
        "--target",
        "tiny/target",
        "--draft",
        "tiny/draft-same",
        "--limit",
        "1",
        "--gammas",
        "2",
        "--max-new-tokens",
        "8",
        "--timing-steps",
        "1",
        "--json",
        "-",
    ]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["alpha"] == 1.0
    assert "alpha" in captured.err  # the table moves to stderr


def test_branch_coverage_counts_mismatches_by_rank() -> None:
    assert evaldraft.branch_coverage([0, 0, 1, 2, 5, 1]) == [0.5, 0.75, 0.75]
    assert evaldraft.branch_coverage([0, 0]) == [None, None, None]
