"""Workaround for vLLM issue #55005 (CPU only): speculative SAMPLING is wrong.

On CPU, vLLM 0.32's `rejection_sampler.expand_batch_to_tokens` runs its Triton
kernel through a C++ stand-in that fills a temporary int64 copy instead of the
caller's buffer (and would truncate float temperatures even if copied back). The
rejection sampler then divides logits by uninitialised memory: with temperature > 0
and any speculative method, tokens follow the wrong distribution. Greedy and GPU are
unaffected. The fix replaces the function with the pure-torch equivalent below.
"""

from __future__ import annotations

import torch


def expand_batch_to_tokens(
    # [batch_size]
    x: torch.Tensor,
    # [batch_size]: cumulative draft tokens per request (inclusive)
    cu_num_tokens: torch.Tensor,
    num_tokens: int,
    replace_from: int = 0,
    replace_to: int = 0,
) -> torch.Tensor:
    """Repeat x[i] for each of request i's tokens, replacing replace_from by replace_to.

    x = [a, b, c], cu_num_tokens = [2, 5, 6] -> [a, a, b, b, b, c]. Returns [num_tokens].
    """
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    expanded = torch.repeat_interleave(x, counts, output_size=num_tokens)
    if replace_from != replace_to:
        expanded = torch.where(expanded == replace_from, torch.full_like(expanded, replace_to), expanded)
    return expanded


def apply() -> bool:
    """Install the fix when vLLM runs on CPU; returns True when installed."""
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    if not current_platform.is_cpu():
        return False
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
    return True
