"""One generation's rounds: the gateway's synchronisation of drafter and verifier.

    client -> gateway  : GenerateRequest
    gateway -> verifier: open (prompt, sampling, gamma)       gateway -> drafter: open
    drafter -> gateway -> verifier: ready (prompt prefilled; while the target prefills)
    verifier -> gateway: preview (tokens sampled, from inside the step)
    gateway -> drafter : commit (start, tokens)               (drafter keeps or rolls back)
    drafter -> gateway -> verifier: block (start, tokens)     (as soon as drafted)
    verifier -> gateway: verdict (tokens, drafted, accepted)  (one per target step)
    gateway -> client  : the preview's tokens as text, then what the verdict adds (at once)

A target step waits for drafts at most the verifier's `draft_wait_ms` (less: about as
long as the drafter is expected to take), and not at all once the gateway has told it
(`end`) that the drafter is gone: a step without a usable block is a plain decode step.
So when the drafter fails, stalls or is killed, the generation goes on as plain target
decoding with the same output, and the stats say so.

A drafter is untrusted input: each of its replies is checked before it is relayed
(specdec.validation.check_draft_block: ids in the vocabulary, at most gamma tokens, positions
after the prompt and within reach of the committed context, at most max_blocks_per_commit
blocks between two commits, one `ready`). A bad block is dropped (a long one trimmed to gamma)
and counted; at MAX_DRAFTER_VIOLATIONS the drafter is treated as failed (fallback, with the
violation as the reason). So a misbehaving drafter can neither fail a request nor flood the
verifier: the verifier only ever sees valid blocks, at a bounded rate.

The drafter's deadline measures the drafter alone: it owes an answer from each commit on
(the first one carries the target's first token), and falls back when it stays silent
for `drafter_timeout_s` while it owes one. The target's queueing and prefill never count:
before the first commit the drafter owes nothing (it prefills its own copy meanwhile).

A *polite* hostile drafter answers in time with valid blocks that carry no draft at all
(empty blocks). Each commit to a drafter that has
spoken (sent `ready` or a block), while the verifier does not hold its drafts and drafts are
still possible (at least two tokens to go), opens a *window* that ends at the next commit. A
window is *idle* when blocks were relayed in it and none carries a drafted token (for the
n-gram method a `final` empty block, "no match here", is an answer: finding nothing is what it
does). A window with no block at all is neither: an honest drafter slower than its target
sends nothing between two commits (its drafts are rolled back by the next one), and a drafter
that sends nothing at all is the silence watch's (`drafter_timeout_s`). After
`max_idle_commits` idle windows in a row the drafter is treated as failed (fallback, reason
"... max_idle_commits ..."); a block with drafts resets the count. An honest model drafter
never sends an empty block (its method always proposes a token), so the rule cannot drop one.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry import trace

from specdec import telemetry
from specdec.validation import (
    MAX_DRAFTER_VIOLATIONS,
    check_draft_block,
    max_blocks_per_commit,
    reported_ms,
)
from specdec.wire import draft_method_name, pb

log = logging.getLogger("specdec.gateway")

# How long a round waits for the verifier's vocabulary size (asked once per verifier stub).
VOCAB_TIMEOUT_S = 10.0
_VOCAB_SIZES: "weakref.WeakKeyDictionary[object, int]" = weakref.WeakKeyDictionary()


async def verifier_vocab_size(stub: object) -> int:
    """The verifier's vocabulary size (GetVerifierInfo), asked once per stub; 0 when unknown."""
    try:
        return _VOCAB_SIZES[stub]
    except (KeyError, TypeError):
        pass
    try:
        info = await stub.GetVerifierInfo(pb.GetVerifierInfoRequest(), timeout=VOCAB_TIMEOUT_S)
    except Exception as err:  # noqa: BLE001 (the verifier's own checks still apply)
        log.warning("no vocabulary size from the verifier (%s): drafted ids are checked for sign only", err)
        return 0
    with contextlib.suppress(TypeError):
        _VOCAB_SIZES[stub] = info.vocab_size
    return info.vocab_size


