"""The gateway's chunks: preview tokens stream at once, verdicts add only what is new."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from prometheus_client import CollectorRegistry
from transformers import AutoTokenizer

from gateway.core import GatewayCore
from gateway.plan import Plan
from specdec import telemetry
from specdec.config import GatewayConfig
from specdec.stats import SpecStats
from specdec.wire import pb


def fake_generation(plan: Plan, steps, stats=None) -> SimpleNamespace:
    """A stand-in for gateway.generation.Generation: its plan, replicas, stats and scripted steps."""
    replicas = (SimpleNamespace(in_flight=0, address="verifier-a"), SimpleNamespace(in_flight=0, address="drafter"))
    return SimpleNamespace(
        plan=plan, steps=steps, replicas=replicas, stats=stats or SpecStats(plan.gamma, plan.drafter)
    )


class NoPool:
    """A replica pool with no replica (the calls GatewayCore makes of gateway.pool.Pool);
    `failed_replicas`: those reported failed."""

    def __init__(self) -> None:
        self.replicas: list = []
        self.failed_replicas: list = []

    def start(self) -> None:
        pass

    def serving(self) -> int:
        return 0

    def failed(self, replica) -> None:
        self.failed_replicas.append(replica)

    async def close(self, grace_s: float = 0.0) -> None:
        pass


def gateway_core(tiny_target) -> GatewayCore:
    """A real GatewayCore over the tiny target's tokenizer, with no channels (only _chunks is exercised)."""
    return GatewayCore(
        GatewayConfig(tokenizer=str(tiny_target)),
        telemetry.GatewayMetrics(CollectorRegistry()),
        AutoTokenizer.from_pretrained(tiny_target),
        pools=lambda cfg: (NoPool(), NoPool()),
    )


def _collect(tiny_target, messages: list, stop: list[str] | None = None) -> list:
    core = gateway_core(tiny_target)

    async def verdicts():
        for m in messages:
            yield m

    plan = Plan("r", [1, 2, 3], pb.SamplingParams(max_tokens=5, stop=stop or []), 4, pb.DRAFT_METHOD_MODEL)
    generation = fake_generation(plan, verdicts)

    async def run() -> list:
        return [c async for c in core._chunks(generation, None)]

    return asyncio.run(run())


def test_preview_tokens_stream_before_their_verdict(tiny_target) -> None:
    chunks = _collect(
        tiny_target,
        [
            pb.Preview(start_position=3, token_ids=[10]),  # the prefill step's token
            pb.Verdict(start_position=3, token_ids=[10]),
            pb.Preview(start_position=4, token_ids=[11, 12]),
            pb.Verdict(start_position=4, token_ids=[11, 12, 13], drafted=2, accepted=1),  # 13 held back
            pb.Verdict(start_position=7, token_ids=[14], finish_reason=pb.FINISH_REASON_LENGTH),
        ],
    )
    assert [c.token_ids for c in chunks] == [[10], [11, 12], [13], [14]]
    assert [(c.drafted, c.accepted) for c in chunks] == [(0, 0), (0, 0), (2, 1), (0, 0)]
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert sum(len(c.token_ids) for c in chunks) == 5  # every token once


def test_a_verdict_with_nothing_new_still_reports_its_counts(tiny_target) -> None:
    chunks = _collect(
        tiny_target,
        [
            pb.Preview(start_position=3, token_ids=[10, 11]),
            pb.Verdict(start_position=3, token_ids=[10, 11], drafted=4, accepted=1),
            pb.Preview(start_position=5, token_ids=[12]),
            pb.Verdict(start_position=5, token_ids=[12]),  # no drafts, nothing new: no chunk
            pb.Verdict(start_position=6, token_ids=[], finish_reason=pb.FINISH_REASON_STOP),
        ],
    )
    assert [(c.token_ids, c.drafted) for c in chunks] == [([10, 11], 0), ([], 4), ([12], 0), ([], 0)]
    assert chunks[-1].finish_reason == pb.FINISH_REASON_STOP


def test_a_verifier_that_goes_away_is_resumed_elsewhere_without_gap_or_duplicate(tiny_target) -> None:
    """UNAVAILABLE mid-generation: the next round starts from the prompt plus what the client
    got (preview tokens included), with the budgets that are left."""
    import grpc

    core = gateway_core(tiny_target)
    failed = core.verifiers.failed_replicas
    plan = Plan("r", [1, 2, 3], pb.SamplingParams(max_tokens=6, min_tokens=4), 4, pb.DRAFT_METHOD_MODEL)

    async def first():
        yield pb.Verdict(start_position=3, token_ids=[10])
        yield pb.Preview(start_position=4, token_ids=[11, 12])  # streamed, verdict lost
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details="Socket closed"
        )

    async def second():
        yield pb.Verdict(start_position=6, token_ids=[13])
        yield pb.Verdict(start_position=7, token_ids=[14, 15], finish_reason=pb.FINISH_REASON_LENGTH)

    resumed = []

    async def next_generation(p, parent, stats):
        resumed.append(p)
        return fake_generation(p, second, stats)

    core._generation = next_generation
    generation = fake_generation(plan, first)

    async def run() -> list:
        return [c async for c in core._chunks(generation, None)]

    chunks = asyncio.run(run())
    assert [t for c in chunks for t in c.token_ids] == [10, 11, 12, 13, 14, 15]  # no gap, no duplicate
    (p,) = resumed
    assert p.prompt_token_ids == [1, 2, 3, 10, 11, 12] and p.request_id == "r-m1"
    assert (p.sampling.max_tokens, p.sampling.min_tokens) == (3, 1)
    assert generation.stats.migrations == 1 and [r.address for r in failed] == ["verifier-a"]


def test_a_verifier_that_goes_away_after_the_last_token_ends_the_stream_normally(tiny_target) -> None:
    """UNAVAILABLE once every token reached the client (previews): no resume with max_tokens 0
    (which the verifier refuses), the stream ends with finish reason length."""
    import grpc

    core = gateway_core(tiny_target)
    plan = Plan("r", [1, 2, 3], pb.SamplingParams(max_tokens=3), 4, pb.DRAFT_METHOD_MODEL)

    async def verdicts():
        yield pb.Verdict(start_position=3, token_ids=[10])
        yield pb.Preview(start_position=4, token_ids=[11, 12])  # the last two tokens
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details="Socket closed"
        )

    resumed = []

    async def next_generation(p, parent, stats):
        resumed.append(p)
        raise AssertionError("nothing is left to resume")

    core._generation = next_generation

    async def run() -> list:
        return [c async for c in core._chunks(fake_generation(plan, verdicts), None)]

    chunks = asyncio.run(run())
    assert [t for c in chunks for t in c.token_ids] == [10, 11, 12] and not resumed
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
