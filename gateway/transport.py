"""The stream transport of one generation: one writer per stream call, and the verifier's
stream read as steps.

Each bidirectional call (the verifier's Verify, the drafter's Draft) has exactly one writer:
an `Outbox` whose task writes the messages in the order they were put, so no stream ever has
two writers and nobody awaits a write while deciding what to send. The verifier's messages are
read by `read_step`: previews and verdicts (specdec.steps), with the verifier's silence bounded
once it owes verdicts, and an early end turned into UNAVAILABLE (the gateway migrates on it).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Generic, TypeAlias, TypeVar, cast

import grpc

from specdec.steps import Step, step_of
from specdec.wire import pb

if TYPE_CHECKING:
    # The two bidirectional calls a generation makes (generic only to type checkers).
    VerifyCall: TypeAlias = grpc.aio.StreamStreamCall[pb.VerifyRequest, pb.VerifyResponse]
    DraftCall: TypeAlias = grpc.aio.StreamStreamCall[pb.DraftRequest, pb.DraftResponse]

Message = TypeVar("Message")  # what an Outbox writes: pb.VerifyRequest or pb.DraftRequest
Response = TypeVar("Response")


class Outbox(Generic[Message]):
    """The one writer of a stream call: `put` queues a message, `close` ends the writing, and
    `write_all(call)` (one task) writes them in order until closed."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[Message | None] = asyncio.Queue()

    def put(self, msg: Message) -> None:
        self._queue.put_nowait(msg)

    def close(self) -> None:
        """Nothing more is written after what was put so far (closing twice is harmless)."""
        self._queue.put_nowait(None)

    async def write_all(self, call: grpc.aio.StreamStreamCall[Message, Response]) -> None:
        while (msg := await self._queue.get()) is not None:
            await call.write(msg)


def unavailable(details: str) -> grpc.aio.AioRpcError:
    """An UNAVAILABLE error of our own making (a verifier gone silent or ended early)."""
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


async def read_step(vcall: VerifyCall, timeout_s: float = 0.0) -> Step:
    """The verifier's next step. `timeout_s` > 0: a silence this long raises UNAVAILABLE (the
    caller passes 0 until the first verdict: queueing and prefill never count). The stream
    ending without a finish reason (a shutdown) raises UNAVAILABLE too, so the generation moves."""
    if timeout_s > 0:
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns the read's result when it
        # completes in the loop turn the caller is cancelled (the client's deadline, a closed
        # stream), and that cancellation is lost: the generation, and the verifier's request with
        # it, ran on to its end
        try:
            async with asyncio.timeout(timeout_s):
                response = await vcall.read()
        except TimeoutError:
            raise unavailable(
                f"the verifier sent nothing for verdict_timeout_s ({timeout_s:g} s) while it owed verdicts"
            ) from None
    else:
        response = await vcall.read()
    if response is grpc.aio.EOF:
        raise unavailable("the verifier ended the stream without a finish reason")
    # grpc-stubs type read() as `object | VerifyResponse` (its EOF sentinel is an `object`): past EOF, a response
    return step_of(cast(pb.VerifyResponse, response))
