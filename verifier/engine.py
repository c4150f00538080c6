"""The target engine: vLLM's V1 LLMEngine, in-process, stepped by one thread.

All sessions share one engine, so concurrent generations are batched by vLLM's
scheduler (continuous batching), not serialised. The engine is built with the
`custom_class` speculative method (verifier.vllm_hooks.ExternalDraftProposer, reading the
engine's draft board, verifier.proposer.DraftBoard), so drafts offered on the board are
verified by vLLM itself with each request's KV cache kept between steps: a step computes
only 1 + (number of drafts) new tokens per request.
Every use of vLLM's internals (environment, version check, CPU sampler fix, engine
construction, scheduler hook) goes through verifier.vllm_hooks.

Per step and request the engine thread emits a `Verdict` (the new tokens, how many
drafts were checked and accepted, the tokens computed) to the session's callback.

Hook point: `TargetEngine.step_hooks`, a list of `StepHook`s the engine thread calls in each
engine step, twice: before vLLM's scheduler runs (`scheduled` None) and right after it decided
(`scheduled`: what it scheduled). Empty in production; plugins (specdec.serving.load_plugins)
append to it: the test suite's fault injection (tests/faultkit.py) sleeps there to make a step
or a prefill slow. A hook runs on the engine's critical path and must not raise.

No silent hang: any exception on the engine thread (a step, a command, emitting a verdict)
fails the engine as a whole: `failed` says why, every session's callback gets an
`EngineFailed` (the server ends those calls with UNAVAILABLE, so their gateways resume them on
another verifier), a session submitted afterwards gets one at once, and the process is sent
SIGTERM (health turns NOT_SERVING while it drains, then it exits with a failure status).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry

from specdec import telemetry
from specdec.config import VerifierConfig
from specdec.validation import max_blocks_per_commit
from verifier import vllm_hooks
from verifier.vllm_hooks import configure_vllm_env

if TYPE_CHECKING:  # importing this module starts no thread pools (numpy's): tests/verifier/test_vllm_hooks.py
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from verifier.proposer import DraftBoard

# A DraftBoard call (offer, ready, end) made with a request's engine id; kept until the engine
# thread adds the request when it comes before that (_Early).
BoardCall = Callable[[str], None]

log = logging.getLogger("specdec.verifier")


StepHook = Callable[[int, "vllm_hooks.ScheduledStep | None"], None]
"""A step hook: `hook(step, scheduled)`, `step` the 1-based number of the engine step under way,
`scheduled` None before the scheduler runs and its decision after (module docstring)."""


class EngineFailed(Exception):
    """The engine thread died (the message says why): the request cannot go on here."""


@dataclass
class Verdict:
    """One target step's result for one request."""

    start_position: int
    token_ids: list[int]
    drafted: int
    accepted: int
    finish_reason: str | None  # None, "length", "stop", "abort"
    computed_tokens: int
    batch_size: int
    step_ms: float
    draft_wait_ms: float = 0.0
    queue_ms: float = 0.0  # first verdict: submitted -> first scheduled
    preview: bool = False  # tokens sampled in a step still running (see VerifyResponse.preview)
    logprobs: list["TokenLogprobs"] = field(default_factory=list)  # [len(token_ids)] when asked for
    stop_token: bool = False  # the last token is the stop token (EOS or a stop_token_id) that ended it
    branch: bool = False  # the drafts verified came from a pre-drafted branch (DraftBoard's terms)
    branch_miss: bool = False  # the step followed a broken chain and no branch had its drafts
    hold_drafts: bool = False  # adaptive gamma holds this request's drafts (DraftBoard.holding)


