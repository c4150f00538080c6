"""gateway.pool: replicas resolved and health-checked, in-process, against real gRPC health servers.

No timers are raced: each test waits for the pool's own first pass (`checked()`), or runs one
health check (`_check`) at a time against a server whose answer it controls.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.pool import AFFINITY_SLACK, SLOW_CHECKS, NoReplica, Pool, affinity_key
from specdec_cli.launch import free_port


def _pool(spec: str) -> Pool:
    return Pool(
        spec, lambda address, name: grpc.aio.insecure_channel(address), lambda channel: channel, health_every_s=0.5
    )


async def _health_server(
    port: int = 0, status: int = health_pb2.HealthCheckResponse.SERVING
) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    h = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(h, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await h.set("", status)
    return server, port


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(test())


def test_a_dns_pool_resolves_and_checks_without_being_picked() -> None:
    """The bug the shipped manifests hit: a dns:/// drafter pool was never started, so it never
    had a replica. Started (as the gateway now does at start-up), it resolves and checks."""

    async def test() -> None:
        server, port = await _health_server()
        pool = _pool(f"dns:///localhost:{port}")
        try:
            assert pool.replicas == {}  # nothing before the first pass
            assert await pool.checked(30)
            assert list(pool.replicas) == [f"127.0.0.1:{port}"] and pool.serving() == 1
            assert pool.choose() is not None
        finally:
            await pool.close()
            await server.stop(None)

    run(test)


def test_a_static_list_skips_a_dead_replica() -> None:
    async def test() -> None:
        server, port = await _health_server()
        dead = free_port()  # nothing listens there
        pool = _pool(f"127.0.0.1:{dead},127.0.0.1:{port}")
        try:
            assert await pool.checked(30)
            assert pool.serving() == 1
            assert {pool.choose().address for _ in range(50)} == {f"127.0.0.1:{port}"}  # type: ignore[union-attr]  # one replica serves: never None
        finally:
            await pool.close()
            await server.stop(None)

    run(test)


def test_a_replica_never_heard_from_is_not_picked() -> None:
    """Before its first health check answers SERVING, a replica is not known to serve: a pick
    waits for that answer, and with none in `timeout_s` says NoReplica (the gateway: UNAVAILABLE
    naming verifier_retry_s). It was optimistic: a pick just after start, or while the first checks
    of a loaded host timed out, got a replica where nothing listens, and the gateway's first request
    then waited out GetVerifierInfo's 30 s (seen in tests/gateway/test_guard.py in a fresh clone)."""

    async def test() -> None:
        hold = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # bound, not listening: refused
        hold.bind(("127.0.0.1", 0))
        server, port = await _health_server()
        nowhere = f"127.0.0.1:{hold.getsockname()[1]}"
        pool, served = _pool(nowhere), _pool(f"127.0.0.1:{port}")
        try:
            assert pool.choose() is None and pool.serving() == 0  # not checked yet
            with pytest.raises(NoReplica):
                await pool.pick(timeout_s=0.3)
            assert (await served.pick(timeout_s=30)).address == f"127.0.0.1:{port}"  # waits for the answer
        finally:
            await asyncio.gather(pool.close(), served.close())
            await server.stop(None)
            hold.close()

    run(test)


def test_not_serving_is_skipped_at_once_a_slow_answer_only_when_it_repeats() -> None:
    async def test() -> None:
        draining, port_a = await _health_server(status=health_pb2.HealthCheckResponse.NOT_SERVING)
        # a server that accepts the call and never answers it: each check times out
        silent = grpc.aio.server()
        never = asyncio.Event()

        async def hang(request: object, context: grpc.aio.ServicerContext) -> object:
            await never.wait()
            return health_pb2.HealthCheckResponse()

        silent.add_generic_rpc_handlers(
            [
                grpc.method_handlers_generic_handler(
                    "grpc.health.v1.Health",
                    {
                        "Check": grpc.unary_unary_rpc_method_handler(
                            hang,
                            request_deserializer=health_pb2.HealthCheckRequest.FromString,
                            response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
                        )
                    },
                )
            ]
        )
        port_b = silent.add_insecure_port("127.0.0.1:0")
        await silent.start()
        pool = _pool(f"127.0.0.1:{port_a},127.0.0.1:{port_b}")
        a, b = pool.replicas[f"127.0.0.1:{port_a}"], pool.replicas[f"127.0.0.1:{port_b}"]
        try:
            await pool._check(a)
            assert not a.serving  # NOT_SERVING (a draining replica): skipped at once
            await pool._check(b)
            assert not b.serving and b.slow_checks == 1  # never heard from: not known to serve
            b.serving, b.slow_checks = True, 0  # as if it had answered SERVING, then got busy
            for i in range(1, SLOW_CHECKS + 1):
                await pool._check(b)
                assert b.serving == (i < SLOW_CHECKS), i  # busy, not gone, until it keeps timing out
        finally:
            never.set()
            await pool.close()
            await asyncio.gather(draining.stop(None), silent.stop(None))

    run(test)


