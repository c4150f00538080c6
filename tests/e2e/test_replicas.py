"""Replicas behind one gateway (gateway/pool.py) and a verifier that goes away mid-generation.

Two verifiers and two drafters (tiny pair), one gateway given both lists. In order:
  - routing: 32 requests spread over both verifiers (each gets >= 30 %), outputs exact;
  - a verifier that hangs (SIGSTOP: alive, silent) under 8 streams: keepalive finds it, its
    streams resume on the other verifier; all 8 finish exact, with no gap or duplicate;
  - a verifier SIGKILLed under 8 streams: the same;
  - a draining verifier (SIGTERM) gets no new request: all go to the other;
  - no verifier left: a request ends with UNAVAILABLE within 5 s, never a hang.
The gateway and verifiers ping every second (--keepalive-time-s 1) so a hung peer is found fast.
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
from specdec.launch import Service

N = 8
MAX_TOKENS = 160
KEEPALIVE = ("--keepalive-time-s", "1", "--keepalive-timeout-s", "1")


class Stack(Services):
    def add_verifier(self, port: int | None = None) -> Service:
        from specdec.launch import free_port, start_service

        svc = start_service(
            "verifier", port or free_port(),
            ["--model", "tiny/target", "--max-gamma", str(MAX_GAMMA), "--threads", "1", "--no-adaptive-gamma",
             "--draft-wait-margin-ms", "2000", *KEEPALIVE],
            self.log_dir, env=self.env, metrics_port=free_port())
        self.started.append(svc)
        return svc


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    s = Stack(tmp_path_factory.mktemp("replicas"))
    try:
        verifiers = [s.add_verifier(), s.add_verifier()]
        drafters = [s._start("drafter", ["--model", "tiny/draft-mid", "--threads", "1", "--quantize", "none"])
                    for _ in range(2)]
        gateway = s.start_gateway(",".join(d.address for d in drafters), ",".join(v.address for v in verifiers),
                                  KEEPALIVE)
        for svc in s.started:
            svc.wait_ready(300)
        yield {"stack": s, "verifiers": verifiers, "drafters": drafters, "gateway": gateway}
    finally:
        s.stop()


@pytest.fixture(scope="module")
def cases(tiny_target: Path) -> tuple[list[list[int]], list[list[int]]]:
    ps = prompts(AutoTokenizer.from_pretrained(tiny_target), N, seed=7)
    ref = vllm_reference(tiny_target, [{"prompt_token_ids": p, "max_tokens": MAX_TOKENS, "ignore_eos": True}
                                       for p in ps])
    return ps, ref


def served(v: Service) -> float:
    return scrape(v.metrics_port).get("specdec:verifier_requests_total", 0.0)


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


def test_requests_spread_over_the_replicas(stack, cases) -> None:
    ps, _ = cases
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
    verifiers: list[Service] = stack["verifiers"]
    for v in verifiers:  # both serve (the previous case's victim is back)
        v.wait_ready(60)
    time.sleep(2.5)  # ... and the gateway's health checks (every second) know it
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
    if fault == "kill":  # bring a verifier back on the same port for the next tests
        i = verifiers.index(struck[0])
        verifiers[i] = stack["stack"].add_verifier(struck[0].port)
        verifiers[i].wait_ready(300)


def test_a_draining_verifier_gets_no_new_requests(stack, cases) -> None:
    ps, ref = cases
    draining, other = stack["verifiers"]
    draining.proc.send_signal(signal.SIGTERM)
    time.sleep(2.5)  # the gateway's health checks (every second) see NOT_SERVING (or the port closed)
    before = served(other)
    with GatewayClient(stack["gateway"].address, timeout_s=120) as client:
        outs = [list(client.generate(spec(p, MAX_TOKENS, gamma=4, ignore_eos=True)).token_ids) for p in ps]
    assert outs == ref and served(other) - before == N
    assert draining.proc.wait(timeout=60) == 0


def test_with_no_verifier_left_the_client_hears_so_quickly(stack, cases) -> None:
    ps, _ = cases
    stack["verifiers"][1].proc.send_signal(signal.SIGKILL)
    stack["verifiers"][1].proc.wait(timeout=30)
    t0 = time.monotonic()
    with GatewayClient(stack["gateway"].address, timeout_s=60) as client:
        with pytest.raises(grpc.RpcError) as info:
            client.generate(spec(ps[0], 8, gamma=4))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "verifier" in info.value.details()
    assert time.monotonic() - t0 < 5.0
