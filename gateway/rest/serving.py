"""The REST bridge's serving logic: a request in, GatewayCore calls, OpenAI's answers out.

`OpenAIServing` turns a parsed request (gateway.rest.protocol) into a GenerationSpec
(gateway.convert.generation_spec, the bridge's one converter), runs it on the core
in-process (`Core.generate`, gateway.core) and shapes the chunks as OpenAI's completions or
chat completions, whole or as server-sent events.
A GatewayError becomes an HTTP status and OpenAI's error JSON in one place (`api_error`): its
field (a GenerationSpec path) is named as the OpenAI field it came from (`param`).

Speculation stats: `metrics.speculative_decoding` carries them under vLLM's names
(mean_acceptance_length, draft_acceptance_rate, acceptance_histogram, num_spec_steps,
num_accepted_draft_tokens, num_draft_tokens, num_spec_tokens), beside vLLM's per-request
timings, where vLLM puts them (the response; the last usage chunk of a stream);
`usage.speculation` keeps specdec's own SpeculationStats (an alias kept for older clients).
(vLLM's counterpart: vllm/entrypoints/openai/serving_completion.py, serving_chat.py.)
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import Executor
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, cast

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import Counter

from gateway import convert
from gateway.client import stats_dict, vllm_spec_metrics
from gateway.convert import REFUSED
from gateway.core import Chunk, Core, ErrorCode, GatewayError
from gateway.rest.protocol import APIError, ChatRequest, CompletionRequest, GenerationRequest
from gateway.text import Tokenizer
from specdec.validation import InvalidField
from specdec.wire import finish_reason_name, pb

log = logging.getLogger("specdec.gateway")


# ---------------------------------------------------------------------------- errors


# the core's error code -> (HTTP status, OpenAI error type); any other code: 500, server_error
HTTP_STATUS: dict[ErrorCode, tuple[int, str]] = {
    ErrorCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    ErrorCode.UNAUTHENTICATED: (401, "authentication_error"),
    ErrorCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    ErrorCode.UNAVAILABLE: (503, "server_error"),
    ErrorCode.DEADLINE_EXCEEDED: (504, "server_error"),
}


def openai_param(field_path: str, prompt_param: str) -> str:
    """The OpenAI field a GenerationSpec field path comes from: the path's last name without
    its index (spec.sampling.top_p -> top_p, spec.stop[1] -> stop); a prompt field is the
    endpoint's prompt (`prompt_param`: prompt, or messages for chat)."""
    name = field_path.rsplit(".", 1)[-1].split("[", 1)[0]
    return prompt_param if name.startswith("prompt") else name


def api_error(err: GatewayError, prompt_param: str = "prompt") -> APIError:
    """A GatewayError as OpenAI's error: the status by code (HTTP_STATUS), `param` naming the
    field at fault, `code` the core's code in lower case; Retry-After (429) and
    WWW-Authenticate (401) headers as HTTP has them."""
    status, type_ = HTTP_STATUS.get(err.code, (500, "server_error"))
    param = openai_param(err.field, prompt_param) if err.field else None
    headers = {}
    if err.code is ErrorCode.RESOURCE_EXHAUSTED:
        headers["Retry-After"] = err.retry_after_s or "1"
    if err.code is ErrorCode.UNAUTHENTICATED:
        headers["WWW-Authenticate"] = "Bearer"
    return APIError(status, str(err), param, type_, err.code.name.lower(), headers)


# ---------------------------------------------------------------------------- prompts


def completion_prompt(tokenizer: Tokenizer, req: CompletionRequest) -> tuple[list[int], str]:
    """A completion's prompt as token ids (the text tokenised as vLLM does: special tokens
    added unless add_special_tokens is false) and as text (for `echo`); one prompt per request."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) > 1:
            raise APIError(
                400,
                f"prompt: batches of prompts are not supported ({len(prompt)} given); send one prompt per request",
                "prompt",
            )
        prompt = prompt[0]
    if req.echo and req.logprobs is not None:
        raise APIError(
            400,
            "echo: echo with logprobs needs the prompt's log-probabilities, which specdec "
            "does not compute; drop echo or logprobs",
            "echo",
        )
    if isinstance(prompt, str):
        ids = list(tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens is not False))
        return ids, prompt
    ids = cast("list[int]", prompt)  # token ids: the text forms (a str, a list of one str) returned above
    for i, t in enumerate(ids):  # the gateway checks the vocabulary; these cannot even be decoded
        if not 0 <= t <= 2**31 - 1:
            raise APIError(400, f"prompt: token id {t} at index {i} is outside the vocabulary", "prompt")
    return list(ids), tokenizer.decode(ids)


def chat_prompt(tokenizer: Tokenizer, req: ChatRequest) -> list[int]:
    """The chat rendered by the tokenizer's template, as token ids (the template already
    holds any special tokens, so none are added unless add_special_tokens is true)."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "messages: this model's tokenizer has no chat template; use /v1/completions", "messages")
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError(
            400,
            "continue_final_message: cannot be combined with add_generation_prompt "
            "(set add_generation_prompt to false), as in vLLM",
            "continue_final_message",
        )
    kwargs = dict(req.chat_template_kwargs or {})
    if kwargs.get("chat_template") is not None:  # the refused field, passed another way (vLLM refuses it too)
        raise APIError(
            400,
            f"chat_template_kwargs: chat_template: not supported: {REFUSED['chat_template'][1]}",
            "chat_template_kwargs",
        )
    if req.documents is not None:
        kwargs["documents"] = req.documents
    try:
        text = tokenizer.apply_chat_template(
            [m.template_dict() for m in req.messages],
            tokenize=False,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            **kwargs,
        )
    except Exception as err:  # jinja2's TemplateError (raise_exception in templates) or ValueError
        raise APIError(400, f"messages: the chat template rejected them: {err}", "messages") from err
    return list(tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens)))


