"""Start and stop service processes locally (`specdec up`, `specdec demo`, the tests).

Each service runs as its own process (`python -m specdec_cli serve KIND ...`), the
way it would on its own host; readiness is the standard gRPC health check.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.errors import EXIT_ADDRESS_IN_USE, exit_status
from specdec.models import choose

log = logging.getLogger(__name__)


_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()  # this process's free_port answers: never the same one twice


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 by default on Linux)."""
    try:
        return int(_EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a service about to be started on it.

    It is drawn at random from below the kernel's ephemeral range, where the OS never puts
    an outgoing connection or a bind to port 0 (vLLM's own sockets among them): asking the OS
    for a port with bind(0), then closing it, would hand back a number the next bind(0)
    anywhere on the machine may take before the service binds it. What is left is a clash
    with another process drawing from the same range; `Cluster` starts a service whose
    chosen port was taken again on a new one (EXIT_ADDRESS_IN_USE).
    """
    low = _ephemeral_low()
    first = 10000 if low > 11000 else 1024
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(first, low) if low > first else 0
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = int(s.getsockname()[1])
        _handed_out.add(port)
        return port
    raise OSError(errno.EADDRINUSE, f"no free port found in {first}..{low - 1}")


class PortTaken(RuntimeError):
    """A service exited at start because a port it was to bind is taken (EXIT_ADDRESS_IN_USE)."""


@dataclass
class Service:
    """A running service process."""

    kind: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path | None = None
    metrics_port: int = 0
    rest_port: int = 0  # gateways: the REST bridge
    host: str = "127.0.0.1"
    # (ca, cert, key) when the service serves TLS: health checks connect with them
    tls: tuple[str, str, str] | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the health check says SERVING; raise if the process died or timed out."""
        deadline = time.monotonic() + timeout_s
        # gRPC backs off reconnecting after each refused connection (1 s, x1.6 each, up to 120 s):
        # polling a service that takes minutes to load, the check could first reach it minutes late
        retry = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000)]
        if self.tls:
            from specdec.security import channel_credentials

            channel = grpc.secure_channel(self.address, channel_credentials(*self.tls), options=retry)
        else:
            channel = grpc.insecure_channel(self.address, options=retry)
        with channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    if self.proc.returncode == EXIT_ADDRESS_IN_USE:
                        raise PortTaken(f"{self.kind}: a port it was to bind is taken; log: {self.log_path}")
                    raise RuntimeError(
                        f"{self.kind} exited with {exit_status(self.proc.returncode)}; log: {self.log_path}"
                    )
                try:
                    resp: health_pb2.HealthCheckResponse = stub.Check(  # type: ignore[attr-defined]  # types-grpcio-health-checking's HealthStub lacks Check (the generated __init__ sets it)
                        health_pb2.HealthCheckRequest(), timeout=1.0
                    )
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise TimeoutError(f"{self.kind} not ready after {timeout_s:g} s; log: {self.log_path}")

    def stop(self, kill: bool = False) -> None:
        """SIGTERM (the service drains, then exits; SIGKILL past STOP_TIMEOUT_S), or SIGKILL."""
        stop_all([self], signal.SIGKILL if kill else signal.SIGTERM)


STOP_TIMEOUT_S = 15.0  # how long a stopped service may take to exit before it is killed


def stop_all(services: Iterable[Service], sig: signal.Signals = signal.SIGTERM) -> None:
    """Stop `services` together: `sig` to each that runs, then wait for them all; one still
    running STOP_TIMEOUT_S after the signal is killed. Each exits on its own time (at once when
    idle, after its drain otherwise), so stopping them one after another would add those times
    up (a dozen services: seconds each)."""
    live = [s for s in services if s.proc.poll() is None]
    for s in live:
        s.proc.send_signal(sig)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for s in live:
        try:
            s.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            s.proc.kill()
            s.proc.wait()


def start_service(
    kind: str,
    port: int,
    args: list[str],
    log_dir: Path | None = None,
    cpus: set[int] | None = None,
    env: dict[str, str] | None = None,
    metrics_port: int | None = None,
    prefix: list[str] | None = None,
    rest_port: int | None = None,
) -> Service:
    """Start `specdec serve KIND --port PORT ARGS...`, optionally pinned to `cpus`.

    metrics_port None keeps the service's configured /metrics port; 0 turns it off.
    rest_port (gateways) likewise for the REST bridge.
    `prefix` runs the command under another (`ip netns exec NS`: another network namespace).
    """
    cmd = [*(prefix or []), sys.executable, "-m", "specdec_cli", "serve", kind, "--port", str(port), *args]
    if metrics_port is not None:
        cmd += ["--metrics-port", str(metrics_port)]
    if rest_port is not None:
        cmd += ["--rest-port", str(rest_port)]
    out = None
    log_path = None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{kind}-{port}.log"
        out = open(log_path, "wb")  # noqa: SIM115 (closed when the process exits)
    preexec = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    proc = subprocess.Popen(
        cmd,
        stdout=out or subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        # unbuffered: vLLM logs to stdout, which Python block-buffers into a file, so a service's log
        # would show nothing of a slow start until 8 KiB had piled up
        env={"PYTHONUNBUFFERED": "1", **os.environ, **(env or {})},
        preexec_fn=preexec,
    )
    return Service(kind, port, proc, log_path, metrics_port or 0, rest_port or 0)


