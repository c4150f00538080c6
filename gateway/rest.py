"""An OpenAI-compatible REST bridge for the gateway (FastAPI), at parity with vLLM's server.

    POST /v1/completions        OpenAI completions (+ `gamma`, `drafter`)
    POST /v1/chat/completions   OpenAI chat completions (the tokenizer's chat template)
    GET  /v1/models             the one model served
    GET  /health                200 when the gateway answers its health check, else 503

The bridge is only a gRPC client of specdec.v1.GatewayService: it turns a request
into a `GenerationSpec`, calls `Generate` (or `GenerateStream` for `stream: true`,
answered as server-sent events) and reshapes the answer. The gateway stays the one
place that validates values: its INVALID_ARGUMENT ("spec.sampling.top_p: ...")
becomes a 400 whose `param` names the OpenAI field (`top_p`).

Parity with vLLM 0.32's OpenAI server: every request field vLLM accepts is either
honoured as vLLM honours it (a field of CompletionRequest / ChatRequest below, or of
gateway.convert.GenerationFields, the fields that become the GenerationSpec), or, when
set to anything but vLLM's default, refused with 400 naming it and saying why
(gateway.convert.REFUSED). A field vLLM does not know is a 400 too, as in OpenAI's API.
Nothing is silently dropped. gateway.convert is the one place a request becomes a
GenerationSpec.

Speculation stats: `metrics.speculative_decoding` carries them under vLLM's names
(mean_acceptance_length, draft_acceptance_rate, acceptance_histogram, num_spec_steps,
num_accepted_draft_tokens, num_draft_tokens, num_spec_tokens), beside vLLM's per-request
timings, where vLLM puts them (the response; the last usage chunk of a stream);
`usage.speculation` keeps specdec's own SpeculationStats (an alias kept for older clients).

Serve it next to the gRPC server, in the same event loop:

    app = build_app("127.0.0.1:50051", tokenizer, "qwen-coder/target")
    server = uvicorn.Server(uvicorn.Config(app, host="0.0.0.0", port=8000, log_level="warning"))
    asyncio.create_task(server.serve())
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Annotated, Any, Literal

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException

from gateway import convert
from gateway.client import AsyncGatewayClient, stats_dict, vllm_spec_metrics
from gateway.convert import REFUSED, GenerationFields, Int32
from specdec.config import MAX_LOGPROBS
from specdec.security import KeyStore
from specdec.validation import InvalidField
from specdec.wire import finish_reason_name, pb

GATEWAY_SERVICE = "specdec.v1.GatewayService"
HEALTH_TIMEOUT_S = 2.0
DEFAULT_MAX_REQUEST_BYTES = 8 << 20  # GatewayConfig.max_request_mb's default

# gRPC status -> (HTTP status, OpenAI error type)
GRPC_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error"),
}

# ---------------------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _GenerationRequest(GenerationFields):
    """Fields both endpoints take: those that become the GenerationSpec (gateway.convert's
    GenerationFields) and the bridge's own. Each means what it means in vLLM's server; other
    fields are checked against REFUSED (gateway.convert.refuse_extras)."""

    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id; like vLLM, only accepted
    request_id: str | None = Field(None, description="the response id's suffix, as in vLLM (specdec.validation's rule: the gateway checks it)")
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    add_special_tokens: bool | None = None


class CompletionRequest(_GenerationRequest):
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


class ChatRequest(_GenerationRequest):
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


log = logging.getLogger("specdec.gateway")


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
    headers = {}
    if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        retry = dict(err.trailing_metadata() or ()).get("retry-after")
        headers["Retry-After"] = str(retry or 1)
    if err.code() == grpc.StatusCode.UNAUTHENTICATED:
        headers["WWW-Authenticate"] = "Bearer"
    return APIError(status, details, param, type_, err.code().name.lower(), headers)


def _validation_error(err: RequestValidationError) -> APIError:
    """FastAPI's 422 as OpenAI's 400; param is the top-level field."""
    first = err.errors()[0]
    loc = list(first.get("loc", ()))[1:]  # drop "body"
    param = loc[0] if loc and isinstance(loc[0], str) else None  # not the offset of a JSON syntax error
    where = ".".join(str(p) for p in loc) if param else ""
    return APIError(400, f"{where}: {first.get('msg')}" if where else str(first.get("msg")), param)


def completion_prompt(tokenizer: Any, req: CompletionRequest) -> tuple[list[int], str]:
    """A completion's prompt as token ids (the text tokenised as vLLM does: special tokens
    added unless add_special_tokens is false) and as text (for `echo`); one prompt per request."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) > 1:
            raise APIError(400, f"prompt: batches of prompts are not supported ({len(prompt)} given); "
                                "send one prompt per request", "prompt")
        prompt = prompt[0]
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo: echo with logprobs needs the prompt's log-probabilities, which specdec "
                            "does not compute; drop echo or logprobs", "echo")
    if isinstance(prompt, str):
        ids = list(tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens is not False))
        return ids, prompt
    for i, t in enumerate(prompt):  # the gateway checks the vocabulary; these cannot even be decoded
        if not 0 <= t <= 2**31 - 1:  # type: ignore[operator]  # token ids here: the text forms returned above
            raise APIError(400, f"prompt: token id {t} at index {i} is outside the vocabulary", "prompt")
    return list(prompt), tokenizer.decode(prompt)  # type: ignore[arg-type]  # (token ids, as above)


