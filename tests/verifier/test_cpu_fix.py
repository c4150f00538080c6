"""vLLM issue #55005: the CPU rejection sampler's expand_batch_to_tokens is wrong; ours is right.

The served-path check is tests/e2e/test_sampling_lossless.py (p ~ 1e-195 without the fix).
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from verifier.cpu_fix import expand_batch_to_tokens  # noqa: E402

X = torch.tensor([0.7, -1.0, 1.3])  # e.g. temperatures; -1 marks a greedy request
CU = torch.tensor([2, 5, 6], dtype=torch.int32)
WANT = torch.tensor([0.7, 0.7, 1.0, 1.0, 1.0, 1.3])


def test_fix_expands_and_replaces() -> None:
    got = expand_batch_to_tokens(X, CU, 6, replace_from=-1, replace_to=1)
    assert torch.equal(got, WANT)
    ints = expand_batch_to_tokens(torch.tensor([5, 0, 7]), CU, 6)
    assert ints.tolist() == [5, 5, 0, 0, 0, 7]


def test_upstream_cpu_version_is_wrong() -> None:
    """Documents the bug the fix works around; when this fails, upstream is fixed."""
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    if not current_platform.is_cpu():
        pytest.skip("the bug is CPU-only")
    import verifier.cpu_fix

    original = rejection_sampler.expand_batch_to_tokens
    if original is verifier.cpu_fix.expand_batch_to_tokens:
        pytest.skip("already patched in this process")
    current_platform.register_triton_kernel_overrides()  # what the CPU worker does at start
    got = original(X.clone(), CU, 6, replace_from=-1, replace_to=1)
    assert not torch.equal(got, WANT)


def test_apply_installs_it() -> None:
    from vllm.v1.sample import rejection_sampler

    from verifier import cpu_fix

    if cpu_fix.apply():
        assert rejection_sampler.expand_batch_to_tokens is cpu_fix.expand_batch_to_tokens
