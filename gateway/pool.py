"""Replicas of a service behind one gateway: which verifier (or drafter) a request goes to.

    --verifier-address 10.0.0.1:50053,10.0.0.2:50053      a list of replicas
    --verifier-address dns:///verifier-headless:50053     every address a name resolves to (a
                                                          Kubernetes headless Service: one per pod),
                                                          resolved again every `resolve_every_s` (every
                                                          `health_every_s` while none of them serves)

Terms:
    in flight   requests this gateway has on a replica now (its own count: no extra RPC)
    healthy     its gRPC health check answers SERVING (checked every `health_every_s`; a check
                that times out counts only at the SLOW_CHECKS-th in a row); a replica whose call
                failed as if it were gone counts as unhealthy until its health check answers
                SERVING again
    pick        the power of two choices: two healthy replicas at random, the one with fewer
                requests in flight (ties: either); a draining replica (NOT_SERVING) or one that
                failed is skipped until it recovers; with none healthy, `pick` waits for one
                up to its timeout (then raises NoReplica)
    affinity    a request with a key (`affinity_key`: the first tokens of a long prompt) goes
                to its home, the healthy replica that rendezvous hashing of the key and the
                addresses names, unless the home has more than AFFINITY_SLACK requests in
                flight beyond another healthy replica picked at random, which then takes it
                (bounded load: a hot prefix spills over). Prompts that start alike meet the
                same verifier and drafter, whose prefix caches hold that start (a chat's turns,
                an editor's completions of one file, a shared system prompt); a replica that
                comes or goes moves only the keys whose home it is
    start       the owner (the gateway) starts every pool when it starts: resolving and health
                checking run in the background from then on, for the drafters' pool as for the
                verifiers'. Until its first pass (resolve, then one health check of each
                replica) is over a pool knows nothing; `checked()` waits for that pass.

Kubernetes does the scaling (replicas, HPA); this only spreads requests over what exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import random
import socket
import time
from array import array
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger("specdec.gateway")


# A home replica (see the module's terms) takes its request unless it has more than this many
# requests in flight beyond another healthy replica's.
AFFINITY_SLACK = 4


def affinity_key(prompt: Sequence[int], tokens: int) -> bytes | None:
    """The affinity key of a prompt (token ids): its first `tokens` ids, or None when it is
    shorter than that (a short prompt's prefill is cheap anywhere) or `tokens` is 0 (off)."""
    if tokens <= 0 or len(prompt) < tokens:
        return None
    return array("q", prompt[:tokens]).tobytes()


def _weight(key: bytes, address: str) -> int:
    """Rendezvous hashing: the replica with the highest weight for a key is its home."""
    return int.from_bytes(hashlib.blake2b(key + b"@" + address.encode(), digest_size=8).digest(), "big")


# A replica whose health checks time out this many times in a row is skipped (one slow answer, from
# a replica busy with its own work, is not a replica that went away; a refused connection is).
SLOW_CHECKS = 3


class NoReplica(Exception):
    """No healthy replica within the wait."""


@dataclass
class Replica:
    """One address of the pool, its channel and what the gateway knows of it."""

    address: str
    channel: grpc.aio.Channel
    stub: Any
    in_flight: int = 0
    # its health check's last answer; False until the first answers SERVING: a replica not yet
    # checked, or whose checks time out from the start, is not known to serve (an optimistic True
    # sent a gateway's first request to an address where nothing listens, to wait out
    # GetVerifierInfo's 30 s instead of hearing UNAVAILABLE within verifier_retry_s)
    serving: bool = False
    slow_checks: int = 0  # health checks in a row that timed out (a busy replica, not a gone one)


def split_addresses(spec: str) -> list[str]:
    """`a:1,b:2` -> ["a:1", "b:2"]; a `dns:///name:port` entry stays one entry."""
    return [a.strip() for a in spec.split(",") if a.strip()]


@dataclass
class Pool:
    """The replicas of one service. `connect(address, server_name)` makes a channel (TLS or not,
    with `server_name` the name the certificate must carry when the address is a resolved IP);
    `make_stub(channel)` the service's stub."""

    spec: str
    connect: Callable[[str, str], grpc.aio.Channel]
    make_stub: Callable[[grpc.aio.Channel], Any]
    service: str = ""  # the health-check service name ("" checks the server as a whole)
    health_every_s: float = 1.0
    resolve_every_s: float = 10.0
    rng: random.Random = field(default_factory=random.Random)
    replicas: dict[str, Replica] = field(default_factory=dict)
    _names: list[tuple[str, int]] = field(default_factory=list)  # dns:/// entries (host, port)
    _task: asyncio.Task[None] | None = None
    _changed: asyncio.Event | None = None
    _checked: asyncio.Event | None = None  # set once the first pass (resolve + health checks) is over

    def __post_init__(self) -> None:
        for entry in split_addresses(self.spec):
            if entry.startswith("dns:///"):
                host, _, port = entry[len("dns:///") :].rpartition(":")
                self._names.append((host, int(port)))
            else:
                self._add(entry, "")
        if not self.replicas and not self._names:
            raise ValueError(f"no address in {self.spec!r}")

    def _add(self, address: str, server_name: str) -> None:
        channel = self.connect(address, server_name)
        self.replicas[address] = Replica(address, channel, self.make_stub(channel))

    async def _resolve(self) -> None:
        loop = asyncio.get_running_loop()
        for host, port in self._names:
            try:
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as err:
                log.warning("cannot resolve %s: %s", host, err)
                continue
            ips = {str(info[4][0]) for info in infos}  # each sockaddr's host: an IPv4 or IPv6 address
            found = {f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips}
            for address in found - set(self.replicas):
                self._add(address, host)
                log.info("replica %s (%s) added", address, host)
            for address in set(self.replicas) - found:
                if self.replicas[address].in_flight == 0:  # a pod that is gone: drop it once idle
                    gone = self.replicas.pop(address)
                    asyncio.get_running_loop().create_task(gone.channel.close())

    async def _check(self, r: Replica) -> None:
        """One health check: SERVING or not as answered; a refused connection (gone) at once; a
        check that times out (a busy replica) only the SLOW_CHECKS-th time in a row, and only for
        a replica that answered SERVING before (one never heard from stays not serving)."""
        try:
            answer: health_pb2.HealthCheckResponse = await health_pb2_grpc.HealthStub(r.channel).Check(  # type: ignore[attr-defined]  # types-grpcio-health-checking's HealthStub lacks Check (the generated __init__ sets it)
                health_pb2.HealthCheckRequest(service=self.service), timeout=max(0.5, self.health_every_s)
            )
            r.serving = answer.status == health_pb2.HealthCheckResponse.SERVING
            r.slow_checks = 0
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                r.slow_checks += 1
                if r.slow_checks < SLOW_CHECKS:
                    return
            r.serving = False

    async def _watch(self) -> None:
        assert self._changed is not None and self._checked is not None
        last_resolve = -1e9
        while True:
            # every resolve_every_s; while none serves (pods still starting), at every pass
            if self._names and (time.monotonic() - last_resolve >= self.resolve_every_s or not self.serving()):
                last_resolve = time.monotonic()
                await self._resolve()
            await asyncio.gather(*(self._check(r) for r in list(self.replicas.values())))
            self._checked.set()
            self._changed.set()
            await asyncio.sleep(self.health_every_s)

    def start(self) -> None:
        """Start resolving and health-checking in the background (in the running loop); the
        owner calls it when it starts. Calling it again does nothing."""
        if self._task is None:
            self._changed = asyncio.Event()
            self._checked = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def checked(self, timeout_s: float) -> bool:
        """Wait (up to `timeout_s`) until the first resolve and health-check pass is over;
        starts the pool if it was not. True when it is over."""
        self.start()
        assert self._checked is not None
        if not self._checked.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):  # not wait_for: see `pick`
                    await self._checked.wait()
        return self._checked.is_set()

    def serving(self) -> int:
        """How many replicas answered SERVING to their last health check (and did not fail since)."""
        return sum(r.serving for r in self.replicas.values())

    def choose(self, exclude: AbstractSet[str] = frozenset(), key: bytes | None = None) -> Replica | None:
        """Among healthy replicas (not in `exclude`): with `key`, its home unless the home's load
        spills over (see the module's terms, affinity); else the power of two choices. None when
        none is healthy."""
        healthy = [r for r in self.replicas.values() if r.address not in exclude and r.serving]
        if not healthy:
            return None
        if len(healthy) == 1:
            return healthy[0]
        if key is not None:
            home = max(healthy, key=lambda r: _weight(key, r.address))
            other = self.rng.choice([r for r in healthy if r is not home])
            return home if home.in_flight <= other.in_flight + AFFINITY_SLACK else other
        a, b = self.rng.sample(healthy, 2)
        return a if a.in_flight <= b.in_flight else b

    async def pick(
        self, timeout_s: float, exclude: AbstractSet[str] = frozenset(), key: bytes | None = None
    ) -> Replica:
        """A replica for one request (`choose`), waiting up to `timeout_s` for one to be healthy."""
        self.start()
        deadline = time.monotonic() + timeout_s
        while True:
            r = self.choose(exclude, key)
            if r is not None:
                return r
            left = deadline - time.monotonic()
            if left <= 0:
                known = ", ".join(self.replicas) or "none resolved"
                raise NoReplica(f"no replica serving within {timeout_s:g} s (known: {known})")
            assert self._changed is not None
            self._changed.clear()
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns normally when the
            # event is set as the caller is cancelled, losing the cancellation (a client's deadline
            # then waited out `timeout_s`; seen once in test_guard's deadline test)
            try:
                async with asyncio.timeout(min(left, self.health_every_s)):
                    await self._changed.wait()
            except TimeoutError:
                pass

    def failed(self, r: Replica) -> None:
        """A call on `r` failed as if the replica were gone: skip it until its health check
        answers SERVING again."""
        r.serving = False
        log.warning("replica %s failed; skipped until it serves again", r.address)

    async def close(self, grace_s: float | None = None) -> None:
        """Stop watching and close the channels (calls in flight get up to `grace_s`)."""
        if self._task is not None:
            self._task.cancel()
        await asyncio.gather(*(r.channel.close(grace=grace_s) for r in self.replicas.values()), return_exceptions=True)
