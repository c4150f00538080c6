"""verifier/convert.py: the one place a wire SamplingParams becomes vLLM's (it imports vLLM's
SamplingParams, not its engine)."""

from __future__ import annotations

import pytest

from specdec.validation import InvalidField
from specdec.wire import pb
from verifier.convert import engine_params, generation_request

pytestmark = pytest.mark.e2e  # imports vLLM (its SamplingParams): not the unit tier (tests/conftest.py)


def test_unset_optional_fields_take_vllms_defaults() -> None:
    p = engine_params(pb.SamplingParams(max_tokens=5))
    assert (p.temperature, p.top_p, p.seed, p.max_tokens) == (0.0, 1.0, None, 5)
    assert p.top_k in (0, -1)  # off (vLLM 0.32 writes -1 as 0)
    assert (p.repetition_penalty, p.logprobs, p.stop_token_ids, p.allowed_token_ids) == (1.0, None, [], None)
    assert not p.detokenize  # the gateway owns the text


def test_every_field_reaches_vllm() -> None:
    sp = pb.SamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        seed=3,
        max_tokens=9,
        ignore_eos=True,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        min_tokens=2,
        stop_token_ids=[7, 8],
        logprobs=3,
        allowed_token_ids=[4, 7],
    )
    p = engine_params(sp)
    assert (p.top_p, p.top_k, p.seed, p.max_tokens, p.ignore_eos) == (pytest.approx(0.9), 5, 3, 9, True)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == pytest.approx((0.5, -0.5, 1.2))
    assert (p.min_tokens, p.stop_token_ids, p.logprobs) == (2, [7, 8], 3)
    assert p.temperature == pytest.approx(0.7) and p.allowed_token_ids == [4, 7]


def test_a_value_vllm_refuses_names_the_field() -> None:
    """specdec.validation checks first; vLLM's own check is the backstop, and names the field too."""
    with pytest.raises(InvalidField) as info:
        engine_params(pb.SamplingParams(max_tokens=5, top_p=0.0))
    assert info.value.field == "open.sampling.top_p"


def test_the_request_keeps_the_prompt_and_gamma() -> None:
    req = generation_request(
        pb.VerifyOpen(
            request_id="r",
            prompt_token_ids=[1, 2],
            gamma=3,
            sampling=pb.SamplingParams(max_tokens=4, stop_token_ids=[9], logprobs=0),
        )
    )
    assert (req.request_id, req.prompt_token_ids, req.gamma) == ("r", [1, 2], 3)
    assert (req.max_tokens, req.stop_token_ids, req.logprobs) == (4, [9], 0)
