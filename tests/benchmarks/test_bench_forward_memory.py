"""`python -m benchmarks.forward_memory`: the worker's steps over long sessions, with and without
a cap on the context tokens one forward reads, on the tiny draft (4 sessions of 120 tokens, a cap
of 200: two sessions a forward). Both runs report; no memory or timing figure is asserted: those
are the benchmark's to report (docs/performance.md, "A forward's workspace")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import RunModule


@pytest.mark.e2e  # loads the tiny draft in two processes (tests/conftest.py tiers)
def test_the_forward_memory_benchmark_runs_each_cap_in_its_own_process(tmp_path: Path, run_module: RunModule) -> None:
    out = tmp_path / "forward-memory.json"
    stdout = run_module(
        "benchmarks.forward_memory",
        *("--models", "tiny", "--sessions", "4", "--tokens", "120", "--caps", "0,200", "--out", str(out)),
    )
    results = json.loads(out.read_text())["results"]
    assert [r["cap"] for r in results] == [0, 200]
    assert all(r["steps"] > 0 and r["resident_mib"] > 0 for r in results)
    assert "| none |" in stdout and "| 200 |" in stdout