def chat_echo(req: ChatRequest) -> str:
    """What vLLM's chat `echo` prepends: the last message's content when it is the assistant's."""
    if not req.echo or req.messages[-1].role != "assistant":
        return ""
    return req.messages[-1].template_dict()["content"]


# ---------------------------------------------------------------------------- logprobs


def _token_text(tokenizer: Tokenizer, token_id: int, as_id: bool, context: Sequence[int] = ()) -> str:
    """A token as vLLM's server names it: "token_id:N" (return_tokens_as_token_ids), or its own
    text; a token that decodes to an incomplete UTF-8 character (a byte-fallback piece, ending in
    U+FFFD) is decoded after the sampled tokens before it (`context`, at most 4), and is "" when
    they do not complete it (vllm/v1/engine/logprobs.py: _correct_decoded_token)."""
    if as_id:
        return f"token_id:{token_id}"
    text: str = tokenizer.decode([token_id])
    if not text.endswith("\ufffd"):
        return text
    context = list(context)[-4:]
    for n in range(1, len(context) + 1):
        ctx = context[-n:]
        full: str = tokenizer.decode(ctx + [token_id])
        if full.endswith("\ufffd"):
            continue
        clean_end = len(ctx)  # context tokens that were incomplete themselves belong to this one
        for j in range(len(ctx) - 1, -1, -1):
            if tokenizer.decode([ctx[j]]).endswith("\ufffd"):
                clean_end = j
            else:
                break
        prefix: str = tokenizer.decode(ctx[:clean_end]) if clean_end else ""
        if full.startswith(prefix):
            return full[len(prefix) :]
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

    tokenizer: Tokenizer
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
            content.append(
                {
                    "token": token,
                    "logprob": _clamp(lp.logprob),
                    "bytes": list(token.encode("utf-8", "replace")),
                    "top_logprobs": [
                        {"token": t, "logprob": v, "bytes": list(t.encode("utf-8", "replace"))} for t, v in top
                    ],
                }
            )
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


COMPLETION = Shape(
    "text_completion", "text_completion", "cmpl-", "prompt", _completion_choice, LogprobsShaper.completion
)
CHAT = Shape(
    "chat.completion",
    "chat.completion.chunk",
    "chatcmpl-",
    "messages",
    _chat_choice,
    LogprobsShaper.chat,
    opening_delta={"role": "assistant", "content": ""},
)


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

    def choice(
        self, text: str, finish: str | None, streaming: bool, ids: Sequence[int], logprobs: Sequence["pb.TokenLogprobs"]
    ) -> dict[str, Any]:
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
    present), or None. It becomes the generation's deadline (`deadline_s`), so a generation the client
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