@dataclass
class Plan:
    """A validated request, ready to run.

    `request_id` is the client's (or one the gateway made up); `tenant` is the namespace of the
    API key that sent it (`tenant_of`), put before it on the verifier and drafter side
    (`backend_id`), so two keys' requests never share an id there."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: "pb.SamplingParams"
    gamma: int
    drafter: int  # pb.DraftMethod: MODEL, NGRAM or NONE
    tenant: str = ""

    @property
    def backend_id(self) -> str:
        """The id the verifier and the drafter know this request by: `<tenant>.<request_id>`."""
        return f"{self.tenant}.{self.request_id}" if self.tenant else self.request_id


def tenant_of(key_id: str) -> str:
    """An API key's namespace for request ids at the verifier: `t` and 8 hex digits of the
    SHA-256 of its key id (the key id itself is already a hash of the key; "anonymous" without keys)."""
    return "t" + hashlib.sha256(key_id.encode()).hexdigest()[:8]


@dataclass
class Stats:
    """Accumulates specdec.v1.SpeculationStats over a generation's verdicts."""

    gamma: int
    drafter: int  # pb.DraftMethod
    verdicts: int = 0
    speculative_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    completion_tokens: int = 0
    computed: int = 0
    blocks: int = 0
    block_tokens: int = 0
    fallback_reason: str = ""
    per_position: list[int] = field(default_factory=list)
    verify_ms: float = 0.0  # engine step time over target steps after prefill
    draft_ms: float = 0.0  # drafter compute time for the blocks received
    rejections: int = 0  # speculative steps that rejected one of their drafts
    draft_wait_ms: float = 0.0
    max_draft_wait_ms: float = 0.0
    drafter_prefill_ms: float = 0.0
    invalid_blocks: int = 0  # drafter replies dropped or trimmed as invalid (not relayed as sent)
    migrations: int = 0  # times the generation moved to another verifier (or the same one, back)
    branches_drafted: int = 0  # pre-drafted branches relayed
    branches_used: int = 0  # steps whose drafts came from a branch (a branch hit)
    branch_misses: int = 0  # steps after a broken chain that found no branch
    held_steps: int = 0  # verdicts with hold_drafts: adaptive gamma held the drafter

    @property
    def branch_hit_rate(self) -> float:
        """branches_used / the steps after a broken chain (see SpeculationStats.branch_hit_rate)."""
        breaks = self.branches_used + self.branch_misses
        return self.branches_used / breaks if breaks else 0.0

    def add_verdict(self, v: "pb.VerifyResponse") -> None:
        self.verdicts += 1
        if self.verdicts > 1:  # the first verdict is the prefill step
            self.verify_ms += v.step_ms
            self.draft_wait_ms += v.draft_wait_ms
            self.max_draft_wait_ms = max(self.max_draft_wait_ms, v.draft_wait_ms)
        self.completion_tokens += len(v.token_ids)
        self.computed += v.computed_tokens
        self.branch_misses += v.branch_miss
        self.held_steps += v.hold_drafts
        if v.drafted:
            self.speculative_steps += 1
            self.drafted += v.drafted
            self.accepted += v.accepted
            self.rejections += v.accepted < v.drafted
            self.branches_used += v.branch
            if len(self.per_position) < v.drafted:
                self.per_position.extend([0] * (v.drafted - len(self.per_position)))
            for i in range(v.accepted):
                self.per_position[i] += 1

    def to_pb(self) -> "pb.SpeculationStats":
        steps = max(0, self.verdicts - 1)  # the first verdict is the prefill step
        return pb.SpeculationStats(
            gamma=self.gamma,
            drafter=self.drafter,
            target_steps=steps,
            speculative_steps=self.speculative_steps,
            drafted_tokens=self.drafted,
            accepted_tokens=self.accepted,
            accepted_per_position=self.per_position,
            acceptance_rate=self.accepted / self.drafted if self.drafted else 0.0,
            mean_accepted_length=1 + self.accepted / self.speculative_steps if self.speculative_steps else 1.0,
            tokens_per_step=(self.completion_tokens - 1) / steps if steps else 0.0,
            blocks_received=self.blocks,
            tokens_received=self.block_tokens,
            drafter_fallback=bool(self.fallback_reason),
            fallback_reason=self.fallback_reason,
            target_computed_tokens=self.computed,
            verify_ms=self.verify_ms,
            draft_wait_ms=self.draft_wait_ms,
            draft_ms=self.draft_ms,
            rejected_steps=self.rejections,
            max_draft_wait_ms=self.max_draft_wait_ms,
            drafter_prefill_ms=self.drafter_prefill_ms,
            migrations=self.migrations,
            branches_drafted=self.branches_drafted,
            branches_used=self.branches_used,
            branch_hit_rate=self.branch_hit_rate,
            branch_misses=self.branch_misses,
            held_steps=self.held_steps,
        )


