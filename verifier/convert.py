"""The verifier's one converter: specdec.v1 wire types -> the vLLM engine's request.

Nothing else in the verifier reads a `SamplingParams` field by field: the servicer validates
the wire message (specdec.validation) and hands it here, and the engine gets what this module
returns. A sampling field added to protos/specdec/v1/common.proto reaches vLLM by one line in
`engine_params` (docs/adding-a-sampling-field.md).

Terms: the *wire* SamplingParams is specdec.v1.SamplingParams (proto3: an `optional` field is
unset when the client left it to the default); the *engine* SamplingParams is
vllm.SamplingParams, which vLLM's scheduler and rejection sampler apply to every verified
position, drafts included.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specdec.validation import InvalidField
from verifier.engine import GenerationRequest

if TYPE_CHECKING:  # the generated stubs' types (specdec.wire.pb holds the same classes); vLLM's
    from vllm import SamplingParams as EngineSamplingParams

    from specdec.v1.common_pb2 import SamplingParams as WireSamplingParams
    from specdec.v1.verifier_pb2 import VerifyOpen


def engine_params(sp: WireSamplingParams, field: str = "open.sampling") -> EngineSamplingParams:
    """The vLLM SamplingParams of a validated wire SamplingParams (unset optional fields take
    vLLM's defaults). Detokenizing is off (the gateway owns the text) and outputs come as deltas
    (each engine step's new tokens). A value vLLM's own checks refuse raises InvalidField naming
    `field`.<vLLM's parameter>."""
    from vllm.exceptions import VLLMClientError
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    try:
        return SamplingParams(
            temperature=sp.temperature,
            top_p=sp.top_p if sp.HasField("top_p") else 1.0,
            top_k=sp.top_k if sp.top_k > 0 else -1,  # 0 and -1 both mean no truncation
            seed=sp.seed if sp.HasField("seed") else None,
            max_tokens=sp.max_tokens,
            ignore_eos=sp.ignore_eos,
            presence_penalty=sp.presence_penalty,
            frequency_penalty=sp.frequency_penalty,
            repetition_penalty=sp.repetition_penalty if sp.HasField("repetition_penalty") else 1.0,
            min_tokens=sp.min_tokens,
            stop_token_ids=list(sp.stop_token_ids) or None,
            logprobs=sp.logprobs if sp.HasField("logprobs") else None,
            allowed_token_ids=list(sp.allowed_token_ids) or None,  # empty: no constraint
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
    except (ValueError, VLLMClientError) as err:  # specdec.validation checks first; this is the backstop
        parameter = getattr(err, "parameter", None)  # vLLM's VLLMValidationError names it
        message = str(err.args[0] if err.args else err)
        raise InvalidField(f"{field}.{parameter}" if parameter else field, message) from err


def generation_request(req: VerifyOpen) -> GenerationRequest:
    """The engine's request for a validated VerifyOpen (TGI's from_pb)."""
    return GenerationRequest(
        request_id=req.request_id,
        prompt_token_ids=list(req.prompt_token_ids),
        gamma=req.gamma,
        params=engine_params(req.sampling),
    )
