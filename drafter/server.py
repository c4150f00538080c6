"""The drafter gRPC service (specdec.v1.DrafterService).

One `Draft` stream per generation. A single worker thread advances all sessions
round-robin, one token each per step (all of a step's tokens in one batched forward,
drafter.batch), so concurrent generations share the draft model fairly; blocks go
out as soon as they are due (see drafter.sessions). Prompts are prefilled one at a time,
in arrival order, and a session waiting for its prefill hears how far the queue ahead of
it has come, or that the queue waits for memory (`DraftProgress`; drafter.memory), so its
gateway tells a slow prefill, or one waiting for a session to end, from a hung drafter.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeAlias

import grpc
import numpy as np
import torch
from prometheus_client import CollectorRegistry

from drafter import memory
from drafter.confidence import ConfidencePolicy, parse_mode
from drafter.prefix_cache import Prefix, PrefixCache
from drafter.sessions import BlockOut, DraftSession, ModelDraftSession, NgramDraftSession, Progress, Ready
from specdec import serving, telemetry
from specdec.config import MAX_GAMMA_LIMIT, DrafterConfig
from specdec.models import compat
from specdec.models.device import draft_placement
from specdec.models.vocab import read as read_draft_vocab
from specdec.validation import (
    BACKEND_REQUEST_ID_EXTRA,
    DRAFT_PROGRESS_INTERVAL_S,
    MAX_REQUEST_ID_CHARS,
    InvalidField,
    OverLimit,
    check_request_id,
    check_sampling,
    check_token_ids,
)
from specdec.wire import draft_method_name, pb, rpc

log = logging.getLogger("specdec.drafter")

METHODS = (pb.DRAFT_METHOD_MODEL, pb.DRAFT_METHOD_NGRAM)


Item = BlockOut | Ready | Progress  # what a session's Draft call writes
Emit = Callable[[Item | BaseException], None]

# A Draft call's context (a string: the generic is not subscriptable at run time).
DraftContext: TypeAlias = "grpc.aio.ServicerContext[pb.DraftRequest, pb.DraftResponse]"


def vocab_size(model: torch.nn.Module) -> int:
    """A transformers causal LM's vocabulary size (its config's `vocab_size`: the logits' last
    dimension)."""
    from transformers import PretrainedConfig  # here: importing this module loads no transformers

    config = model.config
    assert isinstance(config, PretrainedConfig), "a transformers model carries its config"
    return int(config.vocab_size)


# Longest DraftOpen.cache_scope (the gateway sends a tenant: "t" and 8 hex digits).
MAX_CACHE_SCOPE_CHARS = 64
# Weight of the newest drafted token in the worker's running cost per token.
PACE_EWMA = 0.1
# Longest the worker waits, before a step, for the commits of superseded sessions to apply
# (DraftWorker.run): a commit that marked its session superseded waits only for the session's
# lock, which the worker does not hold then, so it applies within a millisecond or so; the
# bound keeps a stalled commit thread from stalling every session.
SUPERSEDED_WAIT_S = 0.05


class DraftWorker(threading.Thread):
    """Runs draft steps for every session that wants work; sleeps when none does.

    Order (`work_order`): drafts a verifier is waiting for (urgent) first, and with `batch`
    every session drafting ahead in the same forward; then, round-robin, drafting ahead
    and the prefill chunks of one new session, the oldest: prompts are prefilled in arrival
    order, as the target's scheduler takes them, so the oldest prompt's drafts are ready when
    its target's first token comes (round-robin prefills made every prompt of a queue ready
    late: four prompts of 3,000 tokens on one CPU drafter, `specdec bench --workloads
    serve-long`). A session still waiting for its `Ready` that asked for them
    (`report_progress`) gets a `Progress` at most every `progress_interval_s`, whenever the
    prompt tokens left before it is ready went down. With `batch` (DrafterConfig.batch_drafts),
    each round's draft tokens are made in one batched forward (drafter.batch); without,
    one session at a time. `token_ms` is the running compute cost of one draft token
    (seeded by the servicer's calibration; a batched token costs its share of the
    forward); a session's wall-clock cost per token is about token_ms times the sessions
    drafting at once. Each drafted token's
    compute goes to `metrics.step_seconds`, and the rows of each forward of the draft model
    that drafts tokens to `metrics.batch_rows` (1 per session's forward when not batching;
    none when metrics is None). Before each step it waits, at most SUPERSEDED_WAIT_S, for the
    commits of superseded sessions (drafter.sessions) to apply: they wait only for the session
    locks the worker has just released, and the sessions then draft from their verdicts in
    this step.
    """

    def __init__(
        self,
        token_ms: float = 0.0,
        metrics: telemetry.DrafterMetrics | None = None,
        batch: bool = True,
        progress_interval_s: float = DRAFT_PROGRESS_INTERVAL_S,
        ride_branches: int = 0,
        on_retire: Callable[[DraftSession], None] | None = None,
        kv_budget: memory.KVBudget | None = None,
    ) -> None:
        super().__init__(name="draft-worker", daemon=True)
        # drafter.memory: a session's prefill starts once its reserve fits the budget (None: at once)
        self.kv_budget = kv_budget
        # the oldest waiting prompt's prefill waits for memory, so the prefill queue does not move
        # (set by pick_work; its sessions' progress reports say so)
        self.memory_blocked = False
        self._admissions = itertools.count(1)  # each admitted session's DraftSession.admission
        # called as on_retire(session) on this thread, between steps, for each session its caller
        # removed (not one removed because its step failed), and for each session it preempts
        # before letting go of its keys/values: the servicer's prefix cache keeps them
        # (drafter.prefix_cache)
        self.on_retire = on_retire
        self._retired: list[DraftSession] = []
        self.metrics = metrics
        self.batch = batch  # one forward for every model session that drafts a token (drafter.batch)
        self.ride_branches = ride_branches  # with batch: branch rows a batch that ride in a session's forward (0: off)
        self.last_batch = 0  # tokens the latest step drafted (the batch size, when batched)
        self._cond = threading.Condition()
        self._sessions: dict[int, tuple[DraftSession, Emit]] = {}
        self._stopped = False
        self.token_ms = token_ms
        self.progress_interval_s = progress_interval_s  # least seconds between two reports to a session

    def pace_ms(self) -> float:
        """Expected wall-clock ms per draft token of one session now (see the class docstring)."""
        with self._cond:
            drafting = sum(1 for s, _ in self._sessions.values() if s.started and not s.closed)
        return self.token_ms * max(1, drafting)

    def add(self, session: DraftSession, emit: Emit) -> None:
        with self._cond:
            self._sessions[id(session)] = (session, emit)
            self._cond.notify()

    def remove(self, session: DraftSession, retire: bool = True) -> None:
        """Stop stepping `session`; `retire`: hand it to `on_retire` (on this worker's thread)."""
        session.close()
        with self._cond:
            if self._sessions.pop(id(session), None) is not None and retire and self.on_retire is not None:
                self._retired.append(session)
            if session.admitted and self.kv_budget is not None and self.metrics is not None:
                self.metrics.kv_cache_bytes.set(self.kv_held())
            self._cond.notify()  # its memory may admit a waiting prefill (drafter.memory)

    def _retire(self) -> None:
        """`on_retire` for each session removed since the previous call (none in a step: the
        worker holds no session's lock here)."""
        with self._cond:
            retired, self._retired = self._retired, []
        for session in retired:
            try:
                assert self.on_retire is not None  # sessions are queued only with one
                self.on_retire(session)
            except Exception:  # noqa: BLE001 - a retired session's keys/values are an optimisation
                log.exception("retiring a draft session failed")

    def sessions(self) -> list[DraftSession]:
        """The sessions stepped now, and those removed and waiting for `on_retire`."""
        with self._cond:
            return [s for s, _ in self._sessions.values()] + list(self._retired)

    def wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def run(self) -> None:
        while True:
            if self._retired:
                self._retire()
            with self._cond:
                if self._stopped:
                    return
                # a superseded session's commit is waiting for the session's lock, free now: let it
                # apply (its `wake` ends the wait), so the session drafts from the verdict in this
                # step, beside the others, rather than from a rejected context or a step later
                self._cond.wait_for(
                    lambda: not any(s.superseded for s, _ in self._sessions.values()), SUPERSEDED_WAIT_S
                )
                active, branchy = self.pick_work()
                if not active and not branchy:
                    if self.memory_blocked:  # the prompts waiting for memory hear that they wait
                        self.report_progress()
                    if not self._retired:
                        self._cond.wait(timeout=self.progress_interval_s if self.memory_blocked else 1.0)
                    continue
            prefilling = any(not s.ready for s, _ in active)
            if active:
                self.advance(active)
            else:  # idle otherwise: one batched step of each session's branches
                self._branch_steps(branchy)
            if prefilling or self.memory_blocked:
                self.report_progress()

    def pick_work(self) -> tuple[list[tuple[DraftSession, Emit]], list[tuple[DraftSession, Emit]]]:
        """The sessions the next step advances (`work_order`, a prefill only once admitted:
        drafter.memory), and when there are none, those with branches to draft."""
        with self._cond:
            self.memory_blocked = False  # until _admit finds the oldest prefill does not fit
            # drafter.memory's growth first, in arrival order: an older session's growth comes
            # before a newer session's place, and before a waiting prompt's admission
            for session, _ in list(self._sessions.values()):
                if session.wants_work():  # a prefill too: its target may have decoded 512 tokens meanwhile
                    self._grow(session)
            active = [(s, e) for s, e in self._sessions.values() if s.wants_work()]
            # a prefill waiting for memory is no work: it waits for a session's removal
            active = work_order(active, self.batch, self._admit) if active else []
            branchy = [] if active else [(s, e) for s, e in self._sessions.values() if s.wants_branch()]
        return active, branchy

    def kv_held(self) -> int:
        """Bytes the admitted sessions hold of the budget (drafter.memory's `held`); call with
        `_cond` held (a cache another thread reads may be growing: its old size or its new)."""
        need = self.kv_budget.need if self.kv_budget is not None else (lambda slots: 0)
        return sum(max(need(s.reserve_slots), s.kv_bytes()) for s, _ in self._sessions.values() if s.admitted)

    def _admit(self, session: DraftSession) -> bool:
        """Whether `session`'s prefill may start: it was admitted, or its reserve fits beside the
        admitted sessions' now (then it is admitted). A context that grew while it waited (its
        gateway committed the target's tokens meanwhile: a queued prompt, a preempted session) is
        reserved whole, with room for what it generates next (drafter.memory.admitted_slots).
        Called with `_cond` held."""
        if session.admitted:
            return True
        if self.kv_budget is None or session.reserve_slots <= 0:
            session.admitted, session.admission = True, next(self._admissions)
            return True
        budget = self.kv_budget
        most = budget.budget_bytes // budget.token_bytes if budget.budget_bytes > 0 else 0
        wanted = session.slots_wanted() + session.window
        slots = memory.admitted_slots(session.reserve_slots, wanted, session.slot_cap, most)
        if slots > session.reserve_slots:
            session.grow_reserve(slots)
        reserve = self.kv_budget.need(session.reserve_slots)
        held = self.kv_held()
        if self.metrics is not None:
            self.metrics.kv_cache_bytes.set(held)
        if not self.kv_budget.admits(held, reserve):
            self.memory_blocked = True
            if not session.kv_waited:
                session.kv_waited = True
                if self.metrics is not None:
                    self.metrics.kv_waits.inc()
            return False
        session.admitted, session.admission = True, next(self._admissions)
        if self.metrics is not None:
            self.metrics.kv_cache_bytes.set(held + reserve)
        return True

    def _grow(self, session: DraftSession) -> None:
        """Grow `session`'s reserve when its next step would hold more than it reserved
        (drafter.memory's growth). When the grown reserve does not fit beside what the others
        hold, the newest admitted sessions make room, newest first, until it does; `session`
        itself when it is the newest. Each is preempted (`_preempt`) when its caller accepts
        that and what it must reserve to come back fits the budget at all; else it is ended
        (`_overflow`). Called with `_cond` held."""
        budget = self.kv_budget
        if budget is None or not session.admitted or session.reserve_slots <= 0:
            return
        wanted = session.slots_wanted()
        if wanted <= session.reserve_slots:
            return
        grown = memory.grown_slots(session.reserve_slots, wanted, session.slot_cap)
        while True:
            others = self.kv_held() - max(budget.need(session.reserve_slots), session.kv_bytes())
            if budget.admits(others, budget.need(grown)):
                session.grow_reserve(grown)
                if self.metrics is not None:
                    self.metrics.kv_cache_bytes.set(others + budget.need(grown))
                return
            newest, emit = max(
                ((s, e) for s, e in self._sessions.values() if s.admitted and s.reserve_slots > 0),
                key=lambda item: item[0].admission,
            )
            comeback = grown if newest is session else newest.reserve_slots  # what it reserves again
            if newest.accepts_preemption and budget.ever_fits(budget.need(comeback)):
                if newest is session:
                    session.grow_reserve(grown)  # admitted again only once its growth fits
                self._preempt(newest, emit, session)
            else:
                self._overflow(newest, emit, session, grown)
            if newest is session:
                return

    def _preempt(self, session: DraftSession, emit: Emit, grower: DraftSession) -> None:
        """Preempt `session` for `grower`'s growth (its own, or an older session's): its
        keys/values go to the prefix cache (`on_retire`), it lets go of them
        (DraftSession.preempt), it is counted, and a ready session's caller hears it (a
        `Progress` that says `preempted`, then the waiting reports; no block until its next
        `Ready`). It waits for admission in arrival order, ahead of the prompts that came after
        it. Called with `_cond` held."""
        whose = "its own" if session is grower else "an older session's"
        log.info(
            "draft session %d preempted for %s growth past %d reserved tokens; it prefills again when it fits",
            id(session),
            whose,
            grower.reserve_slots,
        )
        if self.on_retire is not None:
            try:
                self.on_retire(session)
            except Exception:  # noqa: BLE001 - the kept keys/values are an optimisation: it prefills anyway
                log.exception("keeping a preempted draft session's keys/values failed")
        with session.lock:  # a commit applying holds it; the worker is between steps
            was_ready = session.ready
            session.preempt()
        if self.metrics is not None:
            self.metrics.kv_preemptions.inc()
            self.metrics.kv_cache_bytes.set(self.kv_held())
        if was_ready:
            session.progress_at = time.monotonic()
            emit(Progress(0, session.prefill_left(), waiting_for_memory=True, preempted=True))

    def _overflow(self, session: DraftSession, emit: Emit, grower: DraftSession, grown: int) -> None:
        """End `session` for `grower`'s growth from its reserve to `grown` slots (its own, or an
        older session's): removed (its keys/values go to the prefix cache), counted, and its
        stream ends with RESOURCE_EXHAUSTED naming the setting. Called with `_cond` held."""
        budget = self.kv_budget
        reserve = grower.reserve_slots
        assert budget is not None  # only a budget ends sessions
        whose = "its own" if session is grower else "an older session's"
        log.warning(
            "draft session %d ended for memory: %s keys/values outgrew %d tokens reserved, and %d more do not fit",
            id(session),
            whose,
            reserve,
            grown - reserve,
        )
        self.remove(session)
        if self.metrics is not None:
            self.metrics.kv_overflows.inc()
        emit(
            OverLimit(
                f"draft keys/values: the drafter's kv_cache_mib ({budget.budget_bytes >> 20} MiB) has no room for "
                f"{whose} context past its {reserve} reserved tokens; sessions are ended newest first"
            )
        )

    def report_progress(self) -> None:
        """A `Progress` to each session waiting for its `Ready` that asked for reports, when
        `progress_interval_s` has passed since its latest report and either the prompt tokens
        left before it is ready went down since then, or its prefill waits for memory
        (`memory_blocked` and not admitted: a report that says so, after which the next one is
        not compared with it). Sessions in arrival order: the prefill order."""
        now = time.monotonic()
        with self._cond:
            waiting = [(s, e) for s, e in self._sessions.values() if not s.ready and not s.closed]
            blocked = self.memory_blocked
        queued = 0
        for session, emit in waiting:
            queued += session.prefill_left()
            if not session.report_progress:
                continue
            if session.progress_at is not None and now - session.progress_at < self.progress_interval_s:
                continue
            for_memory = blocked and not session.admitted
            if not for_memory and session.progress_queued is not None and queued >= session.progress_queued:
                continue
            session.progress_at, session.progress_queued = now, None if for_memory else queued
            emit(Progress(session.prefilled(), queued, for_memory))

    def advance(self, active: list[tuple[DraftSession, Emit]]) -> None:
        """One step of each session in `active`, in order: with `batch`, the model sessions
        that draft a token share one forward (drafter.batch); else one `session.step` each."""
        steps = [session.steps for session, _ in active]
        if self.batch:
            from drafter import batch  # imports transformers: only a batching worker needs it

            on_forward = None if self.metrics is None else self.metrics.batch_rows.observe
            results = batch.draft_step([session for session, _ in active], on_forward, self.ride_branches)
        else:
            results = [self._serial_step(session) for session, _ in active]
        drafted = 0
        for (session, emit), before, (out, exc, branches) in zip(active, steps, results, strict=True):
            if exc is not None:
                log.error("draft step failed", exc_info=exc)
                self.remove(session, retire=False)
                emit(exc)
                continue
            if session.steps > before and session.last_token_ms > 0:  # the step drafted a token
                drafted += 1
                self.token_ms += (
                    PACE_EWMA * (session.last_token_ms - self.token_ms) if self.token_ms else session.last_token_ms
                )
                if self.metrics is not None:
                    self.metrics.step_seconds.observe(session.last_token_ms / 1e3)
                    if not self.batch and isinstance(session, ModelDraftSession):
                        self.metrics.batch_rows.observe(1)  # its own forward (batched: draft_step observes)
            if out is not None:
                emit(out)
            for block in branches:  # a branch batch that rode in the forward finished
                emit(block)
            if self.metrics is not None and branches:
                self.metrics.branches.inc(len(branches))
        self.last_batch = drafted

    @staticmethod
    def _serial_step(session: DraftSession) -> tuple[BlockOut | Ready | None, BaseException | None, list[BlockOut]]:
        try:
            return session.step(), None, []
        except Exception as exc:  # noqa: BLE001 - handed back: the worker removes the session
            return None, exc, []

    def _guarded(self, session: DraftSession, emit: Emit, work: Callable[[], object]) -> tuple[bool, object]:
        """(failed, result) of one unit of a session's work; a failing session is removed and
        its stream gets the exception, and the others go on."""
        try:
            return False, work()
        except Exception as exc:
            log.exception("draft step failed")
            self.remove(session, retire=False)
            emit(exc)
            return True, None

    def _branch_steps(self, sessions: list[tuple[DraftSession, Emit]]) -> None:
        for session, emit in sessions:
            failed, blocks = self._guarded(session, emit, session.branch_step)
            if failed or not isinstance(blocks, list):
                continue
            for block in blocks:
                emit(block)
            if self.metrics is not None and blocks:
                self.metrics.branches.inc(len(blocks))
            with self._cond:
                if any(s.wants_work() for s, _ in self._sessions.values()):
                    return  # a commit came in: its drafts first


def work_order(
    active: list[tuple[DraftSession, Emit]], batched: bool, admit: Callable[[DraftSession], bool] | None = None
) -> list[tuple[DraftSession, Emit]]:
    """The sessions one worker step advances, of `active` (every session that wants work, in
    arrival order). When some session is urgent (a verifier waits, or is about to wait, for its
    drafts): those, and with `batched` every other session drafting ahead too, since they share
    the urgent rows' forward, where a row costs little beside the weights every forward reads
    (the int8 qwen-coder draft on one core: ~55 ms a forward of 1 row, ~78 ms of 4,
    `specdec bench-drafter`); a prefill chunk, a forward of its own, waits. Otherwise every
    session, drafting ahead. Of the prefills, only the oldest (`oldest_prefill_only`), once
    `admit` lets it start."""
    urgent = [(s, e) for s, e in active if s.urgent()]
    if urgent and batched:
        active = [(s, e) for s, e in active if s.urgent() or (s.ready and s.started)]
    elif urgent:
        active = urgent
    return oldest_prefill_only(active, admit)


def oldest_prefill_only(
    active: list[tuple[DraftSession, Emit]], admit: Callable[[DraftSession], bool] | None = None
) -> list[tuple[DraftSession, Emit]]:
    """`active` (in arrival order) without the prefills after the first: prompts are prefilled
    one at a time, in arrival order (see DraftWorker). `admit(session)`: whether the first may
    start (drafter.memory: its keys/values fit); when not, no prefill runs, and the prompts
    behind it wait too (None: it may)."""
    first = next((s for s, _ in active if not s.ready), None)
    if first is not None and admit is not None and not admit(first):
        first = None
    return [(s, e) for s, e in active if s.ready or s is first]


def emitter(
    loop: asyncio.AbstractEventLoop,
    out: asyncio.Queue[Item | BaseException | None],
    delay: Callable[[float], None] | None = None,
) -> Emit:
    """The worker thread's way into one Draft call: puts each item on `out` in the call's event
    loop. An item made after that loop closed (the server stopped while the worker was mid-step
    on the session) has no reader left and is dropped, instead of raising in the worker thread.
    `delay` (optional) is given each item's wait for the loop, seconds from `emit` to the loop's
    putting it on `out` (the drafter's specdec:drafter_loop_delay_seconds)."""

    def put(item: Item | BaseException, made: float) -> None:  # on the loop
        if delay is not None:
            delay(time.perf_counter() - made)
        out.put_nowait(item)

    def emit(item: Item | BaseException) -> None:  # on the worker's thread
        try:
            loop.call_soon_threadsafe(put, item, time.perf_counter())
        except RuntimeError:  # "Event loop is closed": the call and its reader are gone
            log.debug("draft session: an item made after its call's event loop closed is dropped")

    return emit


class DrafterServicer(rpc.DrafterServiceServicer):
    """Serves a draft model (method "model") and the n-gram drafter (method "ngram"); its
    metrics (telemetry.DrafterMetrics) live on `registry`."""

    def __init__(
        self,
        cfg: DrafterConfig,
        model: torch.nn.Module,
        vocabulary: compat.Vocabulary,
        metrics: telemetry.DrafterMetrics,
        token_ms: float = 0.0,
        prefix_cache: PrefixCache | None = None,
        kv_budget: memory.KVBudget | None = None,
    ) -> None:
        """A servicer over a loaded draft `model` (a transformers causal LM; its `vocabulary` is
        what the gateway checks against the target) and its draft worker (started here).
        `token_ms`: the measured cost of one draft token (`calibrate`), the first `ready`'s
        estimate. `prefix_cache`: where ended sessions' keys/values wait for a prompt that starts
        with their tokens (None: one of cfg.prefix_cache_mib). `kv_budget`: the live sessions'
        keys/values (drafter.memory; None: no bound). `build(cfg, registry)` loads all of them."""
        self.cfg = cfg
        self.model = model
        self.model_name = cfg.model
        self.vocabulary = vocabulary
        self.vocab_size = vocab_size(model)
        self.tracer = telemetry.setup_tracing("drafter")
        self.metrics = metrics
        self.slots = serving.SessionSlots("drafter", cfg.max_sessions)
        self.confidence = parse_mode(cfg.draft_confidence)  # "off", "auto" or a fixed tau (ValueError: bad)
        # Hook point: called as hook(session) after each draft step and each prefill chunk of
        # every session, on the worker thread (DraftSession.step). Empty in production; plugins append to it
        # (specdec.serving.load_plugins; the tests' fault injection, tests/faultkit.py).
        self.step_hooks: list[Callable[[DraftSession], None]] = []
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache(cfg.prefix_cache_mib << 20)
        self.worker = DraftWorker(
            token_ms,
            self.metrics,
            batch=cfg.batch_drafts,
            ride_branches=cfg.ride_branches,
            on_retire=self._retire if self.prefix_cache.budget_bytes > 0 else None,
            kv_budget=kv_budget,
        )
        self.kv_budget = kv_budget
        if kv_budget is not None:
            self.metrics.kv_cache_budget_bytes.set(kv_budget.budget_bytes)
        self.worker.start()

    def _retire(self, session: DraftSession) -> None:
        """A session has ended: its model cache goes to the prefix cache (on the worker's thread)."""
        if not isinstance(session, ModelDraftSession):
            return
        with session.lock:  # a commit still applying holds it
            tokens, layers = session.kv_prefix()
        self.prefix_cache.store(tokens, layers, session.cache_scope)
        self.metrics.prefix_cache_bytes.set(self.prefix_cache.held_bytes)

    def _open(self, req: "pb.DraftOpen") -> DraftSession:
        if req.request_id:  # optional here (only logs and spans carry it), but never unbounded
            check_request_id("open.request_id", req.request_id, MAX_REQUEST_ID_CHARS + BACKEND_REQUEST_ID_EXTRA)
        if len(req.cache_scope) > MAX_CACHE_SCOPE_CHARS:
            raise InvalidField("open.cache_scope", f"{len(req.cache_scope)} characters, over {MAX_CACHE_SCOPE_CHARS}")
        check_token_ids("open.prompt_token_ids", req.prompt_token_ids, self.vocab_size)
        if not 1 <= req.gamma <= MAX_GAMMA_LIMIT:
            raise InvalidField("open.gamma", f"{req.gamma} is out of range [1, {MAX_GAMMA_LIMIT}]")
        method = req.method or pb.DRAFT_METHOD_MODEL
        if method not in METHODS:
            known = ", ".join(pb.DraftMethod.Name(m) for m in METHODS)
            raise InvalidField("open.method", f"this drafter does not serve method {method}; it serves {known}")
        sp = req.sampling
        check_sampling("open.sampling", sp)
        prompt = list(req.prompt_token_ids)
        lookahead = req.gamma + 1 if self.cfg.lookahead < 0 else self.cfg.lookahead
        if method == pb.DRAFT_METHOD_NGRAM:
            session: DraftSession = NgramDraftSession(
                prompt, req.gamma, lookahead, self.cfg.ngram_max, self.cfg.ngram_min
            )
        else:
            session = self._model_session(req, prompt, lookahead, self._reserve(req, prompt, lookahead))
            max_tokens = sp.max_tokens if sp.HasField("max_tokens") else None
            session.slot_cap = memory.cap_slots(len(prompt), max_tokens, req.gamma + lookahead)
            if self.confidence != "off":
                session.confidence = ConfidencePolicy(self.confidence)
        session.branches = self.cfg.branches
        session.flush_ms = self.cfg.flush_ms
        session.prefill_chunk = self.cfg.prefill_chunk
        session.report_progress = req.report_progress
        # a preemption is announced in a progress report: only to a caller that reads them
        session.accepts_preemption = req.accepts_preemption and req.report_progress
        session.cache_scope = req.cache_scope
        session.step_hooks = self.step_hooks  # shared: a hook appended later reaches running sessions
        return session

    def _reserve(self, req: "pb.DraftOpen", prompt: list[int], lookahead: int) -> int:
        """The slots a model session for `req` reserves (drafter.memory); OverLimit when they are
        over the whole budget."""
        sp = req.sampling
        slots = memory.reserve_slots(
            len(prompt), sp.max_tokens if sp.HasField("max_tokens") else None, req.gamma + lookahead
        )
        if self.kv_budget is not None and not self.kv_budget.ever_fits(self.kv_budget.need(slots)):
            need, budget = self.kv_budget.need(slots) >> 20, self.kv_budget.budget_bytes >> 20
            raise OverLimit(
                f"open.prompt_token_ids: a prompt of {len(prompt)} tokens needs {need} MiB of draft keys/values, "
                f"over this drafter's kv_cache_mib ({budget} MiB)"
            )
        return slots

    def _model_session(
        self, req: "pb.DraftOpen", prompt: list[int], lookahead: int, reserve_slots: int
    ) -> ModelDraftSession:
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
            vocab_limit=self.vocabulary.tokenizer_size,
            allowed_token_ids=sp.allowed_token_ids,
            prefixes=self._find_prefix if self.prefix_cache.budget_bytes > 0 else None,
            reserve_slots=reserve_slots,
        )

    def _find_prefix(self, session: ModelDraftSession) -> Prefix | None:
        """The longest run of keys/values that `session`'s context starts with (its prompt, and
        the target's tokens committed before its prefill began), held by the prefix cache or by
        another session's prompt (one still drafting, prefilling, or ended and not retired yet: a
        chat's previous turn as its next one opens; prompts of a queue that share a system prompt;
        a preempted session's own keys/values as it comes back). Asked by each prefill's first
        step, on the worker's thread."""
        prompt = np.asarray(session.context, dtype=np.int64)  # once, not per session (a commit replaces the list)
        best = self.prefix_cache.lookup(prompt, session.cache_scope)
        for other in self.worker.sessions():
            if other is session or not isinstance(other, ModelDraftSession) or other.model is not session.model:
                continue
            if other.cache_scope != session.cache_scope:
                continue
            found = other.prompt_prefix(prompt)
            if found is not None and found.tokens >= self.prefix_cache.min_tokens:
                if best is None or found.tokens > best.tokens:
                    best = found
        return best

    # gRPC asyncio also serves a handler that writes its responses (context.write) and returns None;
    # the generated base class declares only one that returns them as an iterator
    async def Draft(  # type: ignore[override]  # noqa: N802  # returns None: see the comment above
        self,
        request_iterator: AsyncIterator[pb.DraftRequest],
        context: DraftContext,
    ) -> None:
        async with self.slots.hold(context):
            await self._draft(context)

    async def _draft(self, context: DraftContext) -> None:
        opened, session = await serving.open_session(context, self._open, self.cfg.first_message_timeout_s)
        loop = asyncio.get_running_loop()
        out: asyncio.Queue[Item | BaseException | None] = asyncio.Queue()
        span = self.tracer.start_span(
            "specdec.draft_session",
            context=telemetry.extract_context(opened.trace_context or context.invocation_metadata()),
            attributes={
                "specdec.request_id": opened.request_id,
                "specdec.gamma": opened.gamma,
                "specdec.method": draft_method_name(opened.method or pb.DRAFT_METHOD_MODEL),
            },
        )
        self.metrics.sessions.inc()
        self.metrics.requests.inc()

        emit = emitter(loop, out, self.metrics.loop_delay_seconds.observe)
        self.worker.add(session, emit)

        async def read_commits() -> None:
            try:
                while True:
                    msg = await context.read()
                    if msg is grpc.aio.EOF:  # type: ignore[comparison-overlap]  # grpc's stubs leave EOF out of read()
                        break
                    if msg.WhichOneof("kind") != "commit":
                        raise InvalidField("commit", "only commits may follow `open`")
                    c = msg.commit
                    # empty: a commit that only changes the hold (or gamma)
                    check_token_ids("commit.token_ids", c.token_ids, self.vocab_size, allow_empty=True)
                    # a commit verifies tokens at the end of what is verified: it starts within the
                    # context (past the prompt), never beyond it (positions are uint32 on the wire)
                    prompt_len, known = len(opened.prompt_token_ids), len(session.context)
                    if not prompt_len <= c.start_position <= known:
                        raise InvalidField(
                            "commit.start_position",
                            f"{c.start_position} is outside [{prompt_len}, {known}] (from the "
                            "prompt's end to the context's end)",
                        )
                    if c.gamma and not 1 <= c.gamma <= MAX_GAMMA_LIMIT:
                        raise InvalidField("commit.gamma", f"{c.gamma} is out of range [1, {MAX_GAMMA_LIMIT}]")
                    gamma, breaks, hits, uncovered, stopped = (
                        session.gamma,
                        session.breaks,
                        session.branches_adopted,
                        session.uncovered,
                        session.forwards_stopped,
                    )
                    t0 = time.perf_counter()
                    if session.ready:  # the worker holds the session's lock for one draft step at most
                        session.commit(c.start_position, list(c.token_ids), c.gamma, c.hold)
                    else:
                        # a prefill chunk holds the lock far longer (and the worker may take it again for
                        # the next chunk first): off this event loop, which writes every stream's blocks
                        # and progress reports (a commit here once blocked them for a whole prefill)
                        await asyncio.to_thread(session.commit, c.start_position, list(c.token_ids), c.gamma, c.hold)
                    self.metrics.commit_seconds.observe(time.perf_counter() - t0)
                    # the forward this commit stopped (the worker counts it before the commit gets the lock)
                    self.metrics.forwards_stopped.inc(session.forwards_stopped - stopped)
                    if session.breaks > breaks:  # a broken chain: a branch hit or a miss, at the gamma in force
                        self.metrics.branch_breaks.labels(gamma=str(gamma)).inc()
                        self.metrics.branch_hits.labels(gamma=str(gamma)).inc(session.branches_adopted - hits)
                        self.metrics.branch_uncovered.labels(gamma=str(gamma)).inc(session.uncovered - uncovered)
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
                if isinstance(item, OverLimit):  # ended for memory (DraftWorker._overflow)
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(item))
                if isinstance(item, BaseException):
                    await context.abort(grpc.StatusCode.INTERNAL, f"drafting failed: {item}")
                if isinstance(item, Ready):
                    ready = pb.DraftReady(
                        prefilled_tokens=item.prefilled_tokens,
                        prefill_ms=item.prefill_ms,
                        draft_ms_per_token=self.worker.pace_ms(),
                        reused_tokens=item.reused_tokens,
                    )
                    self.metrics.prefix_reused_tokens.inc(item.reused_tokens)
                    self.metrics.prompt_tokens.inc(item.prefilled_tokens)
                    await context.write(pb.DraftResponse(ready=ready))
                    span.add_event(
                        "ready",
                        {
                            "specdec.prefilled_tokens": item.prefilled_tokens,
                            "specdec.prefill_ms": item.prefill_ms,
                            "specdec.draft_ms_per_token": ready.draft_ms_per_token,
                            "specdec.reused_tokens": item.reused_tokens,
                        },
                    )
                    continue
                if isinstance(item, Progress):
                    progress = pb.DraftProgress(
                        prefilled_tokens=item.prefilled_tokens,
                        queued_tokens=item.queued_tokens,
                        waiting_for_memory=item.waiting_for_memory,
                        preempted=item.preempted,
                    )
                    await context.write(pb.DraftResponse(progress=progress))
                    if item.preempted:
                        span.add_event("preempted", {"specdec.prefill_tokens": item.queued_tokens})  # to prefill again
                    continue
                sequence += 1
                await context.write(pb.DraftResponse(block=_block_pb(item, sequence)))
                self.metrics.blocks.inc()
                self.metrics.tokens.inc(len(item.drafts))
                if item.confidence_cut:
                    self.metrics.confidence_cuts.inc()
                if item.tau and not item.branch:
                    self.metrics.block_tau.observe(item.tau)
                span.add_event(
                    "block",
                    {
                        "specdec.start_position": item.start_position,
                        "specdec.tokens": len(item.drafts),
                        "specdec.draft_ms": item.draft_ms,
                        "specdec.branch": item.branch,
                    },
                )
        finally:
            span.end()
            self.metrics.sessions.dec()
            reader.cancel()
            self.worker.remove(session)

    async def close(self) -> None:
        """Stop drafting: the worker ends the step under way (a forward, or a prefill chunk) and
        exits before this returns, so no draft step runs on into the process's exit."""
        self.worker.stop()
        await asyncio.to_thread(self.worker.join)

    async def GetDrafterInfo(  # noqa: N802
        self,
        request: pb.GetDrafterInfoRequest,
        context: grpc.aio.ServicerContext[pb.GetDrafterInfoRequest, pb.GetDrafterInfoResponse],
    ) -> pb.GetDrafterInfoResponse:
        return pb.GetDrafterInfoResponse(
            model=self.model_name,
            vocab_size=self.vocab_size,
            methods=list(METHODS),
            vocabulary=compat.to_pb(self.vocabulary),
        )


