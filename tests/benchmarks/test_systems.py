"""benchmarks.systems: which baselines share a child process."""

from __future__ import annotations

from benchmarks.systems import child_groups


def _vllm(method: str | None = None) -> dict:
    return {"kind": "vllm", "speculative_config": {"method": method} if method else None}


def test_every_baseline_shares_one_child_with_an_ngram_job_last() -> None:
    jobs = [_vllm(), _vllm("ngram"), _vllm("draft_model"), {"kind": "hf-assisted"}, _vllm()]
    assert child_groups(jobs) == [[0, 2, 3, 4, 1]]


def test_a_second_ngram_job_starts_another_child() -> None:
    # vLLM 0.32 starts no engine in a process after an n-gram engine ran there
    jobs = [_vllm("ngram"), _vllm(), _vllm("ngram"), _vllm("draft_model")]
    assert child_groups(jobs) == [[1, 3, 0], [2]]
    assert child_groups([]) == []
