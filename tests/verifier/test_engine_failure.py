"""No silent hang: an exception anywhere on the verifier's engine thread (a step, a command,
emitting a verdict) ends every session with UNAVAILABLE (its gateway then migrates it), answers
later sessions at once, and stops the process (SIGTERM).

The real TargetEngine, its thread and DraftBoard, and the real VerifierServicer on a loopback
gRPC port, over a fake of vLLM's LLMEngine (one token per request per step): the failures are
injected into the engine's own methods. os.kill is replaced so the test process is not the one
stopped.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from specdec import telemetry
from specdec.config import VerifierConfig
from specdec.models import compat
from specdec.wire import pb, rpc
from verifier import convert, vllm_hooks
from verifier.engine import EngineFailed, GenerationRequest, TargetEngine, Verdict
from verifier.proposer import DraftBoard

BOUND_S = 30.0  # generous: a failure is seen within milliseconds


class FakeVLLM:
    """vLLM's LLMEngine as TargetEngine uses it: every request gets one token (id 1) per step."""

    def __init__(self) -> None:
        self.requests: dict[str, str] = {}  # engine id -> request id
        self.fail_abort = False

    def add_request(self, request_id: str, prompt: Any, params: Any) -> str:
        self.requests[f"{request_id}-e"] = request_id
        return f"{request_id}-e"

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[Any]:
        return [
            SimpleNamespace(
                request_id=rid,
                finished=False,
                outputs=[SimpleNamespace(token_ids=[1], finish_reason=None, logprobs=None, stop_reason=None)],
            )
            for rid in self.requests.values()
        ]

    def abort_request(self, ids: list[str], internal: bool = False) -> None:
        if self.fail_abort:
            raise RuntimeError("injected: abort failed")
        for i in ids:
            self.requests.pop(i, None)


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FakeVLLM, list[tuple[int, int]]]]:
    fake = FakeVLLM()
    kills: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: kills.append((pid, sig)))
    yield fake, kills


def started_engine(fake: FakeVLLM, cfg: VerifierConfig) -> TargetEngine:
    """The real TargetEngine, its thread and a real DraftBoard, over the fake of vLLM's engine."""
    metrics = telemetry.VerifierMetrics(CollectorRegistry())
    board = DraftBoard(max_model_len=2048, metrics=metrics)  # build_engine sets the engine's context length
    return TargetEngine(cfg, fake, board, metrics, vllm_hooks.ModelFacts(100, [0], {0})).start()


def started_servicer(fake: FakeVLLM, cfg: VerifierConfig) -> Any:  # -> VerifierServicer
    from verifier.server import VerifierServicer

    engine = started_engine(fake, cfg)
    return VerifierServicer(cfg, engine, engine.metrics, compat.Vocabulary(cfg.model, 100, 100, "", None, None, None))


def _request(rid: str) -> GenerationRequest:
    return convert.generation_request(
        pb.VerifyOpen(
            request_id=rid,
            prompt_token_ids=[5, 6, 7],
            gamma=0,
            sampling=pb.SamplingParams(max_tokens=10**6, ignore_eos=True),
        )
    )


class Session:
    """A callback that records verdicts and signals the first EngineFailed."""

    def __init__(self) -> None:
        self.verdicts: list[Verdict] = []
        self.failure: EngineFailed | None = None
        self.failed = threading.Event()
        self.verdict = threading.Event()

    def __call__(self, item: Verdict | EngineFailed) -> None:
        if isinstance(item, EngineFailed):
            self.failure = item
            self.failed.set()
        else:
            self.verdicts.append(item)
            self.verdict.set()


def test_an_exception_in_emit_fails_every_session_and_stops_the_process(fake_vllm, monkeypatch) -> None:
    _, kills = fake_vllm

    def broken_emit(self: TargetEngine, *args: Any) -> None:
        raise RuntimeError("injected: emit failed")

    monkeypatch.setattr(TargetEngine, "_emit", broken_emit)
    eng = started_engine(fake_vllm[0], VerifierConfig(batch_window_ms=0))
    a, b = Session(), Session()
    eng.submit(_request("a"), a)
    eng.submit(_request("b"), b)
    try:
        assert a.failed.wait(BOUND_S) and b.failed.wait(BOUND_S)
        assert "injected: emit failed" in eng.failed and "emit failed" in str(a.failure)
        assert kills == [(os.getpid(), signal.SIGTERM)]
        late = Session()
        eng.submit(_request("c"), late)  # after the failure: answered at once, on this thread
        assert late.failed.is_set()
    finally:
        eng.stop()