def chat_prompt(tokenizer: Any, req: ChatRequest) -> list[int]:
    """The chat rendered by the tokenizer's template, as token ids (the template already
    holds any special tokens, so none are added unless add_special_tokens is true)."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "messages: this model's tokenizer has no chat template; use /v1/completions", "messages")
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError(400, "continue_final_message: cannot be combined with add_generation_prompt "
                            "(set add_generation_prompt to false), as in vLLM", "continue_final_message")
    kwargs = dict(req.chat_template_kwargs or {})
    if kwargs.get("chat_template") is not None:  # the refused field, passed another way (vLLM refuses it too)
        raise APIError(400, f"chat_template_kwargs: chat_template: not supported: {REFUSED['chat_template'][1]}",
                       "chat_template_kwargs")
    if req.documents is not None:
        kwargs["documents"] = req.documents
    try:
        text = tokenizer.apply_chat_template([m.template_dict() for m in req.messages], tokenize=False,
                                             add_generation_prompt=req.add_generation_prompt,
                                             continue_final_message=req.continue_final_message, **kwargs)
    except Exception as err:  # jinja2's TemplateError (raise_exception in templates) or ValueError
        raise APIError(400, f"messages: the chat template rejected them: {err}", "messages") from err
    return list(tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens)))


def chat_echo(req: ChatRequest) -> str:
    """What vLLM's chat `echo` prepends: the last message's content when it is the assistant's."""
    if not req.echo or req.messages[-1].role != "assistant":
        return ""
    return req.messages[-1].template_dict()["content"]


# ---------------------------------------------------------------------------- logprobs


def _token_text(tokenizer: Any, token_id: int, as_id: bool, context: Sequence[int] = ()) -> str:
    """A token as vLLM's server names it: "token_id:N" (return_tokens_as_token_ids), or its own
    text; a token that decodes to an incomplete UTF-8 character (a byte-fallback piece, ending in
    U+FFFD) is decoded after the sampled tokens before it (`context`, at most 4), and is "" when
    they do not complete it (vllm/v1/engine/logprobs.py: _correct_decoded_token)."""
    if as_id:
        return f"token_id:{token_id}"
    text = tokenizer.decode([token_id])
    if not text.endswith("\ufffd"):
        return text
    context = list(context)[-4:]
    for n in range(1, len(context) + 1):
        ctx = context[-n:]
        full = tokenizer.decode(ctx + [token_id])
        if full.endswith("\ufffd"):
            continue
        clean_end = len(ctx)  # context tokens that were incomplete themselves belong to this one
        for j in range(len(ctx) - 1, -1, -1):
            if tokenizer.decode([ctx[j]]).endswith("\ufffd"):
                clean_end = j
            else:
                break
        prefix = tokenizer.decode(ctx[:clean_end]) if clean_end else ""
        if full.startswith(prefix):
            return full[len(prefix):]
        common = 0
        for a, b in zip(prefix, full):
            if a != b:
                break
            common += 1
        return full[common:]
    return ""


