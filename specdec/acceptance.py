"""The acceptance rule of speculative decoding, and the sampling math around it.

Terms (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023):
    p          the target's next-token distribution (after temperature/top-k/top-p)
    q          the drafter's distribution the draft token was sampled from
    accepted   leading draft tokens the rule keeps
    recovered  the token sampled on the first rejection, from normalize(max(0, p - q))
    bonus      the token sampled from p after the last draft when all were accepted

The rule is exact for ANY q, provided the verifier uses the q the drafter sampled
from: the output is distributed exactly as target-only sampling. Greedy is the
temperature-0 limit: accept while the draft equals argmax p; the argmax is the
recovered or bonus token.

In the served path vLLM's rejection sampler applies this rule (with one-hot q, which
is exact too); this module is the readable reference used by the drafter (to build
q) and by the tests (as an oracle). It also owns E(alpha, gamma), the expected tokens
per target step that adaptive gamma, eval-draft and the bench's bound all use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def expected_tokens(alpha: float, gamma: int) -> float:
    """E(alpha, gamma): expected tokens of one target step that verifies gamma drafts, each
    accepted with probability alpha independently (Leviathan et al. 2023, eq. 1)."""
    # draft j counts only when drafts 1..j are all accepted: P = alpha^j; j = 0 is the target's
    # own token (the correction or the bonus), always emitted:
    #   E = sum_{j=0..gamma} alpha^j = (1 - alpha^(gamma+1)) / (1 - alpha)
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def target_distribution(
    # [..., vocab]
    logits: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:
    """Softmax of logits / temperature, restricted to top-k and the top-p nucleus.

    Returns probabilities with the same shape as `logits`. temperature must be > 0.
    """
    import torch

    scaled = logits.float() / temperature
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it stays)
        outside = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        sorted_p = sorted_p.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sparse_q(
    # [vocab]
    probs: torch.Tensor,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's q: probs restricted to its top-k support and renormalised.

    Returns (token_ids [k], q [k]). Sampling from this q (not from `probs`) is what
    lets only k numbers per token cross the network while the verifier stays exact.
    """
    import torch

    top = torch.topk(probs, min(k, probs.shape[-1]))
    q = top.values / top.values.sum()
    return top.indices, q


def verify_block(
    # [gamma]
    draft_token_ids: torch.Tensor,
    # [gamma, vocab]: q of each draft position (one-hot rows for a greedy drafter)
    draft_probs: torch.Tensor,
    # [gamma + 1, vocab]: p at each draft position plus the bonus position
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Apply the lossless rule to one block; returns (accepted, next_token).

    next_token is the recovered token on a rejection, else the bonus token.
    """
    import torch

    gamma = draft_token_ids.shape[0]
    for i in range(gamma):
        x = int(draft_token_ids[i])
        p_x, q_x = float(target_probs[i, x]), float(draft_probs[i, x])
        u = float(torch.rand((), generator=generator))
        # accept x with probability min(1, p(x) / q(x))
        if q_x > 0 and u * q_x <= p_x:
            continue
        # first rejection: sample from normalize(max(0, p - q))
        residual = torch.clamp(target_probs[i] - draft_probs[i], min=0.0)
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    # all gamma accepted: the bonus token comes from p at position gamma
    return gamma, int(torch.multinomial(target_probs[gamma], 1, generator=generator))


def verify_block_greedy(
    # [gamma]
    draft_token_ids: torch.Tensor,
    # [gamma + 1, vocab]
    target_logits: torch.Tensor,
) -> tuple[int, int]:
    """Greedy rule: accept while the draft equals the target's argmax; returns (accepted, next_token)."""
    argmax = target_logits.argmax(-1)  # [gamma + 1]
    mismatch = (draft_token_ids != argmax[:-1]).nonzero()
    accepted = int(mismatch[0]) if mismatch.numel() else draft_token_ids.shape[0]
    return accepted, int(argmax[accepted])
