"""The gateway's Generation (one generation's run across drafter and verifier), in-process
against fake streams: drafter deadlines, fallback, verifier errors, half-close ordering,
cancellation, the drafter relay's checks, hold and polite-drafter detection.

The fakes script both peers with events, not timers: each fake peer waits for what the real
one would wait for (the gateway's writes), so no outcome depends on how fast this machine
runs. Only a "target prefill" takes real time (longer than the drafter's deadline), which
is what the deadline must not count.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest
from prometheus_client import CollectorRegistry

from gateway.generation import Generation
from gateway.plan import Plan, tenant_of
from gateway.relay import verifier_vocab_size
from specdec import telemetry
from specdec.wire import pb

PROMPT = [5, 6, 7]
TIMEOUT_S = 0.2


class FakeCall:
    """A bidirectional stream call: the test feeds `responses`, the Generation's writes land in `written`."""

    def __init__(self) -> None:
        self.responses: asyncio.Queue = asyncio.Queue()
        self.written: list = []
        self.written_at: list[float] = []  # time.monotonic() of each write
        self.wrote = asyncio.Event()
        self.cancelled = False

    async def read(self):
        item = await self.responses.get()
        if isinstance(item, BaseException):
            raise item
        return item

    async def write(self, msg) -> None:
        self.written.append(msg)
        self.written_at.append(time.monotonic())
        self.wrote.set()

    async def done_writing(self) -> None:
        pass

    def cancel(self) -> bool:
        self.cancelled = True
        return True

    async def drained(self) -> None:
        """Return once the reader has taken every response put so far: a reader handles what it
        read without awaiting (the relay does), so by then it has handled them all."""
        while not self.responses.empty():
            await asyncio.sleep(0)

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


def _generation(
    verifier: FakeCall, drafter: FakeCall, max_tokens: int = 3, prefill_timeout_s: float | None = None
) -> Generation:
    plan = Plan("r1", list(PROMPT), pb.SamplingParams(max_tokens=max_tokens), gamma=2, drafter=pb.DRAFT_METHOD_MODEL)
    metrics = telemetry.GatewayMetrics(CollectorRegistry())  # each generation its own, to read back
    return Generation(
        plan,
        Stub(verifier, "Verify"),
        Stub(drafter, "Draft"),
        TIMEOUT_S,
        telemetry.SpikeDetector(),
        metrics,
        drafter_prefill_timeout_s=prefill_timeout_s,
    )


def _verdict(start: int, tokens: list[int], finish: bool = False, preview: bool = False, **kw) -> "pb.VerifyResponse":
    """The verifier's message: a verdict, or a preview (`preview`), in VerifyResponse's `step` oneof."""
    if preview:
        return pb.VerifyResponse(preview_tokens=pb.Preview(start_position=start, token_ids=tokens))
    reason = pb.FINISH_REASON_LENGTH if finish else pb.FINISH_REASON_UNSPECIFIED
    return pb.VerifyResponse(verdict=pb.Verdict(start_position=start, token_ids=tokens, finish_reason=reason, **kw))


async def _collect(r: Generation) -> list:
    return [v async for v in r.steps()]


def test_a_target_prefill_longer_than_the_deadline_does_not_fall_back() -> None:
    async def scenario() -> Generation:
        verifier, drafter = FakeCall(), FakeCall()
        r = _generation(verifier, drafter)
        run = asyncio.create_task(_collect(r))
        await drafter.written_kind("open")
        drafter.responses.put_nowait(pb.DraftResponse(ready=pb.DraftReady(prefilled_tokens=3, prefill_ms=1.0)))
        await verifier.written_kind("ready")  # relayed to the verifier
        await asyncio.sleep(3 * TIMEOUT_S)  # the target is queued and prefilling: the drafter owes nothing
        verifier.responses.put_nowait(_verdict(3, [10], preview=True))
        verifier.responses.put_nowait(_verdict(3, [10]))
        await drafter.written_kind("commit")  # now it owes an answer, and gives it
        drafter.responses.put_nowait(
            pb.DraftResponse(block=pb.DraftBlock(start_position=4, token_ids=[11, 12], committed_length=4))
        )
        await verifier.written_kind("block")
        verifier.responses.put_nowait(_verdict(4, [11, 12], finish=True, drafted=2, accepted=2))
        await run
        return r

    r = asyncio.run(scenario())
    assert not r.stats.fallback_reason
    assert r.stats.num_draft_tokens == 2 and r.stats.num_accepted_tokens == 2
    assert r.stats.drafter_prefill_ms == 1.0
    registry = r.metrics.registry
    assert registry.get_sample_value("specdec:spec_decode_num_draft_tokens_total") == 2
    assert registry.get_sample_value("specdec:spec_decode_num_accepted_tokens_per_pos_total", {"position": "1"}) == 1
    assert registry.get_sample_value("specdec:drafter_fallbacks_total") == 0


def test_a_drafter_silent_after_a_commit_falls_back_and_releases_the_verifier() -> None:
    async def scenario() -> tuple[Generation, FakeCall, float]:
        verifier, drafter = FakeCall(), FakeCall()
        r = _generation(verifier, drafter)
        run = asyncio.create_task(_collect(r))
        t0 = time.monotonic()  # before the verdict that makes the drafter owe an answer
        verifier.responses.put_nowait(_verdict(3, [10], preview=True))
        verifier.responses.put_nowait(_verdict(3, [10]))
        await drafter.written_kind("commit")
        end = await verifier.written_kind("end")  # the gateway gives up on the drafter: steps stop waiting
        waited = verifier.written_at[verifier.written.index(end)] - t0  # the fake stamps each write
        verifier.responses.put_nowait(_verdict(4, [11, 12], finish=True))
        await run
        return r, drafter, waited

    r, drafter, waited = asyncio.run(scenario())
    assert "sent nothing" in r.stats.fallback_reason and "position 3" in r.stats.fallback_reason
    # not before the deadline: the debt starts after t0 and the watch re-reads time.monotonic()
    # before it falls back, so this holds exactly, on any machine (no margin)
    assert waited >= TIMEOUT_S
    assert drafter.cancelled
    assert r.stats.completion_tokens == 3  # the generation went on
    assert r.metrics.registry.get_sample_value("specdec:drafter_fallbacks_total") == 1