def _position(lp: "pb.TokenLogprobs") -> list[tuple[int, float]]:
    """One position's entries in vLLM's order: the sampled token first, then the top k by
    rank (the sampled token once, at the front, when it is among them)."""
    entries = {lp.token_id: lp.logprob}
    for tid, value in zip(lp.top_token_ids, lp.top_logprobs):
        entries.setdefault(tid, value)
    return list(entries.items())


def _clamp(logprob: float) -> float:
    return max(logprob, -9999.0)  # -inf is not JSON; OpenAI's floor


@dataclass
class LogprobsShaper:
    """Turns the gateway's TokenLogprobs into an endpoint's `logprobs` object, as vLLM builds it
    (vllm/entrypoints/openai/{completion,chat_completion}/serving.py); `offset` carries the
    completions text offset across a stream's chunks."""

    tokenizer: Any
    top: int  # alternatives asked for
    as_ids: bool = False
    offset: int = 0
    context: list[int] = field(default_factory=list)  # the sampled tokens so far (the last 4 matter)

    def _texts(self, lp: "pb.TokenLogprobs") -> tuple[str, list[tuple[str, float]]]:
        """The sampled token's text and the position's entries as (text, logprob), in vLLM's order."""
        def text(tid: int) -> str:
            return _token_text(self.tokenizer, tid, self.as_ids, self.context)

        entries = [(text(tid), _clamp(v)) for tid, v in _position(lp)]
        self.context = [*self.context[-3:], lp.token_id]
        return entries[0][0], entries

    def completion(self, logprobs: Sequence["pb.TokenLogprobs"]) -> dict[str, Any]:
        out: dict[str, list[Any]] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for lp in logprobs:
            token, entries = self._texts(lp)
            out["tokens"].append(token)
            out["token_logprobs"].append(_clamp(lp.logprob))
            # OpenAI's completions give the sampled token plus the top k: k + 1 entries at most
            out["top_logprobs"].append({t: v for i, (t, v) in enumerate(entries) if i <= self.top})
            out["text_offset"].append(self.offset)
            self.offset += len(token)
        return out

    def chat(self, logprobs: Sequence["pb.TokenLogprobs"]) -> dict[str, Any]:
        content = []
        for lp in logprobs:
            token, entries = self._texts(lp)
            top = entries[: self.top]
            content.append({"token": token, "logprob": _clamp(lp.logprob), "bytes": list(token.encode("utf-8", "replace")),
                            "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode("utf-8", "replace"))}
                                             for t, v in top]})
        return {"content": content}


# ---------------------------------------------------------------------------- responses


@dataclass(frozen=True)
class Shape:
    """How one endpoint shapes its answers."""

    object: str
    chunk_object: str
    id_prefix: str
    prompt_param: str
    choice: Callable[[str, str | None, bool], dict[str, Any]]  # (text, finish, streaming) -> choice
    logprobs: Callable[[LogprobsShaper, Sequence["pb.TokenLogprobs"]], dict[str, Any]]
    opening_delta: dict[str, Any] | None = None  # first streamed choice delta, if any


def _completion_choice(text: str, finish: str | None, streaming: bool) -> dict[str, Any]:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}


def _chat_choice(text: str, finish: str | None, streaming: bool) -> dict[str, Any]:
    if streaming:
        body: dict[str, Any] = {"delta": {"content": text} if text else {}}
    else:
        body = {"message": {"role": "assistant", "content": text}}
    return {"index": 0, **body, "logprobs": None, "finish_reason": finish}