def test_a_pick_cancelled_as_the_pool_changes_stays_cancelled() -> None:
    """A waiting `pick` whose caller is cancelled (a client's deadline passed) in the same loop
    turn as the pool's change event is set ends cancelled. asyncio.wait_for on Python 3.11 lost
    that cancellation, and the pick went on waiting for its whole timeout."""

    async def test() -> None:
        server, port = await _health_server(status=health_pb2.HealthCheckResponse.NOT_SERVING)
        pool = _pool(f"127.0.0.1:{port}")
        try:
            assert await pool.checked(30) and pool.serving() == 0
            task = asyncio.create_task(pool.pick(timeout_s=5))
            await asyncio.sleep(0)  # one loop turn: the task runs to its wait for a change
            assert pool._changed is not None and not task.done()
            pool._changed.set()
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            assert task.cancelled(), task
        finally:
            await pool.close()
            await server.stop(None)

    run(test)


def _static(n: int, seed: int = 0) -> Pool:
    """A list of n replicas, all serving (no channel: `choose` reads only the pool's own state)."""
    import random

    pool = Pool(
        ",".join(f"10.0.0.{i}:50053" for i in range(1, n + 1)),
        lambda a, s: None,
        lambda c: None,
        rng=random.Random(seed),
    )
    for r in pool.replicas.values():
        r.serving = True
    return pool


def test_a_long_prompt_goes_to_its_home_replica_and_spills_over_only_past_the_slack() -> None:
    pool = _static(4)
    key = affinity_key(list(range(300)), 256)
    assert key is not None and affinity_key(list(range(300)) + [7, 8], 256) == key  # a later turn: the same key
    assert affinity_key(list(range(255)), 256) is None and affinity_key(list(range(300)), 0) is None
    home = pool.choose(key=key)
    assert home is not None
    assert {pool.choose(key=key).address for _ in range(50)} == {home.address}  # type: ignore[union-attr]
    home.in_flight = AFFINITY_SLACK  # busier than every other replica by the slack: still home
    assert {pool.choose(key=key).address for _ in range(50)} == {home.address}  # type: ignore[union-attr]
    home.in_flight = AFFINITY_SLACK + 1  # past it: another replica takes the request
    assert home.address not in {pool.choose(key=key).address for _ in range(50)}  # type: ignore[union-attr]


def test_homes_spread_over_the_replicas_and_a_replica_going_moves_only_its_own_keys() -> None:
    pool = _static(4)
    keys = [affinity_key([k] * 256, 256) for k in range(400)]
    homes = {k: pool.choose(key=k).address for k in keys}  # type: ignore[union-attr]
    counts = sorted(list(homes.values()).count(a) for a in pool.replicas)
    assert counts[0] >= 50, counts  # ~100 each: rendezvous hashing spreads keys evenly
    gone = next(iter(pool.replicas))
    pool.replicas[gone].serving = False
    after = {k: pool.choose(key=k).address for k in keys}  # type: ignore[union-attr]
    assert all(after[k] == homes[k] for k in keys if homes[k] != gone)
    assert all(after[k] != gone for k in keys)
    assert pool.choose(exclude={homes[keys[0]]}, key=keys[0]).address != homes[keys[0]]  # type: ignore[union-attr]
