"""The gateway's Round in-process, against fake streams: the drafter's deadline measures the
drafter, never the target's queueing or prefill.

The fakes script both peers with events, not timers: each fake verifier step waits for what
the real one would wait for (the gateway's writes), so the outcome does not depend on how
fast this machine runs. Only the "target prefill" takes real time (longer than the drafter's
deadline), which is what the deadline must not count.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from gateway.rounds import Plan, Round
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
    plan = Plan("r1", list(PROMPT), pb.SamplingParams(max_tokens=3), gamma=2, drafter="model")
    return Round(plan, Stub(verifier, "Verify"), Stub(drafter, "Draft"), TIMEOUT_S, telemetry.SpikeDetector())


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