COMPLETION = Shape("text_completion", "text_completion", "cmpl-", "prompt", _completion_choice, LogprobsShaper.completion)
CHAT = Shape("chat.completion", "chat.completion.chunk", "chatcmpl-", "messages", _chat_choice, LogprobsShaper.chat,
             opening_delta={"role": "assistant", "content": ""})


@dataclass
class Answer:
    """What one request's answer needs beside the gateway's chunks."""

    shape: Shape
    head: dict[str, Any]
    prompt_ids: list[int]
    echo: str = ""  # text put before the output (completions' and chat's `echo`)
    logprobs: LogprobsShaper | None = None
    token_ids: bool = False  # return_token_ids
    started: float = field(default_factory=time.perf_counter)

    def choice(self, text: str, finish: str | None, streaming: bool, ids: Sequence[int],
               logprobs: Sequence["pb.TokenLogprobs"]) -> dict[str, Any]:
        c = self.shape.choice(text, finish, streaming)
        if self.logprobs is not None and (logprobs or not streaming):
            c["logprobs"] = self.shape.logprobs(self.logprobs, logprobs)
        if self.token_ids:
            c["token_ids"] = list(ids)
            if self.shape is COMPLETION:
                c["prompt_token_ids"] = self.prompt_ids
        return c


def usage_dict(usage: "pb.Usage", stats: "pb.SpeculationStats") -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "speculation": stats_dict(stats),  # specdec's names; `metrics.speculative_decoding` has vLLM's
    }


def metrics_dict(stats: "pb.SpeculationStats", tokens: int, first_ms: float, total_ms: float) -> dict[str, Any]:
    """vLLM's per-request `metrics` object (PerRequestMetrics: timings, and the speculation
    under vLLM's names), measured at the bridge."""
    return {
        "time_to_first_token_ms": first_ms,
        "generation_time_ms": total_ms,
        "queue_time_ms": None,
        "mean_itl_ms": (total_ms - first_ms) / (tokens - 1) if tokens > 1 else None,
        "tokens_per_second": tokens / total_ms * 1e3 if total_ms > 0 else None,
        "speculative_decoding": vllm_spec_metrics(stats),
    }


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


# Headers that carry a client's deadline, seconds: ours, then the one OpenAI's SDKs send (their `timeout`).
DEADLINE_HEADERS = ("x-request-timeout", "x-stainless-timeout")
MAX_DEADLINE_S = 86_400.0


def client_deadline_s(headers: Any) -> float | None:
    """The client's deadline in seconds from its request headers (DEADLINE_HEADERS, the first
    present), or None. It becomes the gateway call's gRPC deadline, so a generation the client
    stopped waiting for stops too (504 when it passes). Not a number in (0, MAX_DEADLINE_S]:
    400 naming the header."""
    for name in DEADLINE_HEADERS:
        value = headers.get(name)
        if value is None:
            continue
        try:
            seconds = float(value)
        except ValueError:
            seconds = float("nan")
        if not 0 < seconds <= MAX_DEADLINE_S:  # also NaN
            raise APIError(400, f"{name}: {value[:32]!r} is not a number of seconds in (0, {MAX_DEADLINE_S:g}]", name)
        return seconds
    return None


class ClientStalled(Exception):
    """A streaming client took no message for stream_write_timeout_s."""


