"""gateway.transport's read of the verifier's stream (read_step), against a fake call."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway.transport import read_step
from specdec.wire import pb


def test_a_cancel_as_the_verdict_arrives_is_not_lost() -> None:
    """A generation whose caller is cancelled (the client's deadline passed, or it went away) in
    the loop turn a verdict arrives ends cancelled, which cancels the verifier's request.
    asyncio.wait_for on Python 3.11 returned the verdict instead: the cancellation was lost and
    the generation, with its request in the engine, ran on to its end (seen in
    tests/e2e/test_overload.py::test_a_deadline_reaches_the_engine: 975 engine steps after the
    deadline)."""

    async def run() -> None:
        response: asyncio.Future[pb.VerifyResponse] = asyncio.get_running_loop().create_future()

        class Call:
            def read(self) -> asyncio.Future[pb.VerifyResponse]:
                return response

        task = asyncio.create_task(read_step(Call(), timeout_s=30))  # type: ignore[arg-type]  # the fake has only read()
        await asyncio.sleep(0)  # one loop turn: the task runs to its read
        assert not task.done()
        response.set_result(pb.VerifyResponse(verdict=pb.Verdict(start_position=3, token_ids=[7])))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())


def test_a_silent_verifier_past_the_timeout_is_unavailable() -> None:
    """Owed verdicts that do not come within `timeout_s` end the read with UNAVAILABLE (the
    generation then moves to another verifier)."""

    async def run() -> None:
        never: asyncio.Future[pb.VerifyResponse] = asyncio.get_running_loop().create_future()

        class Call:
            def read(self) -> asyncio.Future[pb.VerifyResponse]:
                return never

        with pytest.raises(grpc.aio.AioRpcError) as info:
            await read_step(Call(), timeout_s=0.01)  # type: ignore[arg-type]  # the fake has only read()
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "verdict_timeout_s" in info.value.details()

    asyncio.run(run())
