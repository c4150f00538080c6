"""The verifier's stream, message by message: a step is a `pb.Preview` or a `pb.Verdict`.

VerifyResponse carries one step in its `step` oneof when the session was opened with
`VerifyOpen.typed_steps` (every gateway since the oneof does). A caller from before the oneof
does not ask, and gets the legacy flat form: the verdict's fields directly on VerifyResponse
(the same field numbers as in Verdict), with `preview` set on a preview. These two functions
are the only code that knows the legacy form: the verifier writes it with `verify_response`,
and `step_of` reads either form (so a new gateway also reads an old verifier's stream).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

from specdec.wire import pb

if TYPE_CHECKING:
    from specdec.v1.verifier_pb2 import Preview, Verdict, VerifyResponse

Step: TypeAlias = "Preview | Verdict"

_VERDICT_FIELDS = tuple(f.name for f in pb.Verdict.DESCRIPTOR.fields)  # each also on VerifyResponse


def verify_response(step: Step, typed: bool) -> VerifyResponse:
    """The VerifyResponse that carries `step`: in the oneof (`typed`), else in the legacy flat form."""
    if isinstance(step, pb.Preview):
        if typed:
            return pb.VerifyResponse(preview_tokens=step)
        return pb.VerifyResponse(start_position=step.start_position, token_ids=step.token_ids, preview=True)
    if typed:
        return pb.VerifyResponse(verdict=step)
    return pb.VerifyResponse(**{name: getattr(step, name) for name in _VERDICT_FIELDS})


def step_of(response: VerifyResponse) -> Step:
    """The preview or verdict a VerifyResponse carries, in either form."""
    kind = response.WhichOneof("step")
    if kind == "verdict":
        return response.verdict
    if kind == "preview_tokens":
        return response.preview_tokens
    if response.preview:
        return pb.Preview(start_position=response.start_position, token_ids=response.token_ids)
    return pb.Verdict(**{name: getattr(response, name) for name in _VERDICT_FIELDS})