class Round:
    """Runs one generation between a VerifierService and a DrafterService stub.

    Iterate `verdicts()`: previews (v.preview, tokens certain to be in the next verdict,
    sent from inside the target step) and verdicts; `stats` (verdicts only) is complete
    when the iteration ends. All writes to the verifier go through one queue and task,
    all writes to the drafter through another, so neither stream has two writers.
    Each round feeds `metrics` (the gateway's, telemetry.GatewayMetrics) and `spikes`.
    `vocab_size`: the target's, for checking drafted ids (None: asked from the verifier once).
    `drafter_stub` None: no drafter serves (none resolved, or every one failed its health
    check): the generation runs as plain target decoding from its first step, and the stats say
    why. `on_drafter_unavailable()` is called when the drafter's call ends with UNAVAILABLE
    (its process went away), so the caller's pool skips it until it serves again.
    `verdict_timeout_s` (> 0): once the verifier has sent its first verdict (queueing and prefill
    never count), a silence this long while it still owes verdicts ends the round with
    UNAVAILABLE, which the gateway treats as a verifier gone (migration).
    `max_idle_commits` (> 0): idle windows in a row (see the module docstring) before the
    drafter is treated as failed; 0: never.
    """

    def __init__(
        self,
        plan: Plan,
        verifier_stub: object,
        drafter_stub: object,
        drafter_timeout_s: float,
        spikes: telemetry.SpikeDetector,
        metrics: telemetry.GatewayMetrics,
        model: str = "",
        parent: Any = None,
        vocab_size: int | None = None,
        stats: Stats | None = None,
        on_drafter_unavailable: Callable[[], None] | None = None,
        verdict_timeout_s: float = 0.0,
        max_idle_commits: int = 0,
    ) -> None:
        self.plan = plan
        self.max_idle_commits = max_idle_commits
        self.verdict_timeout_s = verdict_timeout_s
        self.on_drafter_unavailable = on_drafter_unavailable
        self.verifier_stub = verifier_stub
        self.drafter_stub = drafter_stub
        self.drafter_timeout_s = drafter_timeout_s
        self.spikes = spikes
        self.metrics = metrics
        use_drafter = plan.gamma > 0 and plan.drafter != pb.DRAFT_METHOD_NONE
        # `stats`: a migrated generation's, which this round goes on counting into
        self.stats = stats or Stats(plan.gamma if use_drafter else 0, plan.drafter if use_drafter else pb.DRAFT_METHOD_NONE)
        self.tracer = telemetry.tracer("gateway")
        sp = plan.sampling
        self.span = self.tracer.start_span("specdec.generate", context=parent, attributes={
            "gen_ai.operation.name": "text_completion",
            "gen_ai.request.model": model,
            "gen_ai.request.max_tokens": sp.max_tokens,
            "gen_ai.request.temperature": sp.temperature,
            "gen_ai.request.top_p": sp.top_p if sp.HasField("top_p") else 1.0,
            "gen_ai.usage.input_tokens": len(plan.prompt_token_ids),
            "specdec.request_id": plan.request_id,
            "specdec.gamma": self.stats.gamma,
            "specdec.drafter": draft_method_name(self.stats.drafter),
        })
        self._ctx = trace.set_span_in_context(self.span)
        self._last_ns = time.time_ns()
        self._draft_ms = 0.0  # drafter compute since the last verdict
        self._finished = False
        self._to_verifier: asyncio.Queue["pb.VerifyRequest | None"] = asyncio.Queue()
        self._to_drafter: asyncio.Queue["pb.DraftRequest | None"] = asyncio.Queue()
        self._committed = len(plan.prompt_token_ids)  # the drafter has been told up to here
        self._dcall: grpc.aio.StreamStreamCall | None = None
        # monotonic time of the oldest commit the drafter has not answered yet (None: it owes nothing)
        self._owed_since: float | None = None
        self._owed_at = 0  # ... and the position that commit started at
        self._owing = asyncio.Event()  # set when the drafter starts to owe an answer
        self.vocab_size = vocab_size
        self._blocks_since_commit = 0  # blocks the drafter sent since the latest commit
        self._ready_seen = False
        self._hold = False  # the drafter is told to hold (the verifier's hold_drafts)
        self._spoken = False  # the drafter sent `ready` or a block (its prefill is behind it)
        self._window = False  # the latest commit opened a window (see the module docstring)
        self._answered = False  # ... and a usable block (or the n-gram's "nothing") came in it
        self._relayed = False  # ... and some block came in it
        self.idle_commits = 0  # idle windows in a row

    def _fallback(self, reason: str) -> None:
        """The drafter is gone: tell the verifier to stop waiting for it and go on plainly."""
        if self.stats.fallback_reason or self._finished:
            return
        self.stats.fallback_reason = reason
        log.warning("request %s: drafter fallback: %s", self.plan.request_id, reason)
        self._to_verifier.put_nowait(pb.VerifyRequest(end=pb.DraftEnd(reason=reason)))
        self._to_drafter.put_nowait(None)
        if self._dcall is not None:
            self._dcall.cancel()

    async def _write_all(self, call: grpc.aio.StreamStreamCall, q: asyncio.Queue) -> None:
        while (msg := await q.get()) is not None:
            await call.write(msg)

    async def _verifier_writer(self, vcall: grpc.aio.StreamStreamCall) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError, RuntimeError):
            await self._write_all(vcall, self._to_verifier)  # errors surface on the read side

    async def _drafter_writer(self, dcall: grpc.aio.StreamStreamCall) -> None:
        try:
            await self._write_all(dcall, self._to_drafter)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError, RuntimeError) as err:
            self._fallback(f"drafter write failed: {err}")

    def _violation(self, what: str) -> None:
        """The drafter sent something invalid (dropped or trimmed): count it; at
        MAX_DRAFTER_VIOLATIONS the drafter is treated as failed."""
        self.stats.invalid_blocks += 1
        n = self.stats.invalid_blocks
        if n == 1:
            log.warning("request %s: invalid reply from the drafter: %s", self.plan.request_id, what)
        if n >= MAX_DRAFTER_VIOLATIONS:
            self._fallback(f"drafter sent {n} invalid replies; the last: {what}")

    def _checked_block(self, block: "pb.DraftBlock") -> "pb.DraftBlock | None":
        """The block to relay (trimmed when too long), or None when it must be dropped."""
        self._blocks_since_commit += 1
        cap = max_blocks_per_commit(self.stats.gamma)
        if self._blocks_since_commit > cap:
            self._violation(f"more than {cap} blocks since the latest commit")
            return None
        p = self.plan
        prompt_len = len(p.prompt_token_ids)
        tokens, what = check_draft_block(block, self.stats.gamma, self.vocab_size or 0, prompt_len, self._committed,
                                         prompt_len + p.sampling.max_tokens)
        if what:
            self._violation(what)
        if tokens is None:
            return None
        draft_ms = reported_ms(block.draft_ms)
        if len(tokens) == len(block.token_ids) and draft_ms == block.draft_ms:
            return block
        return pb.DraftBlock(start_position=block.start_position, token_ids=tokens, sequence=block.sequence,
                             draft_ms=draft_ms, final=block.final, committed_length=block.committed_length,
                             branch=block.branch)

    def _checked_ready(self, ready: "pb.DraftReady") -> "pb.DraftReady | None":
        if self._ready_seen:
            self._violation("a second `ready`")
            return None
        self._ready_seen = True
        return pb.DraftReady(prefilled_tokens=ready.prefilled_tokens, prefill_ms=reported_ms(ready.prefill_ms),
                             draft_ms_per_token=reported_ms(ready.draft_ms_per_token))

    async def _relay_blocks(self, dcall: grpc.aio.StreamStreamCall) -> None:
        """drafter -> verifier: check `ready` and each block as they arrive, relay the valid ones."""
        if self.vocab_size is None:
            self.vocab_size = await verifier_vocab_size(self.verifier_stub)
        try:
            while not self.stats.fallback_reason:
                resp = await dcall.read()
                if resp is grpc.aio.EOF:
                    self._fallback("drafter ended its stream")
                    return
                self._owed_since = None  # any message answers what the drafter owed
                if resp.HasField("ready") == resp.HasField("block"):
                    self._violation("a reply with " + ("both a block and `ready`" if resp.HasField("ready") else
                                                       "neither a block nor `ready`"))
                    continue
                self._spoken = True
                if resp.HasField("ready"):
                    ready = self._checked_ready(resp.ready)
                    if ready is not None:
                        self.stats.drafter_prefill_ms = ready.prefill_ms
                        self._to_verifier.put_nowait(pb.VerifyRequest(ready=ready))
                    continue
                block = self._checked_block(resp.block)
                if block is None or self.stats.fallback_reason:
                    continue
                if block.token_ids or (block.final and self.plan.drafter == pb.DRAFT_METHOD_NGRAM):
                    # drafts (even ones the target has passed: an honest drafter slower than its target
                    # is adaptive gamma's business, not a hostile one) or the n-gram's "nothing here"
                    self._answered = True
                self._relayed = True
                self.stats.blocks += 1
                self.stats.block_tokens += len(block.token_ids)
                self.stats.branches_drafted += block.branch
                self._draft_ms += block.draft_ms
                self.stats.draft_ms += block.draft_ms
                self._to_verifier.put_nowait(pb.VerifyRequest(block=block))
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.UNAVAILABLE and self.on_drafter_unavailable is not None:
                self.on_drafter_unavailable()
            self._fallback(f"drafter {err.code().name}: {err.details()}")

    async def _watch_drafter(self) -> None:
        """Fall back when the drafter stays silent for drafter_timeout_s while it owes an answer."""
        while not self.stats.fallback_reason and not self._finished:
            since = self._owed_since
            if since is None:
                self._owing.clear()
                if self._owed_since is None:
                    await self._owing.wait()
                continue
            left = since + self.drafter_timeout_s - time.monotonic()
            if left > 0:
                await asyncio.sleep(left)
                continue
            self._fallback(f"drafter sent nothing for {self.drafter_timeout_s:g} s after the target's tokens at "
                           f"position {self._owed_at}")
            return

    def _observe(self, v: "pb.VerifyResponse") -> None:
        """One round: a span from the previous verdict to this one, metrics, spike check."""
        now = time.time_ns()
        round_ms = (now - self._last_ns) / 1e6
        stages = {
            "verify": v.step_ms,
            "draft": self._draft_ms,
            "draft_wait": v.draft_wait_ms,
            "network": max(0.0, round_ms - v.step_ms - v.draft_wait_ms),
        }
        span = self.tracer.start_span("specdec.round", context=self._ctx, start_time=self._last_ns, attributes={
            "specdec.round": self.stats.verdicts,
            "specdec.gamma": self.stats.gamma,
            "specdec.drafted": v.drafted,
            "specdec.accepted": v.accepted,
            "specdec.tokens": len(v.token_ids),
            "specdec.batch_size": v.batch_size,
            "specdec.computed_tokens": v.computed_tokens,
            "specdec.queue_ms": round(v.queue_ms, 3),
            "specdec.branch": v.branch,
            "specdec.hold_drafts": v.hold_drafts,
            **{f"specdec.stage.{k}_ms": round(ms, 3) for k, ms in stages.items()},
        })
        if self.stats.verdicts == 1:
            self.span.set_attribute("specdec.queue_ms", round(v.queue_ms, 3))
        if self.stats.verdicts > 1:  # the first round is queueing + prefill: time to first token
            spiked = self.spikes.check(stages)
            for stage, limit in spiked.items():
                span.add_event("latency_spike", {"specdec.spike.stage": stage, "specdec.spike.ms": stages[stage],
                                                 "specdec.spike.threshold_ms": limit})
                self.metrics.spikes.labels(stage).inc()
            if spiked:
                span.set_attribute("specdec.spike.stage", ",".join(spiked))
                log.warning("latency spike in %s: request %s round %d trace %s stages %s",
                            ",".join(spiked), self.plan.request_id, self.stats.verdicts,
                            telemetry.trace_id_hex(span), {k: round(ms, 1) for k, ms in stages.items()})
        span.end(end_time=now)
        self._last_ns, self._draft_ms = now, 0.0
        self.metrics.rounds.inc()
        self.metrics.generation_tokens.inc(len(v.token_ids))
        for stage, ms in stages.items():
            self.metrics.round_stage.labels(stage).observe(ms / 1e3)
        if v.drafted:
            self.metrics.num_drafts.inc()
            self.metrics.num_draft_tokens.inc(v.drafted)
            self.metrics.num_accepted_tokens.inc(v.accepted)
            self.metrics.accepted_length.observe(v.accepted + 1)
            for i in range(v.accepted):
                self.metrics.accepted_per_pos.labels(str(i)).inc()

    def _finish_span(self) -> None:
        s = self.stats
        self.span.set_attributes({
            "gen_ai.usage.output_tokens": s.completion_tokens,
            "specdec.target_steps": max(0, s.verdicts - 1),
            "specdec.drafted_tokens": s.drafted,
            "specdec.accepted_tokens": s.accepted,
            "specdec.acceptance_rate": s.accepted / s.drafted if s.drafted else 0.0,
            "specdec.drafter_fallback": bool(s.fallback_reason),
            "specdec.invalid_blocks": s.invalid_blocks,
            "specdec.branches_drafted": s.branches_drafted,
            "specdec.branches_used": s.branches_used,
            "specdec.branch_hit_rate": s.branch_hit_rate,
        })
        if s.fallback_reason:
            self.span.set_attribute("specdec.fallback_reason", s.fallback_reason)
            self.metrics.fallbacks.inc()
        self.span.end()

    def _commit(self, v: "pb.VerifyResponse") -> None:
        """Tell the drafter what the target produced (only what it was not told yet), and
        whether the verifier holds its drafts (a verdict's hold_drafts; previews keep the hold)."""
        if self._dcall is None or self.stats.fallback_reason:
            return
        end = v.start_position + len(v.token_ids)
        hold = self._hold if v.preview else v.hold_drafts
        if end <= self._committed:
            if hold != self._hold:  # nothing new but the hold: an empty commit carries it
                self._hold = hold
                if hold:
                    self._owed_since = None  # a held drafter owes no answer
                self._to_drafter.put_nowait(pb.DraftRequest(commit=pb.DraftCommit(start_position=self._committed,
                                                                                   hold=hold)))
            return
        skip = max(0, self._committed - v.start_position)
        if self._idle_window_ended():
            return
        self._hold = hold
        if hold:
            self._owed_since = None
        elif self._owed_since is None:
            self._owed_since, self._owed_at = time.monotonic(), v.start_position + skip
            self._owing.set()
        self._blocks_since_commit = 0
        self._to_drafter.put_nowait(
            pb.DraftRequest(
                commit=pb.DraftCommit(
                    start_position=v.start_position + skip, token_ids=v.token_ids[skip:], accepted=v.accepted,
                    hold=hold,
                )
            )
        )
        self._committed = end
        p = self.plan
        self._window = self._spoken and not hold and end < len(p.prompt_token_ids) + p.sampling.max_tokens - 1
        self._answered = self._relayed = False

    def _idle_window_ended(self) -> bool:
        """A commit ends the current window (see the module docstring): count it when idle; at
        max_idle_commits in a row, fall back (returns True: nothing more goes to the drafter)."""
        if not self._window or not self._relayed:  # no block: not idle, not answered either
            return False
        self.idle_commits = 0 if self._answered else self.idle_commits + 1
        if self.max_idle_commits <= 0 or self.idle_commits < self.max_idle_commits:
            return False
        self._fallback(f"drafter answered {self.idle_commits} commits in a row with no usable draft "
                       f"(max_idle_commits {self.max_idle_commits})")
        return True

    async def _next_verdict(self, vcall: grpc.aio.StreamStreamCall) -> Any:
        """The verifier's next message; after its first verdict, within verdict_timeout_s."""
        if self.verdict_timeout_s <= 0 or self.stats.verdicts == 0:
            return await vcall.read()
        try:
            return await asyncio.wait_for(vcall.read(), self.verdict_timeout_s)
        except TimeoutError:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                details=f"the verifier sent nothing for verdict_timeout_s ({self.verdict_timeout_s:g} s) while it "
                        "owed verdicts") from None

    async def verdicts(self) -> AsyncIterator["pb.VerifyResponse"]:
        p = self.plan
        carrier = telemetry.inject_context_of(self._ctx)
        metadata = tuple(carrier.items())
        vcall = self.verifier_stub.Verify(metadata=metadata)
        tasks = [asyncio.create_task(self._verifier_writer(vcall))]
        self._to_verifier.put_nowait(
            pb.VerifyRequest(
                open=pb.VerifyOpen(
                    request_id=p.backend_id,
                    prompt_token_ids=p.prompt_token_ids,
                    sampling=p.sampling,
                    gamma=self.stats.gamma,
                    trace_context=carrier,
                )
            )
        )
        try:
            if self.stats.gamma and self.drafter_stub is None:
                self._fallback("no drafter replica serves")
            elif self.stats.gamma:
                self._dcall = self.drafter_stub.Draft(metadata=metadata)
                self._to_drafter.put_nowait(
                    pb.DraftRequest(
                        open=pb.DraftOpen(
                            request_id=p.backend_id,
                            prompt_token_ids=p.prompt_token_ids,
                            sampling=p.sampling,
                            gamma=p.gamma,
                            method=p.drafter,
                            trace_context=carrier,
                        )
                    )
                )
                tasks.append(asyncio.create_task(self._drafter_writer(self._dcall)))
                tasks.append(asyncio.create_task(self._relay_blocks(self._dcall)))
                tasks.append(asyncio.create_task(self._watch_drafter()))
            while True:
                v = await self._next_verdict(vcall)
                if v is grpc.aio.EOF:  # it went away mid-stream (a shutdown): as UNAVAILABLE, so it migrates
                    raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                               details="the verifier ended the stream without a finish reason")
                self._commit(v)
                if v.preview:
                    yield v  # the client gets the tokens now, not after the next block's wait
                    continue
                self.stats.add_verdict(v)
                self._observe(v)
                self._finished = v.finish_reason != pb.FINISH_REASON_UNSPECIFIED
                if self._finished:  # stop writing, then half-close: the verifier ends the call after that
                    self._to_verifier.put_nowait(None)
                    await asyncio.wait({tasks[0]}, timeout=5.0)
                    with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError, RuntimeError):
                        await vcall.done_writing()
                yield v
                if self._finished:
                    return
        finally:
            self._finished = True
            self._finish_span()
            self._to_verifier.put_nowait(None)
            self._to_drafter.put_nowait(None)
            for t in tasks:
                t.cancel()
            for t in tasks:
                try:
                    await t
                except asyncio.CancelledError:
                    pass  # cancelled just above: the round is over
                except Exception:  # a bug in a helper (they handle the errors they expect): say so
                    log.exception("request %s: round helper %s failed", p.request_id, t.get_coro().__qualname__)
            if self._dcall is not None:
                self._dcall.cancel()
            vcall.cancel()
