"""The drafter relay: one generation's drafter stream, checked, relayed to the verifier.

A drafter is untrusted input: each of its replies is checked before it is relayed
(specdec.validation.check_draft_block: ids in the vocabulary, at most gamma tokens, positions
after the prompt and within reach of the committed context, at most max_blocks_per_commit
blocks between two commits, one `ready`, and one more after each preemption). A bad block is
dropped (a long one trimmed to gamma) and counted; at MAX_DRAFTER_VIOLATIONS the drafter is
treated as failed (fallback, with the violation as the reason). So a misbehaving drafter can
neither fail a request nor flood the verifier: the verifier only ever sees valid blocks, at a
bounded rate.

The drafter's deadline measures the drafter alone: it owes an answer from each commit on
(the first one carries the target's first token), and falls back when it stays silent
for `drafter_timeout_s` while it owes one. The target's queueing and prefill never count:
before the first commit the drafter owes nothing (it prefills its own copy meanwhile).

A drafter's prefill can outlast the target's (long prompts queued on one CPU drafter, a CPU
drafter beside a GPU target): four prompts of 3,000 tokens fell back at 10 s in `specdec bench
--workloads serve-long` when silence was all a relay could go by. So the relay asks for
progress reports (DraftOpen.report_progress), and until the drafter has spoken (`ready` or a
block) a report answers what it owes, if it shows progress: its `queued_tokens` (prompt tokens
left before the drafter is ready) below the previous report's; one that does not is a
violation. A report that says `waiting_for_memory` (the drafter's prefill queue waits for a
session to end and leave room for keys/values, drafter.memory) answers without progress, and
the next report is not compared with it. A hung drafter reports nothing and still falls back
at `drafter_timeout_s`; a drafter that keeps reporting, waiting for memory or not, falls back
at `drafter_prefill_timeout_s` after the first commit if it is still not ready then.
Meanwhile the target does not wait for it (verifier.proposer).

Preemption: when a drafter's memory for keys/values runs short it may preempt the session
(DraftOpen.accepts_preemption, which the relay sets; drafter.memory): a report that says
`preempted`, after `ready`. The relay tells the verifier (VerifyRequest.pause: its steps stop
waiting for drafts, and the target decodes plainly), and the drafter is back where it was before
its `ready`: its progress reports answer what it owes, a new `ready` (one per preemption) lets
the verifier wait for its drafts again, and the prefill deadline counts again from the
preemption. At most one preemption between two commits; another is a violation.

Hold: while the verifier's verdicts say `hold_drafts` (adaptive gamma verifies none of this
request's drafts for now), commits tell the drafter to hold, and a held drafter owes nothing.

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

Fallback: when the drafter fails, stalls, misbehaves or is killed, the verifier is told
(`end`: no more blocks, target steps stop waiting) and the generation goes on as plain target
decoding with the same output; the stats say why (SpecStats.fallback_reason).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

import grpc

from gateway.plan import Plan
from gateway.transport import Outbox
from specdec.stats import SpecStats
from specdec.steps import Step
from specdec.validation import (
    MAX_DRAFTER_VIOLATIONS,
    check_draft_block,
    max_blocks_per_commit,
    reported_ms,
)
from specdec.wire import pb, rpc

if TYPE_CHECKING:
    from gateway.transport import DraftCall
    from specdec.v1.common_pb2 import DraftBlock, DraftReady
    from specdec.v1.drafter_pb2 import DraftProgress

log = logging.getLogger("specdec.gateway")

# How long a relay waits for the verifier's vocabulary size (asked once per verifier stub).
VOCAB_TIMEOUT_S = 10.0
_VOCAB_SIZES: "weakref.WeakKeyDictionary[object, int]" = weakref.WeakKeyDictionary()


async def verifier_vocab_size(stub: rpc.VerifierServiceAsyncStub) -> int:
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


# How long a failed write waits for the drafter call's status (it has normally ended already).
STATUS_WAIT_S = 1.0


def status_reason(code: grpc.StatusCode, details: str | None) -> str:
    """The fallback reason for a drafter call that ended with `code`: "drafter CODE: details"."""
    return f"drafter {code.name}: {details}"


async def _ended_status(call: Any) -> str | None:
    """`call`'s final status as a fallback reason ("drafter CODE: details"), when it ended with
    an error within STATUS_WAIT_S; else None."""
    try:
        code = await asyncio.wait_for(call.code(), STATUS_WAIT_S)
        details = await call.details()
    except Exception:  # noqa: BLE001 - no status to tell: the write's own error is the reason
        return None
    if not isinstance(code, grpc.StatusCode) or code in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
        return None
    return status_reason(code, details)


class DrafterRelay:
    """One generation's drafter side: opens the Draft call, checks each reply and relays the
    valid ones into `to_verifier`, commits the target's tokens to the drafter (with the hold),
    watches its deadline and idle windows, and falls back (see the module docstring).

    `gamma`: the generation's (0: no drafter is used). `stub` None: no drafter serves; the
    generation falls back from its first step. `vocab_size`: the target's (None: asked from
    `verifier_stub` once). `on_unavailable()` is called when the drafter's call ends with
    UNAVAILABLE (its process went away). Counts go to `stats`."""

    def __init__(
        self,
        plan: Plan,
        gamma: int,
        stats: SpecStats,
        to_verifier: Outbox[pb.VerifyRequest],
        stub: Any,
        verifier_stub: Any,
        timeout_s: float,
        vocab_size: int | None = None,
        max_idle_commits: int = 0,
        on_unavailable: Callable[[], None] | None = None,
        prefill_timeout_s: float | None = None,
    ) -> None:
        self.plan = plan
        self.gamma = gamma
        self.stats = stats
        self.stub = stub
        self.verifier_stub = verifier_stub
        self.timeout_s = timeout_s
        # how long after the first commit a drafter may still be prefilling; None: timeout_s
        self.prefill_timeout_s = timeout_s if prefill_timeout_s is None else prefill_timeout_s
        self.vocab_size = vocab_size
        self.max_idle_commits = max_idle_commits
        self.on_unavailable = on_unavailable
        self._to_verifier = to_verifier
        self._to_drafter: Outbox[pb.DraftRequest] = Outbox()
        self._call: DraftCall | None = None
        self._finished = False  # the generation ended: no more fallbacks, the watch stops
        self._committed = len(plan.prompt_token_ids)  # the drafter has been told up to here
        # monotonic time of the oldest commit the drafter has not answered yet (None: it owes nothing)
        self._owed_since: float | None = None
        self._owed_at = 0  # ... and the position that commit started at
        # monotonic time the prefill deadline counts from: the first commit, then each preemption
        self._prefill_from: float | None = None
        self._preempted = False  # the drafter preempted the session since its latest `ready`
        self._preempted_since_commit = False  # ... since the latest commit (at most one)
        self._queued: int | None = None  # the latest progress report's queued_tokens
        self._memory_wait = False  # ... which said waiting_for_memory
        self._owing = asyncio.Event()  # set when the drafter starts to owe an answer
        self._blocks_since_commit = 0  # blocks the drafter sent since the latest commit
        self._ready_seen = False
        self._hold = False  # the drafter is told to hold (the verifier's hold_drafts)
        self._spoken = False  # the drafter sent `ready` or a block (its prefill is behind it)
        self._window = False  # the latest commit opened a window (see the module docstring)
        self._answered = False  # ... and a usable block (or the n-gram's "nothing") came in it
        self._relayed = False  # ... and some block came in it
        self.idle_commits = 0  # idle windows in a row

    # ---- life cycle -----------------------------------------------------------------------------
    def start(
        self, metadata: tuple[tuple[str, str], ...], trace_context: Mapping[str, str]
    ) -> list[asyncio.Task[None]]:
        """Open the drafter's call (after the verifier's `open` was queued) and start its tasks,
        which the caller cancels and awaits when the generation ends; none without a drafter."""
        if not self.gamma:
            return []
        if self.stub is None:
            self.fall_back("no drafter replica serves")
            return []
        p = self.plan
        self._call = call = self.stub.Draft(metadata=metadata)
        self._to_drafter.put(
            pb.DraftRequest(
                open=pb.DraftOpen(
                    request_id=p.backend_id,
                    prompt_token_ids=p.prompt_token_ids,
                    sampling=p.sampling,
                    gamma=p.gamma,
                    method=p.drafter,
                    trace_context=trace_context,
                    report_progress=True,
                    accepts_preemption=True,  # memory short: preempted and prefilled again, not ended
                    cache_scope=p.tenant,  # no tenant reuses another's prompts' keys (DraftOpen.cache_scope)
                )
            )
        )
        return [
            asyncio.create_task(self._write(call), name="drafter writer"),
            asyncio.create_task(self._relay(call), name="drafter relay"),
            asyncio.create_task(self._watch(), name="drafter deadline watch"),
        ]

    def finish(self) -> None:
        """The generation ended: nothing more goes to the drafter, and it can no longer fall back."""
        self._finished = True
        self._to_drafter.close()

    def cancel(self) -> None:
        """Cancel the drafter's call (after `finish`)."""
        if self._call is not None:
            self._call.cancel()

    def fall_back(self, reason: str) -> None:
        """The drafter is gone: tell the verifier to stop waiting for it and go on plainly."""
        if self._finished or not self.stats.fell_back(reason):
            return
        log.warning("request %s: drafter fallback: %s", self.plan.request_id, reason)
        self._to_verifier.put(pb.VerifyRequest(end=pb.DraftEnd(reason=reason)))
        self._to_drafter.close()
        if self._call is not None:
            self._call.cancel()

    # ---- drafter -> verifier --------------------------------------------------------------------
    async def _write(self, call: DraftCall) -> None:
        try:
            await self._to_drafter.write_all(call)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError, RuntimeError) as err:
            # a write fails once the drafter has ended the call: its status says why (say
            # RESOURCE_EXHAUSTED naming kv_cache_mib), as the reader would report it, not the write
            self.fall_back(await _ended_status(call) or f"drafter write failed: {err}")

    def _violation(self, what: str) -> None:
        """The drafter sent something invalid (dropped or trimmed): count it; at
        MAX_DRAFTER_VIOLATIONS the drafter is treated as failed."""
        n = self.stats.invalid_reply()
        if n == 1:
            log.warning("request %s: invalid reply from the drafter: %s", self.plan.request_id, what)
        if n >= MAX_DRAFTER_VIOLATIONS:
            self.fall_back(f"drafter sent {n} invalid replies; the last: {what}")

    def _checked_block(self, block: DraftBlock) -> DraftBlock | None:
        """The block to relay (trimmed when too long), or None when it must be dropped."""
        self._blocks_since_commit += 1
        cap = max_blocks_per_commit(self.gamma)
        if self._blocks_since_commit > cap:
            self._violation(f"more than {cap} blocks since the latest commit")
            return None
        p = self.plan
        prompt_len = len(p.prompt_token_ids)
        tokens, what = check_draft_block(
            block, self.gamma, self.vocab_size or 0, prompt_len, self._committed, prompt_len + p.sampling.max_tokens
        )
        if what:
            self._violation(what)
        if tokens is None:
            return None
        draft_ms = reported_ms(block.draft_ms)
        if len(tokens) == len(block.token_ids) and draft_ms == block.draft_ms:
            return block
        return pb.DraftBlock(
            start_position=block.start_position,
            token_ids=tokens,
            sequence=block.sequence,
            draft_ms=draft_ms,
            final=block.final,
            committed_length=block.committed_length,
            branch=block.branch,
        )

    def _checked_ready(self, ready: DraftReady) -> DraftReady | None:
        if self._ready_seen:
            self._violation("a second `ready`")
            return None
        self._ready_seen = True
        return pb.DraftReady(
            prefilled_tokens=ready.prefilled_tokens,
            prefill_ms=reported_ms(ready.prefill_ms),
            draft_ms_per_token=reported_ms(ready.draft_ms_per_token),
            reused_tokens=min(ready.reused_tokens, ready.prefilled_tokens),  # a part of them
        )

    def _progress_answers(self, progress: DraftProgress) -> bool:
        """Whether a progress report is valid (before `ready`; fewer queued tokens than the
        previous report, unless this one or that one says waiting_for_memory): then it answers
        what the drafter owes; else it is a violation. A drafter waiting for memory is bounded
        by the prefill deadline, as a slow prefill is."""
        if self._spoken:
            self._violation("a progress report after `ready` or a block")
            return False
        compare = self._queued is not None and not self._memory_wait and not progress.waiting_for_memory
        if compare and progress.queued_tokens >= (self._queued or 0):
            self._violation(
                f"a progress report that shows none (queued_tokens {progress.queued_tokens}, previously {self._queued})"
            )
            return False
        self._queued, self._memory_wait = progress.queued_tokens, progress.waiting_for_memory
        return True

    def _on_preempted(self, progress: DraftProgress) -> None:
        """The drafter preempted the session (see the module docstring): valid after `ready`,
        at most once between two commits."""
        if not self._spoken or self._preempted_since_commit:
            what = "a preemption before `ready`" if not self._spoken else "a second preemption before a commit"
            self._violation(what)
            return
        n = self.stats.drafter_preempted()
        log.info(
            "request %s: the drafter preempted its session (%d so far); plain decoding until it is ready again",
            self.plan.request_id,
            n,
        )
        self._spoken = self._ready_seen = self._window = False
        self._preempted = self._preempted_since_commit = True
        self._queued, self._memory_wait = progress.queued_tokens, True  # the next report is not compared
        self._owed_since = None  # answered: it owes progress reports from the next commit on
        self._prefill_from = time.monotonic()
        reason = f"drafter preempted the session at position {self._committed} (its kv_cache_mib ran short)"
        self._to_verifier.put(pb.VerifyRequest(pause=pb.DraftPause(reason=reason)))

    async def _relay(self, call: DraftCall) -> None:
        """drafter -> verifier: check `ready` and each block as they arrive, relay the valid ones."""
        if self.vocab_size is None:
            self.vocab_size = await verifier_vocab_size(self.verifier_stub)
        try:
            while not self.stats.fallback_reason:
                read = await call.read()
                if read is grpc.aio.EOF:
                    self.fall_back("drafter ended its stream")
                    return
                resp = cast(pb.DraftResponse, read)  # grpc-stubs type read() as `object | DraftResponse` (EOF's type)
                kinds = [k for k in ("block", "ready", "progress") if resp.HasField(k)]
                if len(kinds) != 1:
                    self._owed_since = None  # a reply, if a bad one: the drafter is not hung
                    what = " and ".join(kinds) if kinds else "no block, `ready` or progress"
                    self._violation(f"a reply with {what}")
                    continue
                if kinds == ["progress"] and resp.progress.preempted:
                    self._on_preempted(resp.progress)
                    continue
                if kinds == ["progress"]:
                    if self._progress_answers(resp.progress):
                        self._owed_since = None  # it is prefilling: what it owed is answered
                    continue
                self._owed_since = None  # a block or `ready` answers what the drafter owed
                self._spoken = True
                if resp.HasField("ready"):
                    self._preempted = False
                    ready = self._checked_ready(resp.ready)
                    if ready is not None:
                        self.stats.observe_ready(ready)
                        self._to_verifier.put(pb.VerifyRequest(ready=ready))
                    continue
                block = self._checked_block(resp.block)
                if block is None or self.stats.fallback_reason:
                    continue
                if block.token_ids or (block.final and self.plan.drafter == pb.DRAFT_METHOD_NGRAM):
                    # drafts (even ones the target has passed: an honest drafter slower than its target
                    # is adaptive gamma's business, not a hostile one) or the n-gram's "nothing here"
                    self._answered = True
                self._relayed = True
                self.stats.observe_block(block)
                self._to_verifier.put(pb.VerifyRequest(block=block))
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.UNAVAILABLE and self.on_unavailable is not None:
                self.on_unavailable()
            self.fall_back(status_reason(err.code(), err.details()))

    async def _watch(self) -> None:
        """Fall back when the drafter stays silent for timeout_s while it owes an answer, or is
        still prefilling prefill_timeout_s after the first commit (see the module docstring)."""
        while not self.stats.fallback_reason and not self._finished:
            since = self._owed_since
            if since is None:
                self._owing.clear()
                if self._owed_since is None:
                    await self._owing.wait()
                continue
            now = time.monotonic()
            # a drafter still prefilling that reports its progress: also the prefill deadline
            prefill_end = None
            if not self._spoken and self._queued is not None and self._prefill_from is not None:
                prefill_end = self._prefill_from + self.prefill_timeout_s
            if prefill_end is not None and now >= prefill_end:
                after = "its preemption" if self._preempted else "the target's first token"
                self.fall_back(
                    f"drafter still prefilling {self.prefill_timeout_s:g} s after {after} "
                    f"(drafter_prefill_timeout_s; {self._queued} prompt tokens queued at its latest report"
                    f"{', waiting for memory' if self._memory_wait else ''})"
                )
                return
            left = since + self.timeout_s - now
            if prefill_end is not None:
                left = min(left, prefill_end - now)
            if left > 0:
                await asyncio.sleep(left)
                continue
            why = ""  # a drafter that has spoken owes blocks; one that has not, its `ready`
            if not self._spoken and self._queued is None:
                why = " (no `ready` and no progress report)"
            elif not self._spoken:
                why = " (no `ready`; its progress reports stopped)"
            self.fall_back(
                f"drafter sent nothing for {self.timeout_s:g} s after the target's tokens "
                f"at position {self._owed_at}{why}"
            )
            return

    # ---- verifier -> drafter --------------------------------------------------------------------
    def commit(self, step: Step) -> None:
        """Tell the drafter what the target produced (only what it was not told yet), and
        whether the verifier holds its drafts (a verdict's hold_drafts; previews keep the hold)."""
        if self._call is None or self.stats.fallback_reason:
            return
        verdict = step if isinstance(step, pb.Verdict) else None
        end = step.start_position + len(step.token_ids)
        hold = verdict.hold_drafts if verdict is not None else self._hold
        if end <= self._committed:
            if hold != self._hold:  # nothing new but the hold: an empty commit carries it
                self._hold = hold
                if hold:
                    self._owed_since = None  # a held drafter owes no answer
                self._to_drafter.put(pb.DraftRequest(commit=pb.DraftCommit(start_position=self._committed, hold=hold)))
            return
        skip = max(0, self._committed - step.start_position)
        if self._idle_window_ended():
            return
        self._hold = hold
        if hold:
            self._owed_since = None
        elif self._owed_since is None:
            self._owed_since, self._owed_at = time.monotonic(), step.start_position + skip
            if self._prefill_from is None:
                self._prefill_from = self._owed_since
            self._owing.set()
        self._blocks_since_commit = 0
        self._preempted_since_commit = False
        self._to_drafter.put(
            pb.DraftRequest(
                commit=pb.DraftCommit(
                    start_position=step.start_position + skip,
                    token_ids=step.token_ids[skip:],
                    accepted=verdict.accepted if verdict is not None else 0,
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
        self.fall_back(
            f"drafter answered {self.idle_commits} commits in a row with no usable draft "
            f"(max_idle_commits {self.max_idle_commits})"
        )
        return True