class EventStreamResponse(StreamingResponse):
    """Server-sent events, sent from the task that serves the request (Starlette's
    StreamingResponse iterates in a task of its own): so one generation runs in one task, from
    its first chunk, read before the status line, to its end, and the drain at shutdown
    (serving.SessionSlots) finds it there. A client that disconnects cancels that task (the
    generation stops: its verifier and drafter calls are cancelled, its slot freed).

    Each message must be taken within `write_timeout_s` (0: no limit). A client that stops
    reading fills the socket's buffers and the next send waits; past the timeout the events
    (and with them the generation) are closed and the response ends unfinished (the server
    then closes the connection). `on_timeout()` is called once when that happens.

    A generation that outlives the drain at shutdown ends with an error event saying so
    (`ended_by_drain(task)`: the notice, Core.ended_by_drain), wherever the drain's cancel finds
    it: waiting for tokens (the events send it) or writing a message (sent here)."""

    def __init__(
        self,
        events: AsyncGenerator[str, None],
        write_timeout_s: float,
        on_timeout: Callable[[], None] | None = None,
        ended_by_drain: Callable[[asyncio.Task[Any] | None], str | None] | None = None,
    ) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.events, self.write_timeout_s, self.on_timeout = events, write_timeout_s, on_timeout
        self.ended_by_drain = ended_by_drain

    async def _send(self, send: Callable[..., Any], message: dict[str, Any]) -> None:
        timeout = self.write_timeout_s
        if timeout <= 0:
            await send(message)
            return
        sending = asyncio.ensure_future(send(message))
        done, _ = await asyncio.wait({sending}, timeout=timeout)
        if done:
            sending.result()
            return
        sending.cancel()
        raise ClientStalled(f"the client read nothing for stream_write_timeout_s ({timeout:g} s)")

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        task = asyncio.current_task()
        assert task is not None  # an ASGI call runs in a task
        state = {"gone": False, "done": False}

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if not state["done"]:
                state["gone"] = True
                task.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for event in self.events:
                await self._send(send, {"type": "http.response.body", "body": event.encode(), "more_body": True})
            state["done"] = True
            await self._send(send, {"type": "http.response.body", "body": b"", "more_body": False})
        except ClientStalled as stalled:
            if self.on_timeout is not None:
                self.on_timeout()
            log.warning("REST stream ended: %s", stalled)
        except OSError:  # the client is gone (a send after its disconnect)
            pass
        except asyncio.CancelledError:
            if state["gone"]:
                task.uncancel()  # our own cancel: the client went away
                return
            notice = self.ended_by_drain(task) if self.ended_by_drain is not None else None
            if notice is None:
                raise
            task.uncancel()  # the drain's cancel: say so, as an error event (the status line is gone)
            error = _sse(api_error(GatewayError(ErrorCode.UNAVAILABLE, notice)).body())
            try:
                await send({"type": "http.response.body", "body": error.encode(), "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:
                pass  # the client is gone too
        finally:
            state["done"] = True
            watcher.cancel()
            await self.events.aclose()  # ends the generation now, not at GC


async def stream_events(
    answer: Answer, first: Chunk | None, chunks: AsyncGenerator[Chunk, None], include_usage: bool
) -> AsyncGenerator[str, None]:
    """The server-sent events of one streamed generation (`first`, already read, then `chunks`):
    an event per chunk with text or a finish reason, the usage chunk (with vLLM's `metrics`) when
    asked for, then [DONE]. An error after the first byte is sent as an error event (the status
    line is gone by then)."""
    shape, head = answer.shape, {**answer.head, "object": answer.shape.chunk_object}
    extra = {"usage": None} if include_usage else {}
    if shape.opening_delta is not None:
        yield _sse(
            {
                **head,
                "choices": [{"index": 0, "delta": shape.opening_delta, "logprobs": None, "finish_reason": None}],
                **extra,
            }
        )
    if answer.echo:
        yield _sse({**head, "choices": [answer.choice(answer.echo, None, True, [], [])], **extra})
        if answer.logprobs is not None:
            answer.logprobs.offset += len(answer.echo)
    last, first_ms, tokens = None, 0.0, 0
    async with aclosing(chunks):  # leaving early (client gone) ends the generation now, not at GC
        try:
            chunk = first
            while chunk is not None:
                finish = finish_reason_name(chunk.finish_reason)
                if chunk.token_ids and not first_ms:
                    first_ms = (time.perf_counter() - answer.started) * 1e3
                tokens += len(chunk.token_ids)
                if chunk.text or finish or chunk.logprobs or (answer.token_ids and chunk.token_ids):
                    choice = answer.choice(chunk.text, finish, True, chunk.token_ids, chunk.logprobs)
                    yield _sse({**head, "choices": [choice], **extra})
                last = chunk
                chunk = await anext(chunks, None)
        except GatewayError as err:
            yield _sse(api_error(err, shape.prompt_param).body())
            return
    if include_usage and last is not None and last.usage is not None and last.stats is not None:
        total_ms = (time.perf_counter() - answer.started) * 1e3
        yield _sse(
            {
                **head,
                "choices": [],
                "usage": usage_dict(last.usage, last.stats),
                "metrics": metrics_dict(last.stats, tokens, first_ms, total_ms),
            }
        )
    yield _sse("[DONE]")


async def _disconnected(request: Request) -> None:
    """Return when the client of `request` (its body already read) disconnects."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(chunks: AsyncGenerator[Chunk, None]) -> list[Chunk]:
    async with aclosing(chunks):
        return [chunk async for chunk in chunks]


# ---------------------------------------------------------------------------- serving


class OpenAIServing:
    """OpenAI's completions and chat completions on a gateway core (`core`, in-process).

    `tokenizer` (the target's) tokenises prompts and renders chat templates, on
    `tokenizer_executor`, never on the event loop that carries every stream; `model_name` is the
    model id the API reports and accepts. A streamed answer's client must take each message
    within `stream_write_timeout_s` (0: no limit; EventStreamResponse), counted in
    `stream_write_timeouts`."""

    def __init__(
        self,
        core: Core,
        tokenizer: Tokenizer,
        model_name: str,
        tokenizer_executor: Executor,
        stream_write_timeout_s: float = 0.0,
        stream_write_timeouts: Counter | None = None,
    ) -> None:
        self.core, self.tokenizer, self.model_name = core, tokenizer, model_name
        self.executor = tokenizer_executor
        self.stream_write_timeout_s, self.stream_write_timeouts = stream_write_timeout_s, stream_write_timeouts

    async def _off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def completions(self, req: CompletionRequest, request: Request) -> Any:
        ids, text = await self._off_loop(completion_prompt, self.tokenizer, req)
        echo = text if req.echo and not req.return_token_ids else ""
        return await self.generate(req, ids, COMPLETION, request, echo=echo)

    async def chat(self, req: ChatRequest, request: Request) -> Any:
        ids = await self._off_loop(chat_prompt, self.tokenizer, req)
        return await self.generate(req, ids, CHAT, request, echo=chat_echo(req))

    async def generate(
        self, req: GenerationRequest, prompt_ids: list[int], shape: Shape, request: Request, echo: str = ""
    ) -> Any:
        """Run one request on the core and answer it in `shape`. The caller's `Authorization`
        goes to the core (which checks the key again and applies its rate limits); a deadline
        header (DEADLINE_HEADERS) becomes the generation's deadline."""
        if req.model and req.model != self.model_name:
            raise APIError(
                404,
                f"model: the model {req.model!r} does not exist; this server has {self.model_name!r}",
                "model",
                code="model_not_found",
            )
        deadline_s = client_deadline_s(request.headers)
        request_id = req.request_id or uuid.uuid4().hex
        try:
            spec = convert.generation_spec(req, prompt_ids, request_id)
        except InvalidField as err:  # named by its OpenAI field already
            raise APIError(400, str(err), err.field) from err
        answer = Answer(
            shape,
            {
                "id": shape.id_prefix + request_id,
                "object": shape.object,
                "created": int(time.time()),
                "model": self.model_name,
            },
            prompt_ids,
            echo=echo,
            token_ids=bool(req.return_token_ids),
            logprobs=None
            if not spec.sampling.HasField("logprobs")
            else LogprobsShaper(self.tokenizer, spec.sampling.logprobs, bool(req.return_tokens_as_token_ids)),
        )
        authorization = request.headers.get("authorization")
        if req.stream:
            # the first chunk is read before the status line, so a refused request gets a plain HTTP error
            stream = self.core.generate(spec, authorization=authorization, deadline_s=deadline_s, stream=True)
            try:
                first = await anext(stream, None)
            except GatewayError as err:
                raise api_error(err, shape.prompt_param) from err
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            timeouts = self.stream_write_timeouts
            return EventStreamResponse(
                stream_events(answer, first, stream, include_usage),
                self.stream_write_timeout_s,
                on_timeout=timeouts.inc if timeouts is not None else None,
                ended_by_drain=self.core.ended_by_drain,
            )
        # as vLLM's `with_cancellation`: a client that goes away cancels its generation (the
        # core's, so the verifier's engine and the drafter stop working for it)
        call = asyncio.ensure_future(
            _collect(self.core.generate(spec, authorization=authorization, deadline_s=deadline_s))
        )
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
            chunks = call.result()
        except GatewayError as err:
            raise api_error(err, shape.prompt_param) from err
        last = chunks[-1] if chunks else Chunk("", [], 0, 0, pb.FINISH_REASON_UNSPECIFIED)
        text = "".join(c.text for c in chunks)
        token_ids = [t for c in chunks for t in c.token_ids]
        logprobs = [lp for c in chunks for lp in c.logprobs]
        if answer.logprobs is not None:
            answer.logprobs.offset = len(echo)
        choice = answer.choice(echo + text, finish_reason_name(last.finish_reason), False, token_ids, logprobs)
        extra = {"prompt_token_ids": prompt_ids} if answer.token_ids and shape is CHAT else {}
        usage = last.usage or pb.Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(token_ids))
        stats = last.stats or pb.SpeculationStats()
        return {
            **answer.head,
            "choices": [choice],
            "usage": usage_dict(usage, stats),
            **extra,
            "metrics": metrics_dict(stats, len(token_ids), last.first_token_ms, last.total_ms),
        }
