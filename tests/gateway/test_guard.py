"""The gateway's guards, on a real in-process gateway (its core, with the gRPC and REST adapters) with no verifier
behind it: what is refused before any work (bounds, API keys, body size), what a client hears
when no verifier serves, and the warnings of an exposed set-up.

No verifier runs: a request that passes every check ends with UNAVAILABLE after
verifier_retry_s, so "refused before any work" is told apart from "refused by the verifier".
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from gateway.client import generation_spec
from gateway.core import Chunk
from gateway.rest.routes import build_app
from gateway.server import GatewayCore, GatewayServicer, build
from specdec.config import GatewayConfig
from specdec.serving import SessionSlots
from specdec.validation import (
    MAX_REQUEST_ID_CHARS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from specdec.wire import pb, rpc

RETRY_S = 0.3  # verifier_retry_s of these gateways
KEY = "sk-guard-1"


class CountingTokenizer:
    """The real tokenizer, counting the calls that tokenise or template, and the threads they ran on."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.calls: list[tuple[str, int]] = []  # (method, thread id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(("encode", threading.get_ident()))
        return self._tokenizer.encode(*args, **kwargs)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(("apply_chat_template", threading.get_ident()))
        return self._tokenizer.apply_chat_template(*args, **kwargs)


class Gateway:
    """A GatewayCore, its gRPC servicer on a loopback port, its REST app (over httpx's ASGI transport)."""

    def __init__(self, core: GatewayCore, address: str, app: Any, tokenizer: CountingTokenizer) -> None:
        self.core, self.address, self.app, self.tokenizer = core, address, app, tokenizer
        self.rest = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://rest")


@contextlib.asynccontextmanager
async def gateway(
    tiny_target: Path,
    keys: str = "",
    max_request_mb: float = 8.0,
    **overrides: Any,
) -> AsyncIterator[Gateway]:
    # nothing listens there: a port this test holds bound without listening (connections are
    # refused), so no other process of a busy host can take it and answer as a verifier
    hold = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    hold.bind(("127.0.0.1", 0))
    nowhere = f"127.0.0.1:{hold.getsockname()[1]}"
    cfg = GatewayConfig(
        **{
            "tokenizer": str(tiny_target),
            "verifier_address": nowhere,
            "drafter_address": nowhere,
            "verifier_retry_s": RETRY_S,
            "rest_port": 0,
            "metrics_port": 0,
            "api_keys": keys,
            "max_request_mb": max_request_mb,
            **overrides,
        }
    )
    core = build(cfg, CollectorRegistry())
    server = grpc.aio.server()
    rpc.add_GatewayServiceServicer_to_server(GatewayServicer(core), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    tokenizer = CountingTokenizer(core.tokenizer)
    app = build_app(
        core,
        tokenizer,
        cfg.tokenizer,
        keys=core.keys,
        max_request_bytes=int(max_request_mb * (1 << 20)),
        tokenizer_executor=core.tokenizer_executor,
        refused=core.metrics.refused,
        stream_write_timeout_s=cfg.stream_write_timeout_s,
        stream_write_timeouts=core.metrics.stream_write_timeouts,
    )
    try:
        gw = Gateway(core, f"127.0.0.1:{port}", app, tokenizer)
        async with gw.rest:
            yield gw
    finally:
        await server.stop(0)
        await core.close()
        hold.close()


async def grpc_error(address: str, spec: pb.GenerationSpec, metadata: tuple = ()) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await rpc.GatewayServiceStub(channel).Generate(pb.GenerateRequest(spec=spec), metadata=metadata, timeout=60)
    return info.value


# ---------------------------------------------------------------------------- bounds


def test_bounds_are_refused_by_name_before_any_work(tiny_target: Path) -> None:
    """Over gRPC INVALID_ARGUMENT naming the field, over REST 400 with `param`, with no verifier
    asked (none runs: a request that passed would end UNAVAILABLE)."""
    cases = [  # (spec fields, the gRPC field, the REST body's fields, the REST param)
        ({"request_id": "a b"}, "spec.request_id", {"request_id": "a b"}, "request_id"),
        ({"request_id": "line\nbreak"}, "spec.request_id", {"request_id": "line\nbreak"}, "request_id"),
        (
            {"request_id": "x" * (MAX_REQUEST_ID_CHARS + 1)},
            "spec.request_id",
            {"request_id": "x" * (MAX_REQUEST_ID_CHARS + 1)},
            "request_id",
        ),
        (
            {"stop": ["s"] * (MAX_STOP_STRINGS + 1)},
            "spec.sampling.stop",
            {"stop": ["s"] * (MAX_STOP_STRINGS + 1)},
            "stop",
        ),
        (
            {"stop": ["x" * (MAX_STOP_STRING_CHARS + 1)]},
            "spec.sampling.stop[0]",
            {"stop": "x" * (MAX_STOP_STRING_CHARS + 1)},
            "stop",
        ),
        (
            {"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)},
            "spec.sampling.stop_token_ids",
            {"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)},
            "stop_token_ids",
        ),
    ]

    async def run() -> None:
        async with gateway(tiny_target) as gw:
            for spec_fields, field, body, param in cases:
                err = await grpc_error(gw.address, generation_spec([1, 2, 3], max_tokens=4, **spec_fields))
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, err.code(), err.details())
                assert err.details().startswith(f"{field}:"), err.details()
                r = await gw.rest.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, **body})
                assert r.status_code == 400 and r.json()["error"]["param"] == param, (param, r.text)
            r = await gw.rest.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "n": 2})
            assert r.status_code == 400 and r.json()["error"]["param"] == "n"

    asyncio.run(run())


