"""The engine's translation of vLLM's outputs (verifier/engine.py), without vLLM."""

from __future__ import annotations

from dataclasses import dataclass

from verifier.engine import _logprobs


@dataclass
class Logprob:  # vllm.logprobs.Logprob's fields
    logprob: float
    rank: int | None
    decoded_token: str | None = None


def test_logprobs_keep_vllms_top_k_by_rank() -> None:
    k = 2
    positions = [
        {5: Logprob(-0.1, 1), 6: Logprob(-2.0, 2)},  # sampled = the best: k entries
        {9: Logprob(-3.0, 4), 5: Logprob(-0.2, 1), 6: Logprob(-1.0, 2)},  # sampled outside the top k
    ]
    out = _logprobs(positions, [5, 9], k)
    assert [(o.token_id, o.logprob, o.rank) for o in out] == [(5, -0.1, 1), (9, -3.0, 4)]
    assert out[0].top_token_ids == [5, 6] and out[0].top_logprobs == [-0.1, -2.0]
    assert out[1].top_token_ids == [5, 6] and out[1].top_logprobs == [-0.2, -1.0]


def test_logprobs_follow_the_tokens_kept() -> None:
    """A verdict cut at max_tokens keeps the logprobs of the tokens it keeps."""
    positions = [{1: Logprob(-0.5, 1)}, {2: Logprob(-0.7, 1)}]
    assert [o.token_id for o in _logprobs(positions, [1], 0)] == [1]
    assert _logprobs(positions, [1, 2], 0)[1].top_token_ids == []