async def _nth_written(call: FakeCall, kind: str, n: int):
    """Wait until the `n`-th (1-based) message of `kind` has been written; return it."""
    while True:
        found = [m for m in call.written if m.WhichOneof("kind") == kind]
        if len(found) >= n:
            return found[n - 1]
        call.wrote.clear()
        await call.wrote.wait()


async def _ready_then_two_drafts_accepted(verifier: FakeCall, drafter: FakeCall, run: asyncio.Task) -> None:
    """The drafter (3 prompt tokens, committed up to 5) says `ready` after a 900 ms prefill and
    sends two drafts at 5; the target accepts both and finishes; the generation ends."""
    drafter.responses.put_nowait(pb.DraftResponse(ready=pb.DraftReady(prefilled_tokens=3, prefill_ms=900.0)))
    drafter.responses.put_nowait(
        pb.DraftResponse(block=pb.DraftBlock(start_position=5, token_ids=[12, 13], committed_length=5))
    )
    await verifier.written_kind("block")
    verifier.responses.put_nowait(_verdict(5, [12, 13], finish=True, drafted=2, accepted=2))
    await run


def _progress(queued: int, prefilled: int = 0) -> "pb.DraftResponse":
    return pb.DraftResponse(progress=pb.DraftProgress(prefilled_tokens=prefilled, queued_tokens=queued))


def test_a_drafter_reporting_its_prefill_is_not_hung_past_the_deadline() -> None:
    """The drafter owes an answer from the target's first token, but is still prefilling (long
    prompts queued on it) for longer than drafter_timeout_s. Each commit it owes is answered
    with a progress report (fewer tokens queued each time), so it does not fall back; once
    ready it speculates. The relay asked for the reports in `open`."""

    async def scenario() -> tuple[Generation, FakeCall]:
        verifier, drafter = FakeCall(), FakeCall()
        r = _generation(verifier, drafter, max_tokens=4, prefill_timeout_s=60.0)
        run = asyncio.create_task(_collect(r))
        verifier.responses.put_nowait(_verdict(3, [10]))
        await _nth_written(drafter, "commit", 1)  # it owes an answer from here
        drafter.responses.put_nowait(_progress(900))
        await asyncio.sleep(3 * TIMEOUT_S)  # its prefill outlasts drafter_timeout_s (the target waits meanwhile)
        verifier.responses.put_nowait(_verdict(4, [11]))
        await _nth_written(drafter, "commit", 2)
        drafter.responses.put_nowait(_progress(400))
        await _ready_then_two_drafts_accepted(verifier, drafter, run)
        return r, drafter

    r, drafter = asyncio.run(scenario())
    assert not r.stats.fallback_reason
    assert r.stats.num_accepted_tokens == 2 and r.stats.drafter_prefill_ms == 900.0
    assert drafter.written[0].open.report_progress


def _waiting(queued: int) -> "pb.DraftResponse":
    return pb.DraftResponse(progress=pb.DraftProgress(queued_tokens=queued, waiting_for_memory=True))


def test_a_drafter_waiting_for_memory_answers_without_progress_and_speculates_once_admitted() -> None:
    """The drafter's prefill queue waits for memory (drafter.memory): its reports say so and
    their queued tokens stay or grow (the context grows with the target's tokens). They answer
    what it owes, for longer than drafter_timeout_s; the first report after the wait is not
    compared with them; once ready it speculates. None is a violation."""

    async def scenario() -> Generation:
        verifier, drafter = FakeCall(), FakeCall()
        r = _generation(verifier, drafter, max_tokens=4, prefill_timeout_s=60.0)
        run = asyncio.create_task(_collect(r))
        verifier.responses.put_nowait(_verdict(3, [10]))
        await _nth_written(drafter, "commit", 1)  # it owes an answer from here
        drafter.responses.put_nowait(_waiting(900))
        drafter.responses.put_nowait(_waiting(900))
        await asyncio.sleep(3 * TIMEOUT_S)  # its wait outlasts drafter_timeout_s (the target decodes meanwhile)
        verifier.responses.put_nowait(_verdict(4, [11]))
        await _nth_written(drafter, "commit", 2)
        drafter.responses.put_nowait(_waiting(901))
        drafter.responses.put_nowait(_progress(950))  # admitted: prefilling, with more queued than before
        drafter.responses.put_nowait(_progress(400))
        await _ready_then_two_drafts_accepted(verifier, drafter, run)
        return r

    r = asyncio.run(scenario())
    assert not r.stats.fallback_reason and r.stats.invalid_blocks == 0
    assert r.stats.num_accepted_tokens == 2


def test_a_drafter_waiting_for_memory_at_the_prefill_deadline_falls_back() -> None:
    async def scenario() -> Generation:
        verifier, drafter = FakeCall(), FakeCall()
        r = _generation(verifier, drafter, max_tokens=4, prefill_timeout_s=3 * TIMEOUT_S)
        run = asyncio.create_task(_collect(r))
        verifier.responses.put_nowait(_verdict(3, [10]))
        await _nth_written(drafter, "commit", 1)
        drafter.responses.put_nowait(_waiting(900))
        await asyncio.sleep(3 * TIMEOUT_S)  # past the prefill deadline
        verifier.responses.put_nowait(_verdict(4, [11]))
        await verifier.written_kind("end")
        verifier.responses.put_nowait(_verdict(5, [12, 13], finish=True))
        await run
        return r

    r = asyncio.run(scenario())
    assert "still prefilling 0.6 s" in r.stats.fallback_reason
    assert "900 prompt tokens queued at its latest report, waiting for memory" in r.stats.fallback_reason


