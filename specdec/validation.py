"""Request validation shared by the three services.

Every check raises `InvalidField(field, message)`; servers turn it into gRPC
INVALID_ARGUMENT with the message "<field>: <message>", so a client always learns
which field was wrong, and the service keeps serving.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specdec.config import MAX_GAMMA_LIMIT, MAX_LOGPROBS


class InvalidField(ValueError):
    """A request field failed validation."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def check_token_ids(field: str, ids: Sequence[int], vocab_size: int, allow_empty: bool = False) -> None:
    """Token ids must be non-empty (unless allowed) and lie in [0, vocab_size)."""
    if not ids and not allow_empty:
        raise InvalidField(field, "must not be empty")
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise InvalidField(field, f"token id {t} at index {i} is outside the vocabulary [0, {vocab_size})")


def check_gamma(field: str, gamma: int, max_gamma: int) -> None:
    if not 0 <= gamma <= min(max_gamma, MAX_GAMMA_LIMIT):
        raise InvalidField(field, f"{gamma} is out of range [0, {min(max_gamma, MAX_GAMMA_LIMIT)}]")


def check_sampling(
    field: str,
    sampling: Any,
    prompt_len: int | None = None,
    max_model_len: int | None = None,
    vocab_size: int | None = None,
) -> None:
    """Check a specdec.v1.SamplingParams; `max_tokens` must be set by the caller's defaults first.
    `vocab_size` bounds stop_token_ids when given."""
    if sampling.temperature < 0 or sampling.temperature != sampling.temperature:
        raise InvalidField(f"{field}.temperature", f"{sampling.temperature} must be >= 0")
    if sampling.HasField("top_p") and not 0.0 < sampling.top_p <= 1.0:
        raise InvalidField(f"{field}.top_p", f"{sampling.top_p} must be in (0, 1]")
    if sampling.top_k < -1:
        raise InvalidField(f"{field}.top_k", f"{sampling.top_k} must be -1, 0 (off) or positive")
    if not sampling.HasField("max_tokens"):
        raise InvalidField(f"{field}.max_tokens", "must be set")
    if sampling.max_tokens <= 0:
        raise InvalidField(f"{field}.max_tokens", f"{sampling.max_tokens} must be > 0")
    if prompt_len is not None and max_model_len is not None and prompt_len + sampling.max_tokens > max_model_len:
        raise InvalidField(
            f"{field}.max_tokens",
            f"prompt ({prompt_len} tokens) + max_tokens ({sampling.max_tokens}) exceeds the model's "
            f"context of {max_model_len} tokens",
        )
    for i, s in enumerate(sampling.stop):
        if not s:
            raise InvalidField(f"{field}.stop[{i}]", "must not be empty")
    for name in ("presence_penalty", "frequency_penalty"):  # vLLM's and OpenAI's range
        value = getattr(sampling, name)
        if not -2.0 <= value <= 2.0:
            raise InvalidField(f"{field}.{name}", f"{value} must be in [-2, 2]")
    if sampling.HasField("repetition_penalty") and not 0.0 < sampling.repetition_penalty <= 1e4:
        raise InvalidField(f"{field}.repetition_penalty", f"{sampling.repetition_penalty} must be > 0")
    if sampling.min_tokens > sampling.max_tokens:
        raise InvalidField(f"{field}.min_tokens",
                           f"{sampling.min_tokens} must be <= max_tokens ({sampling.max_tokens})")
    if vocab_size is not None:
        check_token_ids(f"{field}.stop_token_ids", sampling.stop_token_ids, vocab_size, allow_empty=True)
    if sampling.HasField("logprobs") and sampling.logprobs > MAX_LOGPROBS:
        raise InvalidField(f"{field}.logprobs", f"{sampling.logprobs} is more than the {MAX_LOGPROBS} allowed")
