"""The gateway process: the gRPC service (GatewayServicer, specdec.v1.GatewayService) over the
gateway core (gateway.core.GatewayCore), the REST bridge beside it, `build` and `main`.

The core's API is typed (gateway.core): `GatewayCore.generate(spec, ...)` yields `Chunk`s and
raises `GatewayError` (code, field, message). The gRPC servicer and the REST bridge
(gateway.rest, served beside it by `rest_bridge`) are two thin adapters over one core, in
one process and event loop: each maps a GatewayError in one place (`abort` here,
gateway.rest.serving.api_error there)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from typing import Any, Self

import grpc
from prometheus_client import CollectorRegistry

from gateway.core import Chunk, ClientStalled, GatewayCore, GatewayError
from specdec import security, serving, telemetry
from specdec.config import GatewayConfig
from specdec.wire import pb, rpc

log = logging.getLogger("specdec.gateway")


async def abort(context: grpc.aio.ServicerContext[Any, Any], err: GatewayError) -> None:
    """End a gRPC call with `err`: its code as the status, "field: message" as the details, and
    `retry-after` (seconds, trailing metadata) when it says when to retry. Raises, as abort does."""
    trailing = (("retry-after", err.retry_after_s),) if err.retry_after_s else ()
    await context.abort(grpc.StatusCode[err.code.name], str(err), trailing_metadata=trailing)


def stream_response(chunk: Chunk) -> "pb.GenerateStreamResponse":
    """A chunk as GenerateStream sends it (usage and stats on the final one only)."""
    return pb.GenerateStreamResponse(
        request_id=chunk.request_id,
        text=chunk.text,
        token_ids=chunk.token_ids,
        drafted=chunk.drafted,
        accepted=chunk.accepted,
        finish_reason=chunk.finish_reason,
        usage=chunk.usage,
        stats=chunk.stats,
        logprobs=chunk.logprobs,
    )


class GatewayServicer(rpc.GatewayServiceServicer):
    """specdec.v1.GatewayService, a thin adapter over a GatewayCore: a call's `authorization`
    metadata and trace context go to `GatewayCore.generate`, its chunks go out as messages, and a
    GatewayError ends the call with its status (`abort`). serving.serve drains and closes it."""

    def __init__(self, core: GatewayCore) -> None:
        self.core = core
        self.slots: serving.SessionSlots = core.slots  # the core's calls, drained at shutdown (serving.serve)

    async def close(self) -> None:
        await self.core.close()

    @staticmethod
    def _caller(context: grpc.aio.ServicerContext[Any, Any]) -> dict[str, Any]:
        """`generate`'s keywords from a call's metadata: its API key and its trace, if any."""
        metadata = context.invocation_metadata()
        # its text entries (a `-bin` key's value is bytes), which the key and the trace context are read from
        text = None if metadata is None else [(key, value) for key, value in metadata if isinstance(value, str)]
        return {"authorization": dict(text or ()).get("authorization"), "parent": telemetry.extract_context(text)}

    async def Generate(  # noqa: N802
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext[pb.GenerateRequest, pb.GenerateResponse]
    ) -> pb.GenerateResponse:
        text: list[str] = []
        ids: list[int] = []
        logprobs: list[pb.TokenLogprobs] = []
        last = Chunk("", [], 0, 0, pb.FINISH_REASON_UNSPECIFIED)
        try:
            async with contextlib.aclosing(self.core.generate(request.spec, **self._caller(context))) as chunks:
                async for last in chunks:
                    text.append(last.text)
                    ids.extend(last.token_ids)
                    logprobs.extend(last.logprobs)
        except GatewayError as err:
            await abort(context, err)
        return pb.GenerateResponse(
            request_id=last.request_id,
            text="".join(text),
            token_ids=ids,
            finish_reason=last.finish_reason,
            usage=last.usage,
            stats=last.stats,
            total_ms=last.total_ms,
            first_token_ms=last.first_token_ms,
            logprobs=logprobs,
        )

    async def GenerateStream(  # type: ignore[override]  # grpc.aio also serves a coroutine that writes with context.write (the write timeout needs it); the stubs type only iterators
        self,
        request: pb.GenerateStreamRequest,
        context: grpc.aio.ServicerContext[pb.GenerateStreamRequest, pb.GenerateStreamResponse],
    ) -> None:
        """Stream the generation's chunks. Each chunk must be taken by the transport within
        `stream_write_timeout_s`: a client that stops reading fills its flow-control window and
        the next write waits; past the timeout the generation stops (the round ends: its verifier
        and drafter calls are cancelled) and the max_inflight slot is freed at once. The stream's
        status is then DEADLINE_EXCEEDED, which the client sees after what was sent, if it ever
        reads again (the HTTP/2 stream itself lasts until then or until its connection closes)."""
        try:
            chunks = self.core.generate(request.spec, stream=True, **self._caller(context))
            async with contextlib.aclosing(chunks):  # leaving early ends the round now, not at GC
                async for chunk in chunks:
                    await self._write(context, stream_response(chunk))
        except ClientStalled as stalled:
            context.set_code(grpc.StatusCode.DEADLINE_EXCEEDED)
            context.set_details(str(stalled))
        except GatewayError as err:
            await abort(context, err)

    async def _write(
        self,
        context: grpc.aio.ServicerContext[pb.GenerateStreamRequest, pb.GenerateStreamResponse],
        msg: pb.GenerateStreamResponse,
    ) -> None:
        """One stream write within stream_write_timeout_s (0: no limit); past it, ClientStalled."""
        timeout = self.core.cfg.stream_write_timeout_s
        if timeout <= 0:
            await context.write(msg)
            return
        # asyncio.wait, not wait_for: a write held by flow control does not end when cancelled
        write = asyncio.ensure_future(context.write(msg))
        done, _ = await asyncio.wait({write}, timeout=timeout)
        if done:
            write.result()
            return
        write.cancel()
        write.add_done_callback(lambda task: task.cancelled() or task.exception())
        self.core.metrics.stream_write_timeouts.inc()
        log.warning(
            "request %s: the client took no message for stream_write_timeout_s (%g s); stream ended",
            msg.request_id,
            timeout,
        )
        raise ClientStalled(
            f"gateway: the client read nothing for stream_write_timeout_s ({timeout:g} s); the stream was ended"
        )


async def rest_bridge(cfg: GatewayConfig, core: GatewayCore, stop: asyncio.Event, sock: socket.socket) -> None:
    """Serve the REST bridge beside the gRPC server until `stop` is set: HTTPS with the
    gateway's certificate (re-read when it changes or on SIGHUP), calling `core` in-process;
    the caller's API key goes with each call, so the core checks it and applies its limits as
    it does for a gRPC client. `sock`: its port, bound already (`main` binds it with the
    gRPC port, before the tokenizer loads)."""
    import prometheus_client
    import uvicorn

    from gateway.rest.routes import build_app

    app = build_app(
        core,
        core.tokenizer,
        cfg.tokenizer,
        keys=core.keys,
        metrics_auth=cfg.metrics_auth,
        metrics_app=prometheus_client.make_asgi_app(core.metrics.registry),
        max_request_bytes=int(cfg.max_request_mb * (1 << 20)),
        tokenizer_executor=core.tokenizer_executor,
        refused=core.metrics.refused,
        stream_write_timeout_s=cfg.stream_write_timeout_s,
        stream_write_timeouts=core.metrics.stream_write_timeouts,
    )

    class Server(uvicorn.Server):
        def capture_signals(self) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]  # a no-op context in place of uvicorn's generator-made one
            return contextlib.nullcontext()  # serving.serve owns SIGINT/SIGTERM

    context = ReloadingSSLContext(cfg) if security.tls_enabled(cfg) else None
    if context is None and not security.is_loopback(cfg.host):
        log.warning(
            "gateway: serving PLAINTEXT HTTP (REST bridge) on %s:%d, which other hosts can reach; set "
            "SPECDEC_TLS_CERT / SPECDEC_TLS_KEY",
            cfg.host,
            cfg.rest_port,
        )
    tls: dict[str, Any] = {"ssl_context_factory": lambda config, default: context} if context is not None else {}
    config = uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.rest_port,
        log_level="warning",
        timeout_keep_alive=max(1, round(cfg.rest_keepalive_s)),
        **tls,
    )
    server = Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    reload = asyncio.create_task(_reload_rest_certificates(context)) if context is not None else None
    await stop.wait()
    server.should_exit = True
    await task
    if reload is not None:
        reload.cancel()


def rest_ssl_context(cfg: GatewayConfig) -> ssl.SSLContext:
    """A new TLS server context of the REST bridge from the files as they are now: the gateway's
    certificate and key; with tls_client_auth=require, client certificates must chain to
    tls_client_ca (default tls_ca)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cfg.tls_cert, cfg.tls_key)
    if cfg.tls_client_ca or cfg.tls_ca:
        context.load_verify_locations(cfg.tls_client_ca or cfg.tls_ca)
    context.verify_mode = ssl.CERT_REQUIRED if cfg.tls_client_auth == "require" else ssl.CERT_NONE
    context.set_alpn_protocols(["http/1.1"])
    return context