def _preempted(queued: int) -> "pb.DraftResponse":
    progress = pb.DraftProgress(queued_tokens=queued, waiting_for_memory=True, preempted=True)
    return pb.DraftResponse(progress=progress)


def _ready(prefilled: int) -> "pb.DraftResponse":
    return pb.DraftResponse(ready=pb.DraftReady(prefilled_tokens=prefilled, prefill_ms=5.0))


def _block(start: int, tokens: list[int]) -> "pb.DraftResponse":
    return pb.DraftResponse(block=pb.DraftBlock(start_position=start, token_ids=tokens, committed_length=start))


async def _speculated_then_preempted(verifier: FakeCall, drafter: FakeCall) -> "pb.VerifyRequest":
    """The drafter says `ready`, its two drafts at 4 are accepted (the context is 6 long), then
    it preempts the session; returns the `pause` the relay wrote to the verifier."""
    await drafter.written_kind("open")
    drafter.responses.put_nowait(_ready(3))
    verifier.responses.put_nowait(_verdict(3, [10]))
    await _nth_written(drafter, "commit", 1)
    drafter.responses.put_nowait(_block(4, [11, 12]))
    await verifier.written_kind("block")
    verifier.responses.put_nowait(_verdict(4, [11, 12], drafted=2, accepted=2))
    await _nth_written(drafter, "commit", 2)
    drafter.responses.put_nowait(_preempted(6))
    return await verifier.written_kind("pause")


def test_a_preempted_session_pauses_the_verifier_and_speculates_again_after_its_next_ready() -> None:
    """The drafter preempts the session (drafter.memory: an older session's keys/values grew):
    the verifier is told to stop waiting for its drafts (`pause`), and the target decodes
    plainly. The drafter owes only its waiting and prefill reports meanwhile, for longer than
    drafter_timeout_s; its second `ready` is relayed (not a violation), and it speculates again.
    The relay accepted preemption in `open`."""

    async def scenario() -> tuple[Generation, FakeCall, FakeCall, "pb.VerifyRequest"]:
        verifier, drafter = FakeCall(), FakeCall()
        r = _generation(verifier, drafter, max_tokens=6, prefill_timeout_s=60.0)
        run = asyncio.create_task(_collect(r))
        pause = await _speculated_then_preempted(verifier, drafter)
        await asyncio.sleep(3 * TIMEOUT_S)  # preempted for longer than drafter_timeout_s: it owes nothing yet
        verifier.responses.put_nowait(_verdict(6, [13]))  # a plain step
        await _nth_written(drafter, "commit", 3)  # owed: answered by its reports
        drafter.responses.put_nowait(_waiting(7))
        await asyncio.sleep(3 * TIMEOUT_S)
        drafter.responses.put_nowait(_progress(7))  # admitted again: prefilling (not compared with the wait)
        drafter.responses.put_nowait(_ready(7))
        await _nth_written(verifier, "ready", 2)
        drafter.responses.put_nowait(_block(7, [14, 15]))
        await _nth_written(verifier, "block", 2)
        verifier.responses.put_nowait(_verdict(7, [14, 15], finish=True, drafted=2, accepted=2))
        await run
        return r, verifier, drafter, pause

    r, verifier, drafter, pause = asyncio.run(scenario())
    assert not r.stats.fallback_reason and r.stats.invalid_blocks == 0
    assert r.stats.drafter_preemptions == 1 and r.stats.to_pb().drafter_preemptions == 1
    assert r.stats.num_accepted_tokens == 4 and r.stats.completion_tokens == 6
    assert "preempted the session at position 6" in pause.pause.reason
    assert drafter.written[0].open.accepts_preemption and drafter.written[0].open.report_progress
    kinds = [m.WhichOneof("kind") for m in verifier.written]
    assert kinds.index("pause") < len(kinds) - 1 - kinds[::-1].index("ready")  # the second `ready` after it


def test_a_preempted_drafter_still_prefilling_at_the_prefill_deadline_falls_back() -> None:
    """The prefill deadline counts again from the preemption."""

    async def scenario() -> Generation:
        verifier, drafter = FakeCall(), FakeCall()
        r = _generation(verifier, drafter, max_tokens=6, prefill_timeout_s=3 * TIMEOUT_S)
        run = asyncio.create_task(_collect(r))
        await _speculated_then_preempted(verifier, drafter)
        await asyncio.sleep(3 * TIMEOUT_S)  # past the prefill deadline
        verifier.responses.put_nowait(_verdict(6, [13]))
        await verifier.written_kind("end")
        verifier.responses.put_nowait(_verdict(7, [14, 15], finish=True))
        await run
        return r

    r = asyncio.run(scenario())
    assert "still prefilling 0.6 s after its preemption" in r.stats.fallback_reason, r.stats.fallback_reason
    assert r.stats.drafter_preemptions == 1 and r.stats.completion_tokens == 6


def test_a_drafter_still_prefilling_at_the_prefill_deadline_falls_back() -> None:
    async def scenario() -> tuple[Generation, float]:
        verifier, drafter = FakeCall(), FakeCall()
        r = _generation(verifier, drafter, max_tokens=4, prefill_timeout_s=3 * TIMEOUT_S)
        run = asyncio.create_task(_collect(r))
        t0 = time.monotonic()  # before the first commit
        verifier.responses.put_nowait(_verdict(3, [10]))
        await _nth_written(drafter, "commit", 1)
        drafter.responses.put_nowait(_progress(900))
        await asyncio.sleep(3 * TIMEOUT_S)  # past the prefill deadline, reporting progress all along
        verifier.responses.put_nowait(_verdict(4, [11]))
        end = await verifier.written_kind("end")
        waited = verifier.written_at[verifier.written.index(end)] - t0
        verifier.responses.put_nowait(_verdict(5, [12, 13], finish=True))
        await run
        return r, waited

    r, waited = asyncio.run(scenario())
    assert waited >= 3 * TIMEOUT_S
    assert "still prefilling 0.6 s" in r.stats.fallback_reason
    assert "drafter_prefill_timeout_s; 900 prompt tokens queued" in r.stats.fallback_reason


