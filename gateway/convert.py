"""The REST bridge's one converter: an OpenAI / vLLM request body -> specdec.v1.GenerationSpec.

Every request field vLLM 0.32's OpenAI server takes is in one of two places here:
- `GenerationFields`, the fields that become the GenerationSpec (each one line there and one
  line in `generation_spec`), meaning what they mean in vLLM's server; or
- `REFUSED`, the fields the bridge does not honour: set to anything but vLLM's default they are
  a 400 naming the field and saying why (`refuse_extras`). A field vLLM does not know either
  is a 400 too, as in OpenAI's API. Nothing is silently dropped.

The endpoints' own request models (gateway.rest.protocol: CompletionRequest, ChatRequest) derive from
GenerationFields and add what is not sampling (messages, echo, streaming, how logprobs are
asked for). Values are checked by the gateway, the one place that validates
(specdec.validation); this module only refuses what it cannot carry, raising
`InvalidField(<the OpenAI field>, message)`, which the bridge answers as a 400 whose `param` is
that field. docs/adding-a-sampling-field.md walks a new field through it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specdec.validation import InvalidField
from specdec.wire import DRAFT_METHOD_NAMES, draft_method, pb

if TYPE_CHECKING:  # the generated stubs' types (specdec.wire.pb holds the same classes)
    from specdec.v1.common_pb2 import SamplingParams
    from specdec.v1.gateway_pb2 import GenerationSpec

# Integer fields sized like the proto fields they land in (a larger value is a 400, not a crash).
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
UInt32 = Annotated[int, Field(ge=0, le=2**32 - 1)]
UInt64 = Annotated[int, Field(ge=0, le=2**64 - 1)]

# vLLM 0.32 request fields the bridge does not honour: field -> (the values that mean "off",
# which are accepted as vLLM's defaults, the reason any other value is refused).
_TEXT_ONLY = "specdec serves text and token-id prompts only (no multimodal or embedding inputs)"
_NO_CONSTRAINTS = (
    "token constraints are not carried to the verifier yet; vLLM's rejection sampler "
    "supports them, so this can come later"
)
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "min_p": (
        (None, 0, 0.0),
        "vLLM does not support min_p with speculative decoding "
        "(SamplingParams._validate_spec_decode), and every specdec request runs on a speculative engine",
    ),
    "logit_bias": (
        (None, {}),
        "vLLM does not support logit_bias with speculative decoding (SamplingParams._validate_spec_decode)",
    ),
    "suffix": ((None, ""), "suffix (fill-in-the-middle) is not supported, as in vLLM"),
    "best_of": ((None, 1), "best_of is not supported (vLLM 0.32 dropped it too); send n=1"),
    "use_beam_search": ((False,), "beam search is not speculative decoding: run it on vLLM itself"),
    "length_penalty": ((1, 1.0), "length_penalty applies only to beam search, which specdec does not run"),
    "watermarking": ((None, False), "watermarking is not supported"),
    "truncate_prompt_tokens": ((None,), "prompts are not truncated: send one that fits the model's context"),
    "truncation_side": ((None,), "prompts are not truncated: send one that fits the model's context"),
    "bad_words": ((None, []), _NO_CONSTRAINTS),
    "structured_outputs": ((None,), "structured outputs (guided decoding) are not supported"),
    "prompt_logprobs": ((None,), "the prompt's log-probabilities are not computed (the output's are: logprobs)"),
    "logprob_token_ids": ((None, []), "log-probabilities of chosen token ids are not supported (use logprobs)"),
    "prompt_embeds": ((None,), _TEXT_ONLY),
    "mm_payload": (("tensors",), _TEXT_ONLY),
    "return_mm_kwargs": ((None, False), _TEXT_ONLY),
    "media_io_kwargs": ((None, {}), _TEXT_ONLY),
    "mm_processor_kwargs": ((None, {}), _TEXT_ONLY),
    "priority": ((0,), "no priority scheduling: the verifier serves requests first come, first served"),
    "session_id": ((None,), "sessions are not supported"),
    "routed_experts_prompt_start": ((0,), "MoE routing export is not supported"),
    "return_token_offsets": ((None, False), "token offsets are not returned"),
    "return_prompt_text": ((None, False), "the prompt text is not returned"),
    "cache_salt": ((None,), "the verifier's prefix cache is not partitioned per request"),
    "kv_transfer_params": ((None,), "disaggregated prefill (KV transfer) is not supported"),
    "ec_transfer_params": ((None,), "encoder cache transfer is not supported"),
    "vllm_xargs": ((None, {}), "no custom logits processors run, so extra arguments would be ignored"),
    "repetition_detection": ((None,), "repetition detection is not supported"),
    "thinking_token_budget": ((None,), "thinking budgets need a reasoning parser, which the bridge does not run"),
    "stream_interval": ((None, 1), "specdec streams every target step's tokens as soon as they are verified"),
    "spaces_between_special_tokens": ((True,), "fast tokenizers ignore it; only true is supported"),
    "tools": ((None, []), "tool calling is not supported by the bridge"),
    "tool_choice": ((None, "none"), "tool calling is not supported by the bridge"),
    "reasoning_effort": ((None,), "reasoning controls are not supported by the bridge"),
    "chat_template": (
        (None,),
        "request-supplied chat templates are refused (vLLM also refuses them unless "
        "started with --trust-request-chat-template)",
    ),
}


class GenerationFields(BaseModel):
    """The request fields both endpoints take that become the GenerationSpec: OpenAI's and vLLM's
    sampling fields and specdec's speculation knobs (`gamma`, `drafter`). Fields not declared
    here or by an endpoint's model are checked against REFUSED (`refuse_extras`)."""

    model_config = ConfigDict(extra="allow")

    max_tokens: Int32 | None = None
    temperature: float | None = None  # OpenAI's default is 1.0; 0 is greedy
    top_p: float | None = None
    top_k: Int32 | None = None
    seed: UInt64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int32] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: UInt32 = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    skip_special_tokens: bool = True
    allowed_token_ids: list[Int32] | None = None
    n: int | None = 1
    response_format: dict[str, Any] | None = None
    gamma: UInt32 | None = Field(None, description="draft tokens per target step (extension)")
    drafter: Literal[DRAFT_METHOD_NAMES] | None = Field(None, description="drafter method (extension)")  # type: ignore[valid-type]  # Literal built from the wire's names at import

    def token_limit(self) -> int | None:
        """The generation's max_tokens (an endpoint may name it otherwise); None: the gateway's default."""
        return self.max_tokens

    def top_logprobs_count(self) -> int | None:
        """How many alternatives to report per position; None: no logprobs."""
        return None


