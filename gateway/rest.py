"""An OpenAI-compatible REST bridge for the gateway (FastAPI).

    POST /v1/completions        OpenAI completions (+ `gamma`, `drafter`; usage.speculation)
    POST /v1/chat/completions   OpenAI chat completions (the tokenizer's chat template)
    GET  /v1/models             the one model served
    GET  /health                200 when the gateway answers its health check, else 503

The bridge is only a gRPC client of specdec.v1.GatewayService: it turns a request
into a `GenerationSpec`, calls `Generate` (or `GenerateStream` for `stream: true`,
answered as server-sent events) and reshapes the answer. The gateway stays the one
place that validates requests: its INVALID_ARGUMENT ("spec.sampling.top_p: ...")
becomes a 400 whose `param` names the OpenAI field (`top_p`).

Serve it next to the gRPC server, in the same event loop:

    app = build_app("127.0.0.1:50051", tokenizer, "qwen-coder/target")
    server = uvicorn.Server(uvicorn.Config(app, host="0.0.0.0", port=8000, log_level="warning"))
    asyncio.create_task(server.serve())
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import BaseModel, Field

from gateway.client import AsyncGatewayClient, generation_spec, stats_dict
from specdec.wire import DRAFT_METHOD_NAMES, finish_reason_name, pb

GATEWAY_SERVICE = "specdec.v1.GatewayService"
HEALTH_TIMEOUT_S = 2.0

# Integer fields sized like the proto fields they land in (a larger value is a 400, not a crash).
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
UInt32 = Annotated[int, Field(ge=0, le=2**32 - 1)]
UInt64 = Annotated[int, Field(ge=0, le=2**64 - 1)]


# gRPC status -> (HTTP status, OpenAI error type)
GRPC_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error"),
}


# ---------------------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """Fields both endpoints take: OpenAI's sampling fields and our speculation knobs."""

    model: str | None = None
    max_tokens: Int32 | None = None
    temperature: float | None = None  # OpenAI's default is 1.0; 0 is greedy
    top_p: float | None = None
    seed: UInt64 | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    gamma: UInt32 | None = Field(None, description="draft tokens per target step (extension)")
    drafter: Literal[DRAFT_METHOD_NAMES] | None = Field(None, description="drafter method (extension)")  # type: ignore[valid-type]

    def token_limit(self) -> int | None:
        return self.max_tokens


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str]
    max_tokens: Int32 | None = 16  # OpenAI's default for completions


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: str
    content: str | list[TextPart] | None = None

    def template_dict(self) -> dict[str, str]:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": self.role, "content": content}


class ChatRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int32 | None = None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---------------------------------------------------------------------------- errors


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _param(field_path: str, prompt_param: str) -> str:
    """The OpenAI field a gateway field path names: spec.sampling.top_p -> top_p, spec.stop[1] -> stop."""
    name = re.sub(r"\[\d+\]", "", field_path).rsplit(".", 1)[-1]
    return prompt_param if name.startswith("prompt") else name


def grpc_error(err: grpc.aio.AioRpcError, prompt_param: str = "prompt") -> APIError:
    """Map a gateway error: INVALID_ARGUMENT 400 (param from the field path), UNAVAILABLE 503,
    DEADLINE_EXCEEDED 504, anything else 500."""
    status, type_ = GRPC_ERRORS.get(err.code(), (500, "server_error"))
    details = err.details() or err.code().name
    param = None
    if err.code() == grpc.StatusCode.INVALID_ARGUMENT and ":" in details:
        param = _param(details.split(":", 1)[0], prompt_param)
    return APIError(status, details, param, type_, err.code().name.lower())


def _validation_error(err: RequestValidationError) -> APIError:
    """FastAPI's 422 as OpenAI's 400; param is the top-level field."""
    first = err.errors()[0]
    loc = list(first.get("loc", ()))[1:]  # drop "body"
    param = loc[0] if loc and isinstance(loc[0], str) else None  # not the offset of a JSON syntax error
    where = ".".join(str(p) for p in loc) if param else ""
    return APIError(400, f"{where}: {first.get('msg')}" if where else str(first.get("msg")), param)


