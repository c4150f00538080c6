"""`specdec bench-drafter` (benchmarks.drafter_capacity): one run measures every session count
in both modes, batched and serial, and writes its table, CSV, JSON and plot; bad settings are
one-line errors naming the flag. No timing is asserted: the numbers are the benchmark's to
report, not this test's."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec_cli import main as cli

TINY = [
    "--sessions",
    "1,2,3",
    "--prompt",
    "8",
    "--gamma",
    "4",
    "--accept",
    "2",
    "--seconds",
    "0",
    "--min-rounds",
    "2",
    "--warmup",
    "1",
]


@pytest.mark.e2e  # loads the tiny draft model (tests/conftest.py tiers)
def test_bench_drafter_measures_each_session_count_in_both_modes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "specdec_cli", "bench-drafter", *TINY, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    report = json.loads((out / "drafter-capacity.json").read_text())
    rows = {(r["sessions"], r["mode"]): r for r in report["rows"]}
    assert set(rows) == {(n, mode) for n in (1, 2, 3) for mode in ("serial", "batched")}
    for (n, _), r in rows.items():
        assert r["rounds"] >= 2 and r["tokens"] == n * r["rounds"]  # every session drafts a token per round
        assert r["tok_s"] > 0 and r["pace_ms"] > 0
    assert report["args"]["sessions"] == [1, 2, 3] and "func" not in report["args"]
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| sessions | serial tok/s | batched tok/s |")
    assert [line.split("|")[1].strip() for line in table[1:]] == ["1", "2", "3"]
    with open(out / "drafter-capacity.csv") as f:
        assert len(list(csv.DictReader(f))) == 6
    assert (out / "drafter-capacity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.e2e  # loads the tiny draft model
def test_draft_vocab_ab_measures_both_heads_side_by_side(tmp_path: Path) -> None:
    from specdec.models.tiny import VOCAB_SIZE
    from specdec.models.vocab import DraftVocab

    vocab = tmp_path / "vocab.json"
    DraftVocab(tuple(range(0, VOCAB_SIZE, 4)), VOCAB_SIZE).save(vocab)  # the tiny draft's width
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "specdec_cli",
            "bench-drafter",
            *TINY,
            "--draft-vocab-ab",
            str(vocab),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    report = json.loads((out / "draft-vocab-ab.json").read_text())
    assert [r["sessions"] for r in report["rows"]] == [1, 2, 3]
    for r in report["rows"]:
        assert r["whole"]["tokens"] > 0 and r["cut"]["tokens"] > 0
    table = proc.stdout[proc.stdout.index("| sessions |") :].splitlines()  # after the rows as they came
    assert table[0].startswith("| sessions | whole tok/s | cut tok/s | cut / whole |")
    assert [line.split("|")[1].strip() for line in table[2:5]] == ["1", "2", "3"]


@pytest.mark.e2e  # loads the tiny draft model
def test_the_placement_is_the_drafters_and_is_recorded(tmp_path: Path) -> None:
    """`--device`/`--dtype` place the draft as the drafter's own flags do; the title says where."""
    argv = ["--sessions", "1", *TINY[2:], "--device", "cpu", "--dtype", "bfloat16", "--out", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, "-m", "specdec_cli", "bench-drafter", *argv], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "drafter-capacity.json").read_text())
    assert report["title"].startswith("tiny/draft-mid (cpu bfloat16), 1 thread(s)")
    assert report["args"]["device"] == "cpu" and report["args"]["dtype"] == "bfloat16"


@pytest.mark.e2e  # loads the tiny draft model
def test_the_module_runs_the_same_benchmark(tmp_path: Path) -> None:
    """`python -m benchmarks.drafter_capacity` takes the subcommand's flags (here `--copies`)."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.drafter_capacity", "--copies", "2", "--prompt", "8", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 sessions, prompts 8+: batched step" in proc.stdout and "of which cache copies" in proc.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sessions", "1,x"], "argument --sessions: '1,x' is not a comma-separated list of integers"),
        (["--sessions", "0,2"], "argument --sessions: '0,2': give one or more session counts, each at least 1"),
        (["--accept", "8", "--gamma", "8"], "--accept 8: must be 0 to gamma - 1 (7)"),
        (["--prompt", "0"], "--prompt 0: must be at least 1"),
        (["--core", "100000"], "--core 100000: not one of this process's cores"),
        (["--shape", "qwen2.5-0.5b", "--draft-vocab", "v.json"], "--draft-vocab and --draft-vocab-ab need --model's"),
        (
            ["--device", "cpu", "--dtype", "bfloat16", "--quantize", "int8"],
            "quantize int8 runs float32 activations (torch's dynamic quantisation), not dtype bfloat16",
        ),
        pytest.param(
            ["--device", "cuda"],
            "device cuda: torch sees no CUDA GPU on this host",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU"),
        ),
    ],
)
def test_bad_settings_are_one_line_errors_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        status = cli.main(["bench-drafter", *argv])
    except SystemExit as exit:  # argparse's usage error (--sessions' own type)
        status = int(exit.code or 0)
    assert status == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
