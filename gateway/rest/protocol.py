"""The REST bridge's protocol: OpenAI's (and vLLM's) request models and the error shape.

Parity with vLLM 0.32's OpenAI server: every request field vLLM accepts is either
honoured as vLLM honours it (a field of CompletionRequest / ChatRequest below, or of
gateway.convert.GenerationFields, the fields that become the GenerationSpec), or, when
set to anything but vLLM's default, refused with 400 naming it and saying why
(gateway.convert.REFUSED). A field vLLM does not know is a 400 too, as in OpenAI's API.
Nothing is silently dropped. gateway.convert is the one place a request becomes a
GenerationSpec (gateway.rest.serving calls its `generation_spec`).
(vLLM's counterpart: vllm/entrypoints/openai/protocol.py.)
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, field_validator

from gateway.convert import GenerationFields, Int32
from specdec.config import MAX_LOGPROBS
from specdec.validation import InvalidField

# ---------------------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class GenerationRequest(GenerationFields):
    """Fields both endpoints take: those that become the GenerationSpec (gateway.convert's
    GenerationFields) and the bridge's own. Each means what it means in vLLM's server; other
    fields are checked against REFUSED (gateway.convert.refuse_extras)."""

    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id; like vLLM, only accepted
    request_id: str | None = Field(
        None, description="the response id's suffix, as in vLLM (specdec.validation's rule: the gateway checks it)"
    )
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    add_special_tokens: bool | None = None


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

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        """A content list of parts takes text parts only (the models are text-only): another
        part is refused naming its index and type, not with the union's first branch's error."""
        if isinstance(value, list):
            for i, part in enumerate(value):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(
                        f"part {i} has type {kind!r}; only text parts ({{'type': 'text', 'text': ...}}) are supported"
                    )
        return value

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
            raise InvalidField("top_logprobs", "requires logprobs to be true")
        return (self.top_logprobs or 0) if self.logprobs else None


# ---------------------------------------------------------------------------- errors


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
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
