"""Graceful drain on SIGTERM (specdec.serving.SessionSlots.drain), with its own services.

8 streaming generations in flight; SIGTERM to the gateway: all 8 finish, exact, while a new
request is refused with UNAVAILABLE. The same with SIGTERM to the verifier (behind a fresh
gateway). Then a drain that runs out (shutdown_timeout_s shorter than the generation): the
call ends with UNAVAILABLE saying so, not a bare cancel.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from conftest import Services, vllm_reference
from gen import prompts, spec
from transformers import AutoTokenizer

from gateway.client import AsyncGatewayClient
from specdec.launch import Service

N = 8
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    s = Services(tmp_path_factory.mktemp("drain"))
    try:
        s.verifier = s.start_verifier()
        s.drafters["mid"], s.gateways["mid"] = s.start_pair("tiny/draft-mid", s.verifier)
        for svc in s.started:
            svc.wait_ready(300)
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def cases(tiny_target: Path) -> tuple[list[list[int]], list[list[int]]]:
    ps = prompts(AutoTokenizer.from_pretrained(tiny_target), N, seed=3)
    reference = vllm_reference(tiny_target, [{"prompt_token_ids": p, "max_tokens": MAX_TOKENS, "ignore_eos": True}
                                             for p in ps])
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
        await asyncio.sleep(0.5)  # the signal is handled (the late request is refused either way)
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


def test_sigterm_to_the_gateway_drains(stack: Services, cases) -> None:
    ps, reference = cases
    gateway = stack.gateways["mid"]
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


def test_a_drain_that_runs_out_says_so(stack: Services) -> None:
    """The last test of the module (the verifier is gone): a gateway whose drain is shorter than
    its generation, in front of a verifier that never answers (the stopped one's port)."""
    gateway = stack.start_gateway(stack.drafters["mid"].address, stack.verifier.address,
                                  ("--shutdown-timeout-s", "0.5"))
    gateway.wait_ready(120)

    async def run() -> grpc.aio.AioRpcError:
        async with AsyncGatewayClient(gateway.address, timeout_s=120) as client:
            call = client.stream(spec([1, 2, 3], 8, gamma=4))
            await asyncio.sleep(1.0)  # the request is in the gateway, waiting for the verifier
            gateway.proc.send_signal(signal.SIGTERM)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                while await call.read() is not grpc.aio.EOF:
                    pass
            return info.value

    err = asyncio.run(run())
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert "shutdown_timeout_s" in err.details(), err.details()