@dataclass
class TokenLogprobs:
    """The target's log-probabilities at one generated position (specdec.v1.TokenLogprobs)."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top_token_ids: list[int]  # [k] best first
    top_logprobs: list[float]  # [k]


@dataclass
class GenerationRequest:
    """What a session asks the engine for: the prompt, the drafts per step, and the request as
    vLLM takes it (`params`, a vllm.SamplingParams; verifier.convert builds it from the wire)."""

    request_id: str
    prompt_token_ids: list[int]
    gamma: int
    params: SamplingParams  # max_tokens set

    @property
    def max_tokens(self) -> int:
        max_tokens = self.params.max_tokens
        assert max_tokens is not None, "the verifier sets max_tokens on every request (verifier.convert)"
        return max_tokens

    @property
    def stop_token_ids(self) -> list[int]:
        return list(self.params.stop_token_ids or [])

    @property
    def logprobs(self) -> int | None:
        """Alternatives per position to report; None: no logprobs."""
        return self.params.logprobs


class StepEngine(Protocol):
    """What TargetEngine uses of vLLM's LLMEngine (vllm_hooks.build_engine builds it; the unit
    tests pass a fake with these four methods)."""

    def add_request(self, request_id: str, prompt: TokensPrompt, params: SamplingParams) -> str: ...

    def abort_request(self, request_ids: list[str], internal: bool = False) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    # vLLM's RequestOutputs (a generating engine makes no pooling outputs), read by `_emit`
    def step(self) -> Sequence[Any]: ...


class TargetEngine:
    """Owns the vLLM engine and its stepping thread. `TargetEngine.load(cfg, model_path)` builds
    one for a model; the constructor takes the parts ready-made (tests pass a fake of vLLM's
    LLMEngine and a real DraftBoard)."""

    def __init__(
        self,
        cfg: VerifierConfig,
        engine: StepEngine,
        board: DraftBoard,
        metrics: telemetry.VerifierMetrics,
        facts: vllm_hooks.ModelFacts,
    ) -> None:
        """A TargetEngine over a built vLLM engine (`engine`, whose `custom_class` proposer reads
        `board`) and the facts of its model; `start()` runs its thread. `load` builds all of them."""
        self.failed = ""  # why the engine died ("" while it runs)
        self._fail_lock = threading.Lock()  # orders a failure against submissions
        self.cfg = cfg
        self.metrics = metrics
        self.board = board
        self.engine = engine
        self.metrics.engine_running.set_function(lambda: vllm_hooks.request_counts(engine)[0])
        self.metrics.engine_waiting.set_function(lambda: vllm_hooks.request_counts(engine)[1])
        self._step_tokens = 0  # tokens the engine scheduled in the current step
        self._decode_step = False  # ... and whether they were all decode/verify tokens
        self.vocab_size = facts.vocab_size
        self.eos_token_ids = facts.eos_token_ids
        self._stop_ids = facts.stop_ids  # every id vLLM may stop at: previews stop before them
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._live: dict[str, _Live] = {}  # by our request id
        self._by_engine_id: dict[str, _Live] = {}  # the same, by vLLM's internal id
        # blocks, `ready` and `end` that come before the engine thread has added their request
        # (applied when it does, so an early `end` is never lost); under _early_lock with _live's adds
        self._early: dict[str, _Early] = {}
        self._early_lock = threading.Lock()
        self.steps = 0
        self.step_hooks: list[StepHook] = []  # see the module docstring; empty in production
        self._thread = threading.Thread(target=self._run, name="target-engine", daemon=True)
        self._stopped = False

    @classmethod
    def load(
        cls,
        cfg: VerifierConfig,
        model_path: str,
        metrics: telemetry.VerifierMetrics | None = None,
    ) -> TargetEngine:
        """The factory: vLLM's environment and version check, the CPU sampler fix, the draft board,
        vLLM's engine for the model at `model_path` with the scheduler hook; started. `metrics`:
        the verifier's (engine steps, batch sizes, step cost; shared with the draft board); None
        gives the engine a throwaway registry of its own (tools)."""
        configure_vllm_env(cfg)
        vllm_hooks.check_vllm_version()
        from verifier.proposer import DraftBoard

        if cfg.cpu_sampler_fix and vllm_hooks.apply_cpu_sampler_fix():
            log.info(
                "installed the CPU sampler fixes (vLLM issue #55005, top-k without draft rows, eager logprob ranks)"
            )
        metrics = metrics if metrics is not None else telemetry.VerifierMetrics(CollectorRegistry())
        board = DraftBoard(
            max_model_len=cfg.max_model_len,
            wait_s=cfg.draft_wait_ms / 1e3,
            wait_slack=cfg.draft_wait_slack,
            wait_margin_s=cfg.draft_wait_margin_ms / 1e3,
            adaptive=cfg.adaptive_gamma,
            metrics=metrics,
        )
        engine = vllm_hooks.build_engine(cfg, model_path, board)
        target = cls(cfg, engine, board, metrics, vllm_hooks.model_facts(engine))
        vllm_hooks.install_schedule_hook(engine, target._on_schedule, target._before_schedule)
        return target.start()

    def start(self) -> TargetEngine:
        """Start the engine thread (once)."""
        self._thread.start()
        return self

    # ---- the scheduler hook (engine thread, inside engine.step) ---------------------
    def _before_schedule(self) -> None:
        for hook in self.step_hooks:
            hook(self.steps + 1, None)

    def _on_schedule(self, step: vllm_hooks.ScheduledStep) -> None:
        """Record how many tokens each request was scheduled (= computed) this step."""
        for hook in self.step_hooks:
            hook(self.steps + 1, step)
        now = time.perf_counter()
        self._step_tokens = step.total_tokens
        # a decode/verify step: every request computes its next token and its drafts, no
        # prompt (prompt tokens are cheaper per token, so they would bias the step cost fit)
        self._decode_step = not step.new_requests and all(
            n == 1 + step.spec_tokens.get(rid, 0) for rid, n in step.num_scheduled_tokens.items()
        )
        # requests whose prefill is not done: not scheduled yet, or a chunk in the next step
        self.board.queued = step.waiting + step.prefill_chunks
        for rid, n in step.num_scheduled_tokens.items():
            live = self._by_engine_id.get(rid)
            if live is not None:
                live.computed += n
                live.first_scheduled = live.first_scheduled or now

    # ---- called from any thread -------------------------------------------------
    def submit(self, req: GenerationRequest, on_verdict: Callable[[Verdict | EngineFailed], None]) -> None:
        """Queue a request; its verdicts (or one EngineFailed) go to `on_verdict`, on the engine thread."""
        self.board.arrival()  # before the engine thread can take it (`added`), and outside _fail_lock
        with self._fail_lock:
            if self.failed:  # the thread is gone: nobody would ever answer
                on_verdict(EngineFailed(self.failed))
                return
            with self._early_lock:
                self._early[req.request_id] = _Early(max_blocks_per_commit(req.gamma))
            self._commands.put(("add", (req, on_verdict)))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def offer(
        self,
        request_id: str,
        start: int,
        tokens: list[int],
        final: bool = True,
        committed: int = -1,
        draft_ms: float = 0.0,
        branch: bool = False,
    ) -> None:
        """Put a block on the board (see DraftBoard.offer); committed -1 means start."""

        def call(engine_id: str) -> None:
            self.board.offer(engine_id, start, tokens, final, start if committed < 0 else committed, draft_ms, branch)

        self._call_or_keep(request_id, call)

    def drafter_ready(self, request_id: str, pace_ms: float) -> None:
        """The request's drafter has prefilled the prompt (see DraftBoard.ready)."""
        self._call_or_keep(request_id, lambda engine_id: self.board.ready(engine_id, pace_ms))

    def pause_drafts(self, request_id: str) -> None:
        """The request's drafter drafts nothing until its next `ready` (see DraftBoard.pause)."""
        self._call_or_keep(request_id, self.board.pause)

    def end_drafts(self, request_id: str) -> None:
        self._call_or_keep(request_id, self.board.end, end=True)

    def _call_or_keep(self, request_id: str, call: BoardCall, end: bool = False) -> None:
        """Make `call` with the request's engine id; nothing when the request is gone; when it is
        not added yet, keep the call (a bounded number of them; `end` only as a flag, never
        dropped), made when the engine thread adds the request."""
        live = self._live.get(request_id)
        if live is None:
            with self._early_lock:
                live = self._live.get(request_id)
                if live is None:
                    early = self._early.get(request_id)
                    if early is not None:
                        early.keep(call, end)
                    return
        call(live.engine_id)

    def _apply_early(self, req: GenerationRequest, live: "_Live") -> None:
        """The request is added: make it live, then the calls that came before (in order)."""
        with self._early_lock:
            self._live[req.request_id] = live
            early = self._early.pop(req.request_id, None)
            for call in early.calls if early is not None else ():
                call(live.engine_id)
            if early is not None and early.ended:
                self.board.end(live.engine_id)

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    # ---- engine thread ----------------------------------------------------------
    def _apply_commands(self) -> None:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                req, cb = arg
                try:
                    self._add(req, cb)
                except Exception as exc:  # noqa: BLE001 (vLLM refused this request: fail it alone)
                    log.warning("request %s refused by the engine: %s", req.request_id, exc)
                    cb(Verdict(len(req.prompt_token_ids), [], 0, 0, "abort", 0, 0, 0.0))
                finally:
                    self.board.added()
            elif kind == "abort":
                live = self._live.pop(arg, None)
                if live is not None:
                    self.engine.abort_request([live.engine_id], internal=True)
                    self.board.unregister(live.engine_id)
                    self._by_engine_id.pop(live.engine_id, None)

    def _add(self, req: GenerationRequest, cb: Callable[[Verdict | EngineFailed], None]) -> None:
        """Add one request to the engine (vLLM validates its SamplingParams here)."""
        live = _Live(req, cb, engine_id="", submitted=time.perf_counter())
        # the engine id gets a random suffix; register drafts under it before any step
        try:
            engine_id = self.engine.add_request(req.request_id, {"prompt_token_ids": req.prompt_token_ids}, req.params)
        except BaseException:
            with self._early_lock:
                self._early.pop(req.request_id, None)
            raise
        live.engine_id = engine_id
        self._by_engine_id[engine_id] = live

        def preview(start: int, tokens: list[int]) -> None:
            self._preview(req, cb, start, tokens)

        self.board.register(engine_id, req.gamma, len(req.prompt_token_ids), req.max_tokens, preview)
        self._apply_early(req, live)

    def _gathering_pays(self) -> bool:
        """Idle engine, requests just added: whether to wait for more (`_collect_burst`) before
        the first step. Gathering one more arrival into that step saves it a step's fixed cost
        (base_ms: its first token comes with the others', not a step later) and costs the
        requests already there its prefill (c p: c ms per prompt token, p tokens) and the wait
        (w): for two requests the sum of their TTFTs falls iff c p + 2 w < base_ms. A burst of
        short prompts is gathered into one step; a long prompt starts at once, as on vLLM's
        server (under chunked prefill a burst of long prompts takes several steps either way,
        and a gathered first step only delays the first). p: the mean prompt of the requests
        added, a burst's arrivals taken to be alike. Not measured yet (no warm-up, no decode
        step): no wait. On this CPU (qwen-coder at bf16, one core) base_ms is ~240-320 and c ~3.5
        (the warm-up's 512 tokens in 1.8 s): prompts up to ~60 tokens are gathered at w = 20."""
        cost = self.board.cost
        window = self.cfg.batch_window_ms
        prompts = [len(live.req.prompt_token_ids) for live in self._live.values()]
        if window <= 0 or not prompts or not cost.ready or cost.prefill_ms_per_token <= 0:
            return False
        return cost.prefill_ms_per_token * sum(prompts) / len(prompts) + 2 * window < cost.base_ms

    def _collect_burst(self) -> None:
        """Idle engine, a request arrived: wait while more keep arriving (batch_window_ms of quiet,
        at most 10 windows) so a burst is prefilled in one step, not one request ahead of the rest
        (whose prefill would then stall the first one's decoding); `_gathering_pays` says when."""
        window = self.cfg.batch_window_ms / 1e3
        deadline = time.monotonic() + 10 * window
        while window > 0 and time.monotonic() < deadline:
            before = self._commands.qsize()
            time.sleep(window)
            if self._commands.qsize() == before:
                return

    def _preview(
        self, req: GenerationRequest, cb: Callable[[Verdict | EngineFailed], None], start: int, tokens: list[int]
    ) -> None:
        """Send the part of a step's sampled tokens that its verdict is sure to contain: up to
        max_tokens and before any stop id (the engine may cut there)."""
        room = req.max_tokens - (start - len(req.prompt_token_ids))
        safe = tokens[: max(0, room)]
        for i, t in enumerate(safe):
            if t in self._stop_ids or t in req.stop_token_ids:
                safe = safe[:i]
                break
        if safe:
            cb(Verdict(start, safe, 0, 0, None, 0, 0, 0.0, preview=True))

    def _run(self) -> None:
        """The engine thread: steps until stopped; any exception fails the engine (_fail)."""
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 (whatever it is, the sessions must hear of it)
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        """The engine thread failed: every session gets EngineFailed (its call then ends with
        UNAVAILABLE and its gateway migrates it), later ones at submission, and the process
        stops (SIGTERM: health NOT_SERVING, drain, exit) so its supervisor restarts it."""
        log.critical("engine thread failed; the verifier stops (its supervisor restarts it)", exc_info=exc)
        with self._fail_lock:
            self.failed = f"engine failed: {type(exc).__name__}: {exc}"
            callbacks = [live.callback for live in self._live.values()]
            while True:  # requests queued but not added yet
                try:
                    kind, arg = self._commands.get_nowait()
                except queue.Empty:
                    break
                if kind == "add":
                    callbacks.append(arg[1])
            self._live.clear()
            self._by_engine_id.clear()
        for callback in callbacks:
            try:
                callback(EngineFailed(self.failed))
            except Exception:  # one broken session must not keep the others waiting
                log.exception("telling a session of the engine failure failed")
        os.kill(os.getpid(), signal.SIGTERM)  # drain (nothing is left in flight) and exit

    def _loop(self) -> None:
        while not self._stopped:
            self._apply_commands()
            if not self.engine.has_unfinished_requests():
                woke = self._wake.wait(timeout=1.0)
                self._wake.clear()
                if woke:
                    self._apply_commands()  # the arrival that woke it (a submit queues, then wakes)
                    if self._gathering_pays():
                        self._collect_burst()
                continue
            t0 = time.perf_counter()
            waited0 = self.board.waited_s
            outputs = self.engine.step()  # an exception here, or anywhere in the loop, fails the engine
            wait_ms = (self.board.waited_s - waited0) * 1e3
            step_ms = (time.perf_counter() - t0) * 1e3 - wait_ms
            self.steps += 1
            if self._decode_step:
                self.board.cost.observe(self._step_tokens, step_ms)
            m = self.metrics
            m.step_cost_ms.labels("base").set(self.board.cost.base_ms)
            m.step_cost_ms.labels("per_token").set(self.board.cost.per_token_ms)
            m.engine_steps.inc()
            m.step_seconds.observe(step_ms / 1e3)
            m.draft_wait_seconds.inc(wait_ms / 1e3)
            m.batch_size.observe(len(outputs))
            for out in outputs:
                live = self._live.get(out.request_id)  # RequestOutput carries our (external) id
                if live is None:
                    continue
                self._emit(live, out, len(outputs), step_ms, wait_ms)

    def _emit(self, live: "_Live", out: Any, batch_size: int, step_ms: float, wait_ms: float) -> None:
        completion = out.outputs[0]
        tokens = list(completion.token_ids)
        finish = completion.finish_reason
        room = live.req.max_tokens - live.generated
        if len(tokens) >= room:  # the engine may accept drafts past max_tokens: cut there
            tokens = tokens[:room]
            finish = finish or "length"
        if out.finished and finish is None:
            finish = "stop"
        logprobs = _logprobs(completion.logprobs, tokens, live.req.logprobs) if live.req.logprobs is not None else []
        # vLLM's stop_reason: None for end-of-sequence, the id for a stop_token_id (no stop strings here)
        stop_token = (
            finish == "stop"
            and bool(tokens)
            and completion.finish_reason == "stop"
            and (completion.stop_reason is None or completion.stop_reason == tokens[-1])
        )
        start = live.position
        proposal, from_branch, branch_miss = self.board.take_proposal_info(live.engine_id, start)
        accepted = 0
        while accepted < min(len(proposal), len(tokens)) and proposal[accepted] == tokens[accepted]:
            accepted += 1
        self.board.record(live.engine_id, len(proposal), accepted)
        computed, live.computed = live.computed, 0
        queue_ms = (
            (live.first_scheduled - live.submitted) * 1e3 if live.generated == 0 and live.first_scheduled else 0.0
        )
        self.metrics.computed_tokens.inc(computed)
        live.generated += len(tokens)
        verdict = Verdict(
            start,
            tokens,
            len(proposal),
            accepted,
            finish,
            computed,
            batch_size,
            step_ms,
            wait_ms,
            queue_ms,
            logprobs=logprobs,
            stop_token=stop_token,
            branch=from_branch,
            branch_miss=branch_miss,
            hold_drafts=self.board.holding(live.engine_id),
        )
        if finish is not None:
            self._live.pop(live.req.request_id, None)
            self._by_engine_id.pop(live.engine_id, None)
            self.board.unregister(live.engine_id)
            if not out.finished:
                self.engine.abort_request([live.engine_id], internal=True)
        live.callback(verdict)


