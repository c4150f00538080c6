"""The REST bridge's protocol: OpenAI's (and vLLM's) request models, the fields refused, the
error shape, and the one converter from a request to the core's GenerationSpec (`build_spec`).

Parity with vLLM 0.32's OpenAI server: every request field vLLM accepts is either
honoured as vLLM honours it (a field of CompletionRequest / ChatRequest below), or, when
set to anything but vLLM's default, refused with 400 naming it and saying why (`REFUSED`).
A field vLLM does not know is a 400 too, as in OpenAI's API. Nothing is silently dropped.
(vLLM's counterpart: vllm/entrypoints/openai/protocol.py.)
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from gateway.client import generation_spec
from specdec.config import MAX_LOGPROBS
from specdec.wire import DRAFT_METHOD_NAMES, pb

# Integer fields sized like the proto fields they land in (a larger value is a 400, not a crash).
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
UInt32 = Annotated[int, Field(ge=0, le=2**32 - 1)]
UInt64 = Annotated[int, Field(ge=0, le=2**64 - 1)]


# vLLM 0.32 request fields the bridge does not honour: field -> (the values that mean "off",
# which are accepted as vLLM's defaults, the reason any other value is refused).
_TEXT_ONLY = "specdec serves text and token-id prompts only (no multimodal or embedding inputs)"
_NO_CONSTRAINTS = ("token constraints are not carried to the verifier yet; vLLM's rejection sampler "
                   "supports them, so this can come later")
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "min_p": ((None, 0, 0.0), "vLLM does not support min_p with speculative decoding "
              "(SamplingParams._validate_spec_decode), and every specdec request runs on a speculative engine"),
    "logit_bias": ((None, {}), "vLLM does not support logit_bias with speculative decoding "
                   "(SamplingParams._validate_spec_decode)"),
    "suffix": ((None, ""), "suffix (fill-in-the-middle) is not supported, as in vLLM"),
    "best_of": ((None, 1), "best_of is not supported (vLLM 0.32 dropped it too); send n=1"),
    "use_beam_search": ((False,), "beam search is not speculative decoding: run it on vLLM itself"),
    "length_penalty": ((1, 1.0), "length_penalty applies only to beam search, which specdec does not run"),
    "watermarking": ((None, False), "watermarking is not supported"),
    "truncate_prompt_tokens": ((None,), "prompts are not truncated: send one that fits the model's context"),
    "truncation_side": ((None,), "prompts are not truncated: send one that fits the model's context"),
    "allowed_token_ids": ((None,), _NO_CONSTRAINTS),
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
    "chat_template": ((None,), "request-supplied chat templates are refused (vLLM also refuses them unless "
                      "started with --trust-request-chat-template)"),
}


# ---------------------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class GenerationRequest(BaseModel):
    """Fields both endpoints take: OpenAI's and vLLM's sampling fields and our speculation
    knobs. Each means what it means in vLLM's server; other fields are checked against
    REFUSED (`refuse_extras`)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
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
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id; like vLLM, only accepted
    request_id: str | None = Field(
        None, description="the response id's suffix, as in vLLM (specdec.validation's rule: the gateway checks it)")
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    add_special_tokens: bool | None = None
    response_format: dict[str, Any] | None = None
    gamma: UInt32 | None = Field(None, description="draft tokens per target step (extension)")
    drafter: Literal[DRAFT_METHOD_NAMES] | None = Field(None, description="drafter method (extension)")  # type: ignore[valid-type]  # Literal built from the wire's names at import

    def token_limit(self) -> int | None:
        return self.max_tokens

    def top_logprobs_count(self) -> int | None:
        """How many alternatives to report per position; None: no logprobs."""
        return None


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str]
    max_tokens: Int32 | None = 16  # OpenAI's default for completions
    echo: bool | None = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    def top_logprobs_count(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def template_dict(self) -> dict[str, str]:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": self.role, "content": content}


class ChatRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int32 | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = 0
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    include_reasoning: bool = True  # no reasoning parser runs (as in vLLM without --reasoning-parser)
    parallel_tool_calls: bool | None = True  # no tools are accepted, so there is nothing to parallelise

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def top_logprobs_count(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs to be true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


# ---------------------------------------------------------------------------- errors


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        message, param = _printable(message), None if param is None else _printable(param)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _printable(text: str) -> str:
    """`text` with any lone surrogate (a "\\ud800" escape in the request's JSON) written as a
    backslash escape, so that an error naming it can be sent as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def refuse_surrogates(req: BaseModel) -> None:
    """400 for a string (or an object key) holding a lone surrogate: JSON's \\u escapes can
    spell one, but it is not Unicode text, and neither the tokenizer nor protobuf encodes it."""
    def bad(value: Any) -> bool:
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return True
            return False
        if isinstance(value, BaseModel):
            return bad(value.__dict__) or bad(value.model_extra or {})
        if isinstance(value, dict):
            return any(bad(k) or bad(v) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            return any(bad(v) for v in value)
        return False

    for name, value in {**req.__dict__, **(req.model_extra or {})}.items():
        if bad(name) or bad(value):
            raise APIError(400, f"{name}: not valid Unicode text (it holds a lone surrogate such as \\ud800)", name)


def refuse_extras(req: GenerationRequest) -> None:
    """400 for a field the bridge does not honour: one of vLLM's (REFUSED) set to anything but
    its default, with the reason, or one vLLM does not know either."""
    for name, value in (req.model_extra or {}).items():
        if name in REFUSED:
            off, reason = REFUSED[name]
            if any(value == v and type(value) is type(v) or value is v for v in off):
                continue
            raise APIError(400, f"{name}: not supported: {reason}", name)
        raise APIError(400, f"{name}: unknown field (not part of the OpenAI or vLLM API); remove it", name)


# ---------------------------------------------------------------------------- the converter


def build_spec(req: GenerationRequest, prompt: str | list[int], request_id: str) -> "pb.GenerationSpec":
    """The GenerationSpec of a request: the one place a REST request becomes the core's request
    (a sampling field added to the API is mapped here, once). Unset fields stay unset (the
    gateway's defaults); a field or value the bridge does not honour is an APIError naming it."""
    refuse_extras(req)
    if req.n not in (None, 1):
        raise APIError(400, f"n: only n=1 is supported, got {req.n}", "n")
    if req.response_format is not None and req.response_format.get("type") != "text":
        raise APIError(400, "response_format: only {\"type\": \"text\"} is supported: structured outputs "
                            "(json_object, json_schema, structural_tag) are not", "response_format")
    return generation_spec(
        prompt, max_tokens=req.token_limit(), gamma=req.gamma, drafter=req.drafter or "", request_id=request_id,
        temperature=1.0 if req.temperature is None else req.temperature,  # 0 is greedy in both APIs
        top_p=req.top_p, top_k=req.top_k or 0, seed=req.seed,
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        ignore_eos=req.ignore_eos, presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0, repetition_penalty=req.repetition_penalty,
        min_tokens=req.min_tokens, stop_token_ids=req.stop_token_ids or [], logprobs=req.top_logprobs_count(),
        include_stop_str_in_output=req.include_stop_str_in_output, skip_special_tokens=req.skip_special_tokens,
    )
