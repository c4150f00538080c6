"""The bench's delay proxy (benchmarks/delay_proxy.py): bytes intact and in order, never early,
connections independent, close passed on, gRPC through it. Loopback only.

Timing checks are lower bounds only (a chunk never arrives before its delay has passed), which
hold however slow or busy the machine is; nothing here asserts how fast anything is.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from benchmarks.delay_proxy import DelayProxy, split_address
from specdec_cli.launch import free_port

LOOP = "127.0.0.1"
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    """Writes back what it reads; closes after the peer's end of stream."""
    while data := await r.read(1 << 16):
        w.write(data)
        await w.drain()
    w.close()
    await w.wait_closed()


async def _with_proxy(handler: Handler, delay_ms: float, body: Callable[[int], Awaitable[object]]) -> object:
    """Run `body(proxy_port)` with an upstream server (`handler`) behind a DelayProxy."""
    upstream = await asyncio.start_server(handler, LOOP, 0)
    proxy = DelayProxy(LOOP, 0, LOOP, upstream.sockets[0].getsockname()[1], delay_ms)
    await proxy.start()
    try:
        return await asyncio.wait_for(body(proxy.port), timeout=120)
    finally:
        await proxy.close()
        upstream.close()
        await upstream.wait_closed()


async def _send_all_and_read_back(port: int, pieces: list[bytes]) -> bytes:
    """Write the pieces (one write each), half-close, and read until the end of stream."""
    r, w = await asyncio.open_connection(LOOP, port)

    async def send() -> None:
        for piece in pieces:
            w.write(piece)
            await w.drain()
        w.write_eof()

    sender = asyncio.ensure_future(send())
    got = await r.read()  # until EOF
    await sender
    w.close()
    return got


def test_many_small_writes_arrive_intact_and_in_order_both_ways() -> None:
    pieces = [f"{i:05d};".encode() for i in range(3000)]
    got = asyncio.run(_with_proxy(_echo, 5, lambda port: _send_all_and_read_back(port, pieces)))
    assert got == b"".join(pieces)


def test_a_large_payload_arrives_intact_both_ways() -> None:
    payload = os.urandom(8 << 20)
    pieces = [payload[i : i + 100_000] for i in range(0, len(payload), 100_000)]
    got = asyncio.run(_with_proxy(_echo, 10, lambda port: _send_all_and_read_back(port, pieces)))
    assert len(got) == len(payload) and got == payload


