"""The drafter gRPC service (specdec.v1.DrafterService).

One `Draft` stream per generation. A single worker thread advances all sessions
round-robin, one token at a time, so concurrent generations share the draft
model fairly; blocks go out as soon as they are due (see drafter.sessions).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

import grpc
import torch

from drafter.sessions import BlockOut, DraftSession, ModelDraftSession, NgramDraftSession
from specdec import serving, telemetry
from specdec.config import MAX_GAMMA_LIMIT, DrafterConfig
from specdec.validation import InvalidField, check_sampling, check_token_ids
from specdec.wire import pb, rpc

log = logging.getLogger("specdec.drafter")

METHODS = ("model", "ngram")


class DraftWorker(threading.Thread):
    """Runs draft steps for every session that wants work; sleeps when none does."""

    def __init__(self) -> None:
        super().__init__(name="draft-worker", daemon=True)
        self._cond = threading.Condition()
        self._sessions: dict[int, tuple[DraftSession, Callable[[BlockOut | BaseException], None]]] = {}
        self._stopped = False

    def add(self, session: DraftSession, emit: Callable[[BlockOut | BaseException], None]) -> None:
        with self._cond:
            self._sessions[id(session)] = (session, emit)
            self._cond.notify()

    def remove(self, session: DraftSession) -> None:
        session.close()
        with self._cond:
            self._sessions.pop(id(session), None)

    def wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def run(self) -> None:
        while True:
            with self._cond:
                if self._stopped:
                    return
                active = [(s, e) for s, e in self._sessions.values() if s.wants_work()]
                if not active:
                    self._cond.wait(timeout=1.0)
                    continue
                # drafts a verifier is waiting for come before drafting ahead
                active = [(s, e) for s, e in active if s.urgent()] or active
            for session, emit in active:
                try:
                    block = session.step()
                except Exception as exc:  # a failing session must not stop the others
                    log.exception("draft step failed")
                    self.remove(session)
                    emit(exc)
                    continue
                if block is not None:
                    emit(block)


class DrafterServicer(rpc.DrafterServiceServicer):
    """Serves a draft model (method "model") and the n-gram drafter (method "ngram")."""

    def __init__(self, cfg: DrafterConfig) -> None:
        from specdec.models import load_causal_lm, resolve

        torch.set_num_threads(cfg.threads)
        self.cfg = cfg
        path = resolve(cfg.model)
        self.model = load_causal_lm(cfg.model, cfg.dtype, cfg.quantize)
        self.model_name = cfg.model
        self.vocab_size = int(self.model.config.vocab_size)
        self.tracer = telemetry.setup_tracing("drafter")
        self.worker = DraftWorker()
        self.worker.start()
        log.info("draft model %s loaded from %s (vocab %d, %s, quantize %s)", cfg.model, path, self.vocab_size,
                 cfg.dtype, cfg.quantize)

    def _open(self, req: "pb.DraftOpen") -> DraftSession:
        check_token_ids("open.prompt_token_ids", req.prompt_token_ids, self.vocab_size)
        if not 1 <= req.gamma <= MAX_GAMMA_LIMIT:
            raise InvalidField("open.gamma", f"{req.gamma} is out of range [1, {MAX_GAMMA_LIMIT}]")
        method = req.method or "model"
        if method not in METHODS:
            raise InvalidField("open.method", f"unknown drafter {method!r}; known: {', '.join(METHODS)}")
        sp = req.sampling
        check_sampling("open.sampling", sp)
        prompt = list(req.prompt_token_ids)
        lookahead = req.gamma + 1 if self.cfg.lookahead < 0 else self.cfg.lookahead
        if method == "ngram":
            session: DraftSession = NgramDraftSession(prompt, req.gamma, lookahead, self.cfg.ngram_max, self.cfg.ngram_min)
        else:
            session = self._model_session(req, prompt, lookahead)
        session.flush_ms = self.cfg.flush_ms
        session.inject_delay_ms, session.inject_every = self.cfg.inject_delay_ms, self.cfg.inject_every
        return session

    def _model_session(self, req: "pb.DraftOpen", prompt: list[int], lookahead: int) -> ModelDraftSession:
        sp = req.sampling
        return ModelDraftSession(
            self.model,
            prompt,
            req.gamma,
            lookahead,
            temperature=sp.temperature if self.cfg.sample_drafts else 0.0,
            top_k=sp.top_k if sp.top_k > 0 else 0,
            top_p=sp.top_p if sp.HasField("top_p") else 1.0,
            seed=sp.seed if sp.HasField("seed") else None,
            q_top_k=self.cfg.q_top_k,
        )

    async def Draft(self, request_iterator, context: grpc.aio.ServicerContext) -> None:  # noqa: N802
        opened, session = await serving.open_session(context, self._open)
        loop = asyncio.get_running_loop()
        out: asyncio.Queue[BlockOut | BaseException | None] = asyncio.Queue()
        span = self.tracer.start_span(
            "specdec.draft_session",
            context=telemetry.extract_context(opened.trace_context or context.invocation_metadata()),
            attributes={"specdec.request_id": opened.request_id, "specdec.gamma": opened.gamma,
                        "specdec.method": opened.method or "model"},
        )
        telemetry.DRAFTER_SESSIONS.inc()
        self.worker.add(session, lambda item: loop.call_soon_threadsafe(out.put_nowait, item))

        async def read_commits() -> None:
            try:
                while True:
                    msg = await context.read()
                    if msg is grpc.aio.EOF:
                        break
                    if msg.WhichOneof("kind") != "commit":
                        raise InvalidField("commit", "only commits may follow `open`")
                    c = msg.commit
                    check_token_ids("commit.token_ids", c.token_ids, self.vocab_size)
                    session.commit(c.start_position, list(c.token_ids), c.gamma)
                    self.worker.wake()
            except InvalidField as err:
                out.put_nowait(err)
                return
            out.put_nowait(None)

        reader = asyncio.create_task(read_commits())
        sequence = 0
        try:
            while True:
                item = await out.get()
                if item is None:
                    return
                if isinstance(item, InvalidField):
                    await serving.abort_invalid(context, item)
                if isinstance(item, BaseException):
                    await context.abort(grpc.StatusCode.INTERNAL, f"drafting failed: {item}")
                sequence += 1
                await context.write(pb.DraftResponse(block=_block_pb(item, sequence)))
                telemetry.DRAFTER_BLOCKS.inc()
                telemetry.DRAFTER_TOKENS.inc(len(item.drafts))
                span.add_event("block", {"specdec.start_position": item.start_position,
                                         "specdec.tokens": len(item.drafts), "specdec.draft_ms": item.draft_ms})
        finally:
            span.end()
            telemetry.DRAFTER_SESSIONS.dec()
            reader.cancel()
            self.worker.remove(session)

    async def close(self) -> None:
        self.worker.stop()

    async def GetDrafterInfo(self, request, context) -> "pb.GetDrafterInfoResponse":  # noqa: N802
        return pb.GetDrafterInfoResponse(model=self.model_name, vocab_size=self.vocab_size, methods=list(METHODS))


def _block_pb(block: BlockOut, sequence: int) -> "pb.DraftBlock":
    msg = pb.DraftBlock(
        start_position=block.start_position,
        token_ids=[d.token_id for d in block.drafts],
        probs=[d.prob for d in block.drafts],
        sequence=sequence,
        draft_ms=block.draft_ms,
        final=block.final,
        committed_length=block.committed_length,
    )
    if any(d.support is not None for d in block.drafts):
        for d in block.drafts:
            ids, q = d.support if d.support is not None else ([d.token_id], [1.0])
            msg.q.add(token_ids=ids, probs=q)
    return msg


async def main(cfg: DrafterConfig) -> None:
    await serving.serve(
        "drafter", cfg, DrafterServicer(cfg), rpc.add_DrafterServiceServicer_to_server, "specdec.v1.DrafterService"
    )