def refuse_extras(req: BaseModel) -> None:
    """InvalidField for a field the bridge does not honour: one of vLLM's (REFUSED) set to
    anything but its default, with the reason, or one vLLM does not know either."""
    for name, value in (req.model_extra or {}).items():
        if name in REFUSED:
            off, reason = REFUSED[name]
            if any(value == v and type(value) is type(v) or value is v for v in off):
                continue
            raise InvalidField(name, f"not supported: {reason}")
        raise InvalidField(name, "unknown field (not part of the OpenAI or vLLM API); remove it")


def sampling_params(req: GenerationFields) -> SamplingParams:
    """The wire SamplingParams of a request (TGI's to_pb). A field the client left out stays
    unset, so the gateway's default (max_tokens) or plain sampling's applies."""
    sampling = pb.SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,  # 0 is greedy in both APIs
        top_k=req.top_k or 0,
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        stop_token_ids=req.stop_token_ids or [],
        include_stop_str_in_output=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        skip_special_tokens=req.skip_special_tokens,
        allowed_token_ids=req.allowed_token_ids or [],
    )
    for name, value in (
        ("max_tokens", req.token_limit()),
        ("top_p", req.top_p),
        ("seed", req.seed),
        ("repetition_penalty", req.repetition_penalty),
        ("logprobs", req.top_logprobs_count()),
    ):
        if value is not None:  # proto3 `optional`: unset means the default
            setattr(sampling, name, value)
    return sampling


def generation_spec(req: GenerationFields, prompt: str | list[int], request_id: str) -> GenerationSpec:
    """The GenerationSpec of a request (its prompt as text or token ids). Raises InvalidField
    naming the OpenAI field for what the bridge cannot carry (REFUSED, unknown fields, n > 1,
    a structured response_format)."""
    refuse_extras(req)
    if req.allowed_token_ids == []:  # the wire's empty list means no constraint; vLLM refuses [] too
        raise InvalidField("allowed_token_ids", "must not be empty (leave it out for no constraint)")
    if req.n not in (None, 1):
        raise InvalidField("n", f"only n=1 is supported, got {req.n}")
    if req.response_format is not None and req.response_format.get("type") != "text":
        raise InvalidField(
            "response_format",
            'only {"type": "text"} is supported: structured outputs (json_object, json_schema, structural_tag) are not',
        )
    spec = pb.GenerationSpec(
        sampling=sampling_params(req), drafter=draft_method(req.drafter or ""), request_id=request_id
    )
    if isinstance(prompt, str):
        spec.prompt_text = prompt
    else:
        spec.prompt_token_ids.extend(prompt)
    if req.gamma is not None:
        spec.gamma = req.gamma
    return spec
