from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.validation import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_REQUEST_ID_CHARS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    InvalidField,
    check_gamma,
    check_request_id,
    check_sampling,
    check_sizes,
    check_token_ids,
)
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


def test_allowed_token_ids() -> None:
    """Ids in the vocabulary (when it is known), at most MAX_ALLOWED_TOKEN_IDS; empty: no constraint."""
    check_sampling("s", pb.SamplingParams(max_tokens=3), vocab_size=10)
    check_sampling("s", pb.SamplingParams(max_tokens=3, allowed_token_ids=[0, 9]), vocab_size=10)
    for ids in ([3, 10], [-1]):
        with pytest.raises(InvalidField, match=r"^s.allowed_token_ids: token id -?\d+ at index \d is outside"):
            check_sampling("s", pb.SamplingParams(max_tokens=3, allowed_token_ids=ids), vocab_size=10)
    many = pb.SamplingParams(max_tokens=3, allowed_token_ids=[0] * (MAX_ALLOWED_TOKEN_IDS + 1))
    for check in (lambda: check_sizes("s", many), lambda: check_sampling("s", many, vocab_size=10)):
        with pytest.raises(InvalidField) as info:
            check()
        assert info.value.field == "s.allowed_token_ids"


def test_sampling_context_limit() -> None:
    check_sampling("s", pb.SamplingParams(max_tokens=6), prompt_len=4, max_model_len=10)
    with pytest.raises(InvalidField, match="exceeds the model's context of 10 tokens"):
        check_sampling("s", pb.SamplingParams(max_tokens=7), prompt_len=4, max_model_len=10)


# ---- the bounds on what a client sends (docs/security.md), driven by hypothesis


@settings(max_examples=200, deadline=None)
@given(
    count=st.integers(0, MAX_STOP_STRINGS + 8),
    longest=st.integers(1, MAX_STOP_STRING_CHARS + 64),
    ids=st.integers(0, MAX_STOP_TOKEN_IDS + 64),
)
def test_stop_bounds(count: int, longest: int, ids: int) -> None:
    """Accepted exactly when within every bound; refused naming the field that is over its bound."""
    stops = ["x" * longest] + ["s"] * (count - 1) if count else []
    sp = pb.SamplingParams(max_tokens=4, stop=stops, stop_token_ids=[0] * ids)
    over = []
    if count > MAX_STOP_STRINGS:
        over.append("s.stop")
    elif count and longest > MAX_STOP_STRING_CHARS:
        over.append("s.stop[0]")
    if ids > MAX_STOP_TOKEN_IDS:
        over.append("s.stop_token_ids")
    for check in (lambda: check_sizes("s", sp), lambda: check_sampling("s", sp, vocab_size=10)):
        if not over:
            check()
            continue
        with pytest.raises(InvalidField) as info:
            check()
        assert info.value.field == over[0]  # the first one over its bound, by name


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=MAX_REQUEST_ID_CHARS + 40), st.from_regex(r"[A-Za-z0-9._:-]{1,160}", fullmatch=True)))
def test_request_id_bounds(request_id: str) -> None:
    """1 to 128 characters of [A-Za-z0-9._:-]: anything else (newlines, spaces, control or
    non-ASCII characters, too long) is refused naming the field."""
    ok = 1 <= len(request_id) <= MAX_REQUEST_ID_CHARS and re.fullmatch(r"[A-Za-z0-9._:-]+", request_id)
    if ok:
        check_request_id("spec.request_id", request_id)
        return
    with pytest.raises(InvalidField) as info:
        check_request_id("spec.request_id", request_id)
    assert info.value.field == "spec.request_id"
