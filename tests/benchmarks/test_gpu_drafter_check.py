"""The prepared GPU drafter check runs here against itself (--device cpu): the CPU drafter's
drafts are reproduced token for token, and a host without a GPU is told so."""

from __future__ import annotations

import pytest
import torch

from benchmarks import gpu_drafter_check


def test_the_check_runs_on_the_cpu_against_itself(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_drafter_check.main(["--device", "cpu", "--dtypes", "float32", "--sessions", "2", "--tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert "cpu float32 serial (reference)" in out
    lines = out.splitlines()
    for worker in ("serial", "batched"):  # both ways the drafter's worker steps its sessions
        at = next(i for i, line in enumerate(lines) if line.split("  ")[0] == f"cpu float32 {worker}")
        assert "ms/token" in lines[at] and "rollbacks" in lines[at]
        assert "draft tokens equal to the CPU drafter's: yes" in lines[at + 1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU host runs the check itself")
def test_without_a_gpu_the_cuda_check_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_drafter_check.main([]) == 2
    assert "torch sees no CUDA GPU" in capsys.readouterr().err


def test_drafts_that_differ_fail_the_check(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """A placement drafting other tokens (here: another draft model stands in for it) fails."""
    from specdec.models import load_causal_lm

    loads = []

    def load(ref: str, *args, **kwargs):
        loads.append(ref)
        return load_causal_lm("tiny/draft-far" if len(loads) > 1 else ref, *args, **kwargs)

    monkeypatch.setattr(gpu_drafter_check, "load_causal_lm", load)
    assert gpu_drafter_check.main(["--device", "cpu", "--dtypes", "float32", "--sessions", "1", "--tokens", "8"]) == 1
    assert "draft tokens equal to the CPU drafter's: NO" in capsys.readouterr().out
