"""`python -m benchmarks.forward_cost`: one run times a draft step whole, with the layers'
projections free, and with the output layer free too, alternating, and prints the split. No
timing is asserted: the numbers are the benchmark's to report, not this test's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import RunModule


@pytest.mark.e2e  # loads the tiny draft model (tests/conftest.py tiers)
def test_forward_cost_times_every_mode_alternating(tmp_path: Path, run_module: RunModule) -> None:
    out = tmp_path / "forward-cost.json"
    args = ("--models", "tiny", "--prompt", "16", "--rounds", "2", "--steps", "3", "--out", str(out))
    stdout = run_module("benchmarks.forward_cost", *args)
    table = [line for line in stdout.splitlines() if line.startswith("|")]
    assert table[0] == "| the step | layers' weights | output layer | the rest |"
    step, _, _, rest = (float(x) for x in table[2].strip("|").split("|"))
    assert step > 0 and rest > 0
    measured = json.loads(out.read_text())
    # every mode timed 2 rounds x 3 steps, each of which drafted a token (the module checks that)
    assert {mode: len(ms) for mode, ms in measured["steps_ms"].items()} == {
        "whole": 6,
        "free layers": 6,
        "free layers and head": 6,
    }
    assert all(ms > 0 for times in measured["steps_ms"].values() for ms in times)
