"""`python -m benchmarks.forward_memory`: the worker's steps over long sessions, with a forward's
bounds lifted and as the drafter runs, on the tiny draft (4 sessions of 120 tokens). Both runs
report; no memory or timing figure is asserted: those are the benchmark's to report
(docs/design.md, "The drafter's memory")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import RunModule


@pytest.mark.e2e  # loads the tiny draft in two processes (tests/conftest.py tiers)
def test_the_forward_memory_benchmark_runs_each_mode_in_its_own_process(tmp_path: Path, run_module: RunModule) -> None:
    out = tmp_path / "forward-memory.json"
    stdout = run_module(
        "benchmarks.forward_memory",
        *("--models", "tiny", "--sessions", "4", "--tokens", "120", "--out", str(out)),
    )
    results = json.loads(out.read_text())["results"]
    assert [r["mode"] for r in results] == ["uncapped", "default"]
    assert all(r["steps"] > 0 and r["resident_mib"] > 0 for r in results)
    assert "| uncapped |" in stdout and "| default |" in stdout