def _block_pb(block: BlockOut, sequence: int) -> "pb.DraftBlock":
    msg = pb.DraftBlock(
        start_position=block.start_position,
        token_ids=[d.token_id for d in block.drafts],
        sequence=sequence,
        draft_ms=block.draft_ms,
        final=block.final,
        committed_length=block.committed_length,
        branch=block.branch,
        confidence_cut=block.confidence_cut,
        tau=block.tau,
    )
    return msg


@dataclass(frozen=True)
class Calibration:
    """What `calibrate` measured: one draft token's cost, ms, and its keys/values, bytes."""

    token_ms: float
    token_bytes: int


def calibrate(
    model: torch.nn.Module, vocabulary: compat.Vocabulary, q_top_k: int = 0, prompt_len: int = 32, tokens: int = 6
) -> Calibration:
    """Warm the model up and measure its cost per draft token, milliseconds (median of a few
    greedy steps after a short prefill: the first `ready`'s estimate, before any session ran),
    and what one token's keys/values take (drafter.memory's token bytes)."""
    import statistics

    vocab = vocab_size(model)
    prompt = [i % vocab for i in range(1, prompt_len + 1)]
    session = ModelDraftSession(
        model,
        prompt,
        gamma=tokens,
        lookahead=0,
        temperature=0.0,
        top_k=0,
        top_p=1.0,
        seed=0,
        q_top_k=q_top_k,
        prefill_chunk=prompt_len,
        vocab_limit=vocabulary.tokenizer_size,
    )
    session.commit(prompt_len, [1])
    costs: list[float] = []
    while len(costs) < tokens:
        out = session.step()
        if session.last_token_ms and not isinstance(out, Ready):
            costs.append(session.last_token_ms)
            session.last_token_ms = 0.0
        if isinstance(out, BlockOut) and out.final:
            break
    token_ms = statistics.median(costs[1:] or costs) if costs else 0.0
    return Calibration(token_ms, memory.token_bytes(session.kv_prefix()[1]))


