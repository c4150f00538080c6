"""`specdec bench-turns`: the report's table, and an end-to-end run on the tiny pair (vLLM's
server, then specdec with and without the drafter's prefix cache)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import turns


def _r(ttft: float, latency: float, text: str, speculation: dict | None = None, exact: bool = True) -> dict:
    return {
        "text": text,
        "ttft_ms": ttft,
        "latency_ms": latency,
        "tokens": 4,
        "decode_tok_s": 10.0,
        "speculation": speculation or {},
        "exact": exact,
    }


def test_the_table_gives_each_system_its_ratios_against_target_only_of_the_same_turn() -> None:
    report = {
        "turns": [
            {
                "turn": 2,
                "prompt_tokens": 300,
                "systems": {
                    "target-only": _r(200.0, 1000.0, "a"),
                    "specdec": _r(100.0, 500.0, "a", {"drafter_reused_tokens": 250, "speculative_steps": 3}),
                    "specdec-no-reuse": _r(300.0, 1500.0, "b", {"drafter_reused_tokens": 0}, exact=False),
                },
            }
        ]
    }
    lines = turns.table(report).splitlines()
    assert len(lines) == 5
    assert lines[2].startswith("| 2 | 300 | target-only | 200 | 10.00 | 1000 | 1.00x | 1.00x | - | - | - | yes |")
    assert lines[3] == "| 2 | 300 | specdec | 100 | 10.00 | 500 | 0.50x | 0.50x | 250 | 3 | - | yes |"
    assert lines[4] == "| 2 | 300 | specdec-no-reuse | 300 | 10.00 | 1500 | 1.50x | 1.50x | 0 | - | - | no |"


@pytest.mark.e2e  # three servers on the tiny pair, one after the other (~1 min)
def test_bench_turns_end_to_end_on_the_tiny_pair(tmp_path: Path) -> None:
    """Every turn on every system, exact at float32 (the same dtype on both servers); turn 1 is
    cold for the drafter, each later turn reuses at least the previous turn's prompt with the
    drafter's prefix cache and nothing without it."""
    out = tmp_path / "out"
    cmd = ["bench-turns", "--models", "tiny", "--dtype", "float32", "--turns", "3", "--prompt-tokens", "200"]
    proc = subprocess.run(
        [sys.executable, "-m", "specdec_cli", *cmd, "--added-tokens", "20", "--max-tokens", "16", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "turns.json").read_text())
    assert (out / "turns.md").read_text().strip() == proc.stdout.strip()
    assert [t["turn"] for t in report["turns"]] == [1, 2, 3]
    previous = 0
    for t in report["turns"]:
        systems = t["systems"]
        assert list(systems) == list(turns.SYSTEMS)
        assert all(r["exact"] and r["tokens"] == 16 for r in systems.values()), t
        reused = systems["specdec"]["speculation"]["drafter_reused_tokens"]
        # at least the previous prompt (its last tokens may merge with what follows, or wait for a draft step)
        assert (reused == 0) if t["turn"] == 1 else (reused >= previous - 2), (t["turn"], reused, previous)
        assert systems["specdec-no-reuse"]["speculation"].get("drafter_reused_tokens", 0) == 0
        previous = t["prompt_tokens"]
