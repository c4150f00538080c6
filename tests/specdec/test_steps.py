"""The verifier's stream messages: a preview and a verdict in VerifyResponse's `step` oneof, and
the legacy flat form (callers from before the oneof), read back as the same step."""

from __future__ import annotations

import pytest

from specdec.steps import step_of, verify_response
from specdec.wire import pb

VERDICT = pb.Verdict(
    start_position=7,
    token_ids=[1, 2, 3],
    drafted=4,
    accepted=2,
    finish_reason=pb.FINISH_REASON_LENGTH,
    computed_tokens=5,
    batch_size=3,
    step_ms=1.5,
    draft_wait_ms=0.5,
    queue_ms=2.0,
    logprobs=[pb.TokenLogprobs(token_id=1, logprob=-0.5, rank=1)],
    stop_token=True,
    branch=True,
    branch_miss=True,
    hold_drafts=True,
)
PREVIEW = pb.Preview(start_position=7, token_ids=[1, 2])


@pytest.mark.parametrize("typed", [True, False], ids=["typed", "legacy"])
@pytest.mark.parametrize("step", [VERDICT, PREVIEW], ids=["verdict", "preview"])
def test_a_step_survives_the_wire_in_either_form(step, typed: bool) -> None:
    sent = verify_response(step, typed)
    received = pb.VerifyResponse.FromString(sent.SerializeToString())
    got = step_of(received)
    assert type(got) is type(step) and got == step


def test_the_legacy_form_is_the_flat_fields_with_the_preview_flag() -> None:
    legacy = verify_response(PREVIEW, typed=False)
    assert legacy.WhichOneof("step") is None and legacy.preview and list(legacy.token_ids) == [1, 2]
    legacy = verify_response(VERDICT, typed=False)
    assert legacy.WhichOneof("step") is None and not legacy.preview and legacy.hold_drafts and legacy.accepted == 2
    typed = verify_response(VERDICT, typed=True)
    assert typed.WhichOneof("step") == "verdict" and not typed.token_ids  # nothing in the flat fields


def test_every_verdict_field_has_its_legacy_twin_under_the_same_number() -> None:
    """The legacy form is read field by field: a field added to Verdict needs its twin on
    VerifyResponse (same name, same number) or the legacy form would drop it."""
    flat = pb.VerifyResponse.DESCRIPTOR.fields_by_name
    for field in pb.Verdict.DESCRIPTOR.fields:
        assert field.name in flat and flat[field.name].number == field.number, field.name