@pytest.mark.parametrize(
    ("replies", "what"),
    [
        ([_progress(900), _progress(900)], "a progress report that shows none (queued_tokens 900, previously 900)"),
        (
            [pb.DraftResponse(ready=pb.DraftReady(prefilled_tokens=3)), _progress(10)],
            "a progress report after `ready` or a block",
        ),
        ([pb.DraftResponse(progress=pb.DraftProgress(), block=pb.DraftBlock())], "a reply with block and progress"),
        ([_preempted(3)], "a preemption before `ready`"),
        ([_ready(3), _preempted(3), _ready(3), _preempted(3)], "a second preemption before a commit"),
    ],
)
def test_a_bad_progress_report_is_a_violation_and_no_answer(
    replies: list, what: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A report that shows no progress answers nothing: a drafter cannot stall its request's
    speculation forever by repeating one; it is counted as a violation."""

    async def scenario() -> tuple[Generation, list]:
        verifier, drafter = FakeCall(), FakeCall()
        r = _generation(verifier, drafter, prefill_timeout_s=60.0)
        run = asyncio.create_task(_collect(r))
        verifier.responses.put_nowait(_verdict(3, [10]))
        await drafter.written_kind("commit")
        for reply in replies:
            drafter.responses.put_nowait(reply)
        await drafter.drained()  # the replies are handled: then the next commit is owed
        verifier.responses.put_nowait(_verdict(4, [11]))
        end = await verifier.written_kind("end")
        verifier.responses.put_nowait(_verdict(5, [12], finish=True))
        await run
        return r, end

    with caplog.at_level(logging.WARNING, logger="specdec.gateway"):
        r, end = asyncio.run(scenario())
    assert r.stats.invalid_blocks == 1
    assert f"invalid reply from the drafter: {what}" in caplog.text
    assert "sent nothing for 0.2 s" in r.stats.fallback_reason


@pytest.mark.parametrize("ready", [True, False])
def test_a_silent_drafter_has_the_short_deadline_ready_or_not(ready: bool) -> None:
    """Silent after a commit: a drafter that said `ready` is hung; so is one that did not and
    sends no progress report (hung, or one that does not report), not a slow prefill. Both fall
    back at drafter_timeout_s, not drafter_prefill_timeout_s."""

    async def scenario() -> tuple[Generation, float]:
        verifier, drafter = FakeCall(), FakeCall()
        r = _generation(verifier, drafter, prefill_timeout_s=60.0)
        run = asyncio.create_task(_collect(r))
        if ready:
            drafter.responses.put_nowait(pb.DraftResponse(ready=pb.DraftReady(prefilled_tokens=3, prefill_ms=1.0)))
            await verifier.written_kind("ready")
        t0 = time.monotonic()
        verifier.responses.put_nowait(_verdict(3, [10]))
        end = await verifier.written_kind("end")  # at drafter_timeout_s: the test would take 60 s otherwise
        waited = verifier.written_at[verifier.written.index(end)] - t0
        verifier.responses.put_nowait(_verdict(4, [11, 12], finish=True))
        await run
        return r, waited

    r, waited = asyncio.run(scenario())
    assert waited >= TIMEOUT_S
    silent = "drafter sent nothing for 0.2 s after the target's tokens at position 3"
    assert r.stats.fallback_reason == (silent if ready else f"{silent} (no `ready` and no progress report)")


def test_a_drafter_stream_error_mid_generation_falls_back_and_verdicts_continue() -> None:
    async def scenario() -> tuple[Generation, list]:
        verifier, drafter = FakeCall(), FakeCall()
        r = _generation(verifier, drafter)
        run = asyncio.create_task(_collect(r))
        verifier.responses.put_nowait(_verdict(3, [10]))
        await drafter.written_kind("commit")
        drafter.responses.put_nowait(
            grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details="connection reset"
            )
        )
        await verifier.written_kind("end")
        verifier.responses.put_nowait(_verdict(4, [11]))
        verifier.responses.put_nowait(_verdict(5, [12], finish=True))
        return r, await run

    r, verdicts = asyncio.run(scenario())
    assert r.stats.fallback_reason == "drafter UNAVAILABLE: connection reset"
    assert [list(v.token_ids) for v in verdicts] == [[10], [11], [12]]


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class EndedCall(FakeCall):
    """A drafter call the drafter has ended with `code` (say it ended the session for memory):
    writes fail, as gRPC's do once the call is over, and its status says why."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__()
        self._code, self._details = code, details

    async def write(self, msg) -> None:
        await super().write(msg)
        if msg.WhichOneof("kind") == "commit":
            raise _rpc_error(grpc.StatusCode.INTERNAL, "Internal error from Core")

    async def code(self) -> grpc.StatusCode:
        return self._code

    async def details(self) -> str:
        return self._details


def test_a_write_to_a_drafter_that_ended_the_call_falls_back_with_the_drafters_status() -> None:
    """The writer can learn the call is over before the reader does (a commit sent just as the
    drafter ended the session): the fallback reason is still the drafter's status, not the
    failed write's."""

    async def scenario() -> Generation:
        verifier, drafter = FakeCall(), EndedCall(grpc.StatusCode.RESOURCE_EXHAUSTED, "no room: kv_cache_mib")
        r = _generation(verifier, drafter)
        run = asyncio.create_task(_collect(r))
        verifier.responses.put_nowait(_verdict(3, [10]))
        await verifier.written_kind("end")
        verifier.responses.put_nowait(_verdict(4, [11, 12], finish=True))
        await run
        return r

    r = asyncio.run(scenario())
    assert r.stats.fallback_reason == "drafter RESOURCE_EXHAUSTED: no room: kv_cache_mib"


def test_a_verifier_error_ends_the_generation_with_its_status() -> None:
    """The Generation raises the verifier's error (the gateway then migrates on UNAVAILABLE, or ends
    the call with the status: GatewayServicer._chunks) and releases both calls."""

    async def scenario() -> grpc.aio.AioRpcError:
        verifier, drafter = FakeCall(), FakeCall()
        r = _generation(verifier, drafter)
        verifier.responses.put_nowait(_rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "engine full"))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in r.steps():
                pass
        assert verifier.cancelled and drafter.cancelled  # both calls are released
        return info.value

    err = asyncio.run(scenario())
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and err.details() == "engine full"


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
        r = _generation(verifier, drafter)
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
    async def scenario() -> tuple[FakeCall, FakeCall, Generation]:
        verifier, drafter = FakeCall(), FakeCall()
        r = _generation(verifier, drafter)
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