def build(cfg: DrafterConfig, registry: CollectorRegistry) -> DrafterServicer:
    """The factory: check the draft fits cfg.target (before loading any weights), load it where
    cfg places it, calibrate it, and make the servicer, its metrics on `registry`."""
    from specdec.models import load_causal_lm, resolve
    from specdec.models.lean import LeanDecoder

    parse_mode(cfg.draft_confidence)  # a bad value fails here, before any weights load
    torch.set_num_threads(cfg.threads)
    revision = cfg.revision or None
    path = resolve(cfg.model, revision=revision)
    vocabulary = compat.from_folder(path, cfg.model)
    if cfg.target:  # refuse a draft that does not fit its target before loading any weights
        compat.check(compat.from_folder(resolve(cfg.target), cfg.target), vocabulary)
    placement = draft_placement(cfg.device, cfg.dtype, cfg.quantize)
    cut = read_draft_vocab(cfg.draft_vocab, cfg.model, vocabulary.vocab_size) if cfg.draft_vocab else None
    model = load_causal_lm(cfg.model, placement.dtype, placement.quantize, revision, placement.device, cfg.forward, cut)
    measured = calibrate(model, vocabulary, cfg.q_top_k)
    prefix_bytes = cfg.prefix_cache_mib << 20
    if cfg.kv_cache_mib > 0:
        budget, how = cfg.kv_cache_mib << 20, "kv_cache_mib"
    else:
        budget, how = memory.auto_budget(torch.device(placement.device), prefix_bytes)
    kv_budget = memory.KVBudget(budget, measured.token_bytes)
    log.info(
        "draft keys/values: %d MiB for live sessions (%s), %d KiB a token: %d tokens",
        budget >> 20,
        how,
        measured.token_bytes >> 10,
        budget // max(1, measured.token_bytes),
    )
    log.info(
        "draft model %s loaded from %s (vocab %d%s, %s, %s, quantize %s, forward %s, %.1f ms per draft token)",
        cfg.model,
        path,
        vocab_size(model),
        f", drafting {len(cut.token_ids)} of them ({cfg.draft_vocab})" if cut else "",
        placement.device,
        placement.dtype,
        placement.quantize,
        "lean" if isinstance(model, LeanDecoder) else "transformers",
        measured.token_ms,
    )
    metrics = telemetry.DrafterMetrics(registry)
    return DrafterServicer(cfg, model, vocabulary, metrics, measured.token_ms, kv_budget=kv_budget)


async def main(cfg: DrafterConfig) -> None:
    await serving.serve(
        "drafter",
        cfg,
        lambda registry: build(cfg, registry),
        rpc.add_DrafterServiceServicer_to_server,
        "specdec.v1.DrafterService",
    )
