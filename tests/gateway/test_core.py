"""The gateway core's typed API (gateway.core) and its two adapters' mappings, on a scripted
core: a GatewayError (code, field, message) becomes a gRPC status + details (+ retry-after)
in GatewayServicer, and an HTTP status + OpenAI's error JSON naming the field (`param`) in
the REST bridge; chunks become messages, whole answers and server-sent events.

The scripted core (ScriptedCore) stands in for GatewayCore only here, where the adapters are
the component under test; tests/gateway/test_guard.py runs both adapters on a real core."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import grpc
import httpx
import pytest

from gateway.client import generation_spec
from gateway.core import Chunk, ErrorCode, GatewayError
from gateway.rest.routes import build_app
from gateway.rest.serving import HTTP_STATUS, api_error, openai_param
from gateway.server import GatewayServicer
from specdec.serving import SessionSlots
from specdec.wire import pb, rpc

TOP_P = GatewayError(ErrorCode.INVALID_ARGUMENT, "must be in (0, 1], got 1.5", "spec.sampling.top_p")
LIMITED = GatewayError(ErrorCode.RESOURCE_EXHAUSTED, "key-1234: over its rate limit", retry_after_s="3")
NO_VERIFIER = GatewayError(ErrorCode.UNAVAILABLE, "verifier: none serves within verifier_retry_s (30 s); retry later")
UNKNOWN_KEY = GatewayError(ErrorCode.UNAUTHENTICATED, "missing or unknown API key: send `authorization: Bearer <key>`")
LATE = GatewayError(ErrorCode.DEADLINE_EXCEEDED, "the client's deadline (0.5 s) passed")
MISFIT = GatewayError(ErrorCode.FAILED_PRECONDITION, "gateway tokenizer 'a' does not fit target 'b'")


def final(text: str, ids: list[int], completion_tokens: int) -> Chunk:
    """A final chunk, as GatewayCore ends a generation."""
    return Chunk(
        text,
        ids,
        0,
        0,
        pb.FINISH_REASON_LENGTH,
        request_id="r1",
        usage=pb.Usage(prompt_tokens=3, completion_tokens=completion_tokens),
        stats=pb.SpeculationStats(gamma=4, drafted_tokens=4, accepted_tokens=3, speculative_steps=1),
        first_token_ms=1.0,
        total_ms=2.0,
    )


HELLO = [Chunk("he", [7], 4, 3, pb.FINISH_REASON_UNSPECIFIED, request_id="r1"), final("llo", [8, 9], 3)]


class ScriptedCore:
    """A gateway core (gateway.core.Core, and what GatewayServicer reads of GatewayCore) whose
    generation yields `chunks` then raises `error`, if any; `calls` records each generate()."""

    def __init__(self, chunks: list[Chunk], error: GatewayError | None = None) -> None:
        self.chunks, self.error = chunks, error
        self.calls: list[dict[str, Any]] = []
        self.draining = False
        self.slots = SessionSlots("gateway", 0, "max_inflight")
        self.cfg = SimpleNamespace(stream_write_timeout_s=0.0)

    def serving(self) -> bool:
        return not self.draining

    def ended_by_drain(self, task: asyncio.Task[Any] | None) -> str | None:
        return self.slots.ended_by_drain(task)

    async def generate(
        self,
        spec: pb.GenerationSpec,
        *,
        authorization: str | None = None,
        parent: Any = None,
        deadline_s: float | None = None,
        stream: bool = False,
    ) -> AsyncIterator[Chunk]:
        self.calls.append({"spec": spec, "authorization": authorization, "deadline_s": deadline_s, "stream": stream})
        for chunk in self.chunks:
            yield chunk
        if self.error is not None:
            raise self.error

    async def close(self) -> None:
        pass


# ---------------------------------------------------------------------------- the error type


def test_a_gateway_error_carries_code_field_and_message_apart() -> None:
    assert (TOP_P.code, TOP_P.field, TOP_P.message) == (
        ErrorCode.INVALID_ARGUMENT,
        "spec.sampling.top_p",
        "must be in (0, 1], got 1.5",
    )
    assert str(TOP_P) == "spec.sampling.top_p: must be in (0, 1], got 1.5"  # the gRPC details
    assert str(NO_VERIFIER) == NO_VERIFIER.message and NO_VERIFIER.field is None
    assert {c.name for c in ErrorCode} == {c.name for c in grpc.StatusCode} - {"OK"}  # every gRPC code maps


@pytest.mark.parametrize(
    "field, prompt_param, param",
    [
        ("spec.sampling.top_p", "prompt", "top_p"),
        ("spec.sampling.max_tokens", "prompt", "max_tokens"),
        ("spec.stop[1]", "prompt", "stop"),
        ("spec.sampling.stop_token_ids[0]", "prompt", "stop_token_ids"),
        ("spec.gamma", "prompt", "gamma"),
        ("spec.prompt_token_ids", "prompt", "prompt"),
        ("spec.prompt_text", "messages", "messages"),
    ],
)
def test_a_spec_field_is_named_as_the_openai_field(field: str, prompt_param: str, param: str) -> None:
    assert openai_param(field, prompt_param) == param


@pytest.mark.parametrize(
    "err, status, param, type_, headers",
    [
        (TOP_P, 400, "top_p", "invalid_request_error", {}),
        (UNKNOWN_KEY, 401, None, "authentication_error", {"WWW-Authenticate": "Bearer"}),
        (LIMITED, 429, None, "rate_limit_error", {"Retry-After": "3"}),
        (NO_VERIFIER, 503, None, "server_error", {}),
        (LATE, 504, None, "server_error", {}),
        (MISFIT, 500, None, "server_error", {}),
    ],
)
def test_rest_maps_each_code_to_a_status_and_names_the_field(
    err: GatewayError, status: int, param: str | None, type_: str, headers: dict[str, str]
) -> None:
    mapped = api_error(err)
    assert (mapped.status, mapped.param, mapped.type, mapped.headers) == (status, param, type_, headers)
    assert mapped.code == err.code.name.lower() and mapped.message == str(err)
    assert set(HTTP_STATUS) <= set(ErrorCode)


# ---------------------------------------------------------------------------- the gRPC adapter


async def _grpc(core: ScriptedCore, call: Callable[[Any], Any]) -> Any:
    """`call(stub)` against GatewayServicer(core) on a loopback port."""
    server = grpc.aio.server()
    rpc.add_GatewayServiceServicer_to_server(GatewayServicer(core), server)  # type: ignore[arg-type]  # scripted core
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            return await call(rpc.GatewayServiceStub(channel))
    finally:
        await server.stop(0)


REQUEST = pb.GenerateRequest(spec=generation_spec([1, 2, 3], max_tokens=3))


@pytest.mark.parametrize(
    "err, code, retry",
    [
        (TOP_P, grpc.StatusCode.INVALID_ARGUMENT, None),
        (LIMITED, grpc.StatusCode.RESOURCE_EXHAUSTED, "3"),
        (NO_VERIFIER, grpc.StatusCode.UNAVAILABLE, None),
        (MISFIT, grpc.StatusCode.FAILED_PRECONDITION, None),
    ],
)
@pytest.mark.parametrize("streaming", [False, True])
def test_grpc_maps_the_error_to_its_status_and_details(
    err: GatewayError, code: grpc.StatusCode, retry: str | None, streaming: bool
) -> None:
    core = ScriptedCore([HELLO[0]] if streaming else [], err)

    async def call(stub: Any) -> tuple[list[Any], grpc.aio.AioRpcError]:
        got: list[Any] = []
        with pytest.raises(grpc.aio.AioRpcError) as info:
            if streaming:
                async for message in stub.GenerateStream(
                    pb.GenerateStreamRequest(spec=REQUEST.spec), metadata=(("authorization", "Bearer k"),), timeout=30
                ):
                    got.append(message)
            else:
                await stub.Generate(REQUEST, metadata=(("authorization", "Bearer k"),), timeout=30)
        return got, info.value

    got, error = asyncio.run(_grpc(core, call))
    assert error.code() == code and error.details() == str(err)
    assert dict(error.trailing_metadata() or ()).get("retry-after") == retry
    assert [m.text for m in got] == (["he"] if streaming else [])  # what came before the error
    assert core.calls[0]["authorization"] == "Bearer k" and core.calls[0]["stream"] is streaming


def test_grpc_sends_chunks_as_messages_and_sums_them_in_generate() -> None:
    async def call(stub: Any) -> tuple[Any, list[Any]]:
        whole = await stub.Generate(REQUEST, timeout=30)
        parts = [m async for m in stub.GenerateStream(pb.GenerateStreamRequest(spec=REQUEST.spec), timeout=30)]
        return whole, parts

    whole, parts = asyncio.run(_grpc(ScriptedCore(HELLO), call))
    assert (whole.text, list(whole.token_ids), whole.request_id) == ("hello", [7, 8, 9], "r1")
    assert whole.finish_reason == pb.FINISH_REASON_LENGTH and whole.usage.completion_tokens == 3
    assert whole.stats.accepted_tokens == 3 and (whole.first_token_ms, whole.total_ms) == (1.0, 2.0)
    assert [(m.text, m.drafted, m.HasField("stats")) for m in parts] == [("he", 4, False), ("llo", 0, True)]


# ---------------------------------------------------------------------------- the REST adapter


class Tok:
    """Token id n decodes to the n-th letter (the REST bridge decodes a token-id prompt for echo)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


