"""Start and stop service processes locally (`specdec up`, `specdec demo`, the tests).

Each service runs as its own process (`python -m specdec_cli serve KIND ...`), the
way it would on its own host; readiness is the standard gRPC health check.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.models import choose


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
        if self.tls:
            from specdec.security import channel_credentials

            channel = grpc.secure_channel(self.address, channel_credentials(*self.tls))
        else:
            channel = grpc.insecure_channel(self.address)
        with channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.kind} exited with {self.proc.returncode}; log: {self.log_path}")
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
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_service(
    kind: str,
    port: int,
    args: list[str],
    log_dir: Path | None = None,
    cpus: set[int] | None = None,
    env: dict[str, str] | None = None,
    metrics_port: int | None = None,
    prefix: list[str] | None = None,
) -> Service:
    """Start `specdec serve KIND --port PORT ARGS...`, optionally pinned to `cpus`.

    metrics_port None keeps the service's configured /metrics port; 0 turns it off.
    `prefix` runs the command under another (`ip netns exec NS`: another network namespace).
    """
    cmd = [*(prefix or []), sys.executable, "-m", "specdec_cli", "serve", kind, "--port", str(port), *args]
    if metrics_port is not None:
        cmd += ["--metrics-port", str(metrics_port)]
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
        env={**os.environ, **(env or {})},
        preexec_fn=preexec,
    )
    return Service(kind, port, proc, log_path, metrics_port or 0)


def split_cpus() -> tuple[set[int] | None, set[int] | None]:
    """Target cores and drafter cores: the drafter gets the last core, as if on its own host."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, None
    return set(cpus[:-1]), {cpus[-1]}


@dataclass
class Cluster:
    """The three services of one deployment, started locally."""

    pair: str = "qwen-coder"
    draft: str | None = None  # a model reference replacing the pair's draft (None: the pair's)
    gateway_port: int = 50051
    drafter_port: int = 50052
    verifier_port: int = 50053
    log_dir: Path | None = None
    pin: bool = True
    # extra flags per service kind, e.g. {"gateway": ["--rest-port", "0"]}
    extra_args: dict[str, list[str]] = field(default_factory=dict)
    services: list[Service] = field(default_factory=list)
    target: str | None = None  # a model reference replacing the pair's target (and its tokenizer)
    tokenizer: str | None = None  # the gateway's tokenizer (None: the target's)

    def start(self, timeout_s: float = 900.0) -> None:
        pair = choose(self.pair, self.target, self.draft, self.tokenizer)
        target, default_draft, tokenizer = pair.target, pair.draft, pair.tokenizer
        target_cpus, draft_cpus = split_cpus() if self.pin else (None, None)
        threads = str(len(target_cpus)) if target_cpus else "0"
        # the verifier's network I/O runs beside the drafter, the target's core only computes
        io = ["--io-cpus", ",".join(map(str, sorted(draft_cpus)))] if draft_cpus else []
        verifier = start_service(
            "verifier",
            self.verifier_port,
            ["--model", target, "--threads", threads, *io, *self.extra_args.get("verifier", [])],
            self.log_dir,
            target_cpus,
        )
        drafter = start_service(
            "drafter",
            self.drafter_port,
            ["--model", self.draft or default_draft, "--threads", "1", *self.extra_args.get("drafter", [])],
            self.log_dir,
            draft_cpus,
        )
        self.services = [verifier, drafter]
        try:
            for s in self.services:
                s.wait_ready(timeout_s)
            # the gateway last: its pools' first health checks then find the drafter and verifier
            # serving (a drafter still loading would be taken for down until the next check, and the
            # first requests would decode plainly)
            gateway = start_service(
                "gateway",
                self.gateway_port,
                [
                    "--tokenizer",
                    tokenizer,
                    "--drafter-address",
                    drafter.address,
                    "--verifier-address",
                    verifier.address,
                    *self.extra_args.get("gateway", []),
                ],
                self.log_dir,
                draft_cpus,
            )
            self.services.append(gateway)
            gateway.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for s in reversed(self.services):
            s.stop()
