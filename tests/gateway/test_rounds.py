"""The gateway's Round: speculation statistics, and the round itself in-process against fake
streams (drafter deadlines, fallback, verifier errors, half-close ordering, cancellation).

The fakes script both peers with events, not timers: each fake peer waits for what the real
one would wait for (the gateway's writes), so no outcome depends on how fast this machine
runs. Only a "target prefill" takes real time (longer than the drafter's deadline), which
is what the deadline must not count.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from prometheus_client import CollectorRegistry

from gateway.rounds import Plan, Round, Stats
from gateway.server import _upstream
from specdec import telemetry
from specdec.wire import pb

PROMPT = [5, 6, 7]
TIMEOUT_S = 0.2


class FakeCall:
    """A bidirectional stream call: the test feeds `responses`, the Round's writes land in `written`."""

    def __init__(self) -> None:
        self.responses: asyncio.Queue = asyncio.Queue()
        self.written: list = []
        self.wrote = asyncio.Event()
        self.cancelled = False

    async def read(self):
        item = await self.responses.get()
        if isinstance(item, BaseException):
            raise item
        return item

    async def write(self, msg) -> None:
        self.written.append(msg)
        self.wrote.set()

    async def done_writing(self) -> None:
        pass

    def cancel(self) -> bool:
        self.cancelled = True
        return True

    async def written_kind(self, kind: str, field: str = "kind"):
        """Wait until a message whose oneof `field` is `kind` has been written; return it."""
        while True:
            for msg in self.written:
                if msg.WhichOneof(field) == kind:
                    return msg
            self.wrote.clear()
            await self.wrote.wait()


class Stub:
    def __init__(self, call: FakeCall, method: str) -> None:
        setattr(self, method, lambda metadata=(): call)


def _round(verifier: FakeCall, drafter: FakeCall) -> Round:
    plan = Plan("r1", list(PROMPT), pb.SamplingParams(max_tokens=3), gamma=2, drafter=pb.DRAFT_METHOD_MODEL)
    metrics = telemetry.GatewayMetrics(CollectorRegistry())  # each round its own, to read back
    return Round(plan, Stub(verifier, "Verify"), Stub(drafter, "Draft"), TIMEOUT_S, telemetry.SpikeDetector(), metrics)


def _verdict(start: int, tokens: list[int], finish: bool = False, **kw) -> "pb.VerifyResponse":
    reason = pb.FINISH_REASON_LENGTH if finish else pb.FINISH_REASON_UNSPECIFIED
    return pb.VerifyResponse(start_position=start, token_ids=tokens, finish_reason=reason, **kw)


async def _collect(r: Round) -> list:
    return [v async for v in r.verdicts()]


def test_a_target_prefill_longer_than_the_deadline_does_not_fall_back() -> None:
    async def scenario() -> Round:
        verifier, drafter = FakeCall(), FakeCall()
        r = _round(verifier, drafter)
        run = asyncio.create_task(_collect(r))
        await drafter.written_kind("open")
        drafter.responses.put_nowait(pb.DraftResponse(ready=pb.DraftReady(prefilled_tokens=3, prefill_ms=1.0)))
        await verifier.written_kind("ready")  # relayed to the verifier
        await asyncio.sleep(3 * TIMEOUT_S)  # the target is queued and prefilling: the drafter owes nothing
        verifier.responses.put_nowait(_verdict(3, [10], preview=True))
        verifier.responses.put_nowait(_verdict(3, [10]))
        await drafter.written_kind("commit")  # now it owes an answer, and gives it
        drafter.responses.put_nowait(pb.DraftResponse(block=pb.DraftBlock(start_position=4, token_ids=[11, 12],
                                                                         committed_length=4)))
        await verifier.written_kind("block")
        verifier.responses.put_nowait(_verdict(4, [11, 12], finish=True, drafted=2, accepted=2))
        await run
        return r

    r = asyncio.run(scenario())
    assert not r.stats.fallback_reason
    assert r.stats.drafted == 2 and r.stats.accepted == 2
    assert r.stats.drafter_prefill_ms == 1.0
    registry = r.metrics.registry
    assert registry.get_sample_value("specdec:spec_decode_num_draft_tokens_total") == 2
    assert registry.get_sample_value("specdec:spec_decode_num_accepted_tokens_per_pos_total", {"position": "1"}) == 1
    assert registry.get_sample_value("specdec:drafter_fallbacks_total") == 0


def test_a_drafter_silent_after_a_commit_falls_back_and_releases_the_verifier() -> None:
    async def scenario() -> tuple[Round, FakeCall, float]:
        verifier, drafter = FakeCall(), FakeCall()
        r = _round(verifier, drafter)
        run = asyncio.create_task(_collect(r))
        verifier.responses.put_nowait(_verdict(3, [10], preview=True))
        verifier.responses.put_nowait(_verdict(3, [10]))
        await drafter.written_kind("commit")
        t0 = time.monotonic()
        await verifier.written_kind("end")  # the gateway gives up on the drafter: steps stop waiting
        waited = time.monotonic() - t0
        verifier.responses.put_nowait(_verdict(4, [11, 12], finish=True))
        await run
        return r, drafter, waited

    r, drafter, waited = asyncio.run(scenario())
    assert "sent nothing" in r.stats.fallback_reason and "position 3" in r.stats.fallback_reason
    assert waited >= TIMEOUT_S * 0.9  # not before the deadline (asyncio may round timers slightly)
    assert drafter.cancelled
    assert r.stats.completion_tokens == 3  # the generation went on
    assert r.metrics.registry.get_sample_value("specdec:drafter_fallbacks_total") == 1


