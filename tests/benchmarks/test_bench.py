"""`specdec bench`: the summary arithmetic on known records, and the --quick smoke run's JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import bench
from specdec.errors import UserError


def _record(ttft: float, step: float, sizes: list[int], tokens: list[int] | None = None) -> dict:
    chunks, t = [], ttft
    for n in sizes:
        chunks.append([t, n])
        t += step
    n_tokens = sum(sizes)
    return {"ttft": ttft, "e2e": chunks[-1][0], "chunks": chunks, "tokens": tokens or list(range(n_tokens))}


def test_summary_of_known_records() -> None:
    run = {"system": "specdec", "kind": "specdec", "gamma": 4, "cores": [0]}
    # first token at 1 s, then 4 steps of 0.5 s delivering 4 tokens each: 17 tokens
    result = {
        "concurrency": 1,
        "wall_s": 3.0,
        "requests": [_record(1.0, 0.5, [1, 4, 4, 4, 4])],
        "spec": {
            "drafts": 4,
            "draft_tokens": 16,
            "accepted": 12,
            "steps": 4,
            "verify_ms": 1600.0,
            "draft_wait_ms": 100.0,
            "draft_ms": 1000.0,
            "draft_tokens_sent": 20,
            "rejections": 4,
        },
    }
    row = bench.summarise(run, result)
    assert row["decode_tok_s"] == pytest.approx(16 / 2.0)
    assert row["throughput_tok_s"] == pytest.approx(17 / 3.0)
    assert row["ttft_ms"] == pytest.approx(1000.0)
    assert row["itl_p50_ms"] == pytest.approx(500.0)
    assert row["tpot_ms"] == pytest.approx(2000.0 / 16)
    assert row["alpha"] == pytest.approx(0.75)
    assert row["alpha_token"] == pytest.approx(12 / 16)
    assert row["mean_accepted_length"] == pytest.approx(4.0)
    assert row["tokens_per_step"] == pytest.approx(4.0)
    assert row["verify_step_ms"] == pytest.approx(400.0)
    assert row["round_ms"] == pytest.approx(500.0)
    assert row["overhead_ms"] == pytest.approx(100.0)
    assert row["draft_token_ms"] == pytest.approx(50.0)
    assert row["held_steps"] == 0 and row["drafter_batch_rows_mean"] is None  # not in this result's spec
    result["spec"] |= {
        "held_steps": 2.0,
        "drafter_batch_rows": {"forwards": 4, "mean": 2.5, "max": 3, "histogram": {"1": 1, "3": 3}},
        "drafter_counts": {
            "commits": 4.0,
            "commit_s": 0.1,
            "uncovered": 3.0,
            "stopped": 2.0,
            "items": 10.0,
            "loop_delay_s": 0.03,
            "long_loop_delays": 1.0,
        },
    }
    row = bench.summarise(run, result)
    assert row["held_steps"] == 2 and isinstance(row["held_steps"], int)
    assert row["branches_uncovered"] == 3 and row["commit_wait_ms"] == pytest.approx(25.0)
    assert row["forwards_stopped"] == 2 and isinstance(row["forwards_stopped"], int)
    assert row["loop_delay_ms"] == pytest.approx(3.0) and row["long_loop_delays"] == 1
    assert (row["drafter_forwards"], row["drafter_batch_rows_mean"], row["drafter_batch_rows_max"]) == (4, 2.5, 3)
    assert row["drafter_batch_rows"] == {"1": 1, "3": 3}
    assert "| 2 | 2.5 |" in bench.table([row])  # the held and draft rows columns


def test_speedup_bound_and_exactness_against_target_only() -> None:
    base_run = {"system": "target-only", "kind": "vllm", "gamma": 0, "cores": [0]}
    spec_run = {"system": "specdec", "kind": "specdec", "gamma": 4, "cores": [0]}
    tokens = list(range(17))
    base = bench.summarise(
        base_run, {"concurrency": 1, "wall_s": 9.0, "requests": [_record(1.0, 0.5, [1] * 17, tokens)]}
    )
    spec = bench.summarise(
        spec_run,
        {
            "concurrency": 1,
            "wall_s": 3.0,
            "requests": [_record(1.0, 0.5, [1, 4, 4, 4, 4], tokens)],
            "spec": {
                "drafts": 4,
                "draft_tokens": 16,
                "accepted": 12,
                "steps": 4,
                "verify_ms": 2000.0,
                "draft_wait_ms": 0.0,
                "draft_ms": 1600.0,
                "draft_tokens_sent": 16,
                "rejections": 4,
            },
        },
    )
    rows = [base, spec]
    bench.relate(rows, {"code": [[1, 2, 3]]})
    assert spec["speedup"] == pytest.approx(4.0)  # 0.5 s per token vs 0.5 s per 4 tokens
    # E(0.75, 4) tokens per round of max(500 ms verify, 4 x 100 ms drafting), against 500 ms per token
    assert spec["bound"] == pytest.approx(bench.expected_tokens(0.75, 4))
    assert spec["bound_fraction"] == pytest.approx(4.0 / bench.expected_tokens(0.75, 4))
    spec["draft_token_ms"] = 250.0  # a slow drafter: the round is 4 x 250 ms, twice the verify step
    bench.relate(rows, {"code": [[1, 2, 3]]})
    assert spec["bound"] == pytest.approx(bench.expected_tokens(0.75, 4) / 2)
    assert spec["exact"] == 1.0
    g = bench.goals(rows)
    assert g["batch1_speedup_vs_target_only"]["met"] is True
    assert g["batch1_speedup_vs_vllm_draft_model"]["value"] is None  # no vllm-draft rows in this run


def test_load_bound_is_the_best_gamma_at_the_fitted_step_cost() -> None:
    """c = 4: target-only's step 300 ms for 4 tokens; specdec's verify step 500 ms with 1 draft
    per row and step (8 tokens): per token 50 ms, base 100 ms. Every request: 1 s to its first
    token, then 48 more tokens."""
    plain = {"concurrency": 4, "tpot_ms": 300.0, "ttft_ms": 1000.0}
    spec = {
        "concurrency": 4,
        "verify_step_ms": 500.0,
        "drafts_per_step": 1.0,
        "tokens_per_step": 1.8,
        "alpha": 0.8,
        "alpha_token": 0.8,
        "ttft_ms": 1000.0,
        "tokens": 196,
        "requests": 4,
    }
    ratio, gamma = bench.load_bound(spec, plain)
    rates = {g: bench.expected_tokens(0.8, g) / (100.0 + 50.0 * 4 * (1 + g)) for g in range(1, 17)}
    best = max(rates, key=lambda g: rates[g])
    assert gamma == best
    assert ratio == pytest.approx((1000.0 + 48 * 300.0) / (1000.0 + 48 / rates[best]))
    # without the count, the drafts per step come from the client's tokens per step and alpha
    assert bench.load_bound({**spec, "drafts_per_step": None}, plain) == pytest.approx((ratio, gamma))
    # a verify step no dearer than the plain one (noise): no cost line, no bound
    assert bench.load_bound({**spec, "verify_step_ms": 290.0}, plain) is None
    assert bench.load_bound({**spec, "alpha": None}, plain) is None


def test_fallback_rows_are_flagged_and_report_the_longest_wait() -> None:
    run = {"system": "specdec", "kind": "specdec", "gamma": 4, "cores": [0], "workload": "c8"}
    result = {
        "concurrency": 8,
        "wall_s": 3.0,
        "requests": [_record(1.0, 0.5, [1, 4])],
        "spec": {
            "drafts": 1,
            "draft_tokens": 4,
            "accepted": 3,
            "steps": 1,
            "verify_ms": 400.0,
            "draft_wait_ms": 90.0,
            "draft_ms": 100.0,
            "draft_tokens_sent": 4,
            "rejections": 1,
            "fallbacks": 2,
            "max_draft_wait_ms": 90.0,
        },
    }
    row = bench.summarise(run, result)
    assert (row["workload"], row["fallbacks"], row["max_draft_wait_ms"]) == ("c8", 2, 90.0)
    text = bench.table([row])
    assert "| c8 | ⚠ specdec |" in text and "fell back" in text
    row["fallbacks"] = 0
    assert "⚠" not in bench.table([row])


def test_long_prompt_is_whole_lines_of_a_real_source_file(tiny_target) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target)
    text = bench.source_prompt(bench.LONG_PROMPT_SOURCE, tok, bench.LONG_PROMPT_TOKENS)
    assert len(tok(text)["input_ids"]) >= bench.LONG_PROMPT_TOKENS
    assert text.endswith("\n") and "argparse" in text
    ids, texts = bench.workload_prompts("c8", tok, 0)
    assert len(texts) == bench.C8_REQUESTS == len(set(texts)) and ids == list(bench.C8_SOURCES)


def test_expected_tokens_closed_form() -> None:
    for a in (0.1, 0.5, 0.9):
        assert bench.expected_tokens(a, 4) == pytest.approx((1 - a**5) / (1 - a))


def test_a_childs_events_are_read_and_its_other_output_skipped() -> None:
    seen = []
    lines = [
        "INFO a library printing\n",
        '{"event": "request"}\n',
        "[1, 2]\n",
        '{"event": "result", "n": 1}\n',
        '{"event": "request"}\n',
        '{"event": "result", "n": 2}\n',
    ]
    assert bench.read_events(lines, lambda: seen.append(1)) == [
        {"event": "result", "n": 1},
        {"event": "result", "n": 2},
    ]
    assert len(seen) == 2


def test_prompts_file_is_vllm_custom_jsonl(tmp_path: Path) -> None:
    f = tmp_path / "mine.jsonl"
    f.write_text(
        json.dumps({"prompt": "def f(x):\n"}) + "\n\n" + json.dumps({"prompt": "SELECT", "output_tokens": 9}) + "\n"
    )
    assert bench.file_prompts(f) == (["mine.jsonl:1", "mine.jsonl:3"], ["def f(x):\n", "SELECT"])
    for bad, what in (
        ('{"text": "x"}', "line 1: no `prompt` string"),
        ("not json", "line 1: not JSON"),
        ('{"prompt": ""}', "line 1: no `prompt` string"),
        ("", "no prompts"),
    ):
        f.write_text(bad + "\n")
        with pytest.raises(UserError, match=what):
            bench.file_prompts(f)
    with pytest.raises(UserError, match="missing.jsonl"):
        bench.file_prompts(tmp_path / "missing.jsonl")


def test_bench_with_a_bad_prompts_file_says_so_in_one_line(tmp_path: Path) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "x"}\n')
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "specdec_cli",
            "bench",
            "--models",
            "tiny",
            "--prompts-file",
            str(f),
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "bad.jsonl line 1: no `prompt` string" in proc.stderr.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from specdec.models.tiny import VOCAB_SIZE
    from specdec.models.vocab import DraftVocab

    out = tmp_path_factory.mktemp("bench")
    vocab = out / "vocab.json"
    DraftVocab(tuple(range(0, VOCAB_SIZE, 2)), VOCAB_SIZE).save(
        vocab
    )  # half the tiny draft's ids: the specdec-draft-vocab rows
    proc = subprocess.run(
        [sys.executable, "-m", "specdec_cli", "bench", "--quick", "--draft-vocab", str(vocab), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| system |" in proc.stdout
    return out


def test_quick_run_writes_every_field(quick: Path) -> None:
    report = json.loads((quick / "bench.json").read_text())
    for key in (
        "command",
        "models",
        "prompts",
        "prompt_tokens",
        "max_tokens",
        "gammas",
        "concurrency",
        "cores",
        "cpu",
        "versions",
        "started",
        "duration_s",
    ):
        assert key in report["meta"], key
    rows = report["rows"]
    fields = {k for k, _, _ in bench.COLUMNS} | {
        "requests",
        "tokens",
        "tokens_per_step",
        "verify_step_ms",
        "round_ms",
        "draft_wait_ms",
        "bound",
        "draft_token_ms",
        "alpha_token",
    }
    for row in rows:
        assert fields <= set(row), fields - set(row)
    seen = {(r["system"], r["gamma"], r["concurrency"], r["cores"]) for r in rows}
    for g in (1, 2, 4, 8):
        assert ("specdec", g, 1, 1) in seen and ("vllm-draft", g, 1, 1) in seen
        assert ("specdec-confidence", g, 1, 1) in seen  # drafts sized by confidence, batch 1
    for c in (1, 4, 16):
        assert ("target-only", 0, c, 1) in seen and ("specdec", 4, c, 1) in seen
    for system in ("vllm-ngram", "hf-assisted"):
        assert any(s == system for s, *_ in seen)
    assert ("vllm-draft", 4, 1, 2) in seen and ("specdec-fp32-draft", 4, 1, 1) in seen
    assert ("specdec-no-branches", 4, 1, 1) in seen
    assert {("specdec-draft-vocab", 4, c, 1) for c in (1, 4, 16)} <= seen  # --draft-vocab: the drafter's
    outputs = json.loads((quick / "outputs.json").read_text())  # every request's output ids, per row
    assert [(o["system"], o["gamma"], o["concurrency"]) for o in outputs] == [
        (r["system"], r["gamma"], r["concurrency"]) for r in rows
    ]
    assert all(len(o["tokens"]) == r["requests"] for o, r in zip(outputs, rows, strict=True))
    assert ("target-only-sync", 0, 1, 1) in seen and ("target-only-sync", 0, 16, 1) in seen  # async scheduling off
    for row in rows:  # greedy: every system's output is the target's (batch 1)
        if row["concurrency"] == 1 and row["system"] != "hf-assisted":
            assert row["exact"] == 1.0, row
        assert row["tokens"] == row["requests"] * report["meta"]["max_tokens"]
    spec1 = [r for r in rows if r["system"].startswith("specdec") and r["gamma"] and r["concurrency"] == 1]
    assert all(
        r[k] is not None
        for r in spec1
        for k in ("alpha", "alpha_token", "bound_fraction", "overhead_ms", "verify_step_ms", "draft_token_ms")
    )
    assert set(report["goals"]) == set(bench.GOALS) | {"branch_hit_rate"}
    # the realistic workloads: a long prompt (specdec against its own gamma 0) and 8 requests at once
    assert {w: len(v["prompt_tokens"]) for w, v in report["meta"]["workloads"].items()} == {
        "code": 2,
        "long": 1,
        "c8": 8,
    }
    realistic = {(r["workload"], r["system"], r["gamma"], r["concurrency"]) for r in rows if r["workload"] != "code"}
    assert realistic == {
        ("long", "target-only", 0, 1),
        ("long", "vllm-draft", 4, 1),
        ("long", "specdec", 0, 1),
        ("long", "specdec", 4, 1),
        ("c8", "target-only", 0, 8),
        ("c8", "vllm-draft", 4, 8),
        ("c8", "specdec", 4, 8),
    }
    for row in rows:
        if row["system"].startswith("specdec"):
            assert row["fallbacks"] == 0 and row["max_draft_wait_ms"] is not None, row
        if row["workload"] != "code":
            assert row["exact"] == 1.0, row
    # held steps and the drafter's batch size (its specdec:drafter_batch_rows, read from its /metrics)
    for row in rows:
        if not row["system"].startswith("specdec"):
            assert row["held_steps"] is None and row["drafter_batch_rows"] is None, row
            continue
        assert isinstance(row["held_steps"], int) and row["held_steps"] >= 0, row
        # the drafter's commits and the breaks no branch covered (its /metrics, around the workload)
        assert isinstance(row["branches_uncovered"], int) and row["branches_uncovered"] >= 0, row
        assert row["commit_wait_ms"] is None or row["commit_wait_ms"] >= 0, row
        assert isinstance(row["forwards_stopped"], int) and row["forwards_stopped"] >= 0, row
        if row["gamma"]:  # drafts were made: draft forwards, of at least one row each
            assert row["drafter_forwards"] >= 1, row
            # blocks were sent, each through the drafter's event loop
            assert row["loop_delay_ms"] >= 0 and 0 <= row["long_loop_delays"], row
            # (not bounded by the concurrency: a finished request's session may draft once more
            # beside the next request's before the drafter closes it)
            assert 1 <= row["drafter_batch_rows_mean"] <= row["drafter_batch_rows_max"], row
            histogram = row["drafter_batch_rows"]
            assert sum(histogram.values()) == row["drafter_forwards"], row
            assert max(int(k) for k in histogram) == row["drafter_batch_rows_max"], row
        else:  # gamma 0: plain decoding, the drafter makes no forward
            assert row["drafter_forwards"] == 0 and row["drafter_batch_rows_mean"] is None, row
    # 16 requests verified together commit together: the drafter batches their drafts
    assert any(r["drafter_batch_rows_max"] > 1 for r in rows if r["system"] == "specdec" and r["concurrency"] == 16)
    assert (quick / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
