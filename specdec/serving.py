"""gRPC server bootstrap shared by the services: health, reflection, graceful stop, plugins.

Plugins: `SPECDEC_PLUGINS` (comma-separated `module:function`, unset by default, so a
production service loads nothing) names hooks that `serve` imports and calls as
`function(service_name, servicer)` once the servicer is built, before the server starts.
A plugin may append to the servicers' documented hook lists (`TargetEngine.step_hooks`,
`DrafterServicer.step_hooks`) or wrap the servicer's objects; the test suite's fault
injection (tests/faultkit.py, docs/testing-faults.md) is the one user. Production code
never imports a plugin.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import importlib
import logging
import os
import signal
import socket
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from types import FrameType
from typing import Any, NoReturn, Protocol, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server

from specdec import security
from specdec.config import DrafterConfig, GatewayConfig, VerifierConfig
from specdec.telemetry import service_registry
from specdec.validation import InvalidField, OverLimit

log = logging.getLogger("specdec")
T = TypeVar("T")
Open = TypeVar("Open")  # a session stream's `open` message: pb.VerifyOpen, pb.DraftOpen

GRACE_S = 1.0  # after the drain: for the calls' last messages


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")


async def abort_invalid(context: security.AnyContext, err: InvalidField) -> NoReturn:
    """End the call with INVALID_ARGUMENT naming the field."""
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))


async def open_session(
    context: security.AnyContext, build: Callable[[Open], T], timeout_s: float = 0.0
) -> tuple[Open, T]:
    """Read a session stream's first message, which must be `open`, and build the session
    from it (`build` takes the `open` message: its type is the stream's); returns both. A bad
    one ends the call with INVALID_ARGUMENT naming the field, one over a setting's limit
    (validation.OverLimit) with RESOURCE_EXHAUSTED naming the setting. A stream that
    sends nothing for `timeout_s` (first_message_timeout_s; 0: no limit) ends with
    DEADLINE_EXCEEDED, so a half-open stream cannot hold its max_sessions slot."""
    try:
        # asyncio.timeout, not wait_for, which on Python 3.11 loses a cancellation that comes in the
        # loop turn the message does (gateway/transport.py read_step)
        async with asyncio.timeout(timeout_s if timeout_s > 0 else None):
            first = await context.read()
    except TimeoutError:
        await context.abort(
            grpc.StatusCode.DEADLINE_EXCEEDED, f"open: no `open` came within first_message_timeout_s ({timeout_s:g} s)"
        )
        raise  # unreachable: abort raises
    if first is grpc.aio.EOF or first.WhichOneof("kind") != "open":
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "open: the first message must be `open`")
    try:
        return first.open, build(first.open)
    except InvalidField as err:
        await abort_invalid(context, err)
        raise  # unreachable: abort raises
    except OverLimit as err:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
        raise  # unreachable: abort raises


class Aborter(Protocol):
    """What SessionSlots needs of a call's context: a gRPC servicer context, or an adapter's
    stand-in that turns the refusal into its own error (gateway.core)."""

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: Any = ()) -> Any:
        """End the call with `code` and `details` (and `trailing_metadata` pairs)."""


class SessionSlots:
    """The calls (sessions) a service is serving: admission, and the drain at shutdown.

    At most `limit` at once (0: unlimited; `setting` names the limit): one more is refused
    with RESOURCE_EXHAUSTED naming it, with `retry-after` (seconds) in the trailing metadata,
    before any work. `drain(timeout_s)` (SIGTERM) refuses new calls with UNAVAILABLE at once,
    lets the ones in flight finish for up to `timeout_s`, then ends the rest with UNAVAILABLE
    saying the service shut down (never a silent cancel).
    """

    def __init__(self, service: str, limit: int, setting: str = "max_sessions") -> None:
        self.service, self.limit, self.setting = service, limit, setting
        self.active = 0
        self.draining = False
        self._calls: dict[asyncio.Task[Any], Aborter] = {}
        self._expired: set[asyncio.Task[Any]] = set()
        self._timeout_s = 0.0

    @contextlib.asynccontextmanager
    async def hold(self, context: Aborter) -> AsyncIterator[None]:
        if self.draining:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"{self.service}: shutting down (draining); retry, on another replica if there is one",
            )
        if self.limit and self.active >= self.limit:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.service}: {self.setting} ({self.limit}) calls are in flight; retry later, or "
                f"raise SPECDEC_{self.setting.upper()} / add replicas",
                trailing_metadata=(("retry-after", "1"),),
            )
        task = asyncio.current_task()
        self.active += 1
        if task is not None:
            self._calls[task] = context
        try:
            yield
        except asyncio.CancelledError:
            notice = self.ended_by_drain(task)
            if notice is not None:  # our drain ran out: say so instead of a bare cancel
                await context.abort(grpc.StatusCode.UNAVAILABLE, notice)
            raise
        finally:
            self.active -= 1
            if task is not None:
                self._calls.pop(task, None)
                self._expired.discard(task)

    def ended_by_drain(self, task: asyncio.Task[Any] | None) -> str | None:
        """The notice for a call in flight (its task) that the drain ended, having run past
        shutdown_timeout_s: what its caller is told. None: the drain did not end it."""
        if task is None or task not in self._expired:
            return None
        return (
            f"{self.service}: shut down before this call finished (shutdown_timeout_s, {self._timeout_s:g} s, "
            "passed); retry"
        )

    async def drain(self, timeout_s: float, poll_s: float = 0.05) -> int:
        """Refuse new calls, wait up to `timeout_s` for those in flight, end the rest; returns
        how many had to be ended."""
        self.draining, self._timeout_s = True, timeout_s
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self._calls and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(poll_s)
        left = list(self._calls)
        for task in left:
            self._expired.add(task)
            task.cancel()
        for _ in range(100):  # let them send their status
            if not self._calls:
                break
            await asyncio.sleep(0.01)
        return len(left)


PLUGINS_ENV = "SPECDEC_PLUGINS"


def load_plugins(name: str, servicer: object, spec: str | None = None) -> list[str]:
    """Import and call each `module:function` of `spec` (default: the `SPECDEC_PLUGINS`
    environment variable; empty or unset: none) as `function(name, servicer)`; returns the
    plugins called. A malformed entry raises ValueError naming it (the service then does not
    start, rather than run without a hook it was asked to load)."""
    spec = os.environ.get(PLUGINS_ENV, "") if spec is None else spec
    loaded = []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        module, _, function = entry.partition(":")
        if not module or not function:
            raise ValueError(f"{PLUGINS_ENV}: {entry!r} is not module:function")
        hook = getattr(importlib.import_module(module), function)
        hook(name, servicer)
        log.warning("%s: loaded plugin %s", name, entry)
        loaded.append(entry)
    return loaded


class Servicer(Protocol):
    """What `serve` needs of a service implementation besides its RPCs: `close()`, and the
    `slots` its calls are admitted through (drained at shutdown)."""

    slots: SessionSlots

    async def close(self) -> None: ...


S = TypeVar("S", bound=Servicer)


# The last line of a stack dump (dump_stacks): a reader of the log knows the dump is whole.
DUMP_END = "End of the stack dump."


def dump_stacks(fd: int = 2) -> None:
    """Write every thread's Python stack to file descriptor `fd` (stderr: the service's log):
    a line naming each thread by its id, faulthandler's dump of every thread (innermost frame
    first; `Current thread` is the one writing), then DUMP_END.

    The frames are walked by `faulthandler.dump_traceback` called from Python, i.e. in C with
    the interpreter lock held for the whole walk: no other thread runs Python code, so none
    changes its frames, while they are read. Two other ways crash:
    - `faulthandler.register(SIGUSR1, all_threads=True)` walks them inside the C signal handler,
      without the lock: a verifier whose engine thread was running segfaulted inside that walk
      (tests/e2e/test_stacks.py, 2026-12-03);
    - a walk in Python (`sys._current_frames()`, then each frame's `f_back`) lets the lock go
      between bytecodes, every switch interval; a thread that runs meanwhile pops the frames
      being read, and reading `f_back` of such a frame has crashed CPython 3.11
      (python/cpython#99110, and reports on 3.11.5 since).
    It writes with os.write, not sys.stderr: a signal that lands while the main thread is inside
    a buffered write to stderr (a log line) would make a second buffered write fail as reentrant.
    """
    names = ", ".join(f"{t.ident:#018x} {t.name!r}" for t in threading.enumerate() if t.ident is not None)
    _write_all(fd, f"\nStack dump of every thread ({names}):\n".encode(errors="replace"))
    faulthandler.dump_traceback(fd, all_threads=True)
    _write_all(fd, f"{DUMP_END}\n".encode())


def _write_all(fd: int, data: bytes) -> None:
    """os.write until all of `data` is written (a write to a pipe may take part of it)."""
    while data:
        data = data[os.write(fd, data) :]


def _on_sigusr1(signum: int, frame: FrameType | None) -> None:
    """SIGUSR1: dump every thread's stack to the log (dump_stacks); the service goes on."""
    with contextlib.suppress(OSError):  # a closed stderr must not stop the service
        dump_stacks()


def bind_tcp(host: str, port: int, what: str = "") -> socket.socket:
    """A TCP socket bound to host:port (an IPv4 or IPv6 address or a host name; "[::]" as
    gRPC writes it), not yet listening: a server started later (the REST bridge, once the
    model is loaded) then owns a port nothing could take meanwhile. An OSError keeps the OS's
    errno (EADDRINUSE: the port is taken) and names `what` and the address."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    family, kind, proto, _, address = socket.getaddrinfo(bare, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC and uvicorn bind theirs
        sock.bind(address)
    except OSError as err:
        sock.close()
        raise OSError(err.errno, f"cannot bind {what or 'a port'} {host}:{port}: {err.strerror}") from err
    return sock


def bind_error(name: str, what: str, host: str, port: int) -> OSError:
    """The error for a port gRPC could not bind (it says only that it failed): the same bind
    with a plain socket gives the OS's reason and errno (EADDRINUSE: taken by another process)."""
    try:
        bind_tcp(host, port, what).close()
    except OSError as err:
        return OSError(err.errno, f"{name}: {err.strerror}")
    return OSError(f"{name}: cannot bind {what} {host}:{port}")


async def serve(
    name: str,
    cfg: DrafterConfig | VerifierConfig | GatewayConfig,
    build: Callable[[CollectorRegistry], S],
    add_to_server: Callable[[S, grpc.aio.Server], None],
    service: str,
    also: Callable[[S, asyncio.Event], Coroutine[Any, Any, None]] | None = None,
) -> None:
    """Run one gRPC service until SIGINT/SIGTERM, then stop gracefully.

    cfg gives host, port and metrics_port (Prometheus /metrics, 0: off). The ports are bound
    first, then `build(registry)` makes the servicer (loading its model can take minutes and
    opens ports of its own, vLLM's for one: binding first means none of them can take ours).
    `registry` is this service's own (telemetry.service_registry(name): the shared families
    only, until the servicer builds its metrics object on it); /metrics serves it alone.
    `service` is the full service name for health checks and reflection.
    `also(servicer, stop_event)` runs beside the server in the same loop (the gateway's REST
    bridge) and must return once the event is set.
    TLS, message sizes and keepalive come from cfg (specdec.security; a plaintext port other
    hosts can reach is warned about).
    SIGHUP re-reads the TLS certificates. SIGUSR1 writes every thread's Python stack to stderr
    (the service's log) and the service goes on: what a stalled service is doing.
    """
    security.check_tls_settings(cfg)
    # a Python handler: it runs in the main thread between two bytecodes, or as soon as a wait
    # (the event loop's, a lock's, a sleep) is interrupted, so it answers while the model loads
    # and while the engine thread is stuck; not while a C call holds the interpreter lock
    signal.signal(signal.SIGUSR1, _on_sigusr1)
    server = grpc.aio.server(
        options=security.grpc_options(cfg, server=True), interceptors=security.server_interceptors(name, cfg)
    )
    bound = security.add_port(server, name, f"{cfg.host}:{cfg.port}", cfg)
    if bound == 0:
        raise bind_error(name, "its gRPC port", cfg.host, cfg.port)
    registry = service_registry(name)
    if cfg.metrics_port:
        try:
            start_http_server(cfg.metrics_port, addr=cfg.host, registry=registry)
        except OSError as err:
            where = f"{cfg.host}:{cfg.metrics_port}"
            raise OSError(err.errno, f"{name}: cannot bind its metrics port {where}: {err.strerror}") from err
        log.info("%s metrics on http://%s:%d/metrics", name, cfg.host, cfg.metrics_port)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    probes = None  # health_port: the same health answers in plaintext, nothing else (bound before loading too)
    if cfg.health_port:
        probes = grpc.aio.server(options=security.grpc_options(cfg, server=True))
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, probes)
        try:
            probes.add_insecure_port(f"{cfg.host}:{cfg.health_port}")
        except RuntimeError:  # grpcio's "Failed to bind": the OS says why
            raise bind_error(name, "its health port", cfg.host, cfg.health_port) from None
        await probes.start()  # answers NOT_FOUND until the servicer is built and the statuses are set
        log.info("%s health checks (plaintext) on %s:%d", name, cfg.host, cfg.health_port)
    servicer = build(registry)
    load_plugins(name, servicer)
    add_to_server(servicer, server)
    reflection.enable_server_reflection([service, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    await server.start()
    for svc in ("", service):
        await health_servicer.set(svc, health_pb2.HealthCheckResponse.SERVING)
    log.info("%s serving on %s:%d", name, cfg.host, bound)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, security.request_reload)  # re-read the TLS certificates
    stopped = asyncio.Event()  # the drain is over: `also` stops too
    side = asyncio.create_task(also(servicer, stopped)) if also is not None else None
    try:
        await stop.wait()
    finally:
        # the drain: health says NOT_SERVING at once (load balancers and readiness probes move
        # away), new calls get UNAVAILABLE, calls in flight finish within shutdown_timeout_s
        log.info("%s draining (up to %g s)", name, cfg.shutdown_timeout_s)
        for svc in ("", service):
            await health_servicer.set(svc, health_pb2.HealthCheckResponse.NOT_SERVING)
        ended = await servicer.slots.drain(cfg.shutdown_timeout_s)
        log.info("%s stopping%s", name, f" ({ended} calls ended unfinished)" if ended else "")
        await server.stop(GRACE_S)
        if probes is not None:
            await probes.stop(0)
        stopped.set()
        if side is not None:
            await side
        await servicer.close()
