from __future__ import annotations

import pytest

from specdec.validation import InvalidField, check_gamma, check_sampling, check_token_ids
from specdec.wire import pb


def test_token_ids() -> None:
    check_token_ids("ids", [0, 9], 10)
    with pytest.raises(InvalidField, match=r"^ids: must not be empty"):
        check_token_ids("ids", [], 10)
    with pytest.raises(InvalidField, match=r"^ids: token id 10 at index 1"):
        check_token_ids("ids", [0, 10], 10)


def test_gamma() -> None:
    check_gamma("g", 0, 8)
    with pytest.raises(InvalidField, match=r"^g: 9 is out of range \[0, 8\]"):
        check_gamma("g", 9, 8)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temperature": -1.0, "max_tokens": 3}, "s.temperature"),
        ({"top_p": 0.0, "max_tokens": 3}, "s.top_p"),
        ({"top_k": -2, "max_tokens": 3}, "s.top_k"),
        ({}, "s.max_tokens"),
        ({"max_tokens": 0}, "s.max_tokens"),
        ({"max_tokens": 3, "stop": [""]}, "s.stop[0]"),
    ],
)
def test_sampling(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidField) as info:
        check_sampling("s", pb.SamplingParams(**kwargs))
    assert info.value.field == field


def test_sampling_context_limit() -> None:
    check_sampling("s", pb.SamplingParams(max_tokens=6), prompt_len=4, max_model_len=10)
    with pytest.raises(InvalidField, match="exceeds the model's context of 10 tokens"):
        check_sampling("s", pb.SamplingParams(max_tokens=7), prompt_len=4, max_model_len=10)