@contextlib.asynccontextmanager
async def rest(core: ScriptedCore) -> AsyncIterator[httpx.AsyncClient]:
    app = build_app(core, Tok(), "m")  # type: ignore[arg-type]  # the scripted core fits gateway.core.Core
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://rest") as client:
        yield client


BODY = {"prompt": [1, 2, 3], "max_tokens": 3}


@pytest.mark.parametrize(
    "err, status, param",
    [
        (TOP_P, 400, "top_p"),
        (LIMITED, 429, None),
        (UNKNOWN_KEY, 401, None),
        (NO_VERIFIER, 503, None),
        (LATE, 504, None),
    ],
)
@pytest.mark.parametrize("streaming", [False, True])
def test_rest_answers_an_error_before_the_first_chunk_as_plain_http(
    err: GatewayError, status: int, param: str | None, streaming: bool
) -> None:
    core = ScriptedCore([], err)

    async def run() -> httpx.Response:
        async with rest(core) as client:
            return await client.post(
                "/v1/completions",
                json={**BODY, "stream": streaming},
                headers={"authorization": "Bearer k", "x-request-timeout": "7"},
            )

    r = asyncio.run(run())
    assert r.status_code == status and r.json()["error"]["param"] == param
    assert r.json()["error"]["message"] == str(err) and r.json()["error"]["code"] == err.code.name.lower()
    if err is LIMITED:
        assert r.headers["retry-after"] == "3"
    (call,) = core.calls
    assert (call["authorization"], call["deadline_s"], call["stream"]) == ("Bearer k", 7.0, streaming)
    assert list(call["spec"].prompt_token_ids) == [1, 2, 3] and call["spec"].sampling.max_tokens == 3