# ---- a drafter is untrusted: the relay drops or trims bad blocks, and falls back on repeat ----

VOCAB = 100
GAMMA = 2


class VerifierStub(Stub):
    """The verifier's stub, with GetVerifierInfo (the relay asks it for the vocabulary once)."""

    def __init__(self, call: FakeCall, vocab: int = VOCAB) -> None:
        super().__init__(call, "Verify")
        self.asked = 0
        self.vocab = vocab

    async def GetVerifierInfo(self, request, timeout=None):  # noqa: N802
        self.asked += 1
        return pb.GetVerifierInfoResponse(vocab_size=self.vocab)


def _hostile_generation(verifier: FakeCall, drafter: FakeCall, max_tokens: int = 20, **kw) -> Generation:
    plan = Plan(
        "r1", list(PROMPT), pb.SamplingParams(max_tokens=max_tokens), gamma=GAMMA, drafter=pb.DRAFT_METHOD_MODEL
    )
    metrics = telemetry.GatewayMetrics(CollectorRegistry())
    return Generation(
        plan, VerifierStub(verifier), Stub(drafter, "Draft"), 60.0, telemetry.SpikeDetector(), metrics, **kw
    )


def _block(start: int, tokens: list[int], committed: int = 4, **kw) -> "pb.DraftResponse":
    block = pb.DraftBlock(start_position=start, token_ids=tokens, committed_length=committed, **kw)
    return pb.DraftResponse(block=block)


def _relayed(verifier: FakeCall) -> list["pb.DraftBlock"]:
    return [m.block for m in verifier.written if m.WhichOneof("kind") == "block"]


async def _until_relayed(verifier: FakeCall, n: int) -> None:
    while len(_relayed(verifier)) < n:
        verifier.wrote.clear()
        await verifier.wrote.wait()


async def _hostile(responses: list, sentinel: bool = True, **kw) -> tuple[Generation, FakeCall, FakeCall, list]:
    """One generation: the target's first token (a commit up to 4), the drafter's `responses`, then
    (sentinel) a valid block, which tells that every response before it was handled, or (no
    sentinel) the fallback's `end`; then the target finishes. Returns the generation, both fakes and
    the verdicts."""
    verifier, drafter = FakeCall(), FakeCall()
    r = _hostile_generation(verifier, drafter, **kw)
    run = asyncio.create_task(_collect(r))
    verifier.responses.put_nowait(_verdict(3, [10]))
    await drafter.written_kind("commit")
    for resp in responses:
        drafter.responses.put_nowait(resp)
    if sentinel:
        drafter.responses.put_nowait(_block(4, [32, 33]))
        while not any(b.token_ids == [32, 33] for b in _relayed(verifier)):
            verifier.wrote.clear()
            await verifier.wrote.wait()
    else:  # the drafter keeps misbehaving: wait for the fallback
        await verifier.written_kind("end")
    verifier.responses.put_nowait(_verdict(4, [11, 12], finish=True))
    return r, verifier, drafter, await run


BAD_BLOCKS = {
    "id past the vocabulary": (_block(4, [1, VOCAB]), "token id 100 at index 1 is outside the vocabulary [0, 100)"),
    "negative id": (_block(4, [-5]), "token id -5 at index 0"),
    "id 10**9": (_block(4, [10**9, 1]), "token id 1000000000"),
    "start far in the future": (_block(2**31, [1, 2]), "block.start_position: 2147483648 is more than"),
    "start inside the prompt": (_block(0, [1, 2], committed=0), "lies inside the prompt"),
    "drafted from a context never committed": (_block(40, [1], committed=40), "block.committed_length: 40 is past"),
    "start before its own context": (_block(3, [1], committed=4), "is before the context it was drafted from"),
    "no block, ready or progress": (pb.DraftResponse(), "a reply with no block, `ready` or progress"),
}


@pytest.mark.parametrize("case", sorted(BAD_BLOCKS))
def test_a_bad_block_is_dropped_and_counted_and_the_generation_goes_on(case: str) -> None:
    bad, what = BAD_BLOCKS[case]
    r, verifier, _, verdicts = asyncio.run(_hostile([bad]))
    assert [list(b.token_ids) for b in _relayed(verifier)] == [[32, 33]]  # only the sentinel reached the verifier
    assert r.stats.invalid_blocks == 1 and not r.stats.fallback_reason  # one is tolerated
    assert r.stats.blocks_received == 1 and r.stats.tokens_received == 2
    assert [list(v.token_ids) for v in verdicts] == [[10], [11, 12]]
    assert not any(m.WhichOneof("kind") == "end" for m in verifier.written)
    assert what  # (the fallback test below checks the reason names it)