# ---------------------------------------------------------------------------- spec


def build_spec(req: _GenerationRequest, prompt: str | list[int], request_id: str) -> "pb.GenerationSpec":
    """The GenerationSpec of a request. Unset fields stay unset (the gateway's defaults)."""
    if req.n != 1:
        raise APIError(400, f"n: only n=1 is supported, got {req.n}", "n")
    return generation_spec(
        prompt, max_tokens=req.token_limit(), gamma=req.gamma, drafter=req.drafter or "", request_id=request_id,
        temperature=1.0 if req.temperature is None else req.temperature,  # 0 is greedy in both APIs
        top_p=req.top_p, seed=req.seed, stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
    )


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """A completion's prompt: text or token ids; one prompt per request."""
    if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], str):
        if len(req.prompt) > 1:
            raise APIError(400, f"prompt: batches of prompts are not supported ({len(req.prompt)} given); "
                                "send one prompt per request", "prompt")
        return req.prompt[0]
    return req.prompt  # type: ignore[return-value]


def chat_prompt(tokenizer: Any, req: ChatRequest) -> list[int]:
    """The chat rendered by the tokenizer's template, as token ids (the template already
    holds any special tokens, so none are added)."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "messages: this model's tokenizer has no chat template; use /v1/completions", "messages")
    try:
        text = tokenizer.apply_chat_template([m.template_dict() for m in req.messages], tokenize=False,
                                             add_generation_prompt=True)
    except Exception as err:  # jinja2's TemplateError (raise_exception in templates) or ValueError
        raise APIError(400, f"messages: the chat template rejected them: {err}", "messages") from err
    return list(tokenizer.encode(text, add_special_tokens=False))


# ---------------------------------------------------------------------------- responses


@dataclass(frozen=True)
class Shape:
    """How one endpoint shapes its answers."""

    object: str
    chunk_object: str
    id_prefix: str
    prompt_param: str
    choice: Callable[[str, str | None, bool], dict[str, Any]]  # (text, finish, streaming) -> choice
    opening_delta: dict[str, Any] | None = None  # first streamed choice delta, if any


def _completion_choice(text: str, finish: str | None, streaming: bool) -> dict[str, Any]:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}


def _chat_choice(text: str, finish: str | None, streaming: bool) -> dict[str, Any]:
    if streaming:
        body: dict[str, Any] = {"delta": {"content": text} if text else {}}
    else:
        body = {"message": {"role": "assistant", "content": text}}
    return {"index": 0, **body, "logprobs": None, "finish_reason": finish}


COMPLETION = Shape("text_completion", "text_completion", "cmpl-", "prompt", _completion_choice)
CHAT = Shape("chat.completion", "chat.completion.chunk", "chatcmpl-", "messages", _chat_choice,
             opening_delta={"role": "assistant", "content": ""})


def usage_dict(usage: "pb.Usage", stats: "pb.SpeculationStats") -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "speculation": stats_dict(stats),
    }


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def _open_stream(client: AsyncGatewayClient, spec: "pb.GenerationSpec", prompt_param: str,
                       ) -> AsyncGenerator["pb.GenerateStreamResponse", None]:
    """Start GenerateStream and wait for its first chunk, so a rejected request still
    gets a plain HTTP error; the iterator yields every chunk and cancels the call if left early."""
    call = client.stream(spec)
    try:
        first = await call.read()
    except grpc.aio.AioRpcError as err:
        raise grpc_error(err, prompt_param) from err

    async def chunks() -> AsyncGenerator["pb.GenerateStreamResponse", None]:
        try:
            chunk = first
            while chunk is not grpc.aio.EOF:
                yield chunk
                chunk = await call.read()
        finally:
            call.cancel()  # no-op once the call is done; stops the generation on a client disconnect

    return chunks()


async def stream_events(
    shape: Shape, head: dict[str, Any], chunks: AsyncGenerator["pb.GenerateStreamResponse", None], include_usage: bool,
) -> AsyncIterator[str]:
    """The server-sent events of one streamed generation: a chunk per gateway chunk with
    text or a finish reason, the usage chunk when asked for, then [DONE]. An error after
    the first byte is sent as an error event (the status line is gone by then)."""
    extra = {"usage": None} if include_usage else {}
    if shape.opening_delta is not None:
        yield _sse({**head, "choices": [{"index": 0, "delta": shape.opening_delta, "logprobs": None,
                                         "finish_reason": None}], **extra})
    last = None
    try:
        async with aclosing(chunks):  # leaving early (client gone) cancels the call now, not at GC
            async for chunk in chunks:
                finish = finish_reason_name(chunk.finish_reason)
                if chunk.text or finish:
                    yield _sse({**head, "choices": [shape.choice(chunk.text, finish, True)], **extra})
                last = chunk
    except grpc.aio.AioRpcError as err:
        yield _sse(grpc_error(err, shape.prompt_param).body())
        return
    if include_usage and last is not None:
        yield _sse({**head, "choices": [], "usage": usage_dict(last.usage, last.stats)})
    yield _sse("[DONE]")


# ---------------------------------------------------------------------------- app


def build_app(gateway_address: str, tokenizer: Any, model_name: str) -> FastAPI:
    """The REST bridge for the gateway at `gateway_address`. `tokenizer` (the target's)
    renders chat templates; `model_name` is the model id the API reports and accepts."""
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The channel belongs to the serving event loop, so it is made here, not in build_app.
        # No wait_for_ready and no deadline: an unreachable gateway is an immediate 503, and a
        # generation runs as long as its client keeps the HTTP request open.
        async with AsyncGatewayClient(gateway_address, timeout_s=None, wait_for_ready=False) as client:
            state["gateway"] = client
            state["health"] = health_pb2_grpc.HealthStub(client.channel)
            yield

    app = FastAPI(title="specdec OpenAI-compatible API", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError) -> JSONResponse:
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        return _validation_error(err).response()

    async def generate(req: _GenerationRequest, prompt: str | list[int], shape: Shape) -> Any:
        """Run one request through the gateway and answer it in `shape`."""
        if req.model and req.model != model_name:
            raise APIError(404, f"model: the model {req.model!r} does not exist; this server has {model_name!r}",
                           "model", code="model_not_found")
        request_id = uuid.uuid4().hex
        spec = build_spec(req, prompt, request_id)
        head = {"id": shape.id_prefix + request_id, "object": shape.object, "created": int(time.time()),
                "model": model_name}
        if req.stream:
            chunks = await _open_stream(state["gateway"], spec, shape.prompt_param)
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = stream_events(shape, {**head, "object": shape.chunk_object}, chunks, include_usage)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            r = await state["gateway"].generate(spec)
        except grpc.aio.AioRpcError as err:
            raise grpc_error(err, shape.prompt_param) from err
        return {**head, "choices": [shape.choice(r.text, finish_reason_name(r.finish_reason), False)],
                "usage": usage_dict(r.usage, r.stats)}

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest) -> Any:
        return await generate(req, completion_prompt(req), COMPLETION)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(req: ChatRequest) -> Any:
        return await generate(req, chat_prompt(tokenizer, req), CHAT)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "specdec"}]}

    @app.get("/health")
    async def health() -> JSONResponse:
        try:
            r = await state["health"].Check(health_pb2.HealthCheckRequest(service=GATEWAY_SERVICE),
                                            timeout=HEALTH_TIMEOUT_S)
            if r.status == health_pb2.HealthCheckResponse.SERVING:
                return JSONResponse({"status": "ok"})
            detail = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
        except grpc.aio.AioRpcError as err:
            detail = f"{err.code().name}: {err.details()}"
        return JSONResponse({"status": "unavailable", "detail": detail}, status_code=503)

    return app
