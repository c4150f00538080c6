"""specdec.serving's admission and drain (SessionSlots), with a fake gRPC context, and its
SIGUSR1 stack dump. No timers decide an outcome: the calls wait on events the test sets."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading

import grpc
import pytest

from specdec import serving
from specdec.serving import DUMP_END, SessionSlots, dump_stacks, open_session
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


def _parked_thread() -> tuple[threading.Thread, threading.Event]:
    """A thread named 'parked' waiting in `_park` until the returned event is set."""
    release = threading.Event()

    def _park() -> None:
        release.wait()

    thread = threading.Thread(target=_park, name="parked", daemon=True)
    thread.start()
    return thread, release


def test_dump_stacks_names_every_thread_and_ends_with_its_marker(tmp_path) -> None:
    thread, release = _parked_thread()
    try:
        with open(tmp_path / "log", "w+b") as log:
            dump_stacks(log.fileno())
            log.seek(0)
            text = log.read().decode()
    finally:
        release.set()
        thread.join()
    names = dict(re.findall(r"(0x[0-9a-f]{16}) '([^']*)'", text.split("\n", 2)[1]))  # the head line
    assert names[f"{thread.ident:#018x}"] == "parked", text
    assert names[f"{threading.main_thread().ident:#018x}"] == "MainThread", text
    headers = re.findall(r"^(?:Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):$", text, re.M)
    assert set(headers) == set(names), text  # every thread's stack, each once
    assert len(headers) == len(set(headers)), text
    parked = text.split(f"Thread {thread.ident:#018x} (most recent call first):\n")[1].split("\n\n")[0]
    assert " in _park\n" in parked and " in wait\n" in parked, parked  # its own frames, innermost first
    assert parked.index(" in wait\n") < parked.index(" in _park\n"), parked
    assert text.rstrip("\n").endswith(DUMP_END), text


def test_sigusr1_dumps_the_stacks_to_stderr_and_returns(capfd) -> None:
    """The handler serve() installs, run by a real signal: the process goes on (this test)."""
    thread, release = _parked_thread()
    before = signal.signal(signal.SIGUSR1, serving._on_sigusr1)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)  # a Python handler runs before the next bytecode here
        err = capfd.readouterr().err
    finally:
        signal.signal(signal.SIGUSR1, before)
        release.set()
        thread.join()
    parked = err.split(f"Thread {thread.ident:#018x} (most recent call first):\n")[1].split("\n\n")[0]
    assert " in _park\n" in parked, err
    main = err.split(f"Current thread {threading.main_thread().ident:#018x} (most recent call first):\n")[1]
    assert " in _on_sigusr1\n" in main.split("\n\n")[0] and DUMP_END in main, err