@pytest.mark.parametrize("case", sorted(BAD_BLOCKS))
def test_a_drafter_that_keeps_misbehaving_is_a_failed_drafter(case: str) -> None:
    bad, what = BAD_BLOCKS[case]
    r, verifier, drafter, verdicts = asyncio.run(_hostile([bad] * 1000, sentinel=False))
    assert r.stats.fallback_reason.startswith("drafter sent 3 invalid replies; the last: ")
    assert what in r.stats.fallback_reason, r.stats.fallback_reason
    assert r.stats.invalid_blocks == 3  # the relay stopped reading at the fallback
    assert _relayed(verifier) == []
    assert verifier.written[-1].WhichOneof("kind") == "end" and what in verifier.written[-1].end.reason
    assert drafter.cancelled
    assert [list(v.token_ids) for v in verdicts] == [[10], [11, 12]]  # the generation went on
    assert r.stats.to_pb().drafter_fallback
    assert r.metrics.registry.get_sample_value("specdec:drafter_fallbacks_total") == 1


def test_a_block_longer_than_gamma_is_trimmed_to_gamma() -> None:
    r, verifier, _, _ = asyncio.run(_hostile([_block(4, list(range(1, 50)) * 2000, draft_ms=3.0, final=True)]))
    first = _relayed(verifier)[0]
    assert list(first.token_ids) == [1, 2] and first.start_position == 4 and first.final and first.draft_ms == 3.0
    assert r.stats.invalid_blocks == 1 and r.stats.tokens_received == 2 + 2


def test_valid_blocks_pass_unchanged_and_stale_ones_are_not_violations() -> None:
    good = [
        _block(4, [1, 2], sequence=1, draft_ms=1.5),
        _block(6, [3], committed=4, final=True),  # a continuation
        _block(4, [], committed=4),  # nothing for position 4
        _block(3, [9, 9], committed=3),  # stale: drafted from an older context (the target moved on)
    ]
    r, verifier, _, _ = asyncio.run(_hostile(good))
    assert [b for b in _relayed(verifier)][:4] == [g.block for g in good]
    assert r.stats.invalid_blocks == 0 and not r.stats.fallback_reason


def test_garbage_times_are_zeroed_and_a_second_ready_is_dropped() -> None:
    nan = float("nan")
    responses = [
        pb.DraftResponse(ready=pb.DraftReady(prefilled_tokens=3, prefill_ms=nan, draft_ms_per_token=float("inf"))),
        pb.DraftResponse(ready=pb.DraftReady(prefilled_tokens=3, prefill_ms=1.0)),
        _block(4, [1, 2], draft_ms=-7.0),
    ]
    r, verifier, _, _ = asyncio.run(_hostile(responses))
    readies = [m.ready for m in verifier.written if m.WhichOneof("kind") == "ready"]
    assert len(readies) == 1 and readies[0].prefill_ms == 0.0 and readies[0].draft_ms_per_token == 0.0
    assert _relayed(verifier)[0].draft_ms == 0.0 and r.stats.draft_ms == 0.0
    assert r.stats.invalid_blocks == 1  # the second ready


def test_a_flood_is_cut_at_the_cap_then_falls_back() -> None:
    from specdec.validation import max_blocks_per_commit

    cap = max_blocks_per_commit(GAMMA)
    r, verifier, drafter, verdicts = asyncio.run(_hostile([_block(4, [1, 2])] * 5000, sentinel=False))
    assert len(_relayed(verifier)) == cap  # valid blocks, but no more than a drafter ever sends per commit
    assert f"more than {cap} blocks since the latest commit" in r.stats.fallback_reason
    assert drafter.cancelled and [list(v.token_ids) for v in verdicts] == [[10], [11, 12]]


def test_a_commit_renews_the_block_allowance() -> None:
    from specdec.validation import max_blocks_per_commit

    cap = max_blocks_per_commit(GAMMA)

    async def scenario() -> tuple[Generation, FakeCall]:
        verifier, drafter = FakeCall(), FakeCall()
        r = _hostile_generation(verifier, drafter)
        run = asyncio.create_task(_collect(r))
        verifier.responses.put_nowait(_verdict(3, [10]))
        await drafter.written_kind("commit")
        for _ in range(cap):
            drafter.responses.put_nowait(_block(4, [1, 2]))
        await _until_relayed(verifier, cap)
        verifier.responses.put_nowait(_verdict(4, [11]))  # the next commit
        while sum(m.WhichOneof("kind") == "commit" for m in drafter.written) < 2:
            drafter.wrote.clear()
            await drafter.wrote.wait()
        for _ in range(cap):
            drafter.responses.put_nowait(_block(5, [1, 2], committed=5))
        await _until_relayed(verifier, 2 * cap)
        verifier.responses.put_nowait(_verdict(5, [12], finish=True))
        await run
        return r, verifier

    r, verifier = asyncio.run(scenario())
    assert len(_relayed(verifier)) == 2 * cap and r.stats.invalid_blocks == 0 and not r.stats.fallback_reason


def test_the_vocabulary_is_asked_once_per_verifier_stub_or_given() -> None:
    async def scenario() -> tuple[int, int]:
        stub = VerifierStub(FakeCall(), vocab=7)
        sizes = [await verifier_vocab_size(stub) for _ in range(3)]
        return sizes, stub.asked

    sizes, asked = asyncio.run(scenario())
    assert sizes == [7, 7, 7] and asked == 1
    r, verifier, _, _ = asyncio.run(_hostile([_block(4, [50])], vocab_size=40))  # given: not asked
    assert r.relay.vocab_size == 40 and r.stats.invalid_blocks == 1
    assert r.verifier_stub.asked == 0


def test_a_branch_block_may_carry_gamma_plus_one_tokens_and_is_relayed_as_a_branch() -> None:
    branch = _block(4, [1, 2, 3, 4], branch=True)  # the correction, then gamma + 1 drafts: one too many
    r, verifier, _, _ = asyncio.run(_hostile([_block(4, [1, 2, 3], branch=True), branch]))
    relayed = _relayed(verifier)
    assert [list(b.token_ids) for b in relayed[:2]] == [[1, 2, 3], [1, 2, 3]] and all(b.branch for b in relayed[:2])
    assert r.stats.invalid_blocks == 1 and r.stats.branches_drafted == 2