class ReloadingSSLContext(ssl.SSLContext):
    """The REST bridge's TLS context: every new connection is made by `current`, a context
    built whole from the files (rest_ssl_context), which `reload()` replaces when they change
    (or after SIGHUP). A replaced context's trust store goes with it: a CA removed from the
    bundle is no longer trusted. Connections already open keep theirs."""

    def __new__(cls, cfg: GatewayConfig) -> Self:
        return super().__new__(cls, ssl.PROTOCOL_TLS_SERVER)

    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        self.files = security.CertFiles(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca or cfg.tls_ca)
        self.files.read()
        self.current = rest_ssl_context(cfg)

    def wrap_bio(self, *args: Any, **kwargs: Any) -> Any:  # what asyncio calls for each connection
        return self.current.wrap_bio(*args, **kwargs)

    def wrap_socket(self, *args: Any, **kwargs: Any) -> Any:
        return self.current.wrap_socket(*args, **kwargs)

    def reload(self) -> bool:
        """Build a new context when the files changed (or SIGHUP came); False when they did not,
        or when the new files do not load (the current context stays)."""
        if not self.files.changed():
            return False
        try:
            self.files.read()
            self.current = rest_ssl_context(self.cfg)
        except (OSError, ValueError) as err:  # ssl.SSLError is an OSError
            log.warning("REST bridge certificate reload failed (%s); keeping the current ones", err)
            return False
        log.info("REST bridge certificates reloaded from %s", self.cfg.tls_cert)
        return True