def test_bounds_driven_by_hypothesis_over_rest(tiny_target: Path) -> None:
    """Random stop lists, stop_token_ids and request ids through the REST bridge and the gateway:
    400 naming the first field over its bound exactly when one is; otherwise the request passes
    every check (and, with no verifier, ends 503). One gateway serves every example (a service
    keeps serving after bad input), on one event loop kept for the test."""
    runner = asyncio.Runner()
    stack = contextlib.AsyncExitStack()
    gw = runner.run(stack.enter_async_context(gateway(tiny_target)))
    chars = st.sampled_from("aZ9._:-") | st.sampled_from(" \n\t/\u00e9\x00")

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        stops=st.integers(0, MAX_STOP_STRINGS + 3),
        longest=st.integers(1, MAX_STOP_STRING_CHARS + 3),
        ids=st.integers(0, MAX_STOP_TOKEN_IDS + 3),
        request_id=st.text(chars, min_size=1, max_size=8)
        | st.integers(MAX_REQUEST_ID_CHARS - 2, MAX_REQUEST_ID_CHARS + 2).map(lambda n: "r" * n),
    )
    def check(stops: int, longest: int, ids: int, request_id: str) -> None:
        body: dict[str, Any] = {
            "prompt": [1, 2, 3],
            "max_tokens": 2,
            "request_id": request_id,
            "stop": (["x" * longest] + ["s"] * (stops - 1)) if stops else [],
            "stop_token_ids": [1] * ids,
        }
        bad_id = len(request_id) > MAX_REQUEST_ID_CHARS or any(c not in "aZr9._:-" for c in request_id)
        over = ["request_id"] if bad_id else []
        if stops > MAX_STOP_STRINGS or (stops and longest > MAX_STOP_STRING_CHARS):
            over.append("stop")
        if ids > MAX_STOP_TOKEN_IDS:
            over.append("stop_token_ids")

        r = runner.run(gw.rest.post("/v1/completions", json=body))
        if over:
            assert r.status_code == 400 and r.json()["error"]["param"] == over[0], (over, r.text)
        else:
            assert r.status_code == 503, r.text  # every check passed; no verifier serves

    try:
        check()
    finally:
        runner.run(stack.aclose())
        runner.close()


# ---------------------------------------------------------------------------- no verifier


def test_no_verifier_is_unavailable_within_verifier_retry_s_naming_no_address(tiny_target: Path) -> None:
    async def run() -> tuple[grpc.aio.AioRpcError, float, str]:
        async with gateway(tiny_target) as gw:
            t0 = time.monotonic()
            err = await grpc_error(gw.address, generation_spec([1, 2, 3], max_tokens=4))
            return err, time.monotonic() - t0, gw.core.cfg.verifier_address

    err, took, address = asyncio.run(run())
    assert err.code() == grpc.StatusCode.UNAVAILABLE, (err.code(), err.details())
    assert "verifier_retry_s" in err.details()
    assert address not in err.details() and address.rsplit(":", 1)[1] not in err.details()
    assert took < 10 * max(RETRY_S, 1.0)  # within verifier_retry_s (the bound: 10x, for a loaded host)


