"""The verifier gRPC service (specdec.v1.VerifierService).

A `Verify` stream per generation: `open` submits the request to the shared
TargetEngine; each later `block` goes on the draft board; each engine step's
verdict for the request is streamed back. Cancelling the call aborts the request.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import TypeAlias

import grpc
from prometheus_client import CollectorRegistry

from specdec import serving, telemetry
from specdec.config import VerifierConfig
from specdec.models import compat
from specdec.steps import Step, verify_response
from specdec.validation import (
    BACKEND_REQUEST_ID_EXTRA,
    MAX_REQUEST_ID_CHARS,
    InvalidField,
    bad_token_id,
    check_gamma,
    check_request_id,
    check_sampling,
    check_token_ids,
    reported_ms,
)
from specdec.wire import FINISH_REASONS, pb, rpc
from verifier import convert
from verifier.engine import EngineFailed, GenerationRequest, TargetEngine, Verdict

log = logging.getLogger("specdec.verifier")

# After the last verdict, how long the caller has to half-close its side of the stream.
CLOSE_GRACE_S = 10.0

# A Verify call's context (a string: the generic is not subscriptable at run time).
VerifyContext: TypeAlias = "grpc.aio.ServicerContext[pb.VerifyRequest, pb.VerifyResponse]"


def step_pb(v: Verdict) -> Step:
    """The engine's verdict (or preview, `v.preview`) as the wire's step message."""
    if v.preview:
        return pb.Preview(start_position=v.start_position, token_ids=v.token_ids)
    return pb.Verdict(
        start_position=v.start_position,
        token_ids=v.token_ids,
        drafted=v.drafted,
        accepted=v.accepted,
        finish_reason=FINISH_REASONS[v.finish_reason],
        computed_tokens=v.computed_tokens,
        batch_size=v.batch_size,
        step_ms=v.step_ms,
        draft_wait_ms=v.draft_wait_ms,
        queue_ms=v.queue_ms,
        logprobs=[
            pb.TokenLogprobs(
                token_id=lp.token_id,
                logprob=lp.logprob,
                rank=lp.rank,
                top_token_ids=lp.top_token_ids,
                top_logprobs=lp.top_logprobs,
            )
            for lp in v.logprobs
        ],
        stop_token=v.stop_token,
        branch=v.branch,
        branch_miss=v.branch_miss,
        hold_drafts=v.hold_drafts,
    )


class VerifierServicer(rpc.VerifierServiceServicer):
    """The verifier; its metrics (telemetry.VerifierMetrics, shared with the engine and its
    draft board) live on `registry`."""

    def __init__(
        self,
        cfg: VerifierConfig,
        engine: TargetEngine,
        metrics: telemetry.VerifierMetrics,
        vocabulary: compat.Vocabulary,
    ) -> None:
        """A servicer over a started engine; `vocabulary` is what gateways check their tokenizer
        and drafters against (`build` loads all of them for cfg.model)."""
        self.cfg = cfg
        self.model_name = cfg.model
        self.tracer = telemetry.setup_tracing("verifier")
        self.metrics = metrics
        self.engine = engine
        # the engine's context length: max_model_len, or the model's own when left to vLLM (0 on CUDA)
        self.max_model_len = engine.board.max_model_len
        self.vocabulary = vocabulary
        self._ids: set[str] = set()
        self.slots = serving.SessionSlots("verifier", cfg.max_sessions)

    def _request(self, req: "pb.VerifyOpen") -> GenerationRequest:
        check_request_id("open.request_id", req.request_id, MAX_REQUEST_ID_CHARS + BACKEND_REQUEST_ID_EXTRA)
        if req.request_id in self._ids:
            raise InvalidField("open.request_id", f"{req.request_id!r} is already in use")
        check_token_ids("open.prompt_token_ids", req.prompt_token_ids, self.engine.vocab_size)
        check_gamma("open.gamma", req.gamma, self.cfg.max_gamma)
        check_sampling(
            "open.sampling", req.sampling, len(req.prompt_token_ids), self.max_model_len, self.engine.vocab_size
        )
        return convert.generation_request(req)

    # gRPC asyncio also serves a handler that writes its responses (context.write) and returns None;
    # the generated base class declares only one that returns them as an iterator
    async def Verify(  # type: ignore[override]  # noqa: N802  # returns None: see the comment above
        self,
        request_iterator: AsyncIterator[pb.VerifyRequest],
        context: VerifyContext,
    ) -> None:
        async with self.slots.hold(context):
            await self._verify(context)

    async def _verify(self, context: VerifyContext) -> None:
        if self.engine.failed:  # the process is stopping: say why instead of hanging
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"verifier: {self.engine.failed}")
        opened, req = await serving.open_session(context, self._request, self.cfg.first_message_timeout_s)
        loop = asyncio.get_running_loop()
        verdicts: asyncio.Queue[Verdict | InvalidField | EngineFailed] = asyncio.Queue()
        span = self.tracer.start_span(
            "specdec.verify_session",
            context=telemetry.extract_context(opened.trace_context or context.invocation_metadata()),
            attributes={
                "specdec.request_id": req.request_id,
                "specdec.gamma": req.gamma,
                "gen_ai.usage.input_tokens": len(req.prompt_token_ids),
            },
        )
        self.metrics.sessions.inc()
        self.metrics.requests.inc()
        self._ids.add(req.request_id)

        def on_verdict(v: Verdict | EngineFailed) -> None:  # on the engine's thread
            loop.call_soon_threadsafe(verdicts.put_nowait, v)

        self.engine.submit(req, on_verdict)
        vocab = self.engine.vocab_size

        async def read_blocks() -> None:
            """Blocks onto the board. Defence in depth (the gateway checks the drafter's blocks
            before relaying them): a block is trimmed to the session's gamma, and one with an id
            outside the vocabulary is dropped and ends the drafts of this session, which goes on
            as plain decoding: a bad draft never fails the request. Only a message that is not a
            block, `ready`, `pause` or `end` (a broken caller, not a drafter) ends the call."""
            spoiled = False  # an invalid block came: no more drafts for this session
            try:
                while True:
                    msg = await context.read()
                    if msg is grpc.aio.EOF:  # type: ignore[comparison-overlap]  # grpc's stubs leave EOF out of read()
                        return
                    kind = msg.WhichOneof("kind")
                    if kind == "end":
                        self.engine.end_drafts(req.request_id)
                        continue
                    if kind == "ready":
                        self.engine.drafter_ready(req.request_id, reported_ms(msg.ready.draft_ms_per_token))
                        continue
                    if kind == "pause":
                        self.engine.pause_drafts(req.request_id)
                        span.add_event("drafts_paused", {"specdec.reason": msg.pause.reason[:200]})
                        continue
                    if kind != "block":
                        raise InvalidField("block", "only blocks, `ready`, `pause` or `end` may follow `open`")
                    if spoiled:
                        continue
                    b = msg.block
                    tokens = list(b.token_ids[: req.gamma + (1 if b.branch else 0)])  # a branch: correction + gamma
                    bad = bad_token_id(tokens, vocab)
                    if bad:
                        spoiled = True
                        log.warning(
                            "request %s: invalid block dropped, drafts ended: block.token_ids: %s", req.request_id, bad
                        )
                        span.add_event("invalid_block", {"specdec.reason": f"block.token_ids: {bad}"})
                        self.engine.end_drafts(req.request_id)
                        continue
                    self.engine.offer(
                        req.request_id,
                        b.start_position,
                        tokens,
                        b.final,
                        b.committed_length,
                        reported_ms(b.draft_ms),
                        b.branch,
                    )
            except InvalidField as err:
                verdicts.put_nowait(err)
            except grpc.aio.AioRpcError:
                pass  # the caller went away
            finally:
                self.engine.end_drafts(req.request_id)  # no more blocks can come

        reader = asyncio.create_task(read_blocks())
        finished = False
        try:
            while True:
                item = await verdicts.get()
                if isinstance(item, InvalidField):
                    await serving.abort_invalid(context, item)
                if isinstance(item, EngineFailed):  # UNAVAILABLE: the gateway resumes it on another verifier
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"verifier: {item}")
                await context.write(verify_response(step_pb(item), typed=opened.typed_steps))
                if not item.preview:
                    span.add_event(
                        "step",
                        {
                            "specdec.tokens": len(item.token_ids),
                            "specdec.drafted": item.drafted,
                            "specdec.accepted": item.accepted,
                            "specdec.computed_tokens": item.computed_tokens,
                            "specdec.batch_size": item.batch_size,
                            "specdec.step_ms": item.step_ms,
                            "specdec.draft_wait_ms": item.draft_wait_ms,
                        },
                    )
                if item.finish_reason is not None and not item.preview:
                    finished = True
                    span.set_attribute("specdec.finish_reason", item.finish_reason)
                    # let the caller half-close first, so no block it has in flight hits a closed stream
                    await asyncio.wait({reader}, timeout=CLOSE_GRACE_S)
                    return
        finally:
            span.end()
            self.metrics.sessions.dec()
            reader.cancel()
            self._ids.discard(req.request_id)
            if not finished:  # cancelled, failed or invalid: free the engine's slot
                self.engine.abort(req.request_id)

    async def close(self) -> None:
        self.engine.stop()

    async def GetVerifierInfo(  # noqa: N802
        self,
        request: pb.GetVerifierInfoRequest,
        context: grpc.aio.ServicerContext[pb.GetVerifierInfoRequest, pb.GetVerifierInfoResponse],
    ) -> pb.GetVerifierInfoResponse:
        return pb.GetVerifierInfoResponse(
            model=self.model_name,
            vocab_size=self.engine.vocab_size,
            max_model_len=self.max_model_len,
            max_gamma=self.cfg.max_gamma,
            eos_token_ids=self.engine.eos_token_ids,
            max_sessions=self.cfg.max_sessions,
            active_sessions=self.slots.active,
            draining=self.slots.draining,
            vocabulary=compat.to_pb(self.vocabulary),
        )


def build(cfg: VerifierConfig, registry: CollectorRegistry) -> VerifierServicer:
    """The factory: resolve cfg.model, load it into a started TargetEngine (its thread runs on the
    process's CPUs), read its vocabulary, and make the servicer; its metrics live on `registry`."""
    from specdec.models import resolve

    metrics = telemetry.VerifierMetrics(registry)
    path = resolve(cfg.model, revision=cfg.revision or None)
    engine = TargetEngine.load(cfg, str(path), metrics)
    # what a gateway checks its tokenizer and drafters against (rows: the engine's)
    # (the tokenizer as transformers loads it, as the gateway and the drafter load theirs)
    vocabulary = replace(compat.from_folder(path, cfg.model, with_rows=False), vocab_size=engine.vocab_size)
    servicer = VerifierServicer(cfg, engine, metrics, vocabulary)
    if cfg.io_cpus:
        # this thread (the asyncio loop) and the gRPC threads it starts move off the engine's
        # CPUs: on a CPU-only host the network I/O would otherwise steal the target's core
        # (on a GPU host the forward passes run on the GPU and this matters less)
        os.sched_setaffinity(0, {int(c) for c in cfg.io_cpus.split(",")})
    return servicer


async def main(cfg: VerifierConfig) -> None:
    built: list[VerifierServicer] = []

    def build_one(registry: CollectorRegistry) -> VerifierServicer:
        built.append(build(cfg, registry))
        return built[-1]

    await serving.serve(
        "verifier", cfg, build_one, rpc.add_VerifierServiceServicer_to_server, "specdec.v1.VerifierService"
    )
    if built and built[0].engine.failed:  # stopped because the engine failed: a failure status for its supervisor
        raise SystemExit(f"verifier: {built[0].engine.failed}")
