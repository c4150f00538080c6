"""`specdec bench-link`: the delays, the table and the goals on known rows, and the --quick smoke run
across real network namespaces (skipped, with the reason, where they cannot be made)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import link


def _row(variant: str, fraction: float, delay_ms: float, speedup: float, **extra: object) -> dict:
    return {
        "system": "specdec",
        "variant": variant,
        "rtt_fraction": fraction,
        "delay_ms": delay_ms,
        "rtt_ms": 2 * delay_ms,
        "speedup": speedup,
        "decode_tok_s": 10 * speedup,
        "exact": 1.0,
        "branch_hit_rate": None,
        "verify_step_ms": 400.0,
        "round_ms": 500.0,
        "fallbacks": 0,
        **extra,
    }


def test_delays_from_rtt_fractions() -> None:
    assert link.parse_fractions("0.1,0.25,0.5") == [0.0, 0.1, 0.25, 0.5]  # zero delay always runs, first
    assert link.parse_fractions("0.25,0,0.25") == [0.0, 0.25]
    with pytest.raises(ValueError):
        link.parse_fractions("-0.1")
    # RTT = 2d = fraction x verify step: 10% of a 400 ms step is a 40 ms RTT, 20 ms each way
    assert link.one_way_delay_ms(0.1, 400.0) == pytest.approx(20.0)
    assert link.one_way_delay_ms(0.25, 20.0) == pytest.approx(2.5)
    assert link.one_way_delay_ms(0.0, 400.0) == 0.0


def test_variants_are_names_and_drafter_flags() -> None:
    assert link.parse_variants("branches,no-branches") == {"branches": [], "no-branches": ["--branches", "0"]}
    assert link.parse_variants("lockstep=--lookahead 0") == {"lockstep": ["--lookahead", "0"]}
    with pytest.raises(ValueError):
        link.parse_variants("nonesuch")


def test_fraction_of_zero_delay_speedup_table_and_goals() -> None:
    base = {
        "system": "target-only",
        "variant": None,
        "rtt_ms": None,
        "speedup": None,
        "decode_tok_s": 10.0,
        "exact": None,
        "verify_step_ms": None,
        "round_ms": None,
        "fallbacks": None,
        "branch_hit_rate": None,
    }
    rows = [
        base,
        _row("branches", 0.0, 0.0, 2.0, branch_hit_rate=0.5),
        _row("branches", 0.1, 20.0, 1.9),
        _row("branches", 0.25, 50.0, 1.4),
        _row("no-branches", 0.0, 0.0, 1.6),
        _row("no-branches", 0.25, 50.0, 1.3),
    ]
    link.relate_link(rows, verify_ref_ms=400.0)
    assert [r.get("rtt_pct") for r in rows[1:]] == pytest.approx([0, 10, 25, 0, 25])
    assert [r.get("of_zero") for r in rows[1:]] == pytest.approx([1.0, 0.95, 0.7, 1.0, 1.3 / 1.6])
    goals = {(g["variant"], g["rtt_fraction"]): g for g in link.link_goals(rows, ["branches", "no-branches"])}
    assert goals["branches", 0.1]["met"] is True and goals["branches", 0.1]["target"] == 0.9
    assert goals["branches", 0.25]["met"] is False  # 0.70 < 0.75
    assert goals["no-branches", 0.25]["met"] is True  # 0.8125
    assert goals["no-branches", 0.1]["value"] is None and goals["no-branches", 0.1]["met"] is None  # not run
    text = link.table(rows, {"other": "drafter exited with 2: unrecognized arguments: --branches 0"})
    lines = text.splitlines()
    assert lines[0].startswith("| RTT ms | RTT / verify | variant |")
    assert "| – | – | target-only (vLLM) | 10.00 |" in lines[2]
    assert "| 40.0 | 10% | branches | 19.00 | 1.90x | 95% | 100% | – |" in text
    assert "| 0.0 | 0% | branches | 20.00 | 2.00x | 100% | 100% | 50% |" in text
    assert "variant other failed: drafter exited with 2" in text
    said = "\n".join(link.goal_lines(link.link_goals(rows, ["branches"])))
    assert "goal RTT 10% of the verify step, branches: 0.95 of the zero-delay speedup (>= 0.90) met" in said
    assert "goal RTT 25% of the verify step, branches: 0.70 of the zero-delay speedup (>= 0.75) NOT met" in said


def test_plot_writes_a_png(tmp_path: Path) -> None:
    rows = [_row("branches", 0.0, 0.0, 2.0), _row("branches", 0.25, 50.0, 1.6)]
    link.relate_link(rows, 400.0)
    link.plot(rows, tmp_path / "link.png")
    assert (tmp_path / "link.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, int]:
    """The --quick run: its output folder, stdout and process id (its namespaces are named by it)."""
    reason = link.unavailable_reason()
    if reason is not None:
        pytest.skip(f"no network namespaces: {reason}")
    out = tmp_path_factory.mktemp("bench-link")
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdec_cli", "bench-link", "--quick", "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.terminate()  # the bench stops its services and deletes its namespaces on SIGTERM
            proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    assert "| RTT ms |" in stdout
    return out, stdout, proc.pid


def test_quick_run_across_namespaces(quick: tuple[Path, str, int]) -> None:
    out, stdout, _ = quick
    report = json.loads((out / "link.json").read_text())
    assert report["meta"]["rtt_fractions"] == [0.0, 0.25] and report["meta"]["verify_step_ms"] > 0
    rows = report["rows"]
    assert rows[0]["system"] == "target-only"
    ran = {r["variant"] for r in rows if r.get("variant")}
    assert "branches" in ran and not set(report["failed"]) & {"branches"}  # the drafter's defaults always run
    for variant in ran:  # each variant that ran: both RTTs, the target's exact tokens, every request
        mine = [r for r in rows if r.get("variant") == variant]
        assert sorted(r["rtt_fraction"] for r in mine) == [0.0, 0.25], variant
        delayed = next(r for r in mine if r["rtt_fraction"] == 0.25)
        assert delayed["rtt_ms"] == pytest.approx(0.25 * report["meta"]["verify_step_ms"])
        for r in mine:
            assert r["exact"] == 1.0 and r["tokens"] == r["requests"] * report["meta"]["max_tokens"], r
            assert r["speedup"] and r["of_zero"] and r["fallbacks"] == 0, r
    for variant, reason in report["failed"].items():
        # only a drafter that does not start (no `--branches` flag yet, say) may fail, and is said so
        assert variant not in ran and reason, (variant, reason)
        assert f"variant {variant} failed" in stdout
    assert {(g["variant"], g["rtt_fraction"]) for g in report["goals"]} == {
        (v, f) for v in link.VARIANTS for f in link.GOALS
    }
    assert (out / "link.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_quick_run_leaves_no_namespaces(quick: tuple[Path, str, int]) -> None:
    _, _, pid = quick
    left = {ns for ns in _namespaces() if ns.startswith(link.NAMESPACE_PREFIX) and ns.endswith(f"-{pid}")}
    assert not left, left


def test_no_namespaces_is_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from specdec_cli import main as cli

    monkeypatch.setattr(link, "unavailable_reason", lambda: "creating network namespaces needs root")
    args = cli.build_parser(["bench-link"]).parse_args(["bench-link", "--quick"])
    with pytest.raises(Exception) as err:
        args.func(args)
    message, status = cli.explain(err.value)
    assert status == 2 and "needs root" in message and "\n" not in message
