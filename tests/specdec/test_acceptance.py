"""The reference acceptance rule is exact: its output distribution is p, for any q."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdec.acceptance import expected_tokens, sparse_q, target_distribution, verify_block, verify_block_greedy


def _sample_first_token(p: torch.Tensor, q: torch.Tensor, n: int, seed: int) -> np.ndarray:
    """Run draft-then-verify n times for a one-token block; count the first output token."""
    g = torch.Generator().manual_seed(seed)
    counts = np.zeros(p.shape[-1])
    target = torch.stack([p, p])  # [gamma + 1 = 2, vocab]
    for _ in range(n):
        x = torch.multinomial(q, 1, generator=g)
        accepted, nxt = verify_block(x, q[None], target, g)
        counts[int(x) if accepted else nxt] += 1
    return counts


def test_sampling_rule_is_exact_for_any_q() -> None:
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    for q in (torch.tensor([0.05, 0.05, 0.1, 0.3, 0.5]), p.clone(), torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0])):
        counts = _sample_first_token(p, q, 6000, seed=1)
        assert chisquare(counts, 6000 * p.numpy()).pvalue > 1e-3


def test_identical_q_accepts_everything() -> None:
    p = torch.tensor([0.25, 0.25, 0.5])
    g = torch.Generator().manual_seed(0)
    target = torch.stack([p, p, p])
    for _ in range(100):
        x = torch.multinomial(p, 2, replacement=True, generator=g)
        accepted, _ = verify_block(x, torch.stack([p, p]), target, g)
        assert accepted == 2


def test_greedy_rule() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])  # argmax 1, 0, 2
    assert verify_block_greedy(torch.tensor([1, 0]), logits) == (2, 2)  # all accepted + bonus
    assert verify_block_greedy(torch.tensor([1, 2]), logits) == (1, 0)  # rejected at 1, corrected to 0
    assert verify_block_greedy(torch.tensor([0, 0]), logits) == (0, 1)


def test_target_distribution_top_k_top_p() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.allclose(target_distribution(logits, 1.0), torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=1e-6)
    assert torch.allclose(target_distribution(logits, 1.0, top_k=2), torch.tensor([0.625, 0.375, 0, 0]), atol=1e-6)
    # nucleus 0.7: 0.5 alone is short of it, 0.5 + 0.3 reaches it
    assert torch.allclose(target_distribution(logits, 1.0, top_p=0.7), torch.tensor([0.625, 0.375, 0, 0]), atol=1e-6)
    ids, q = sparse_q(torch.tensor([0.1, 0.6, 0.3]), 2)
    assert ids.tolist() == [1, 2] and torch.allclose(q, torch.tensor([2 / 3, 1 / 3]))


def test_expected_tokens() -> None:
    """E(alpha, gamma) = (1 - alpha^(gamma+1)) / (1 - alpha), gamma + 1 at alpha 1."""
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