def test_an_exception_in_command_handling_fails_every_session(fake_vllm) -> None:
    fake, kills = fake_vllm
    eng = started_engine(fake_vllm[0], VerifierConfig(batch_window_ms=0))
    a, b = Session(), Session()
    eng.submit(_request("a"), a)
    eng.submit(_request("b"), b)
    try:
        assert a.verdict.wait(BOUND_S) and b.verdict.wait(BOUND_S)  # both are running
        fake.fail_abort = True
        eng.abort("a")  # the engine thread's handling of this command raises
        assert b.failed.wait(BOUND_S), "the other session would have waited forever"
        assert "injected: abort failed" in eng.failed and kills == [(os.getpid(), signal.SIGTERM)]
    finally:
        eng.stop()


def test_the_client_of_a_failed_engine_sees_unavailable(fake_vllm, monkeypatch) -> None:
    """Through the real VerifierServicer: a session whose engine fails ends with UNAVAILABLE
    (which the gateway migrates on), never a hang; a new session is refused the same way."""
    _, kills = fake_vllm
    emitted = threading.Event()
    real_emit = TargetEngine._emit

    def emit_then_fail(self: TargetEngine, *args: Any) -> None:
        if emitted.is_set():
            raise RuntimeError("injected: emit failed")
        real_emit(self, *args)
        emitted.set()

    monkeypatch.setattr(TargetEngine, "_emit", emit_then_fail)

    async def run() -> tuple[grpc.aio.AioRpcError, grpc.aio.AioRpcError]:
        servicer = started_servicer(fake_vllm[0], VerifierConfig(model="tiny/target", batch_window_ms=0))
        server = grpc.aio.server()
        rpc.add_VerifierServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = rpc.VerifierServiceStub(channel)
                errors = []
                for rid in ("first", "after"):
                    call = stub.Verify()
                    with pytest.raises(grpc.aio.AioRpcError) as info:  # the write fails too once the call ended
                        await call.write(
                            pb.VerifyRequest(
                                open=pb.VerifyOpen(
                                    request_id=rid,
                                    prompt_token_ids=[5, 6, 7],
                                    gamma=0,
                                    sampling=pb.SamplingParams(max_tokens=1000, ignore_eos=True),
                                )
                            )
                        )
                        while await asyncio.wait_for(call.read(), BOUND_S) is not grpc.aio.EOF:
                            pass
                    errors.append(info.value)
                return errors[0], errors[1]
        finally:
            await server.stop(0)
            await servicer.close()

    first, after = asyncio.run(run())
    for err in (first, after):
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "engine failed" in err.details(), err
    assert kills == [(os.getpid(), signal.SIGTERM)]


def test_half_open_verify_sessions_free_their_slots(fake_vllm) -> None:
    """A Verify stream that never sends `open` ends with DEADLINE_EXCEEDED after
    first_message_timeout_s, freeing its max_sessions slot (as on the drafter:
    tests/drafter/test_half_open.py)."""

    async def run() -> tuple[list[grpc.StatusCode], int]:
        cfg = VerifierConfig(model="tiny/target", max_sessions=20, first_message_timeout_s=0.5)
        servicer = started_servicer(fake_vllm[0], cfg)
        server = grpc.aio.server()
        rpc.add_VerifierServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = rpc.VerifierServiceStub(channel)
                calls = [stub.Verify() for _ in range(cfg.max_sessions)]
                codes = await asyncio.wait_for(asyncio.gather(*(c.code() for c in calls)), BOUND_S)
                return codes, servicer.slots.active
        finally:
            await server.stop(0)
            await servicer.close()

    codes, active = asyncio.run(run())
    assert set(codes) == {grpc.StatusCode.DEADLINE_EXCEEDED} and active == 0