class TimedStreamingResponse(StreamingResponse):
    """A StreamingResponse each of whose messages must be taken within `write_timeout_s` (0: no
    limit). A client that stops reading fills the socket's buffers and the next send waits;
    past the timeout the body iterator is closed (which cancels the gateway call: the
    generation stops and its slot is freed) and the response ends unfinished (the server then
    closes the connection). `on_timeout()` is called once when that happens."""

    def __init__(self, content: Any, write_timeout_s: float, on_timeout: Callable[[], None] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.write_timeout_s = write_timeout_s
        self.on_timeout = on_timeout

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        timeout = self.write_timeout_s
        if timeout <= 0:
            await super().__call__(scope, receive, send)
            return

        async def timed_send(message: dict[str, Any]) -> None:
            sending = asyncio.ensure_future(send(message))
            done, _ = await asyncio.wait({sending}, timeout=timeout)
            if done:
                sending.result()
                return
            sending.cancel()
            raise ClientStalled(f"the client read nothing for stream_write_timeout_s ({timeout:g} s)")

        try:
            await super().__call__(scope, receive, timed_send)
        except ClientStalled as stalled:
            await self.body_iterator.aclose()  # type: ignore[union-attr]  # cancels the gateway call now
            if self.on_timeout is not None:
                self.on_timeout()
            log.warning("REST stream ended: %s", stalled)


async def _open_stream(client: AsyncGatewayClient, spec: "pb.GenerationSpec", prompt_param: str, metadata: Any = (),
                       timeout_s: float | None = None) -> AsyncGenerator["pb.GenerateStreamResponse", None]:
    """Start GenerateStream (deadline `timeout_s`, None: none) and wait for its first chunk, so a
    rejected request still gets a plain HTTP error; the iterator yields every chunk and cancels
    the call if left early."""
    call = client.stream(spec, metadata=metadata, timeout_s=timeout_s)
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
    answer: Answer, chunks: AsyncGenerator["pb.GenerateStreamResponse", None], include_usage: bool,
) -> AsyncIterator[str]:
    """The server-sent events of one streamed generation: a chunk per gateway chunk with
    text or a finish reason, the usage chunk (with vLLM's `metrics`) when asked for, then
    [DONE]. An error after the first byte is sent as an error event (the status line is
    gone by then)."""
    shape, head = answer.shape, {**answer.head, "object": answer.shape.chunk_object}
    extra = {"usage": None} if include_usage else {}
    if shape.opening_delta is not None:
        yield _sse({**head, "choices": [{"index": 0, "delta": shape.opening_delta, "logprobs": None,
                                         "finish_reason": None}], **extra})
    if answer.echo:
        yield _sse({**head, "choices": [answer.choice(answer.echo, None, True, [], [])], **extra})
        if answer.logprobs is not None:
            answer.logprobs.offset += len(answer.echo)
    last, first_ms, tokens = None, 0.0, 0
    try:
        async with aclosing(chunks):  # leaving early (client gone) cancels the call now, not at GC
            async for chunk in chunks:
                finish = finish_reason_name(chunk.finish_reason)
                if chunk.token_ids and not first_ms:
                    first_ms = (time.perf_counter() - answer.started) * 1e3
                tokens += len(chunk.token_ids)
                if chunk.text or finish or chunk.logprobs or (answer.token_ids and chunk.token_ids):
                    choice = answer.choice(chunk.text, finish, True, chunk.token_ids, chunk.logprobs)
                    yield _sse({**head, "choices": [choice], **extra})
                last = chunk
    except grpc.aio.AioRpcError as err:
        yield _sse(grpc_error(err, shape.prompt_param).body())
        return
    if include_usage and last is not None:
        total_ms = (time.perf_counter() - answer.started) * 1e3
        yield _sse({**head, "choices": [], "usage": usage_dict(last.usage, last.stats),
                    "metrics": metrics_dict(last.stats, tokens, first_ms, total_ms)})
    yield _sse("[DONE]")