def _logprobs(positions: Any, tokens: list[int], k: int) -> list[TokenLogprobs]:
    """vLLM's per-position logprobs for the `tokens` kept, as TokenLogprobs. vLLM gives each
    position as {token id: Logprob(logprob, rank)}: the sampled token, then the k most likely
    (ranks 1..k; the sampled token appears once, first, when it is among them)."""
    out = []
    for token, entries in zip(tokens, positions or []):
        sampled = entries[token]
        top = sorted((lp.rank, tid, lp.logprob) for tid, lp in entries.items() if lp.rank is not None and lp.rank <= k)
        out.append(
            TokenLogprobs(
                token, sampled.logprob, sampled.rank or 0, [tid for _, tid, _ in top], [lp for _, _, lp in top]
            )
        )
    return out


@dataclass
class _Early:
    """Calls for a session that came before the engine thread added its request: at most
    `limit` blocks and readies (the board takes no more per step either), and whether its
    drafts ended (never dropped)."""

    limit: int
    calls: list[BoardCall] = field(default_factory=list)
    ended: bool = False

    def keep(self, call: BoardCall, end: bool) -> None:
        if end:
            self.ended = True
        elif len(self.calls) < self.limit:
            self.calls.append(call)


@dataclass
class _Live:
    req: GenerationRequest
    callback: Callable[[Verdict | EngineFailed], None]
    engine_id: str
    submitted: float = 0.0  # perf_counter at submission
    first_scheduled: float = 0.0  # perf_counter when the engine first scheduled it (0: not yet)
    computed: int = 0  # tokens the engine computed for it since the last verdict
    generated: int = 0

    @property
    def position(self) -> int:
        return len(self.req.prompt_token_ids) + self.generated
