"""specdec.serving's session limit, with a fake gRPC context."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from specdec.serving import SessionSlots


class Aborted(Exception):
    pass


class Context:
    def __init__(self) -> None:
        self.status: tuple[grpc.StatusCode, str] | None = None

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.status = (code, details)
        raise Aborted


def test_sessions_past_the_limit_are_refused_by_name() -> None:
    async def run() -> None:
        slots = SessionSlots("verifier", 2)
        async with slots.hold(Context()), slots.hold(Context()):
            ctx = Context()
            with pytest.raises(Aborted):
                async with slots.hold(ctx):
                    pass
            assert ctx.status[0] == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_sessions (2)" in ctx.status[1]
        assert slots.active == 0
        async with slots.hold(Context()):  # freed: served again
            assert slots.active == 1

    asyncio.run(run())