async def _reload_rest_certificates(context: ReloadingSSLContext, every_s: float = 1.0) -> None:
    """Reload the REST bridge's certificates when their files change (or after SIGHUP); new
    connections get the new ones. (gRPC servers check at each handshake.)"""
    while True:
        await asyncio.sleep(every_s)
        context.reload()


def build(cfg: GatewayConfig, registry: CollectorRegistry) -> GatewayCore:
    """The factory: load the tokenizer (cfg.tokenizer) and make the core, its metrics on
    `registry`, its replica pools over gRPC channels. Call it in the serving event loop. Both
    adapters take the core: `GatewayServicer(core)` (gRPC) and `rest_bridge(cfg, core, stop, sock)`."""
    from transformers import AutoTokenizer

    from specdec.models import resolve_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_tokenizer(cfg.tokenizer, revision=cfg.tokenizer_revision or None))
    return GatewayCore(cfg, telemetry.GatewayMetrics(registry), tokenizer)


async def main(cfg: GatewayConfig) -> None:
    # the REST port is bound first, as serving.serve binds the gRPC port before `build`: taken, the
    # gateway fails at once with EADDRINUSE, not after loading; free, nothing can take it meanwhile
    rest = serving.bind_tcp(cfg.host, cfg.rest_port, "gateway: the REST bridge's port") if cfg.rest_port else None
    try:
        await serving.serve(
            "gateway",
            cfg,
            lambda registry: GatewayServicer(build(cfg, registry)),
            rpc.add_GatewayServiceServicer_to_server,
            "specdec.v1.GatewayService",
            also=(lambda servicer, stop: rest_bridge(cfg, servicer.core, stop, rest)) if rest is not None else None,
        )
    finally:
        if rest is not None:
            rest.close()