def test_a_draining_gateway_refuses_both_adapters_and_its_health_says_so(tiny_target: Path) -> None:
    """Once the drain began (serving.serve at SIGTERM), the one core refuses new generations from
    both adapters: gRPC UNAVAILABLE, REST 503 with the same message, and REST /health is 503."""

    async def run() -> tuple[grpc.aio.AioRpcError, httpx.Response, int, int]:
        async with gateway(tiny_target) as gw:
            up = (await gw.rest.get("/health")).status_code
            gw.core.slots.draining = True  # what SessionSlots.drain sets first
            err = await grpc_error(gw.address, generation_spec([1, 2, 3], max_tokens=4))
            r = await gw.rest.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4})
            return err, r, up, (await gw.rest.get("/health")).status_code

    err, r, up, down = asyncio.run(run())
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.details()
    assert r.status_code == 503 and r.json()["error"]["message"] == err.details()
    assert (up, down) == (200, 503)


# ---------------------------------------------------------------------------- exposure warnings


def test_an_exposed_gateway_is_warned_about(tiny_target: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Off loopback without API keys; plaintext to a verifier and drafters on other hosts."""

    async def run(**overrides: Any) -> None:
        cfg = GatewayConfig(tokenizer=str(tiny_target), rest_port=0, metrics_port=0, **overrides)
        await build(cfg, CollectorRegistry()).close()

    with caplog.at_level("WARNING", logger="specdec.gateway"):
        asyncio.run(
            run(host="0.0.0.0", verifier_address="10.9.8.7:50053", drafter_address="dns:///drafter.specdec:50052")
        )
    text = "\n".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert "NO API KEYS" in text
    assert "PLAINTEXT gRPC to the verifiers on 10.9.8.7" in text
    assert "PLAINTEXT gRPC to the drafters on drafter.specdec" in text
    caplog.clear()
    with caplog.at_level("WARNING", logger="specdec.gateway"):
        asyncio.run(run())  # loopback everywhere: nothing to warn about
    assert not [r for r in caplog.records if r.levelname == "WARNING" and r.name == "specdec.gateway"]


# ---------------------------------------------------------------------------- REST: key, then body


async def asgi_call(
    app: Any,
    path: str,
    headers: dict[str, str],
    chunks: list[bytes],
) -> tuple[int, dict[str, str], bytes, int]:
    """One raw ASGI request: (status, headers, body, how many times the app read the request)."""
    reads = 0
    pending = list(chunks)

    async def receive() -> dict[str, Any]:
        nonlocal reads
        reads += 1
        chunk = pending.pop(0) if pending else b""
        return {"type": "http.request", "body": chunk, "more_body": bool(pending)}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 1),
        "server": ("rest", 80),
    }
    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, body, reads


def test_rest_answers_401_before_reading_the_body_and_never_tokenises(tiny_target: Path) -> None:
    big = b'{"prompt": "' + b"word " * 100_000 + b'", "max_tokens": 4}'

    async def run() -> CountingTokenizer:
        async with gateway(tiny_target, keys=KEY) as gw:
            for path in ("/v1/completions", "/v1/chat/completions"):
                for auth in ({}, {"authorization": "Bearer sk-wrong"}):
                    headers = {"content-type": "application/json", "content-length": str(len(big)), **auth}
                    status, response_headers, _, reads = await asgi_call(gw.app, path, headers, [big])
                    assert (status, reads) == (401, 0), (path, auth, status, reads)
                    assert response_headers["www-authenticate"] == "Bearer"
            r = await gw.rest.get("/v1/models")
            assert r.status_code == 401
            refused = gw.core.metrics.registry.get_sample_value(
                "specdec:gateway_refused_total", {"reason": "unauthenticated"}
            )
            assert refused == 5  # counted where the gateway counts its own refusals
            return gw.tokenizer

    tokenizer = asyncio.run(run())
    assert tokenizer.calls == []  # no tokenizer call for an unauthenticated request


def test_rest_bodies_over_max_request_mb_are_413(tiny_target: Path) -> None:
    cap_mb = 0.01  # 10 KiB
    body = b'{"prompt": "' + b"w" * 20_000 + b'", "max_tokens": 4}'
    auth = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}

    async def run() -> None:
        async with gateway(tiny_target, keys=KEY, max_request_mb=cap_mb) as gw:
            # a Content-Length over the cap: refused from the headers
            status, _, text, reads = await asgi_call(
                gw.app, "/v1/completions", {**auth, "content-length": str(len(body))}, [body]
            )
            assert (status, reads) == (413, 0) and b"max_request_mb" in text
            # no Content-Length (chunked): refused once what was read passes the cap, the rest unread
            chunks = [body[i : i + 4096] for i in range(0, len(body), 4096)]
            status, _, text, reads = await asgi_call(gw.app, "/v1/completions", auth, chunks)
            assert status == 413 and b"max_request_mb" in text and reads < len(chunks), (status, reads)
            assert gw.tokenizer.calls == []

    asyncio.run(run())


def test_rest_tokenises_off_the_event_loop(tiny_target: Path) -> None:
    async def run() -> tuple[list[tuple[str, int]], int, httpx.Response]:
        async with gateway(tiny_target, keys=KEY) as gw:
            r = await gw.rest.post(
                "/v1/completions",
                headers={"authorization": f"Bearer {KEY}"},
                json={"prompt": "hello there", "max_tokens": 4},
            )
            return gw.tokenizer.calls, threading.get_ident(), r

    calls, loop_thread, r = asyncio.run(run())
    assert r.status_code == 503  # authenticated, tokenised, then no verifier
    assert calls and all(thread != loop_thread for _, thread in calls), calls


def test_a_non_streaming_rest_request_is_cancelled_when_its_client_disconnects(tiny_target: Path) -> None:
    """As vLLM's with_cancellation: the client goes away while its request waits (here for a
    verifier, verifier_retry_s 60 s): the gateway call is cancelled and its slot freed at once."""

    async def run() -> tuple[int, int]:
        async with gateway(tiny_target, verifier_retry_s=60.0) as gw:
            slots = gw.core.slots = WatchedSlots("gateway", 256, "max_inflight")
            body = b'{"prompt": [1, 2, 3], "max_tokens": 4}'
            sent = False

            async def receive() -> dict[str, Any]:
                nonlocal sent
                if not sent:
                    sent = True
                    return {"type": "http.request", "body": body, "more_body": False}
                await slots.entered.wait()  # the generation holds its gateway slot: now the client goes
                return {"type": "http.disconnect"}

            statuses: list[int] = []

            async def send(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    statuses.append(message["status"])

            scope = {
                "type": "http",
                "asgi": {"version": "3.0"},
                "http_version": "1.1",
                "method": "POST",
                "scheme": "http",
                "path": "/v1/completions",
                "raw_path": b"/v1/completions",
                "query_string": b"",
                "root_path": "",
                "client": ("127.0.0.1", 1),
                "server": ("rest", 80),
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
            await asyncio.wait_for(gw.app(scope, receive, send), 20)
            await asyncio.wait_for(slots.left.wait(), 20)  # freed long before verifier_retry_s
            return statuses[0], slots.active

    status, active = asyncio.run(run())
    assert status == 499 and active == 0


# ---------------------------------------------------------------------------- slots held by clients that stop reading


class WatchedSlots(SessionSlots):
    """The gateway's SessionSlots, with events set when a call enters (`entered`) and leaves
    (`left`) its slot."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.entered, self.left = asyncio.Event(), asyncio.Event()

    @contextlib.asynccontextmanager
    async def hold(self, context: Any) -> AsyncIterator[None]:
        async with super().hold(context):
            self.entered.set()
            try:
                yield
            finally:
                self.left.set()