def test_a_drafter_stream_error_mid_generation_falls_back_and_verdicts_continue() -> None:
    async def scenario() -> tuple[Round, list]:
        verifier, drafter = FakeCall(), FakeCall()
        r = _round(verifier, drafter)
        run = asyncio.create_task(_collect(r))
        verifier.responses.put_nowait(_verdict(3, [10]))
        await drafter.written_kind("commit")
        drafter.responses.put_nowait(grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                                          grpc.aio.Metadata(), details="connection reset"))
        await verifier.written_kind("end")
        verifier.responses.put_nowait(_verdict(4, [11]))
        verifier.responses.put_nowait(_verdict(5, [12], finish=True))
        return r, await run

    r, verdicts = asyncio.run(scenario())
    assert r.stats.fallback_reason == "drafter UNAVAILABLE: connection reset"
    assert [list(v.token_ids) for v in verdicts] == [[10], [11], [12]]


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def test_a_verifier_error_reaches_the_client_with_its_status() -> None:
    class Context:
        code = details = None

        async def abort(self, code, details):
            self.code, self.details = code, details
            raise asyncio.CancelledError  # what grpc's abort does: the handler ends here

    async def scenario() -> Context:
        verifier, drafter = FakeCall(), FakeCall()
        r = _round(verifier, drafter)
        verifier.responses.put_nowait(_rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "engine full"))
        context = Context()
        with pytest.raises(asyncio.CancelledError):
            async for _ in _upstream(r.verdicts(), context):
                pass
        assert verifier.cancelled and drafter.cancelled  # both calls are released
        return context

    context = asyncio.run(scenario())
    assert context.code == grpc.StatusCode.RESOURCE_EXHAUSTED and context.details == "verifier: engine full"


def test_after_the_last_verdict_the_gateway_stops_writing_then_half_closes() -> None:
    """Blocks still queued for the verifier are written before the half-close, none after it."""

    class Recording(FakeCall):
        def __init__(self) -> None:
            super().__init__()
            self.events: list[str] = []

        async def write(self, msg) -> None:
            self.events.append(f"write {msg.WhichOneof('kind')}")
            await super().write(msg)

        async def done_writing(self) -> None:
            self.events.append("done_writing")

    async def scenario() -> Recording:
        verifier, drafter = Recording(), FakeCall()
        r = _round(verifier, drafter)
        run = asyncio.create_task(_collect(r))
        verifier.responses.put_nowait(_verdict(3, [10]))
        await drafter.written_kind("commit")
        for start in (4, 6):  # two blocks in flight when the last verdict arrives
            drafter.responses.put_nowait(pb.DraftResponse(block=pb.DraftBlock(start_position=start, token_ids=[1, 2])))
        while verifier.events.count("write block") < 2:
            await verifier.written_kind("block")
            await asyncio.sleep(0)
        verifier.responses.put_nowait(_verdict(4, [11, 12], finish=True))
        await run
        return verifier

    events = asyncio.run(scenario()).events
    assert events[0] == "write open" and events[-1] == "done_writing" and events.count("done_writing") == 1
    assert events.count("write block") == 2


def test_a_cancelled_client_cancels_both_calls() -> None:
    async def scenario() -> tuple[FakeCall, FakeCall, Round]:
        verifier, drafter = FakeCall(), FakeCall()
        r = _round(verifier, drafter)
        run = asyncio.create_task(_collect(r))
        verifier.responses.put_nowait(_verdict(3, [10]))
        await drafter.written_kind("commit")
        run.cancel()  # the client went away mid-generation
        with pytest.raises(asyncio.CancelledError):
            await run
        return verifier, drafter, r

    verifier, drafter, r = asyncio.run(scenario())
    assert verifier.cancelled and drafter.cancelled
    assert r.stats.completion_tokens == 1 and not r.stats.fallback_reason


def _v(tokens: int, drafted: int = 0, accepted: int = 0, computed: int = 0) -> "pb.VerifyResponse":
    return pb.VerifyResponse(token_ids=[1] * tokens, drafted=drafted, accepted=accepted, computed_tokens=computed)


def test_stats_definitions() -> None:
    s = Stats(gamma=4, drafter=pb.DRAFT_METHOD_MODEL)
    for v in (_v(1, computed=10), _v(5, 4, 4, 5), _v(2, 4, 1, 5), _v(1)):  # prefill, full accept, reject, plain
        s.add_verdict(v)
    p = s.to_pb()
    assert (p.target_steps, p.speculative_steps, p.drafted_tokens, p.accepted_tokens) == (3, 2, 8, 5)
    assert list(p.accepted_per_position) == [2, 1, 1, 1]
    assert p.acceptance_rate == pytest.approx(5 / 8)
    assert p.mean_accepted_length == pytest.approx(1 + 5 / 2)  # vLLM's definition
    assert p.tokens_per_step == pytest.approx((9 - 1) / 3)  # the prefill token excluded
    assert p.target_computed_tokens == 20 and not p.drafter_fallback


def test_fallback_is_reported() -> None:
    s = Stats(gamma=2, drafter=pb.DRAFT_METHOD_MODEL)
    s.fallback_reason = "drafter UNAVAILABLE: connection refused"
    p = s.to_pb()
    assert p.drafter_fallback and "UNAVAILABLE" in p.fallback_reason
