"""Half-open sessions: a Draft stream that never sends its `open` frees its max_sessions slot
after first_message_timeout_s, so a flood of them cannot lock real sessions out.

The real DrafterServicer (the tiny draft model) on a loopback gRPC port.
"""

from __future__ import annotations

import asyncio

import grpc
from prometheus_client import CollectorRegistry

from drafter.server import build
from specdec.config import DrafterConfig
from specdec.wire import pb, rpc

SLOTS = 100
FIRST_MESSAGE_TIMEOUT_S = 1.0
BOUND_S = 60.0  # for 100 streams to be ended after 1 s, on a loaded host


def _open() -> pb.DraftRequest:
    return pb.DraftRequest(
        open=pb.DraftOpen(
            request_id="real",
            prompt_token_ids=[5, 6, 7, 8],
            gamma=2,
            method=pb.DRAFT_METHOD_MODEL,
            sampling=pb.SamplingParams(max_tokens=8),
        )
    )


def test_100_half_open_sessions_do_not_block_a_real_one() -> None:
    async def run() -> tuple[list[grpc.StatusCode], int, pb.DraftResponse]:
        cfg = DrafterConfig(
            model="tiny/draft-mid", quantize="none", max_sessions=SLOTS, first_message_timeout_s=FIRST_MESSAGE_TIMEOUT_S
        )
        servicer = build(cfg, CollectorRegistry())
        server = grpc.aio.server()
        rpc.add_DrafterServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = rpc.DrafterServiceStub(channel)
                half_open = [stub.Draft() for _ in range(SLOTS)]  # they never write a message
                # the drafter ends them (else they would hold every slot forever)
                codes = await asyncio.wait_for(asyncio.gather(*(c.code() for c in half_open)), BOUND_S)
                held = servicer.slots.active
                real = stub.Draft()
                await real.write(_open())
                first = await asyncio.wait_for(real.read(), BOUND_S)
                real.cancel()
                return codes, held, first
        finally:
            await server.stop(0)
            await servicer.close()

    codes, held, first = asyncio.run(run())
    assert set(codes) == {grpc.StatusCode.DEADLINE_EXCEEDED}  # each held a slot until then, none was refused
    assert held == 0
    assert first is not grpc.aio.EOF and (first.HasField("ready") or first.HasField("block"))
