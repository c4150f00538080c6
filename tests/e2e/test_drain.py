"""Graceful drain on SIGTERM (specdec.serving.SessionSlots.drain).

8 streaming generations in flight; SIGTERM to a gateway: all 8 finish, exact, while a new
request is refused with UNAVAILABLE. The same with SIGTERM to a verifier (this module's own,
behind a fresh gateway). Then a drain that runs out (shutdown_timeout_s shorter than the
generation, in front of a verifier that never answers: an in-process fake, as the hostile
drafter of tests/e2e/test_hostile_drafter.py): the call ends with UNAVAILABLE saying so, not
a bare cancel.

Each test brings its own victim (a fresh gateway; this module's verifier, which only the
verifier test stops; the silent fake for the last), so the tests pass in any order. None
sleeps to synchronise: each waits for the event (the victim's health says NOT_SERVING, the
gateway counts the request in flight) in a bounded loop.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from conftest import Services, vllm_reference
from gen import prompts, scrape, spec
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import HealthServicer
from transformers import AutoTokenizer

from gateway.client import AsyncGatewayClient
from specdec.wire import pb, rpc
from specdec_cli.launch import Service

N = 8
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    """A verifier (and a drafter) of this module's own: the verifier test stops it."""
    s = Services(tmp_path_factory.mktemp("drain"))
    try:
        s.verifier = s.start_verifier()
        s.drafters["mid"] = s._start("drafter", ["--model", "tiny/draft-mid", "--threads", "1", "--quantize", "none"])
        s.ready()
        yield s
    finally:
        s.stop()


async def wait_not_serving(svc: Service, timeout_s: float = 60) -> None:
    """Until `svc`'s health check says NOT_SERVING (its drain has begun) or its port is closed."""
    deadline = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(svc.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                status = (await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)).status
            except grpc.aio.AioRpcError:
                return  # gone: the drain is over already
            if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                return
            assert time.monotonic() < deadline, f"{svc.kind} still SERVING {timeout_s} s after SIGTERM"
            await asyncio.sleep(0.02)  # poll interval of the bounded wait, not a synchronisation


@pytest.fixture(scope="module")
def cases(tiny_target: Path) -> tuple[list[list[int]], list[list[int]]]:
    ps = prompts(AutoTokenizer.from_pretrained(tiny_target), N, seed=3)
    reference = vllm_reference(
        tiny_target, [{"prompt_token_ids": p, "max_tokens": MAX_TOKENS, "ignore_eos": True} for p in ps]
    )
    return ps, reference


async def _drain_while_streaming(
    gateway: Service, victim: Service, ps: list[list[int]]
) -> tuple[list, grpc.StatusCode]:
    """Start N streams, SIGTERM `victim` once each has its first tokens, send one more request,
    then read the N streams to their end. Returns (token ids per stream, the late request's code)."""
    async with AsyncGatewayClient(gateway.address, timeout_s=300) as client:
        calls = [client.stream(spec(p, MAX_TOKENS, gamma=4, ignore_eos=True)) for p in ps]
        firsts = await asyncio.gather(*(c.read() for c in calls))
        victim.proc.send_signal(signal.SIGTERM)
        await wait_not_serving(victim)
        try:
            await client.generate(spec(ps[0], 4, gamma=4))
            late = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as err:
            late = err.code()

        async def rest(call, first) -> list[int]:
            ids, chunk = [], first
            while chunk is not grpc.aio.EOF:  # read() only: grpc.aio forbids mixing it with iteration
                ids.extend(chunk.token_ids)
                chunk = await call.read()
            return ids

        return await asyncio.gather(*(rest(c, f) for c, f in zip(calls, firsts, strict=True))), late


def test_sigterm_to_the_gateway_drains(services: Services, cases) -> None:
    ps, reference = cases
    gateway = services.start_gateway(services.drafters["mid"].address, services.verifier.address)
    gateway.wait_ready(120)
    outputs, late = asyncio.run(_drain_while_streaming(gateway, gateway, ps))
    assert outputs == reference  # all 8 finished, exact
    assert late == grpc.StatusCode.UNAVAILABLE
    assert gateway.proc.wait(timeout=60) == 0
    assert "draining" in gateway.log_path.read_text()


def test_sigterm_to_the_verifier_drains(stack: Services, cases) -> None:
    ps, reference = cases
    gateway = stack.start_gateway(stack.drafters["mid"].address, stack.verifier.address)
    gateway.wait_ready(120)
    outputs, late = asyncio.run(_drain_while_streaming(gateway, stack.verifier, ps))
    assert outputs == reference
    assert late == grpc.StatusCode.UNAVAILABLE
    assert stack.verifier.proc.wait(timeout=120) == 0


class SilentVerifier(rpc.VerifierServiceServicer):
    """A verifier that serves its health and limits but never answers a Verify call (it holds
    the stream open until the caller cancels): the peer a drain must give up on."""

    def GetVerifierInfo(self, request, context) -> "pb.GetVerifierInfoResponse":  # noqa: N802
        return pb.GetVerifierInfoResponse(model="silent", vocab_size=512, max_model_len=2048, max_gamma=8)

    def Verify(self, request_iterator, context) -> Iterator["pb.VerifyResponse"]:  # noqa: N802
        cancelled = threading.Event()
        context.add_callback(cancelled.set)
        cancelled.wait(300)
        return iter(())


@pytest.fixture
def silent_verifier() -> Iterator[str]:
    """The address of a SilentVerifier served in this process."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    rpc.add_VerifierServiceServicer_to_server(SilentVerifier(), server)
    health = HealthServicer()
    for name in ("", "specdec.v1.VerifierService"):
        health.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=0)


def test_a_drain_that_runs_out_says_so(services: Services, silent_verifier: str) -> None:
    """A gateway whose drain is shorter than its generation, in front of a verifier that never
    answers: the drain runs out and says so."""
    gateway = services.start_gateway(services.drafters["mid"].address, silent_verifier, ("--shutdown-timeout-s", "0.5"))
    gateway.wait_ready(120)

    def in_flight() -> float:
        return scrape(gateway.metrics_port).get("specdec:requests_running", 0.0)

    async def run() -> grpc.aio.AioRpcError:
        async with AsyncGatewayClient(gateway.address, timeout_s=120) as client:
            call = client.stream(spec([1, 2, 3], 8, gamma=4))
            deadline = time.monotonic() + 60
            while in_flight() < 1:  # the request is in the gateway, its Verify call unanswered
                assert time.monotonic() < deadline, "the request never reached the gateway"
                await asyncio.sleep(0.02)  # poll interval of the bounded wait
            gateway.proc.send_signal(signal.SIGTERM)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                while await call.read() is not grpc.aio.EOF:
                    pass
            return info.value

    err = asyncio.run(run())
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert "shutdown_timeout_s" in err.details(), err.details()
