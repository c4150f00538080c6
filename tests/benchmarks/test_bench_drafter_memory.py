"""`python -m benchmarks.drafter_memory`: a queue of prompts at a drafter inside a memory cgroup
(root only), on the tiny pair with a 1 MiB keys/values budget, where one prompt fits at a time:
the first is prefilled, the next waits for memory (none of them ends: they never commit), no
stream fails and the drafter stays up. No timing or memory figure is asserted: those are the
benchmark's to report (docs/performance.md, "The drafter's memory")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import RunModule

from benchmarks.drafter_memory import memory_cgroup


def _cgroup_unavailable() -> bool:
    with memory_cgroup(1 << 30) as procs:
        return procs is None


@pytest.mark.e2e  # starts a drafter of the tiny pair (tests/conftest.py tiers)
@pytest.mark.skipif(_cgroup_unavailable(), reason="needs root and a memory cgroup it can make")
def test_a_queue_over_the_budget_waits_and_the_drafter_keeps_serving(tmp_path: Path, run_module: RunModule) -> None:
    out = tmp_path / "memory.json"
    stdout = run_module(
        "benchmarks.drafter_memory",
        *("--models", "tiny", "--limit-mib", "3072", "--prompts", "4", "--tokens", "400", "--modes", "auto"),
        *("--drafter-args", "--kv-cache-mib 1", "--threads", "1", "--interval", "1", "--idle", "5"),
        *("--logs", str(tmp_path / "logs"), "--out", str(out)),
    )
    assert "| auto | 1 | 1 | 1 | 0 | 0 |" in stdout  # budget 1 MiB, one prompt ready (done), none ended or failed
    (result,) = json.loads(out.read_text())["results"]
    assert result["alive"] and result["ready"] == 1 and result["failed"] == 0
    assert result["waits"] >= 1  # the second prompt waited for the first
    assert result["peak_kv_mib"] <= 1


@pytest.mark.e2e
@pytest.mark.skipif(_cgroup_unavailable(), reason="needs root and a memory cgroup it can make")
def test_long_generations_grow_within_the_budget(tmp_path: Path, run_module: RunModule) -> None:
    """`--generate`: two streams commit 600 tokens each, at a 2 MiB budget (1,024 tokens of the
    tiny draft) where one reserve (100 + 512 + window + 1) fits and two do not: every stream
    commits all its tokens, none fails for anything but memory, and the drafter holds no more
    than its budget and stays up."""
    out = tmp_path / "generate.json"
    run_module(
        "benchmarks.drafter_memory",
        *("--models", "tiny", "--limit-mib", "3072", "--prompts", "2", "--tokens", "100", "--modes", "auto"),
        *("--generate", "600", "--max-tokens", "700", "--rate", "1000", "--commit-tokens", "50"),
        *("--drafter-args", "--kv-cache-mib 2", "--threads", "1", "--interval", "1", "--idle", "5"),
        *("--logs", str(tmp_path / "logs"), "--out", str(out)),
    )
    (result,) = json.loads(out.read_text())["results"]
    assert result["alive"] and result["failed"] == 0 and result["finished"] + result["ended_for_memory"] >= 2
    assert result["generated"] >= 600 and result["peak_kv_mib"] <= 2


@pytest.mark.e2e
@pytest.mark.skipif(_cgroup_unavailable(), reason="needs root and a memory cgroup it can make")
def test_a_growth_beside_another_session_preempts_the_newest_and_nothing_ends(
    tmp_path: Path, run_module: RunModule
) -> None:
    """At a 3 MiB budget (1,536 tokens of the tiny draft) two reserves of 200 + 512 + window + 1
    fit, and one of them grown (to 200 + 900 + window + 1) beside the other does not: the
    newest session is preempted (the streams accept it, as the gateway's do), and no stream is
    ended or fails. The older one never ends (the streams stay open), so the preempted one stays
    paused: done once it committed its tokens."""
    out = tmp_path / "preempt.json"
    stdout = run_module(
        "benchmarks.drafter_memory",
        *("--models", "tiny", "--limit-mib", "3072", "--prompts", "2", "--tokens", "200", "--modes", "auto"),
        *("--generate", "800", "--max-tokens", "900", "--rate", "1000", "--commit-tokens", "50"),
        *("--drafter-args", "--kv-cache-mib 3", "--threads", "1", "--interval", "1", "--idle", "5"),
        *("--logs", str(tmp_path / "logs"), "--out", str(out)),
    )
    (result,) = json.loads(out.read_text())["results"]
    assert result["alive"] and result["failed"] == 0 and result["ended_for_memory"] == 0
    assert result["ready"] == 2 and result["finished"] == 2 and result["preemptions"] == 1
    assert "| 1 (1, 1, 0, 0) | – |" in stdout  # preempted once, never back: no pause ended
    assert result["peak_kv_mib"] <= 3


@pytest.mark.e2e
@pytest.mark.skipif(_cgroup_unavailable(), reason="needs root and a memory cgroup it can make")
def test_a_preempted_session_comes_back_once_an_older_request_ends(tmp_path: Path, run_module: RunModule) -> None:
    """`--close --generate-min`: at a 4 MiB budget (2,048 tokens of the tiny draft) two streams
    of 200 prompt tokens commit 1,000 and 1,600 tokens (the stream lengths' fixed order gives
    the older one 1,000) and close. Both grow past their first reserve at ~512 tokens, where
    two grown reserves do not fit: the newer one is preempted. When the older one closes, the
    newer one comes back (prefilled again), drafts again, and closes at its end. Nothing ends for
    memory and nothing fails. Its one dependence on pace: the newer stream's last 600 tokens
    (6 s at 100 tokens a second) outlast its prefill of ~1,200 tokens of the tiny draft."""
    out = tmp_path / "comeback.json"
    stdout = run_module(
        "benchmarks.drafter_memory",
        *("--models", "tiny", "--limit-mib", "3072", "--prompts", "2", "--tokens", "200", "--modes", "auto"),
        *("--generate", "1600", "--generate-min", "1000", "--close", "--max-tokens", "1700"),
        *("--rate", "100", "--commit-tokens", "50"),
        *("--drafter-args", "--kv-cache-mib 4", "--threads", "1", "--interval", "1", "--idle", "30"),
        *("--logs", str(tmp_path / "logs"), "--out", str(out)),
    )
    (result,) = json.loads(out.read_text())["results"]
    assert result["alive"] and result["failed"] == 0 and result["ended_for_memory"] == 0
    assert result["closed"] == 2 and result["generated"] == 2600
    assert result["preemptions"] == 1 and result["back_after_preemption"] == 1
    assert result["drafted_after_coming_back"] == 1
    assert len(result["pauses_s"]) == 1 and result["paused_to_end_s"] == []
    assert 0 <= result["pauses_waiting_for_memory_s"][0] <= result["pauses_s"][0]
    assert "| 1 (1, 1, 1, 1) |" in stdout
    assert result["peak_kv_mib"] <= 4
