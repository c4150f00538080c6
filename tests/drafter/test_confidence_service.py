"""Drafts sized by confidence through the real DrafterServicer (the tiny draft model) on a
loopback gRPC port: the setting reaches the sessions, the blocks carry the cut and tau, and
the drafter's metrics count cuts, tau and branch hits per gamma."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from prometheus_client import CollectorRegistry

from drafter.server import DrafterServicer, build
from specdec.config import DrafterConfig
from specdec.wire import pb, rpc

BOUND_S = 60.0  # for a few draft steps of the tiny model on a loaded host
PROMPT = [3, 14, 15, 92, 65]


def test_a_bad_draft_confidence_fails_at_start_naming_the_setting() -> None:
    with pytest.raises(ValueError, match="draft_confidence"):
        build(DrafterConfig(model="tiny/draft-mid", quantize="none", draft_confidence="often"), CollectorRegistry())


async def _next_block(call: grpc.aio.StreamStreamCall, branch: bool) -> pb.DraftBlock:
    while True:
        msg = await asyncio.wait_for(call.read(), BOUND_S)
        assert msg is not grpc.aio.EOF
        if msg.HasField("block") and msg.block.branch == branch:
            return msg.block


def test_fixed_tau_cuts_blocks_and_the_metrics_count_cuts_tau_and_branch_breaks_per_gamma() -> None:
    async def run() -> tuple[pb.DraftBlock, pb.DraftBlock, pb.DraftBlock, DrafterServicer]:
        # tau 1: every draft whose conf is < 1 ends its block (one draft per round)
        cfg = DrafterConfig(model="tiny/draft-mid", quantize="none", draft_confidence="1.0", branches=3)
        servicer = build(cfg, CollectorRegistry())
        server = grpc.aio.server()
        rpc.add_DrafterServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = rpc.DrafterServiceStub(channel).Draft()
                await call.write(
                    pb.DraftRequest(
                        open=pb.DraftOpen(
                            request_id="r",
                            prompt_token_ids=PROMPT,
                            gamma=4,
                            method=pb.DRAFT_METHOD_MODEL,
                            sampling=pb.SamplingParams(max_tokens=16),
                        )
                    )
                )
                await call.write(pb.DraftRequest(commit=pb.DraftCommit(start_position=5, token_ids=[35])))
                first = await _next_block(call, branch=False)
                branch = await _next_block(call, branch=True)  # drafted in the steps the cut freed
                # the target rejects the draft with a token no branch bets on: a branch break, no hit
                other = next(t for t in range(1, 500) if t not in (first.token_ids[0], branch.token_ids[0]))
                await call.write(pb.DraftRequest(commit=pb.DraftCommit(start_position=6, token_ids=[other])))
                second = await _next_block(call, branch=False)
                call.cancel()
                return first, branch, second, servicer
        finally:
            await server.stop(0)
            await servicer.close()

    first, branch, second, servicer = asyncio.run(run())
    assert first.start_position == 6 and len(first.token_ids) == 1 and first.final and first.confidence_cut
    assert first.tau == 1.0 and branch.start_position == 6
    assert second.start_position == 7 and second.confidence_cut
    sample = servicer.metrics.registry.get_sample_value
    assert sample("specdec:drafter_confidence_cuts_total") >= 2
    assert sample("specdec:drafter_block_tau_count") >= 2 and sample("specdec:drafter_block_tau_sum") >= 2.0
    assert sample("specdec:drafter_branch_breaks_total", {"gamma": "4"}) == 1
    assert sample("specdec:drafter_branch_hits_total", {"gamma": "4"}) == 0
    # `other` may be a candidate no branch was drafted for yet: the break is uncovered or not, once
    assert sample("specdec:drafter_branch_uncovered_total", {"gamma": "4"}) in (0, 1)
    assert sample("specdec:drafter_commit_seconds_count") == 2  # both commits, each timed once