async def _disconnected(request: Request) -> None:
    """Return when the client of `request` (its body already read) disconnects."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---------------------------------------------------------------------------- the guard


class Guard:
    """ASGI middleware in front of every route: the work a request may cause before it is known.

    - The API key first: a /v1 route (and /metrics with `metrics_auth`) without a known key is
      answered 401 from its headers alone; none of its body is read, nothing is parsed,
      tokenised or templated.
    - Then the body's size: over `max_body` bytes (a Content-Length over it, or a body that
      grows past it while it is read) is answered 413 without reading the rest.
    /health stays open. Each refusal is counted in `refused` (the gateway's
    `specdec:gateway_refused_total`, by reason), when given."""

    def __init__(self, app: Any, keys: KeyStore | None, max_body: int, metrics_auth: bool, refused: Any = None) -> None:
        self.app, self.keys, self.max_body, self.metrics_auth = app, keys, max_body, metrics_auth
        self.refused = refused

    def _count(self, reason: str) -> None:
        if self.refused is not None:
            self.refused.labels(reason).inc()

    def _needs_key(self, path: str) -> bool:
        if self.keys is None or not self.keys.enabled:
            return False
        return path.startswith("/v1/") or path == "/v1" or (self.metrics_auth and path.startswith("/metrics"))

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        if self._needs_key(scope["path"]) and self.keys.identify(headers.get("authorization")) is None:  # type: ignore[union-attr]  # keys is set when _needs_key is true
            err = APIError(401, "missing or unknown API key: send `Authorization: Bearer <key>`", None,
                           "authentication_error", "invalid_api_key", {"WWW-Authenticate": "Bearer"})
            self._count("unauthenticated")
            await err.response()(scope, receive, send)
            return
        too_large = APIError(413, f"the request body is larger than max_request_mb ({self.max_body / (1 << 20):g} MiB)",
                             None, "invalid_request_error", "request_too_large")
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body:
            self._count("request_too_large")
            await too_large.response()(scope, receive, send)
            return
        read = 0

        async def bounded_receive() -> dict[str, Any]:
            nonlocal read
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                if read > self.max_body:  # a chunked body that grew past the cap: FastAPI passes it on
                    self._count("request_too_large")
                    raise HTTPException(413, too_large.message)
            return message

        await self.app(scope, bounded_receive, send)


# ---------------------------------------------------------------------------- app


def build_app(gateway_address: str, tokenizer: Any, model_name: str, keys: KeyStore | None = None,
              metrics_auth: bool = False, metrics_app: Any = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              tokenizer_executor: Executor | None = None, refused: Any = None, stream_write_timeout_s: float = 0.0,
              stream_write_timeouts: Any = None) -> FastAPI:
    """The REST bridge for the gateway at `gateway_address`. `tokenizer` (the target's)
    renders chat templates; `model_name` is the model id the API reports and accepts.

    API keys: `keys` (the gateway's KeyStore) is checked by `Guard` before any of a request's
    body is read, for every /v1 route, and for /metrics (`metrics_app`, mounted there) when
    `metrics_auth`; /health stays open. The `Authorization` header then travels to the gateway
    with the call, which checks it again and applies the key's rate limits (429 from there).
    Bodies over `max_request_bytes` are answered 413. Tokenising and chat templating run on
    `tokenizer_executor` (default: one thread of its own), never on the event loop that carries
    every stream. `refused`: the gateway's refusal counter (by reason), which counts the bridge's own
    401 and 413 answers too. A streamed answer's client must take each message within
    `stream_write_timeout_s` (0: no limit; TimedStreamingResponse), counted in
    `stream_write_timeouts`. A client's deadline header (DEADLINE_HEADERS) becomes the gateway
    call's deadline."""
    state: dict[str, Any] = {}
    executor = tokenizer_executor or ThreadPoolExecutor(1, thread_name_prefix="rest-tokenizer")

    async def off_loop(fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)

    def forwarded(request: Request) -> tuple[tuple[str, str], ...]:
        auth = request.headers.get("authorization")
        return (("authorization", auth),) if auth else ()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The channel belongs to the serving event loop, so it is made here, not in build_app.
        # No wait_for_ready and no default deadline: an unreachable gateway is an immediate 503, and a
        # generation runs as long as its client keeps the HTTP request open (or its deadline header says).
        async with AsyncGatewayClient(gateway_address, timeout_s=None, wait_for_ready=False) as client:
            state["gateway"] = client
            state["health"] = health_pb2_grpc.HealthStub(client.channel)
            yield

    app = FastAPI(title="specdec OpenAI-compatible API", lifespan=lifespan)
    app.add_middleware(Guard, keys=keys, max_body=max_request_bytes, metrics_auth=metrics_auth, refused=refused)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError) -> JSONResponse:
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        return _validation_error(err).response()

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, err: HTTPException) -> JSONResponse:
        """Starlette's own errors (404 unknown route, 405 method, 400 unparsable body) in
        OpenAI's shape too, as vLLM's server answers them."""
        phrase = HTTPStatus(err.status_code).phrase
        return APIError(err.status_code, f"{err.detail} ({request.method} {request.url.path})",
                        code=phrase.lower().replace(" ", "_"), headers=dict(err.headers or {})).response()

    async def generate(req: _GenerationRequest, prompt_ids: list[int], shape: Shape, request: Request,
                       echo: str = "") -> Any:
        """Run one request through the gateway and answer it in `shape`."""
        if req.model and req.model != model_name:
            raise APIError(404, f"model: the model {req.model!r} does not exist; this server has {model_name!r}",
                           "model", code="model_not_found")
        metadata = forwarded(request)
        deadline_s = client_deadline_s(request.headers)
        request_id = req.request_id or uuid.uuid4().hex
        try:
            spec = convert.generation_spec(req, prompt_ids, request_id)
        except InvalidField as err:
            raise APIError(400, str(err), err.field) from err
        answer = Answer(
            shape, {"id": shape.id_prefix + request_id, "object": shape.object, "created": int(time.time()),
                    "model": model_name},
            prompt_ids, echo=echo, token_ids=bool(req.return_token_ids),
            logprobs=None if not spec.sampling.HasField("logprobs") else
            LogprobsShaper(tokenizer, spec.sampling.logprobs, bool(req.return_tokens_as_token_ids)),
        )
        if req.stream:
            chunks = await _open_stream(state["gateway"], spec, shape.prompt_param, metadata, deadline_s)
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return TimedStreamingResponse(
                stream_events(answer, chunks, include_usage), stream_write_timeout_s, media_type="text/event-stream",
                on_timeout=stream_write_timeouts.inc if stream_write_timeouts is not None else None)
        # as vLLM's `with_cancellation`: a client that goes away cancels its generation (the gRPC
        # call, so the gateway, the verifier's engine and the drafter stop working for it)
        call = asyncio.ensure_future(state["gateway"].generate(spec, metadata=metadata, timeout_s=deadline_s))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({call, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not call.done():  # the client went away first (or this handler is cancelled)
                call.cancel()
                call.add_done_callback(lambda task: task.cancelled() or task.exception())
        if not call.done():
            return Response(status_code=499)  # nobody reads it: the client is gone
        try:
            r = call.result()
        except grpc.aio.AioRpcError as err:
            raise grpc_error(err, shape.prompt_param) from err
        if answer.logprobs is not None:
            answer.logprobs.offset = len(echo)
        choice = answer.choice(echo + r.text, finish_reason_name(r.finish_reason), False, r.token_ids, r.logprobs)
        extra = {"prompt_token_ids": prompt_ids} if answer.token_ids and shape is CHAT else {}
        return {**answer.head, "choices": [choice], "usage": usage_dict(r.usage, r.stats), **extra,
                "metrics": metrics_dict(r.stats, len(r.token_ids), r.first_token_ms, r.total_ms)}

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest, request: Request) -> Any:
        refuse_surrogates(req)
        ids, text = await off_loop(completion_prompt, tokenizer, req)
        return await generate(req, ids, COMPLETION, request,
                              echo=text if req.echo and not req.return_token_ids else "")

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(req: ChatRequest, request: Request) -> Any:
        refuse_surrogates(req)
        ids = await off_loop(chat_prompt, tokenizer, req)
        return await generate(req, ids, CHAT, request, echo=chat_echo(req))

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
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

    if metrics_app is not None:
        app.mount("/metrics", metrics_app)  # behind Guard's key check when metrics_auth
    return app