def split_cpus() -> tuple[set[int] | None, set[int] | None]:
    """Target cores and drafter cores: the drafter gets the last core, as if on its own host."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, None
    return set(cpus[:-1]), {cpus[-1]}


ANY_PORT = -1
"""A `Cluster` port meaning: a free one, chosen by `free_port`, and chosen again if another
process binds it before the service does."""
PORT_TRIES = 5  # starts of one service whose chosen port was taken, before giving up


def _pick(port: int | None) -> int | None:
    return free_port() if port == ANY_PORT else port


@dataclass
class Cluster:
    """The three services of one deployment, started locally.

    Ports: a number is bound as given (a service that cannot bind it fails the start);
    ANY_PORT is chosen by `free_port` and, if taken before the service binds it, chosen again
    (up to PORT_TRIES starts). After `start`, `gateway`, `drafter` and `verifier` give each
    service's address and ports.
    """

    pair: str = "qwen-coder"
    draft: str | None = None  # a model reference replacing the pair's draft (None: the pair's)
    gateway_port: int = 50051
    drafter_port: int = 50052
    verifier_port: int = 50053
    log_dir: Path | None = None
    pin: bool = True
    # extra flags per service kind, e.g. {"verifier": ["--dtype", "float32"]}
    extra_args: dict[str, list[str]] = field(default_factory=dict)
    services: list[Service] = field(default_factory=list)
    target: str | None = None  # a model reference replacing the pair's target (and its tokenizer)
    tokenizer: str | None = None  # the gateway's tokenizer (None: the target's)
    # /metrics port per service kind (0: off, ANY_PORT: a free one); a kind not named keeps its setting
    metrics_port: dict[str, int] = field(default_factory=dict)
    rest_port: int | None = None  # the gateway's REST bridge (0: off, ANY_PORT: a free one; None: its setting)

    def _service(self, kind: str) -> Service:
        for s in self.services:
            if s.kind == kind:
                return s
        raise LookupError(f"no {kind} started")

    @property
    def gateway(self) -> Service:
        return self._service("gateway")

    @property
    def drafter(self) -> Service:
        return self._service("drafter")

    @property
    def verifier(self) -> Service:
        return self._service("verifier")

    def _ports(self, kind: str) -> tuple[int, int | None, int | None]:
        """`kind`'s gRPC, /metrics and REST ports as set here (None: the service's setting)."""
        grpc_port = {"gateway": self.gateway_port, "drafter": self.drafter_port, "verifier": self.verifier_port}
        return grpc_port[kind], self.metrics_port.get(kind), self.rest_port if kind == "gateway" else None

    def _launch(self, kind: str, args: list[str], cpus: set[int] | None) -> Callable[[], Service]:
        """What starts `kind` (again): each ANY_PORT drawn anew at every call."""
        port, metrics, rest = self._ports(kind)

        def launch() -> Service:
            return start_service(
                kind,
                free_port() if port == ANY_PORT else port,
                args,
                self.log_dir,
                cpus,
                metrics_port=_pick(metrics),
                rest_port=_pick(rest),
            )

        return launch

    def _ready(self, kind: str, launch: Callable[[], Service], timeout_s: float) -> None:
        """Wait for `kind` to serve; started on ports of its own choosing that another process
        took first, it is started again on new ones."""
        chosen = ANY_PORT in self._ports(kind)
        for attempt in range(1, PORT_TRIES + 1):
            try:
                self._service(kind).wait_ready(timeout_s)
                return
            except PortTaken:
                if not chosen or attempt == PORT_TRIES:
                    raise
                log.warning("%s: a port chosen for it was taken first; starting it on new ones", kind)
                self.services = [s for s in self.services if s.kind != kind] + [launch()]

    def start(self, timeout_s: float = 900.0) -> None:
        pair = choose(self.pair, self.target, self.draft, self.tokenizer)
        target, default_draft, tokenizer = pair.target, pair.draft, pair.tokenizer
        target_cpus, draft_cpus = split_cpus() if self.pin else (None, None)
        threads = str(len(target_cpus)) if target_cpus else "0"
        # the verifier's network I/O runs beside the drafter, the target's core only computes
        io = ["--io-cpus", ",".join(map(str, sorted(draft_cpus)))] if draft_cpus else []
        launches = {
            "verifier": self._launch(
                "verifier",
                ["--model", target, "--threads", threads, *io, *self.extra_args.get("verifier", [])],
                target_cpus,
            ),
            "drafter": self._launch(
                "drafter",
                ["--model", self.draft or default_draft, "--threads", "1", *self.extra_args.get("drafter", [])],
                draft_cpus,
            ),
        }
        self.services = [launches["verifier"](), launches["drafter"]()]
        try:
            for kind, launch in launches.items():
                self._ready(kind, launch, timeout_s)
            # the gateway last: its pools' first health checks then find the drafter and verifier
            # serving (a drafter still loading would be taken for down until the next check, and the
            # first requests would decode plainly)
            gateway = self._launch(
                "gateway",
                [
                    "--tokenizer",
                    tokenizer,
                    "--drafter-address",
                    self.drafter.address,
                    "--verifier-address",
                    self.verifier.address,
                    *self.extra_args.get("gateway", []),
                ],
                draft_cpus,
            )
            self.services.append(gateway())
            self._ready("gateway", gateway, timeout_s)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """The gateway first (it drains its requests in flight, which need the drafter and the
        verifier), then the others together."""
        stop_all([s for s in self.services if s.kind == "gateway"])
        stop_all(reversed([s for s in self.services if s.kind != "gateway"]))