def test_the_verifier_hold_reaches_the_drafter_and_it_owes_nothing_while_held() -> None:
    """hold_drafts on a verdict: the drafter gets a commit with hold (an empty one when the
    verdict adds no token); while held, a silent drafter is no failure; a verdict without
    hold releases it."""

    async def scenario() -> tuple[Generation, FakeCall]:
        verifier, drafter = FakeCall(), FakeCall()
        r = _generation(verifier, drafter, max_tokens=20)
        run = asyncio.create_task(_collect(r))
        verifier.responses.put_nowait(_verdict(3, [10], preview=True))
        verifier.responses.put_nowait(_verdict(3, [10], hold_drafts=True))  # no new token: an empty commit
        while sum(m.WhichOneof("kind") == "commit" for m in drafter.written) < 2:
            drafter.wrote.clear()
            await drafter.wrote.wait()
        verifier.responses.put_nowait(_verdict(4, [11], hold_drafts=True))
        await asyncio.sleep(3 * TIMEOUT_S)  # the drafter, held, stays silent: no fallback
        verifier.responses.put_nowait(_verdict(5, [12]))  # released
        while sum(m.WhichOneof("kind") == "commit" for m in drafter.written) < 4:
            drafter.wrote.clear()
            await drafter.wrote.wait()
        drafter.responses.put_nowait(
            pb.DraftResponse(block=pb.DraftBlock(start_position=6, token_ids=[13], committed_length=6))
        )
        await verifier.written_kind("block")
        verifier.responses.put_nowait(_verdict(6, [13], finish=True, drafted=1, accepted=1))
        await run
        return r, drafter

    r, drafter = asyncio.run(scenario())
    commits = [m.commit for m in drafter.written if m.WhichOneof("kind") == "commit"]
    assert [(c.start_position, list(c.token_ids), c.hold) for c in commits] == [
        (3, [10], False),
        (4, [], True),
        (4, [11], True),
        (5, [12], False),
        (6, [13], False),
    ]
    assert not r.stats.fallback_reason and r.stats.to_pb().held_steps == 2


def test_a_failing_helper_task_is_logged_not_swallowed(caplog: pytest.LogCaptureFixture) -> None:
    """A helper task of the generation (here the drafter relay) failing with an error it does not
    expect: the generation still ends, and the error is logged with its traceback at its end."""

    async def scenario() -> list:
        verifier, drafter = FakeCall(), FakeCall()
        r = _generation(verifier, drafter)
        run = asyncio.create_task(_collect(r))
        verifier.responses.put_nowait(_verdict(3, [10]))
        await drafter.written_kind("commit")
        drafter.responses.put_nowait(RuntimeError("a bug in the relay"))
        verifier.responses.put_nowait(_verdict(4, [11, 12], finish=True))
        return await run

    with caplog.at_level("ERROR", logger="specdec.gateway"):
        verdicts = asyncio.run(scenario())
    assert [list(v.token_ids) for v in verdicts] == [[10], [11, 12]]
    failed = [rec for rec in caplog.records if "generation helper" in rec.getMessage()]
    assert failed and failed[0].exc_info and "a bug in the relay" in str(failed[0].exc_info[1])


def test_the_verifier_and_drafter_know_a_request_by_its_tenant_namespaced_id() -> None:
    """Plan.backend_id: the API key's namespace, then the client's id; two keys' "r1" differ."""

    async def scenario(key: str) -> tuple[str, str]:
        verifier, drafter = FakeCall(), FakeCall()
        plan = Plan(
            "r1",
            list(PROMPT),
            pb.SamplingParams(max_tokens=1),
            gamma=2,
            drafter=pb.DRAFT_METHOD_MODEL,
            tenant=tenant_of(key),
        )
        r = Generation(
            plan,
            Stub(verifier, "Verify"),
            Stub(drafter, "Draft"),
            TIMEOUT_S,
            telemetry.SpikeDetector(),
            telemetry.GatewayMetrics(CollectorRegistry()),
        )
        run = asyncio.create_task(_collect(r))
        vopen, dopen = await verifier.written_kind("open"), await drafter.written_kind("open")
        verifier.responses.put_nowait(_verdict(3, [10], finish=True))
        await run
        return vopen.open.request_id, dopen.open.request_id

    a, b = asyncio.run(scenario("key-aaaaaaaa")), asyncio.run(scenario("key-bbbbbbbb"))
    assert a[0] == a[1] and b[0] == b[1]  # the drafter and the verifier share it
    assert a[0] != b[0] and a[0].endswith(".r1") and b[0].endswith(".r1")
    assert a[0] == f"{tenant_of('key-aaaaaaaa')}.r1"


def test_a_verifier_silent_while_it_owes_verdicts_is_treated_as_gone() -> None:
    """verdict_timeout_s: after its first verdict the verifier goes silent (alive, but sends
    nothing): the generation ends with UNAVAILABLE, which the gateway migrates on, instead of waiting
    forever. Before its first verdict (queueing, prefill) silence is fine."""

    async def scenario() -> tuple[grpc.aio.AioRpcError, float]:
        verifier, drafter = FakeCall(), FakeCall()
        plan = Plan("r1", list(PROMPT), pb.SamplingParams(max_tokens=8), gamma=2, drafter=pb.DRAFT_METHOD_MODEL)
        r = Generation(
            plan,
            Stub(verifier, "Verify"),
            Stub(drafter, "Draft"),
            60.0,
            telemetry.SpikeDetector(),
            telemetry.GatewayMetrics(CollectorRegistry()),
            verdict_timeout_s=TIMEOUT_S,
        )
        got = []

        async def consume() -> None:
            async for v in r.steps():
                got.append(v)

        run = asyncio.create_task(consume())
        await verifier.written_kind("open")
        await asyncio.sleep(3 * TIMEOUT_S)  # queued and prefilling: no verdict owed yet, no timeout
        assert not run.done()
        verifier.responses.put_nowait(_verdict(3, [10]))  # the first verdict, then silence
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(run, 10 * TIMEOUT_S * 10)
        return info.value, time.monotonic() - t0

    err, waited = asyncio.run(scenario())
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "verdict_timeout_s" in err.details()
    assert waited >= TIMEOUT_S * 0.9


