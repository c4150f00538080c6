"""gRPC server bootstrap shared by the services: health, reflection, graceful stop."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from specdec.validation import InvalidField

log = logging.getLogger("specdec")

GRACE_S = 5.0


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")


async def abort_invalid(context: grpc.aio.ServicerContext, err: InvalidField) -> None:
    """End the call with INVALID_ARGUMENT naming the field."""
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))


async def serve(
    name: str,
    host: str,
    port: int,
    register: Callable[[grpc.aio.Server], Awaitable[list[str]] | list[str]],
    metrics_port: int = 0,
) -> None:
    """Start an aio server, register services (register returns their full names),
    mark them SERVING, serve Prometheus /metrics on metrics_port (0: off), and run until
    SIGINT/SIGTERM, then stop gracefully."""
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.so_reuseport", 0)]
    )
    names = register(server)
    if asyncio.iscoroutine(names):
        names = await names
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"{name}: cannot bind {host}:{port}")
    await server.start()
    if metrics_port:
        start_http_server(metrics_port, addr=host)
        log.info("%s metrics on http://%s:%d/metrics", name, host, metrics_port)
    for service in ["", *names]:
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    log.info("%s serving on %s:%d", name, host, bound)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("%s stopping", name)
    for service in ["", *names]:
        await health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.stop(GRACE_S)
