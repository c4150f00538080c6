"""Replicas behind one gateway (gateway/pool.py) and a verifier that goes away mid-generation.

Two verifiers and two drafters (tiny pair), one gateway given both lists. Each test first
brings both verifiers back to serving (`revive`), so the tests pass in any order:
  - routing: 32 requests spread over both verifiers (each gets >= 30 %), outputs exact;
  - a verifier that hangs (SIGSTOP: alive, silent) under 8 streams: keepalive finds it, its
    streams resume on the other verifier; all 8 finish exact, with no gap or duplicate;
  - a verifier SIGKILLed under 8 streams: the same;
  - a draining verifier (SIGTERM) gets no new request: all go to the other;
  - no verifier left: a request ends with UNAVAILABLE after the gateway's verifier_retry_s,
    never a hang (a client deadline of 30x that would end a hang with DEADLINE_EXCEEDED).
The gateway and verifiers ping every second (--keepalive-time-s 1) so a hung peer is found fast.
No test sleeps to let the gateway notice a change: each waits for the event itself (the
victim's exit, or requests reaching both verifiers), in a bounded loop.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from conftest import MAX_GAMMA, Services, vllm_reference
from gen import prompts, scrape, spec
from transformers import AutoTokenizer

from gateway.client import AsyncGatewayClient, GatewayClient
from specdec.config import GatewayConfig
from specdec_cli.launch import Service

N = 8
MAX_TOKENS = 160
KEEPALIVE = ("--keepalive-time-s", "1", "--keepalive-timeout-s", "1")


class Stack(Services):
    def add_verifier(self, port: int | None = None) -> Service:
        from specdec_cli.launch import free_port, start_service

        svc = start_service(
            "verifier",
            port or free_port(),
            [
                "--model",
                "tiny/target",
                "--max-gamma",
                str(MAX_GAMMA),
                "--threads",
                "1",
                "--no-adaptive-gamma",
                "--draft-wait-margin-ms",
                "2000",
                *KEEPALIVE,
            ],
            self.log_dir,
            env=self.env,
            metrics_port=free_port(),
        )
        self.started.append(svc)
        return svc


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    s = Stack(tmp_path_factory.mktemp("replicas"))
    try:
        verifiers = [s.add_verifier(), s.add_verifier()]
        drafters = [
            s._start("drafter", ["--model", "tiny/draft-mid", "--threads", "1", "--quantize", "none"]) for _ in range(2)
        ]
        gateway = s.start_gateway(
            ",".join(d.address for d in drafters), ",".join(v.address for v in verifiers), KEEPALIVE
        )
        s.ready()
        yield {"stack": s, "verifiers": verifiers, "drafters": drafters, "gateway": gateway}
    finally:
        s.stop()


@pytest.fixture(scope="module")
def cases(tiny_target: Path) -> tuple[list[list[int]], list[list[int]]]:
    ps = prompts(AutoTokenizer.from_pretrained(tiny_target), N, seed=7)
    ref = vllm_reference(
        tiny_target, [{"prompt_token_ids": p, "max_tokens": MAX_TOKENS, "ignore_eos": True} for p in ps]
    )
    return ps, ref


def served(v: Service) -> float:
    return scrape(v.metrics_port).get("specdec:verifier_requests_total", 0.0)


def wait_until_both_serve(
    gateway: Service, verifiers: list[Service], prompt: list[int], timeout_s: float = 300
) -> None:
    """Send short requests until each verifier has served one more: then the gateway's health
    checks count both as serving (the event itself, not a sleep for the check interval). A
    request may be refused meanwhile (UNAVAILABLE: the gateway's channel to a verifier that was
    down is still in gRPC's reconnect backoff, which grows to tens of seconds): it is retried."""
    before = [served(v) for v in verifiers]
    deadline = time.monotonic() + timeout_s
    with GatewayClient(gateway.address, timeout_s=60) as client:
        while not all(served(v) > b for v, b in zip(verifiers, before, strict=True)):
            assert time.monotonic() < deadline, "the gateway never routed to both verifiers"
            try:
                client.generate(spec(prompt, 1, gamma=0))
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.UNAVAILABLE:
                    raise


async def _streams(gateway: Service, ps: list[list[int]], during) -> list:
    """N streams; once each has its first tokens, `during()`; then read them to the end.
    Returns (token ids, migrations) per stream."""
    async with AsyncGatewayClient(gateway.address, timeout_s=300) as client:
        calls = [client.stream(spec(p, MAX_TOKENS, gamma=4, ignore_eos=True)) for p in ps]
        firsts = await asyncio.gather(*(c.read() for c in calls))
        during()

        async def rest(call, chunk) -> tuple[list[int], int]:
            ids, last = [], chunk
            while chunk is not grpc.aio.EOF:
                ids.extend(chunk.token_ids)
                last = chunk
                chunk = await call.read()
            return ids, last.stats.migrations

        return await asyncio.gather(*(rest(c, f) for c, f in zip(calls, firsts, strict=True)))


def revive(stack: dict, prompt: list[int]) -> None:
    """Each test starts with both verifiers serving, whatever ran before it (tests run in a
    random order): a verifier an earlier test stopped is started again on its port."""
    verifiers: list[Service] = stack["verifiers"]
    for i, v in enumerate(verifiers):
        if v.proc.poll() is not None:
            verifiers[i] = stack["stack"].add_verifier(v.port)
    for v in verifiers:
        v.wait_ready(300)
    wait_until_both_serve(stack["gateway"], verifiers, prompt)


def test_requests_spread_over_the_replicas(stack, cases) -> None:
    ps, _ = cases
    revive(stack, ps[0])
    before = [served(v) for v in stack["verifiers"]]

    async def run() -> None:
        async with AsyncGatewayClient(stack["gateway"].address, timeout_s=300) as client:
            await asyncio.gather(*(client.generate(spec(ps[i % N], 8, gamma=4)) for i in range(32)))

    asyncio.run(run())
    got = [served(v) - b for v, b in zip(stack["verifiers"], before, strict=True)]
    assert sum(got) == 32 and min(got) >= 0.3 * 32, got


@pytest.mark.parametrize("fault", ["hang", "kill"])
def test_a_verifier_that_goes_away_mid_generation(stack, cases, fault: str) -> None:
    ps, ref = cases
    revive(stack, ps[0])
    verifiers: list[Service] = stack["verifiers"]
    struck: list[Service] = []

    def strike() -> None:  # the verifier with the most of these streams
        victim = max(verifiers, key=lambda v: scrape(v.metrics_port).get("specdec:verifier_sessions", 0))
        victim.proc.send_signal(signal.SIGSTOP if fault == "hang" else signal.SIGKILL)
        struck.append(victim)

    try:
        results = asyncio.run(_streams(stack["gateway"], ps, strike))
    finally:
        if fault == "hang" and struck:
            struck[0].proc.send_signal(signal.SIGCONT)
    assert [ids for ids, _ in results] == ref  # all 8 complete, exact: no gap, no duplicate
    assert any(m > 0 for _, m in results)  # the victim's streams moved


def test_a_draining_verifier_gets_no_new_requests(stack, cases) -> None:
    ps, ref = cases
    revive(stack, ps[0])
    draining, other = stack["verifiers"]
    draining.proc.send_signal(signal.SIGTERM)
    # with nothing in flight the drain ends at once: wait for that event (a clean exit), after
    # which its port refuses and the gateway's next health check (every second) marks it
    assert draining.proc.wait(timeout=60) == 0
    before = served(other)
    with GatewayClient(stack["gateway"].address, timeout_s=120) as client:
        outs = [list(client.generate(spec(p, MAX_TOKENS, gamma=4, ignore_eos=True)).token_ids) for p in ps]
    assert outs == ref and served(other) - before == N


def test_with_no_verifier_left_the_client_hears_so_quickly(stack, cases) -> None:
    ps, _ = cases
    for v in stack["verifiers"]:
        if v.proc.poll() is None:
            v.proc.send_signal(signal.SIGKILL)
            v.proc.wait(timeout=30)
    retry_s = GatewayConfig().verifier_retry_s  # the module's gateway keeps the default
    with GatewayClient(stack["gateway"].address, timeout_s=30 * retry_s) as client:
        with pytest.raises(grpc.RpcError) as info:
            client.generate(spec(ps[0], 8, gamma=4))
    # UNAVAILABLE, not DEADLINE_EXCEEDED: the gateway answered within 30x its retry, never hung
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "verifier" in info.value.details()