def test_no_chunk_arrives_before_its_delay_in_either_direction() -> None:
    delay_ms, n, size = 40.0, 8, 16
    arrivals_up: list[tuple[float, int]] = []  # (time, bytes received so far) at the upstream
    sent_down: list[float] = []

    async def upstream(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        loop, total = asyncio.get_running_loop(), 0
        while total < n * size:
            data = await r.read(1 << 16)
            if not data:
                break
            total += len(data)
            arrivals_up.append((loop.time(), total))
        for i in range(n):  # and n messages back, spaced apart
            sent_down.append(loop.time())
            w.write(bytes([i]) * size)
            await w.drain()
            await asyncio.sleep(0.01)
        w.close()

    async def body(port: int) -> tuple[list[float], list[tuple[float, int]]]:
        loop = asyncio.get_running_loop()
        r, w = await asyncio.open_connection(LOOP, port)
        sent_up, arrivals_down, total = [], [], 0
        for i in range(n):
            sent_up.append(loop.time())  # before the write: the proxy reads it later still
            w.write(bytes([i]) * size)
            await w.drain()
            await asyncio.sleep(0.01)
        while data := await r.read(1 << 16):
            total += len(data)
            arrivals_down.append((loop.time(), total))
        w.close()
        return sent_up, arrivals_down

    sent_up, arrivals_down = asyncio.run(_with_proxy(upstream, delay_ms, body))

    def check(sent: list[float], arrivals: list[tuple[float, int]]) -> None:
        assert arrivals and arrivals[-1][1] == n * size
        for i, t_sent in enumerate(sent):
            # the read that brought message i's first byte
            t_arrived = next(t for t, total in arrivals if total > i * size)
            assert t_arrived - t_sent >= delay_ms / 1e3, (i, t_arrived - t_sent)

    check(sent_up, arrivals_up)
    check(sent_down, arrivals_down)


def test_concurrent_connections_are_independent() -> None:
    async def body(port: int) -> tuple[bytes, bytes, bytes]:
        (r1, w1), (r2, w2) = [await asyncio.open_connection(LOOP, port) for _ in range(2)]
        for i in range(50):  # interleaved writes on the two connections
            w1.write(b"a%03d" % i)
            w2.write(b"b%03d" % i)
        await asyncio.gather(w1.drain(), w2.drain())
        first = await r1.readexactly(200)
        w1.close()  # the first connection ends; the second goes on
        await w1.wait_closed()
        w2.write(b"after")
        await w2.drain()
        second = await r2.readexactly(205)
        w2.write_eof()
        rest = await r2.read()
        w2.close()
        return first, second, rest

    first, second, rest = asyncio.run(_with_proxy(_echo, 5, body))
    assert first == b"".join(b"a%03d" % i for i in range(50))
    assert second == b"".join(b"b%03d" % i for i in range(50)) + b"after"
    assert rest == b""


def test_close_propagates_after_the_pending_bytes() -> None:
    async def says_bye(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"bye")
        await w.drain()
        w.close()  # the server ends the connection right after its last bytes

    async def reads_to_the_end(port: int) -> bytes:
        r, w = await asyncio.open_connection(LOOP, port)
        got = await r.read()  # "bye", then the end of stream (never the end first)
        w.close()
        return got

    assert asyncio.run(_with_proxy(says_bye, 20, reads_to_the_end)) == b"bye"

    heard: list[bytes] = []
    done: list[asyncio.Event] = []

    async def waits_for_the_end(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        heard.append(await r.read())  # returns at the client's end of stream
        done[0].set()
        w.close()

    async def says_last_words(port: int) -> None:
        done.append(asyncio.Event())
        r, w = await asyncio.open_connection(LOOP, port)
        w.write(b"last words")
        await w.drain()
        w.close()  # a full close by the client reaches the server as its end of stream
        await done[0].wait()

    asyncio.run(_with_proxy(waits_for_the_end, 20, says_last_words))
    assert heard == [b"last words"]


def test_an_unreachable_upstream_closes_the_client_connection() -> None:
    async def main() -> bytes:
        proxy = DelayProxy(LOOP, 0, LOOP, free_port(), 5)  # nothing listens upstream
        await proxy.start()
        try:
            r, w = await asyncio.open_connection(LOOP, proxy.port)
            got = await asyncio.wait_for(r.read(), timeout=60)
            w.close()
            return got
        finally:
            await proxy.close()

    assert asyncio.run(main()) == b""


def test_address_parsing() -> None:
    assert split_address("10.0.0.1:50051") == ("10.0.0.1", 50051)
    assert split_address("[::1]:80") == ("::1", 80)
    for bad in ("10.0.0.1", ":80", "host:port"):
        with pytest.raises(ValueError):
            split_address(bad)
    with pytest.raises(ValueError):
        DelayProxy(LOOP, 0, LOOP, 1, -1)


def test_grpc_health_check_through_the_proxy_process() -> None:
    """The proxy as the bench runs it: a process that says `ready`, relays gRPC (HTTP/2), stops on SIGTERM."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)  # "" is SERVING
    upstream_port = server.add_insecure_port(f"{LOOP}:0")
    server.start()
    port, delay_ms = free_port(), 20.0
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "benchmarks.delay_proxy",
            "--listen",
            f"{LOOP}:{port}",
            "--upstream",
            f"{LOOP}:{upstream_port}",
            "--delay-ms",
            str(delay_ms),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        with grpc.insecure_channel(f"{LOOP}:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            assert (
                stub.Check(health_pb2.HealthCheckRequest(), timeout=60).status == health_pb2.HealthCheckResponse.SERVING
            )
            t0 = time.monotonic()  # connected: one call is one round trip through the proxy
            assert (
                stub.Check(health_pb2.HealthCheckRequest(), timeout=60).status == health_pb2.HealthCheckResponse.SERVING
            )
            assert time.monotonic() - t0 >= 2 * delay_ms / 1e3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        server.stop(None)
