"""`python -m benchmarks.commit_stop`: one run measures rejecting commits with the stop on and
off, alternating, through a real draft worker, and prints (and writes) both. No timing is
asserted: the numbers are the benchmark's to report, not this test's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import RunModule


@pytest.mark.e2e  # loads the tiny draft model (tests/conftest.py tiers)
def test_commit_stop_measures_both_modes_in_one_run(tmp_path: Path, run_module: RunModule) -> None:
    out = tmp_path / "commit-stop.json"
    stdout = run_module(
        "benchmarks.commit_stop",
        *("--models", "tiny", "--trials", "2", "--commits", "3", "--prompt", "16", "--delay-ms", "0,2"),
        *("--out", str(out)),
    )
    rows = [line for line in stdout.splitlines() if line.startswith("| stop o")]
    assert [r.split("|")[1].strip() for r in rows] == ["stop on", "stop off"]
    assert all(r.split("|")[2].strip() == "6" for r in rows)  # 2 sessions x 3 rejecting commits each
    measured = json.loads(out.read_text())
    for mode in ("stop on", "stop off"):
        assert len(measured[mode]["waits"]) == len(measured[mode]["redrafts"]) == 6
        assert all(w >= 0 for w in measured[mode]["waits"])
        # the first re-drafted block comes after its commit started (it drafts from the verdict);
        # not compared with the commit's return, which another thread's block may precede
        assert all(r > 0 for r in measured[mode]["redrafts"])
    assert measured["stop off"]["stopped"] == 0  # its sessions are never superseded
