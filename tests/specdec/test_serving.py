"""specdec.serving's admission and drain (SessionSlots), with a fake gRPC context. No timers
decide an outcome: the calls wait on events the test sets."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from specdec.serving import SessionSlots, open_session
from specdec.wire import pb


class Aborted(Exception):
    pass


class Context:
    def __init__(self) -> None:
        self.status: tuple[grpc.StatusCode, str] | None = None
        self.trailing: tuple = ()

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: tuple = ()) -> None:
        self.status, self.trailing = (code, details), trailing_metadata
        raise Aborted


def test_sessions_past_the_limit_are_refused_by_name() -> None:
    async def run() -> None:
        slots = SessionSlots("gateway", 2, "max_inflight")
        async with slots.hold(Context()), slots.hold(Context()):
            ctx = Context()
            with pytest.raises(Aborted):
                async with slots.hold(ctx):
                    pass
            assert ctx.status[0] == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_inflight (2)" in ctx.status[1]
            assert dict(ctx.trailing)["retry-after"] == "1"
        assert slots.active == 0
        async with slots.hold(Context()):  # freed: served again
            assert slots.active == 1

    asyncio.run(run())


def test_drain_lets_calls_in_flight_finish_and_refuses_new_ones() -> None:
    async def run() -> None:
        slots = SessionSlots("verifier", 0)
        started, release = asyncio.Event(), asyncio.Event()

        async def call() -> str:
            async with slots.hold(Context()):
                started.set()
                await release.wait()
            return "done"

        task = asyncio.create_task(call())
        await started.wait()
        drain = asyncio.create_task(slots.drain(timeout_s=3600))
        await asyncio.sleep(0)
        late = Context()
        with pytest.raises(Aborted):
            async with slots.hold(late):
                pass
        assert late.status[0] == grpc.StatusCode.UNAVAILABLE and "draining" in late.status[1]
        release.set()
        assert await task == "done" and await drain == 0

    asyncio.run(run())


def test_drain_ends_what_is_left_with_a_clear_status() -> None:
    async def run() -> None:
        slots = SessionSlots("gateway", 0)
        started = asyncio.Event()
        ctx = Context()

        async def call() -> None:
            async with slots.hold(ctx):
                started.set()
                await asyncio.Event().wait()  # never finishes by itself

        task = asyncio.create_task(call())
        await started.wait()
        assert await slots.drain(timeout_s=0) == 1
        with pytest.raises((Aborted, asyncio.CancelledError)):
            await task
        assert ctx.status[0] == grpc.StatusCode.UNAVAILABLE and "shutdown_timeout_s" in ctx.status[1]
        assert slots.active == 0

    asyncio.run(run())


def test_a_cancel_as_the_open_message_arrives_is_not_lost() -> None:
    """A session whose caller goes away in the loop turn its `open` arrives ends cancelled.
    asyncio.wait_for on Python 3.11 returned the message instead, and the session went on."""

    async def run() -> None:
        message: asyncio.Future[pb.VerifyRequest] = asyncio.get_running_loop().create_future()

        class Stream(Context):
            def read(self) -> asyncio.Future[pb.VerifyRequest]:
                return message

        task = asyncio.create_task(open_session(Stream(), lambda o: o, timeout_s=30))
        await asyncio.sleep(0)  # one loop turn: the task runs to its read
        assert not task.done()
        message.set_result(pb.VerifyRequest(open=pb.VerifyOpen(request_id="r")))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