def _events(r: httpx.Response) -> list[Any]:
    return [
        json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
        for line in r.text.splitlines()
        if line.startswith("data: ")
    ]


def test_rest_sends_an_error_after_the_first_chunk_as_an_event_naming_the_field() -> None:
    err = GatewayError(ErrorCode.INVALID_ARGUMENT, "too many", "spec.stop[2]")

    async def run() -> httpx.Response:
        async with rest(ScriptedCore([HELLO[0]], err)) as client:
            return await client.post("/v1/completions", json={**BODY, "stream": True})

    r = asyncio.run(run())
    assert r.status_code == 200
    events = _events(r)
    assert events[0]["choices"][0]["text"] == "he"
    assert events[-1] == {
        "error": {
            "message": "spec.stop[2]: too many",
            "type": "invalid_request_error",
            "param": "stop",
            "code": "invalid_argument",
        }
    }


def test_rest_shapes_the_chunks_whole_and_as_events() -> None:
    async def run() -> tuple[httpx.Response, httpx.Response]:
        async with rest(ScriptedCore(HELLO)) as client:
            whole = await client.post("/v1/completions", json=BODY)
            events = await client.post(
                "/v1/completions", json={**BODY, "stream": True, "stream_options": {"include_usage": True}}
            )
            return whole, events

    whole, stream = asyncio.run(run())
    body = whole.json()
    assert body["choices"][0]["text"] == "hello" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3 and body["usage"]["speculation"]["accepted_tokens"] == 3
    assert body["metrics"]["speculative_decoding"]["num_draft_tokens"] == 4
    *chunks, usage, done = _events(stream)
    assert [c["choices"][0]["text"] for c in chunks] == ["he", "llo"] and done == "[DONE]"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3


def test_rest_health_follows_the_core() -> None:
    core = ScriptedCore([])

    async def run() -> list[int]:
        async with rest(core) as client:
            up = (await client.get("/health")).status_code
            core.draining = True
            return [up, (await client.get("/health")).status_code]

    assert asyncio.run(run()) == [200, 503]