async def _written_count(call: FakeCall, kind: str, n: int) -> None:
    """Wait until `n` messages of oneof kind `kind` have been written."""
    while sum(m.WhichOneof("kind") == kind for m in call.written) < n:
        call.wrote.clear()
        await call.wrote.wait()


SILENT = "silent"  # a _polite_scenario answer: no block in that window


def _polite_scenario(
    answers: list[list[int] | None | str],
    method: int = pb.DRAFT_METHOD_MODEL,
    max_idle: int = 3,
    holds: set[int] = frozenset(),
    final: bool = False,
) -> Generation:
    """A generation whose drafter says `ready`, then answers commit k (k = 0, 1, ...) with one block
    of `answers[k]` tokens at the committed position (None: a block at a passed position;
    SILENT: no block before the next commit), the
    verifier giving one token per verdict (`holds`: the verdicts that hold the drafts)."""

    async def scenario() -> Generation:
        verifier, drafter = FakeCall(), FakeCall()
        plan = Plan("r1", list(PROMPT), pb.SamplingParams(max_tokens=100), gamma=2, drafter=method)
        metrics = telemetry.GatewayMetrics(CollectorRegistry())
        r = Generation(
            plan,
            Stub(verifier, "Verify"),
            Stub(drafter, "Draft"),
            60.0,
            telemetry.SpikeDetector(),
            metrics,
            vocab_size=1000,
            max_idle_commits=max_idle,
        )
        run = asyncio.create_task(_collect(r))
        await drafter.written_kind("open")
        drafter.responses.put_nowait(pb.DraftResponse(ready=pb.DraftReady(prefilled_tokens=3, prefill_ms=1.0)))
        await verifier.written_kind("ready")
        pos, blocks = len(PROMPT), 0
        for k, answer in enumerate(answers):
            verifier.responses.put_nowait(_verdict(pos, [10 + k], hold_drafts=k in holds))
            pos += 1
            # the verdict's commit reaches the drafter, or the relay gives up on it (`end`)
            committed = asyncio.ensure_future(_written_count(drafter, "commit", k + 1))
            ended = asyncio.ensure_future(_written_count(verifier, "end", 1))
            await asyncio.wait({committed, ended}, return_when=asyncio.FIRST_COMPLETED)
            committed.cancel()
            ended.cancel()
            if r.stats.fallback_reason:
                break
            if k in holds or answer == SILENT:
                continue
            start, tokens = (pos - 1, [1]) if answer is None else (pos, answer)
            drafter.responses.put_nowait(
                pb.DraftResponse(
                    block=pb.DraftBlock(
                        start_position=start, token_ids=tokens, committed_length=min(start, pos), final=final
                    )
                )
            )
            blocks += 1
            await _written_count(verifier, "block", blocks)  # relayed before the next commit
        verifier.responses.put_nowait(_verdict(pos, [99], finish=True))
        await run
        return r

    return asyncio.run(scenario())


def test_a_polite_drafter_with_no_usable_drafts_falls_back_after_max_idle_commits() -> None:
    """Empty blocks are valid but useless: after max_idle_commits such answers in a row the
    drafter is treated as failed."""
    for answer in ([],):
        r = _polite_scenario([answer] * 6)
        assert "3 commits in a row with no usable draft" in r.stats.fallback_reason, r.stats.fallback_reason
        assert "max_idle_commits" in r.stats.fallback_reason
        assert r.metrics.registry.get_sample_value("specdec:drafter_fallbacks_total") == 1


def test_usable_drafts_holds_and_the_ngrams_nothing_do_not_count_as_idle() -> None:
    # a usable block among empty ones resets the count
    r = _polite_scenario([[], [], [5], [], [], [7], [], []])
    assert not r.stats.fallback_reason and r.relay.idle_commits == 2
    # windows held by adaptive gamma are not the drafter's fault
    r = _polite_scenario([[], [], [], [], [], [], []], holds={1, 2, 3, 4, 5})
    assert not r.stats.fallback_reason, r.stats.fallback_reason
    # the n-gram drafter's final empty block says "no match here": an answer
    r = _polite_scenario([[]] * 6, method=pb.DRAFT_METHOD_NGRAM, final=True)
    assert not r.stats.fallback_reason
    # ... while a model drafter's is not
    r = _polite_scenario([[]] * 6, final=True)
    assert "max_idle_commits" in r.stats.fallback_reason
    # drafts the target has already passed: an honest drafter slower than its target (adaptive
    # gamma's business), not a polite hostile one
    r = _polite_scenario([None] * 6)
    assert not r.stats.fallback_reason, r.stats.fallback_reason
    # a window with no block (an honest drafter slower than its target) neither counts nor resets
    r = _polite_scenario([SILENT] * 8)
    assert not r.stats.fallback_reason and r.relay.idle_commits == 0, r.stats.fallback_reason
    r = _polite_scenario([[], SILENT, [], SILENT, SILENT, [], []])
    assert "3 commits in a row with no usable draft" in r.stats.fallback_reason, r.stats.fallback_reason
    # 0: never
    r = _polite_scenario([[]] * 6, max_idle=0)
    assert not r.stats.fallback_reason and r.relay.idle_commits == 6  # the last verdict ends the sixth window