def test_a_grpc_stream_whose_client_stops_reading_is_ended_and_its_slot_freed(tiny_target: Path) -> None:
    """A client opens GenerateStream and never reads: once its flow-control window is full the
    gateway's next write waits, and after stream_write_timeout_s the stream ends, the generation
    is closed (here an endless one standing in for the verifier's verdicts) and the slot freed."""
    timeout_s = 0.5

    async def run() -> tuple[int, int, int, grpc.StatusCode]:
        async with gateway(tiny_target, stream_write_timeout_s=timeout_s) as gw:
            slots = gw.core.slots = WatchedSlots("gateway", 256, "max_inflight")
            closed = asyncio.Event()
            produced = 0

            async def endless(spec: Any, key: str, parent: Any) -> AsyncIterator[Chunk]:
                nonlocal produced
                try:
                    while True:
                        produced += 1
                        yield Chunk("x" * 1000, [1] * 100, 0, 0, pb.FINISH_REASON_UNSPECIFIED, request_id="r")
                finally:
                    closed.set()  # the round's finally: its verifier and drafter calls are cancelled there

            gw.core._generate = endless  # type: ignore[method-assign]  # the test replaces the core's generation with an endless stream
            # a small stream window and no BDP growth: the window fills after a few messages
            options = [("grpc.http2.lookahead_bytes", 4096), ("grpc.http2.bdp_probe", 0)]
            async with grpc.aio.insecure_channel(gw.address, options=options) as channel:
                call = rpc.GatewayServiceStub(channel).GenerateStream(
                    pb.GenerateStreamRequest(spec=generation_spec([1, 2, 3], max_tokens=4))
                )
                await asyncio.wait_for(slots.entered.wait(), 20)
                t0 = time.monotonic()
                await asyncio.wait_for(closed.wait(), 100 * timeout_s)  # never without the timeout
                await asyncio.wait_for(slots.left.wait(), 20)
                ended_after = time.monotonic() - t0
                active = slots.active
                code = grpc.StatusCode.OK
                with contextlib.suppress(grpc.aio.AioRpcError):
                    async for _ in call:  # what arrived before the end, then the status
                        pass
                code = await call.code()
            timeouts = gw.core.metrics.registry.get_sample_value("specdec:gateway_stream_write_timeouts_total")
            print(f"\nended after {ended_after:.2f} s ({produced} messages produced); status {code.name}")
            return active, produced, int(timeouts), code

    active, produced, timeouts, code = asyncio.run(run())
    assert active == 0 and timeouts == 1
    assert produced < 10_000  # the writes did wait for the client: nothing unbounded was buffered
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_rest_stream_whose_client_stops_reading_is_ended_and_its_slot_freed(tiny_target: Path) -> None:
    """The REST side: a client that stays connected but takes no more of its event stream. After
    stream_write_timeout_s the response ends, the gateway call is cancelled (the generation
    closed) and the gateway's slot freed."""
    timeout_s = 0.5

    async def run() -> tuple[int, int, int]:
        async with gateway(tiny_target, stream_write_timeout_s=timeout_s) as gw:
            slots = gw.core.slots = WatchedSlots("gateway", 256, "max_inflight")
            closed = asyncio.Event()

            async def endless(spec: Any, key: str, parent: Any) -> AsyncIterator[Chunk]:
                try:
                    while True:
                        yield Chunk("x", [1], 0, 0, pb.FINISH_REASON_UNSPECIFIED, request_id="r")
                finally:
                    closed.set()

            gw.core._generate = endless  # type: ignore[method-assign]  # the test replaces the core's generation with an endless stream
            body = b'{"prompt": [1, 2, 3], "max_tokens": 4, "stream": true}'
            sent_body = False
            bodies = 0

            async def receive() -> dict[str, Any]:
                nonlocal sent_body
                if not sent_body:
                    sent_body = True
                    return {"type": "http.request", "body": body, "more_body": False}
                await asyncio.Event().wait()  # connected, silent: never a disconnect
                raise AssertionError("unreachable")

            async def send(message: dict[str, Any]) -> None:
                nonlocal bodies
                if message["type"] == "http.response.body":
                    bodies += 1
                    if bodies > 1:  # the client took the first event, then stops reading
                        await asyncio.Event().wait()

            scope = {
                "type": "http",
                "asgi": {"version": "3.0"},
                "http_version": "1.1",
                "method": "POST",
                "scheme": "http",
                "path": "/v1/completions",
                "raw_path": b"/v1/completions",
                "query_string": b"",
                "root_path": "",
                "client": ("127.0.0.1", 1),
                "server": ("rest", 80),
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
            await asyncio.wait_for(gw.app(scope, receive, send), 100 * timeout_s)  # never without the timeout
            await asyncio.wait_for(closed.wait(), 20)
            await asyncio.wait_for(slots.left.wait(), 20)
            timeouts = gw.core.metrics.registry.get_sample_value("specdec:gateway_stream_write_timeouts_total")
            return slots.active, bodies, int(timeouts)

    active, bodies, timeouts = asyncio.run(run())
    assert active == 0 and bodies == 2 and timeouts == 1


def test_rest_passes_its_clients_deadline_to_the_gateway_call(tiny_target: Path) -> None:
    """X-Request-Timeout (or X-Stainless-Timeout, which OpenAI's SDKs send) becomes the gateway
    call's deadline: a request that would wait verifier_retry_s (60 s) for a verifier ends with 504
    at its deadline and frees its slot; a deadline that is not a number of seconds is a 400 naming
    the header, before any work."""

    async def run() -> list[tuple[int, Any, int]]:
        async with gateway(tiny_target, verifier_retry_s=60.0) as gw:
            slots = gw.core.slots = WatchedSlots("gateway", 256, "max_inflight")
            out = []
            for header, value in (
                ("X-Request-Timeout", "0.5"),
                ("X-Stainless-Timeout", "0.5"),
                ("X-Request-Timeout", "soon"),
                ("X-Stainless-Timeout", "-1"),
            ):
                for stream in (False, True):
                    slots.entered.clear()
                    slots.left.clear()
                    r = await asyncio.wait_for(
                        gw.rest.post(
                            "/v1/completions",
                            json={"prompt": [1, 2, 3], "max_tokens": 4, "stream": stream},
                            headers={header: value},
                        ),
                        20,
                    )  # 60 s without the deadline
                    if slots.entered.is_set():  # the gateway's side of the deadline ends its call too
                        await asyncio.wait_for(slots.left.wait(), 20)
                    out.append((r.status_code, r.json()["error"]["param"], slots.active))
            return out

    results = asyncio.run(run())
    assert results[:4] == [(504, None, 0)] * 4, results
    assert results[4:] == [(400, "x-request-timeout", 0)] * 2 + [(400, "x-stainless-timeout", 0)] * 2, results


def test_the_rest_bridge_keeps_idle_connections_for_rest_keepalive_s(tiny_target: Path) -> None:
    """The REST bridge (uvicorn) closes an idle keep-alive connection after rest_keepalive_s, not
    uvicorn's 5 s: at 1 s the server closes the connection after a request (EOF); at the default
    (longer than a load balancer's usual 60 s idle timeout, so the server does not close a
    connection as a proxy in front sends on it) it is still open past uvicorn's 5 s."""
    from gateway.server import rest_bridge

    async def idle(keepalive_s: float, watch_s: float) -> bool:
        """Whether the server closed the connection within `watch_s` of a request's answer."""
        async with gateway(tiny_target, rest_keepalive_s=keepalive_s) as gw:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sock.listen()  # a connection made now waits in the backlog until the bridge accepts it
            stop = asyncio.Event()
            serving = asyncio.create_task(rest_bridge(gw.core.cfg, gw.core, stop, sock))
            try:
                reader, writer = await asyncio.open_connection(*sock.getsockname())
                writer.write(b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n")
                await writer.drain()
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
                assert head.startswith(b"HTTP/1.1 "), head
                length = int(
                    next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1]
                )
                await reader.readexactly(length)
                try:
                    closed = await asyncio.wait_for(reader.read(1), watch_s) == b""
                except TimeoutError:
                    closed = False
                writer.close()
                return closed
            finally:
                stop.set()
                await asyncio.wait_for(serving, 30)

    assert asyncio.run(idle(1.0, 30.0))  # closed after 1 s (30 s: a bound, not the expectation)
    default = GatewayConfig().rest_keepalive_s
    assert default > 60
    assert not asyncio.run(idle(default, 7.0))  # uvicorn's own 5 s would have closed it
