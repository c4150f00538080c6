"""Draft sessions: one per generation, holding the drafter's view of the sequence.

Terms:
    context     committed tokens followed by the drafter's own not-yet-verified drafts
    committed   how many leading tokens of `context` the target has verified
    window      how far past `committed` the drafter may draft: gamma + lookahead.
                `lookahead` lets the drafter keep drafting while a block is verified.
    sent        tokens of `context` already sent to the caller in blocks
    prefill     feeding the prompt through the draft model, in chunks of `prefill_chunk`
                tokens, from `open` on: it runs while the target is queued and prefills,
                so the first draft needs one draft step after the first commit
    ready       the prefill is done; announced (a `Ready`) before any block, and again after
                each preemption
    preempted   (drafter.memory) the worker let go of the session's model state for an older
                session's keys/values (`preempt`): its context is cut to what is committed, and
                it waits for admission and prefills that context again, as a new prompt does
    progress    until then, on request (`report_progress`), a `Progress` now and then: the
                drafter's worker prefills prompts in arrival order and reports, to each
                session still waiting, the prompt tokens left before it is ready

    branch      a pre-drafted continuation for a verdict the target has not given yet: the
                rejection of the draft at position p with correction t (t among the draft
                model's likeliest alternatives at p). Keyed (p, t); its drafts are the
                draft model's continuation of context[:p] + [t]. Drafted only when nothing
                else is to do (the window is full): urgent drafts, then the full-accept
                lookahead, then branches, best first by their estimated probability
                P(p, t) = prod_{j<p} conf(j) * q_p(t), over the positions the step being
                verified decides (committed .. committed + gamma: its drafts, then the
                bonus token after them); the candidates not drafted yet are drafted
                together, as one batch of rows through the model, whatever their
                positions: each row reads the session's own cache up to its position and
                keeps its own keys/values after it (nothing is copied; see
                ModelDraftSession._begin_branch_rows and drafter.rows)
    ride        (DrafterConfig.ride_branches: rows a batch, 0: off) branch rows join the
                forward that drafts the session's own token ahead (the block being
                verified is drafted, so its candidates are known), ride_branches of the
                best candidates a batch: they read the weights that forward reads anyway,
                so a batch can finish before the verdict comes, where the window fills
                about when it does; a batch unfinished when the window is full goes on in
                idle time, and the next best candidates then ride in the next batch
    conf        the draft model's probability of its own token at a position (its
                estimate that the target agrees)
    reach       prod conf over the drafts past the committed context: the draft model's
                estimate that the target accepts them all
    confidence  drafts sized by confidence (`confidence`, a drafter.confidence.ConfidencePolicy;
                None: off): the session drafts past the committed context only while the
                reach is >= the policy's tau; the draft on which it fell below ends the
                block, sent at once as `final` (a confidence cut), and the session spends
                the rest of the round on branches. Commits teach the policy its tau.
    superseded  a commit that rejects a token of the context is waiting for the session's lock:
                the draft step under way drafts from a context the target has rejected. With
                the lean forward (specdec.models.lean, `stop`), that step's forward stops at
                its next layer and drafts nothing (`STOPPED`), so the commit, and the re-draft
                the verifier waits for after it, start a layer later instead of a forward
                later; a batched forward stops only when every session in it is superseded.
                Before its next step the worker waits for such a commit to apply
                (drafter.server.SUPERSEDED_WAIT_S). Read without the lock: a hint for when to
                stop and wait, never for what a commit does.

A commit (position s, verified tokens T) makes the committed context
context[:s] + T. Drafts that agree with T are kept; at the first disagreement the
drafts are dropped and the model's KV cache is rolled back to the agreeing prefix,
never recomputed from scratch. A commit that rejects at p with the correction t of a
branch drafted from the same committed context adopts the branch: its drafts become the
context's, and are sent again as a fresh block (the verifier has normally picked the
branch by then: the block changes nothing there), with no draft step spent on them. A
branch still under way for that verdict is adopted with the drafts it has so far (the
verifier never saw them: the block is their first sending), and drafting goes on after them.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Literal

import numpy as np
import torch

from drafter.confidence import ConfidencePolicy
from drafter.prefix_cache import LayerKV, Prefix, common_prefix
from specdec.acceptance import sparse_q, target_distribution

if TYPE_CHECKING:  # drafter.rows and transformers load with a model session only
    from transformers.cache_utils import Cache

    from drafter.rows import Row


# `DraftSession.step_begin_locked`'s answer when the step drafts a token.
class _Step(enum.Enum):
    DRAFT_NEEDED = 0
    STOPPED = 1


DRAFT_NEEDED: Final = _Step.DRAFT_NEEDED  # step_begin_locked: the step goes on to draft a token
STOPPED: Final = _Step.STOPPED  # _next_token: its forward stopped (the session is `superseded`)


@dataclass
class Draft:
    """One drafted token: its id, q(token), and the sparse q it was sampled from (or None: one-hot)."""

    token_id: int
    prob: float
    support: tuple[list[int], list[float]] | None
    conf: float = 1.0  # the draft model's probability of token_id (see the module's terms)
    alts: tuple[tuple[int, float], ...] = ()  # the next likeliest tokens and their probabilities, best first


@dataclass
class Ready:
    """The session's prompt is in the draft model's cache: it can draft from the first commit on."""

    prefilled_tokens: int
    prefill_ms: float
    reused_tokens: int = 0  # of them, copied from the drafter's prefix cache (drafter.prefix_cache), not computed


@dataclass
class Progress:
    """The session is still prefilling, and closer to ready than at its previous report; or its
    prefill waits for memory (drafter.memory: the queue does not move until a session ends)."""

    prefilled_tokens: int  # this session's prompt tokens in the draft model's cache
    queued_tokens: int  # prompt tokens to prefill before it is ready: its rest and the sessions' ahead of it
    waiting_for_memory: bool = False
    preempted: bool = False  # the first report after the session was preempted (DraftProgress.preempted)


@dataclass
class BlockOut:
    """A block ready to send: drafts starting at `start_position`."""

    start_position: int
    drafts: list[Draft]
    draft_ms: float
    final: bool = False  # nothing more is drafted until the next commit
    committed_length: int = 0  # the committed context it was drafted from
    branch: bool = False  # a pre-drafted branch: drafts[0] is the correction it bets on
    confidence_cut: bool = False  # the block ends where the reach fell below tau (see the module's terms)
    tau: float = 0.0  # the session's tau when the block went out (0: drafts sized by confidence are off)


class DraftSession:
    """Shared bookkeeping of a draft session; subclasses implement `_next_token`."""

    def __init__(
        self, prompt: list[int], gamma: int, lookahead: int, flush_ms: float = 50.0, prefill_chunk: int = 128
    ) -> None:
        self.context: list[int] = list(prompt)
        self.prompt_len = len(prompt)
        self.committed = len(prompt)
        self.sent = len(prompt)
        self.gamma = gamma
        self.lookahead = lookahead
        self.flush_ms = flush_ms
        self.prefill_chunk = prefill_chunk
        self.lock = threading.Lock()
        self.superseded = False  # see the module's terms (set and cleared by `commit`)
        self.forwards_stopped = 0  # draft forwards stopped part-way because the session was superseded
        self.closed = False
        self.started = False  # drafting starts with the first commit (the target's first token)
        self.held = False  # the verifier holds this request's drafts (adaptive gamma backed it off)
        self.ready = False  # the prefill is done and announced
        self.prefill_ms = 0.0
        self.reused_tokens = 0  # prompt tokens whose keys/values came from the drafter's prefix cache
        # drafter.memory: the slots of keys/values this session reserves (0: none, it holds none),
        # and whether the worker has admitted it (its prefill may start)
        self.reserve_slots = 0
        self.slot_cap = 0  # the most slots it can ever hold (drafter.memory.cap_slots; 0: no cap)
        self.admitted = False
        self.admission = 0  # its place in the order the worker admitted sessions (1: the first)
        self.kv_waited = False  # its prefill waited for the budget (counted once)
        self.cache_scope = ""  # DraftOpen.cache_scope: whose keys/values it may reuse (drafter.prefix_cache)
        self.report_progress = False  # the caller reads `Progress` (DraftOpen.report_progress)
        # the caller handles a preemption (DraftOpen.accepts_preemption); else memory ends the session
        self.accepts_preemption = False
        self.progress_at: float | None = None  # monotonic time of the latest `Progress` sent (None: none yet)
        self.progress_queued: int | None = None  # ... and its queued_tokens (None: none sent yet)
        self.exhausted = False  # the method has nothing more to propose for this context
        self._pending: list[Draft] = []
        self._pending_since = 0.0
        self._pending_ms = 0.0
        self.steps = 0
        self.last_token_ms = 0.0  # compute time of the token the latest draft step drafted (0: none)
        # called as hook(self) after each draft step and each prefill chunk (`ready` still False)
        # (the servicer's step_hooks list; empty in production, tests/faultkit.py's fault
        # injection appends to it)
        self.step_hooks: list[Callable[[DraftSession], None]] = []
        # pre-drafted branches (see the module's terms); branches = 0: none
        self.branches = 0  # most branches per committed context
        self.branch_alts = 3  # alternatives considered per position (the draft's 2nd-4th likeliest tokens)
        self._drafted: dict[int, Draft] = {}  # position -> the Draft of the context's token there
        self._branches: dict[tuple[int, int], list[Draft]] = {}  # (p, t) -> drafts after t
        self._branch_job: object | None = None  # a branch batch under way (subclass state)
        self._resend = False  # an adopted branch's drafts are pending: send them first
        self.branches_drafted = 0
        self.branches_adopted = 0
        self.branch_ms = 0.0  # compute spent on branches
        self.breaks = 0  # commits that broke the drafts' chain (a rejection or a wrong bonus guess)
        # ... of which no branch could have covered: the verdict was not among the branch
        # candidates (its correction was not among the draft's alternatives, or ranked past `branches`)
        self.uncovered = 0
        # drafts sized by confidence (see the module's terms); None: off
        self.confidence: ConfidencePolicy | None = None
        self.confidence_cuts = 0  # blocks cut where the reach fell below tau

    @property
    def window(self) -> int:
        return self.gamma + self.lookahead

    def wants_work(self) -> bool:
        if self.closed:
            return False
        if not self.ready:
            return True  # the prefill, or just the `Ready` announcing it
        if not self.started or self.held:
            return False
        if self._resend:
            return True  # an adopted branch's drafts wait to be sent (even past tau or the window)
        return not self.exhausted and len(self.context) - self.committed < self.window and not self.confidence_cut()

    def reach(self) -> float:
        """prod conf over the drafts past the committed context (1.0: none; see the module's terms)."""
        reach = 1.0
        for p in range(self.committed, len(self.context)):
            d = self._drafted.get(p)
            reach *= d.conf if d is not None else 1.0
        return reach

    def confidence_cut(self) -> bool:
        """Whether the session stops drafting past its context for this round: drafts sized
        by confidence are on, it has drafted past the committed context, and the reach is below tau."""
        return self.confidence is not None and len(self.context) > self.committed and self.reach() < self.confidence.tau

    def urgent(self) -> bool:
        """Whether the verifier is (about to be) waiting for this session's drafts: the target
        has produced its first token (the session started) and fewer than gamma drafts lie past
        the committed context. A prefill before the first commit is not urgent: it overlaps the
        target's own prefill, and drafts other verifiers are waiting for come first."""
        return (
            self.started and self.wants_work() and (not self.ready or len(self.context) - self.committed < self.gamma)
        )

    def commit(self, start: int, tokens: list[int], gamma: int = 0, hold: bool = False) -> None:
        """Apply a target verdict: context[:start] + tokens is now verified. `hold`: the
        verifier backed this request off (DraftCommit.hold): draft nothing until a commit without."""
        if self._supersedes(start, tokens):
            self.superseded = True  # the forward under way stops at its next layer (module's terms)
        with self.lock:
            self.superseded = False
            self.started = True
            self.held = hold
            if gamma:
                self.gamma = gamma
            end = start + len(tokens)
            agree = 0
            while (
                agree < len(tokens)
                and start + agree < len(self.context)
                and self.context[start + agree] == tokens[agree]
            ):
                agree += 1
            if self.confidence is not None:
                self.confidence.observe_commit(time.perf_counter(), len(tokens), self._decided(start, tokens, agree))
            broke = agree < len(tokens) and start + agree < len(self.context) and (start + agree) in self._drafted
            if broke:
                self.breaks += 1  # a draft of the chain was rejected: a branch hit, or a miss
            branch = None
            if agree == len(tokens) - 1 and start == self.committed:  # a rejection, of the drafts of this context
                verdict = (start + agree, tokens[agree])
                branch = self._branches.get(verdict)
                if branch is None:  # a branch under way for it: the drafts it has so far
                    branch = self._unfinished_branch(*verdict) or None
                if broke and branch is None and self.branches > 0:
                    if verdict not in {(p, t) for _, p, t in self.branch_candidates()}:
                        self.uncovered += 1
            if branch is not None:  # the verdict a branch was drafted for
                keep = start + agree
                self.context = self.context[:keep] + [tokens[agree]] + [d.token_id for d in branch]
                self._rollback(keep)
                self._forget_drafts(keep)
                self._drafted.update({keep + 1 + j: d for j, d in enumerate(branch)})
                self._pending = list(branch)  # sent again as a fresh block (see the module docstring)
                self._pending_since, self._pending_ms = time.perf_counter(), 0.0
                self._resend = bool(branch)
                self.sent = keep + 1
                self.branches_adopted += 1
            elif agree < len(tokens):
                keep = start + agree  # drafts past here are wrong
                self.context = self.context[:keep] + list(tokens[agree:])
                self._rollback(keep)
                self._forget_drafts(keep)
                self._pending.clear()
                self.sent = len(self.context)
            else:  # unsent drafts the target has now verified need not be sent
                covered = min(len(self._pending), max(0, end - self.sent))
                del self._pending[:covered]
                self.sent += covered
            self.committed = max(self.committed, end)
            self.sent = max(self.sent, self.committed)
            self.exhausted = False  # the context grew: the method may propose again
            self._branches.clear()  # drafted for the previous verdict
            self._branch_job = None
            for p in [p for p in self._drafted if p < self.committed]:
                del self._drafted[p]

    def _supersedes(self, start: int, tokens: list[int]) -> bool:
        """Whether the verdict (start, tokens) rejects a token of the context. Read without the
        lock (the worker may append a draft meanwhile): a hint for `superseded` only."""
        context = self.context
        return any(context[p] != t for p, t in zip(range(start, len(context)), tokens))

    def _decided(self, start: int, tokens: list[int], agree: int) -> list[tuple[float, bool]]:
        """The drafts the commit (start, tokens) decides, agreeing on its first `agree` tokens:
        (the reach at each, measured from `start`; survived) for each drafted position from
        start on that the verdict reaches, and every draft after a rejected one (dead with it)."""
        out: list[tuple[float, bool]] = []
        reach = 1.0
        for j, p in enumerate(range(start, len(self.context))):
            d = self._drafted.get(p)
            if d is None or (j >= len(tokens) and agree == len(tokens)):
                break  # not a draft, or past the verdict with every draft before it accepted: undecided
            reach *= d.conf
            out.append((reach, j < agree))
        return out

    def step(self) -> BlockOut | Ready | None:
        """One unit of work: a prefill chunk (a `Ready` after the last one), or one draft token
        (if the window allows) with a block when one is due."""
        with self.lock:
            first = self.step_begin_locked()
            if first is not DRAFT_NEEDED:
                return first
            return self.step_draft_locked(time.perf_counter())

    def step_begin_locked(self) -> BlockOut | Ready | None | Literal[_Step.DRAFT_NEEDED]:
        """The part of `step` before drafting a token: the step's result, or DRAFT_NEEDED when
        the step drafts one (then `step_draft_locked` finishes it). Called with the lock held;
        drafter.batch calls the two halves itself, to draft many sessions' tokens in one forward."""
        if not self.ready:
            t0 = time.perf_counter()
            if self._needs_warmup():
                self._warmup(self.prefill_chunk)
                for hook in self.step_hooks:
                    hook(self)
            self.prefill_ms += (time.perf_counter() - t0) * 1e3
            if self._needs_warmup():
                return None
            self.ready = True
            return Ready(len(self.context), self.prefill_ms, self.reused_tokens)
        if self._resend:  # an adopted branch's drafts, before anything else
            self._resend = False
            return self._flush(force=not self.wants_work(), now=True)
        if not self.wants_work():
            return self._flush(force=True)
        self.last_token_ms = 0.0
        return DRAFT_NEEDED

    def step_draft_locked(
        self,
        t0: float,
        draft: Draft | None | Literal[_Step.DRAFT_NEEDED] = DRAFT_NEEDED,
        compute_ms: float | None = None,
    ) -> BlockOut | None:
        """The rest of a step that drafts a token (started at perf_counter `t0`): `draft`, or
        the session's own `_next_token()` when not given. `compute_ms`: the token's compute
        (a batched step's share of its forward); default: the time since t0."""
        if draft is DRAFT_NEEDED:
            drafted = self._next_token()
            if drafted is STOPPED:  # a commit rejected the context mid-forward: no step happened
                self.forwards_stopped += 1
                return None
            draft = drafted
        assert draft is None or isinstance(draft, Draft)
        self.steps += 1
        hooks_start = time.perf_counter()
        for hook in self.step_hooks:
            hook(self)
        if compute_ms is not None:  # a batched row: its share of the forward, and its own hooks' time
            compute_ms += (time.perf_counter() - hooks_start) * 1e3
        if draft is None:
            self.exhausted = True
            # an empty block tells the verifier not to wait for drafts at this position
            return self._flush(force=True) or BlockOut(self.sent, [], 0.0, True, self.committed)
        if not self._pending:
            self._pending_since = t0
            self._pending_ms = 0.0
        full_before = len(self.context) + 1 - self.committed >= self.window  # the window ends here anyway
        self._drafted[len(self.context)] = draft
        self.context.append(draft.token_id)
        self._pending.append(draft)
        step_ms = (time.perf_counter() - t0) * 1e3 if compute_ms is None else compute_ms
        self.last_token_ms = step_ms
        self._pending_ms += step_ms
        cut = not full_before and self.confidence_cut()
        if self.confidence is not None:
            self.confidence.observe_token(step_ms)
            self.confidence_cuts += cut
        return self._flush(force=not self.wants_work(), cut=cut)

    def _flush(self, force: bool, now: bool = False, cut: bool = False) -> BlockOut | None:
        """Send pending drafts when forced (nothing more to draft; the block is `final`), at
        gamma of them, when the first has waited flush_ms (a slow drafter streams token by
        token), or `now`. `cut`: a confidence cut ends the block (forced too)."""
        if not self._pending:
            return None
        waited_ms = (time.perf_counter() - self._pending_since) * 1e3
        if not (force or now) and len(self._pending) < self.gamma and waited_ms < self.flush_ms:
            return None
        block = BlockOut(
            self.sent,
            self._pending,
            self._pending_ms,
            final=force,
            committed_length=self.committed,
            confidence_cut=cut,
            tau=self.confidence.tau if self.confidence is not None else 0.0,
        )
        self.sent += len(self._pending)
        self._pending = []
        return block

    def _forget_drafts(self, keep: int) -> None:
        for p in [p for p in self._drafted if p >= keep]:
            del self._drafted[p]

    def branch_candidates(self) -> list[tuple[float, int, int]]:
        """The `branches` likeliest verdicts worth a branch, best first: (P, p, t) for the
        rejection at p with correction t (see the module's terms). Empty when branches are off."""
        if self.branches <= 0:
            return []
        out: list[tuple[float, int, int]] = []
        reach = 1.0  # prod_{j<p} conf(j): the chance the target accepts every draft before p
        # the positions the step being verified decides: its gamma drafts, then the bonus token
        for p in range(self.committed, min(self.committed + self.gamma + 1, len(self.context))):
            d = self._drafted.get(p)
            if d is None:
                break
            out.extend((reach * q, p, t) for t, q in d.alts[: self.branch_alts])
            reach *= d.conf
        out.sort(key=lambda c: -c[0])
        return out[: self.branches]

    def _next_branches(self) -> list[tuple[int, int]] | None:
        """The candidates not drafted yet, best first, as (position, correction): drafted
        together, one batch (None: none is left)."""
        todo = [(p, t) for _, p, t in self.branch_candidates() if (p, t) not in self._branches]
        return todo or None

    def wants_branch(self) -> bool:
        """Whether the session has branch work: it is idle otherwise (its window is full) and
        a candidate branch is not drafted yet."""
        with self.lock:
            return (
                self.branches > 0
                and self.ready
                and self.started
                and not self.closed
                and not self.held
                and not self.wants_work()
                and not self._resend
                and (self._branch_job is not None or self._next_branches() is not None)
            )

    def branch_step(self) -> list[BlockOut]:
        """One unit of branch work (one batched draft step); the branch blocks finished by it."""
        with self.lock:
            if not (self.branches > 0 and self.started and not self.closed and not self.wants_work()):
                return []
            t0 = time.perf_counter()
            if self._branch_job is None:
                nxt = self._next_branches()
                if nxt is None:
                    return []
                self._branch_job = self._begin_branch_rows(nxt)
            done = self._advance_branches()
            self.branch_ms += (time.perf_counter() - t0) * 1e3
            return self._branches_done(done)

    def _branches_done(self, done: tuple[list[tuple[int, int]], list[list[Draft]], float] | None) -> list[BlockOut]:
        """The branch blocks of a finished batch (`_advance_branches`' answer; none when None),
        kept for the commit that may adopt one."""
        if done is None:
            return []
        self._branch_job = None
        rows, conts, draft_ms = done
        blocks = []
        for (p, t), cont in zip(rows, conts):
            self._branches[(p, t)] = cont
            self.branches_drafted += 1
            blocks.append(
                BlockOut(p, [Draft(t, 1.0, None), *cont], draft_ms / len(rows), False, self.committed, branch=True)
            )
        return blocks

    def _unfinished_branch(self, p: int, t: int) -> list[Draft]:
        """The drafts the branch batch under way has drafted so far for the rejection at p with
        correction t ([]: none, or no such row). Called with the lock held."""
        return []

    def rides(self) -> bool:
        """Whether the session's branch rows ride in the forward drafting its next token (see the
        module's terms, `ride`): branches are on, the token drafts ahead (the block being verified,
        committed .. committed + gamma - 1, is drafted: its candidates are known), and a candidate
        branch is not drafted yet. Called with the lock held."""
        return (
            self.branches > 0
            and self.started
            and not self.closed
            and not self.held
            and not self._resend
            and len(self.context) - self.committed >= self.gamma
            and (self._branch_job is not None or self._next_branches() is not None)
        )

    def _begin_branches(self, position: int, corrections: list[int]) -> object:
        """Start drafting branches at `position`, one per correction (subclass state)."""
        return self._begin_branch_rows([(position, t) for t in corrections])

    def _begin_branch_rows(self, rows: list[tuple[int, int]]) -> object:
        """Start drafting one branch per (position, correction) in `rows`, as one batch (subclass state)."""
        raise NotImplementedError

    def _advance_branches(self) -> tuple[list[tuple[int, int]], list[list[Draft]], float] | None:
        """One draft step for the branch batch under way; when done, (its rows, each row's
        drafts, compute ms). A branch has gamma drafts after its correction, fewer with
        drafts sized by confidence (its drafts' reach, the correction not counted, falls below
        tau: the batch ends when every row's has)."""
        raise NotImplementedError

    def _next_token(self) -> Draft | None | Literal[_Step.STOPPED]:
        """The draft for the context's next position (None: the method has none; STOPPED: the
        session was superseded while it ran: see the module's terms)."""
        raise NotImplementedError

    def prefill_left(self) -> int:
        """Prompt tokens still to feed through the draft model before the session is ready
        (0: none left; its `Ready` may still be due)."""
        return 0

    def prefilled(self) -> int:
        """Prompt tokens in the draft model's cache."""
        return 0

    def _needs_warmup(self) -> bool:
        """Whether there is work to do before the first commit (e.g. the prompt's KV cache)."""
        return False

    def _warmup(self, chunk: int) -> None:
        """Do up to `chunk` tokens of that work (it runs while the target prefills)."""

    def _rollback(self, keep: int) -> None:
        """Forget model state past the first `keep` tokens of the context."""

    def kv_bytes(self) -> int:
        """Bytes the session's keys/values hold now (drafter.memory; 0: it holds none)."""
        return 0

    def slots_wanted(self) -> int:
        """Slots of keys/values its next step holds: the context (the step feeds what the cache
        lacks of it; the token it drafts is fed by the step after). Read without the lock: a
        commit landing meanwhile may add tokens, which drafter.memory counts at the cache's size."""
        return len(self.context)

    def grow_reserve(self, slots: int) -> None:
        """Reserve `slots` (drafter.memory's growth; the worker checked they fit the budget)."""
        self.reserve_slots = slots

    def preempt(self) -> None:
        """Let go of the model state (see the module's terms): the context is cut to what is
        committed (drafts past it are unverified), pending drafts and branches are dropped, and
        the session is neither ready nor admitted, so the worker admits it again, in arrival
        order, when its reserve fits, and prefills the committed context. Call with the lock
        held, after taking what the prefix cache keeps of it."""
        self.context = self.context[: self.committed]  # replaced, not cut in place (prompt_prefix reads it unlocked)
        self.sent = self.committed
        self._pending.clear()
        self._resend = False
        self._drafted.clear()
        self._branches.clear()
        self._branch_job = None
        self.exhausted = False
        self.ready = self.admitted = self.kv_waited = False
        self.prefill_ms, self.reused_tokens = 0.0, 0
        self.progress_at = self.progress_queued = None

    def close(self) -> None:
        self.closed = True


@dataclass
class _BranchRow:
    """One branch of a batch under way: the draft model's continuation of context[:p] + [t].
    It reads the session's cache for context[:base] and keeps its own keys/values after it
    (positions base ..), so starting a batch copies nothing."""

    p: int
    t: int
    base: int  # context tokens read from the session's cache (min(p, its cached length))
    cache: Cache  # the row's own keys/values, from position base on
    feed: list[int]  # the next forward's input: context[base:p] + [t], then the latest draft
    drafts: list[Draft] = field(default_factory=list)  # drafted after t
    reach: float = 1.0  # drafts sized by confidence: prod conf over `drafts`
    end: int = -1  # ... and how many of them the row keeps (-1: not cut yet)


@dataclass
class _BranchJob:
    """A branch batch under way: its rows, and the compute spent on it (ms)."""

    rows: list[_BranchRow]
    ms: float = 0.0


class ModelDraftSession(DraftSession):
    """Drafts with a causal LM, keeping its KV cache across rounds.

    `cached` counts context tokens whose keys/values are in the cache; each step feeds
    only context[cached:] (one token in steady state, a few after a commit).

    The model may sit on a GPU (`model.device`): its inputs and KV cache live there, and the
    choice of a token is made from the logits on the CPU except for a greedy pick without
    alternatives (an argmax on the device). `vocab_limit` (> 0): drafts are chosen among the
    first vocab_limit ids only, the draft tokenizer's: padding rows of the embedding past
    them are never proposed (specdec.models.compat). `allowed_token_ids` (non-empty): drafts
    are chosen among those ids only, as the target samples (SamplingParams.allowed_token_ids);
    the output would be exact without it (the target rejects the others), this keeps the
    drafts acceptable. `prefixes` (drafter.prefix_cache): called by the session's first prefill
    step, on the worker's thread, as prefixes(self); the keys/values of the prompt's first
    tokens that it answers (a Prefix, or None) are copied into the session's cache, and the
    prefill computes only the rest. `reserve_slots` (drafter.memory's reserve): the slots its
    cache allocates at once (0: it grows as it fills).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        prompt: list[int],
        gamma: int,
        lookahead: int,
        temperature: float,
        top_k: int,
        top_p: float,
        seed: int | None,
        q_top_k: int,
        prefill_chunk: int = 128,
        vocab_limit: int = 0,
        allowed_token_ids: Sequence[int] = (),
        prefixes: Callable[[ModelDraftSession], Prefix | None] | None = None,
        reserve_slots: int = 0,
    ) -> None:
        super().__init__(prompt, gamma, lookahead, prefill_chunk=prefill_chunk)
        from drafter.kvcache import GrowingCache  # imports transformers: only a model session needs it

        self.model = model
        self.device = getattr(model, "device", torch.device("cpu"))
        self.vocab_limit = vocab_limit
        self.allowed_token_ids = list(allowed_token_ids)
        self._disallowed: torch.Tensor | None = None  # [vocab] True where a token may not be drafted
        self.reserve_slots = reserve_slots  # (DraftSession's)
        self.cache = GrowingCache(reserve_slots)  # a DynamicCache that appends in place (drafter.kvcache)
        self.cached = 0
        self._prefix_source = prefixes
        self._prefixes = prefixes  # None once asked (each prefill's first step)
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.q_top_k = q_top_k
        self.generator = torch.Generator()
        self.generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
        self.forward_tokens = 0  # tokens run through the draft model (work counter)

    @torch.inference_mode()
    def _forward(self, upto: int, stoppable: bool = False) -> torch.Tensor:
        """Feed context[cached:upto] through the model; return the last position's logits [vocab].
        `stoppable` (the lean forward): the forward stops when the session is superseded
        (specdec.models.lean.Stopped, raised with the cache as it was)."""
        from specdec.models.lean import LeanDecoder, Stopped

        new = self.context[self.cached : upto]
        extra = {"stop": lambda: self.superseded} if stoppable and isinstance(self.model, LeanDecoder) else {}
        try:
            # [1, len(new)] -> logits [1, len(new), vocab]
            out = self.model(
                input_ids=torch.tensor([new], dtype=torch.long, device=self.device),
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=1,
                **extra,
            )
        except Stopped:
            self.cache.truncate(self.cached)  # the layers it reached hold the step's keys/values
            raise
        logits: torch.Tensor = out.logits  # [1, 1, vocab]: logits_to_keep=1 keeps the last position only
        self.cached = upto
        self.forward_tokens += len(new)
        return logits[0, -1]

    def prefill_left(self) -> int:
        return 0 if self.ready else max(0, len(self.context) - 1 - self.cached)

    def prefilled(self) -> int:
        return self.cached

    def _needs_warmup(self) -> bool:
        return self.cached < len(self.context) - 1

    def _warmup(self, chunk: int) -> None:
        # the prompt's KV cache, all but the last token (fed with the first drafted step): a
        # prefix's keys/values first (one copy: the step's work), then chunks of the rest
        if self._prefixes is not None:
            find, self._prefixes = self._prefixes, None
            prefix = find(self)
            if prefix is not None and 0 < prefix.tokens < len(self.context):
                self._reuse(prefix)
                return
        self._forward(min(self.cached + max(1, chunk), len(self.context) - 1))

    @torch.inference_mode()
    def _reuse(self, prefix: Prefix) -> None:
        """Start the cache from a prefix: a copy of its first prefix.tokens slots (into buffers
        of this session's own, with room to grow)."""
        from drafter.kvcache import GrowingCache

        n = prefix.tokens
        cache = GrowingCache(self.reserve_slots)
        for layer, (keys, values) in enumerate(prefix.layers):
            # [1, kv heads, >= n, dim] -> the layer's first n slots
            cache.update(keys[:, :, :n].to(self.device), values[:, :, :n].to(self.device), layer)
        self.cache, self.cached, self.reused_tokens = cache, n, n

    def kv_bytes(self) -> int:
        return self.cache.nbytes()

    def preempt(self) -> None:
        from drafter.kvcache import GrowingCache

        super().preempt()
        # the prefix cache holds the old buffers' views when it kept them; the prefill asks it again
        self.cache, self.cached, self._prefixes = GrowingCache(self.reserve_slots), 0, self._prefix_source

    def grow_reserve(self, slots: int) -> None:
        super().grow_reserve(slots)
        self.cache.reserve(slots)  # the next buffer the cache allocates has exactly these slots

    def _layer_views(self, n: int) -> list[LayerKV]:
        """Per layer, views of the cache's first n keys/values [1, kv heads, n, dim] ([] when a
        layer holds fewer)."""
        layers: list[LayerKV] = []
        for layer in self.cache.layers:
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if keys is None or values is None or keys.shape[-2] < n or values.shape[-2] < n:
                return []
            layers.append((keys[:, :, :n], values[:, :, :n]))
        return layers

    def kv_prefix(self) -> tuple[list[int], list[LayerKV]]:
        """What the cache holds, for the drafter's prefix cache once the session has ended:
        context[:cached] and per layer views of its keys/values [1, kv heads, cached, dim]
        (([], []) when a layer holds fewer). Call with the lock held, after the session closed."""
        layers = self._layer_views(self.cached)
        return (list(self.context[: self.cached]), layers) if layers else ([], [])

    def prompt_prefix(self, prompt: Sequence[int] | np.ndarray) -> Prefix | None:
        """The keys/values this session holds for the start of `prompt` (its tokens up to
        len(prompt) - 1), within this session's own prompt: None when they share none.

        Called on the worker's thread without this session's lock (the worker may hold it, in a
        batched step): the cache's slots before `prompt_len` that it has computed never change
        (a commit rolls back to a position at or past the prompt's end; only the worker runs
        forwards), and a buffer that grows leaves the old one to the views taken of it."""
        n = min(self.cached, self.prompt_len)  # read once: the stable slots
        if n <= 0:
            return None
        mine = self.context  # a commit replaces the list, keeping its first prompt_len tokens
        match = common_prefix(mine[:n], prompt[: len(prompt) - 1])
        layers = self._layer_views(match) if match > 0 else []
        return Prefix(match, layers) if layers else None

    @torch.inference_mode()
    def _next_token(self) -> Draft | None | Literal[_Step.STOPPED]:
        from specdec.models.lean import Stopped

        try:
            logits = self._forward(len(self.context), stoppable=True)  # [vocab]
        except Stopped:
            return STOPPED
        return self.pick_locked(logits)

    def pick_locked(self, logits: torch.Tensor) -> Draft:
        """The step's draft from the logits [vocab] after the context's last token (drafter.batch
        hands it a row of a batched forward): greedy or sampled with the session's generator."""
        return self._pick(logits, with_alts=self.branches > 0 or self.confidence is not None)

    def _pick(self, logits: torch.Tensor, with_alts: bool) -> Draft:
        """The draft token from one position's logits [vocab]; with_alts: its conf and the
        branch_alts likeliest other tokens (temperature 0: the model's own softmax)."""
        if self.vocab_limit:
            logits = logits[: self.vocab_limit]  # [vocab_limit]: no padding row
        if self.allowed_token_ids:
            logits = logits.masked_fill(self._disallowed_mask(logits), float("-inf"))
        if self.temperature == 0 and not with_alts:
            return Draft(int(logits.argmax()), 1.0, None)  # on the model's device
        logits = logits.float().cpu()  # sampling and alternatives: on the CPU, with self.generator
        if self.temperature == 0:
            token = int(logits.argmax())
            probs = torch.softmax(logits.float(), dim=-1)
            top_p, top_i = torch.topk(probs, self.branch_alts + 1)
            alts = tuple((int(i), float(q)) for i, q in zip(top_i.tolist(), top_p.tolist()) if i != token)
            return Draft(token, 1.0, None, float(probs[token]), alts[: self.branch_alts])
        probs = target_distribution(logits, self.temperature, self.top_k, self.top_p)
        ids, q = sparse_q(probs, self.q_top_k)
        pick = int(torch.multinomial(q, 1, generator=self.generator))
        token = int(ids[pick])
        alts = tuple((int(i), float(p)) for i, p in zip(ids.tolist(), q.tolist()) if int(i) != token and p > 0)
        return Draft(token, float(q[pick]), (ids.tolist(), q.tolist()), float(q[pick]), alts[: self.branch_alts])

    def _disallowed_mask(self, logits: torch.Tensor) -> torch.Tensor:
        """[vocab] bool, True for the ids outside allowed_token_ids (made once, on the logits'
        device); all False when none of the allowed ids is a row of these logits (nothing the
        drafter could draft would be allowed: it drafts as if unconstrained, and the target rejects)."""
        if self._disallowed is None or self._disallowed.shape != logits.shape:
            inside = [t for t in self.allowed_token_ids if 0 <= t < logits.shape[-1]]
            mask = torch.ones(logits.shape, dtype=torch.bool, device=logits.device)
            mask[torch.tensor(inside, dtype=torch.long, device=logits.device)] = False
            self._disallowed = mask if inside else torch.zeros_like(mask)
        return self._disallowed

    def _begin_branch_rows(self, rows: list[tuple[int, int]]) -> object:
        """The batch's state (`_BranchJob`): one `_BranchRow` per (position, correction), none of
        them fed yet. Nothing is copied: each row reads this session's cache up to its position."""
        from drafter.kvcache import GrowingCache

        out = []
        for p, t in rows:
            # the row reads context[:base] from the session's cache; tokens before p that are not
            # cached yet (the last draft, a commit's new tokens) are fed with the row
            base = min(p, self.cached)
            out.append(_BranchRow(p, t, base, GrowingCache(), self.context[base:p] + [t]))
        return _BranchJob(out)

    def branch_rows_locked(self, most: int = 0) -> list[Row]:
        """The rows (drafter.rows.Row) of the branch batch under way, started here if none is
        (with the `most` best candidates not drafted yet; 0: all of them): each row's next input
        after its cached keys/values. Called with the lock held; the forward's logits for them
        go to `branch_picked_locked`, in this order."""
        from drafter.rows import Row, layer_kv

        if self._branch_job is None:
            nxt = self._next_branches()
            if nxt is None:
                return []
            self._branch_job = self._begin_branch_rows(nxt[:most] if most > 0 else nxt)
        job = self._branch_job
        assert isinstance(job, _BranchJob)

        def row(r: _BranchRow) -> Row:
            return Row(
                r.feed,
                r.base + r.cache.get_seq_length(),
                lambda layer: layer_kv(self.cache, layer, r.base) + layer_kv(r.cache, layer),
                r.cache,
            )

        return [row(r) for r in job.rows]

    def branch_picked_locked(self, logits: torch.Tensor, ms: float) -> list[BlockOut]:
        """Advance the branch batch under way by one token a row, from the logits [rows, vocab]
        of a forward of `branch_rows_locked`'s rows (`ms`: its compute, or the rows' share of a
        forward they rode in); the branch blocks, when that finished the batch."""
        job = self._branch_job
        assert isinstance(job, _BranchJob)
        self.branch_ms += ms
        return self._branches_done(self._picked(job, logits, ms))

    @torch.inference_mode()
    def _advance_branches(self) -> tuple[list[tuple[int, int]], list[list[Draft]], float] | None:
        from drafter.rows import forward
        from specdec.models.lean import Stopped

        job = self._branch_job
        assert isinstance(job, _BranchJob)
        t0 = time.perf_counter()
        # [rows, T] -> logits [rows, vocab] (T = 1 after the first step, and in it for a row at a cached position)
        try:
            logits = forward(self.model, self.branch_rows_locked(), stop=lambda: self.superseded)
        except Stopped:  # a commit rejected the context the batch drafts from: it drops the batch
            self.forwards_stopped += 1
            return None
        return self._picked(job, logits, (time.perf_counter() - t0) * 1e3)

    def _picked(
        self, job: _BranchJob, logits: torch.Tensor, ms: float
    ) -> tuple[list[tuple[int, int]], list[list[Draft]], float] | None:
        """One draft a row from its logits [rows, vocab]: `_advance_branches`' answer."""
        t0 = time.perf_counter()
        # with confidence on, each pick's conf (an adopted branch's drafts count in the reach)
        picks = [self._pick(logits[b], with_alts=self.confidence is not None) for b in range(len(job.rows))]
        for r, d in zip(job.rows, picks):
            self.forward_tokens += len(r.feed)
            r.drafts.append(d)
            r.feed = [d.token_id]
        job.ms += ms + (time.perf_counter() - t0) * 1e3
        if (
            self.confidence is not None
        ):  # a branch is sized by confidence too: a row ends where its reach fell below tau
            for r, d in zip(job.rows, picks):
                if r.end < 0:
                    r.reach *= d.conf
                    if r.reach < self.confidence.tau:
                        r.end = len(r.drafts)
        if len(job.rows[0].drafts) < self.gamma and not all(r.end >= 0 for r in job.rows):
            return None
        conts = [r.drafts[: r.end] if r.end >= 0 else r.drafts for r in job.rows]
        return [(r.p, r.t) for r in job.rows], conts, job.ms

    def _unfinished_branch(self, p: int, t: int) -> list[Draft]:
        job = self._branch_job
        if not isinstance(job, _BranchJob):
            return []
        for r in job.rows:
            if (r.p, r.t) == (p, t):
                return list(r.drafts[: r.end] if r.end >= 0 else r.drafts)
        return []

    def _rollback(self, keep: int) -> None:
        if self.cached > keep:
            self.cache.crop(keep - self.cached)  # negative: drop that many (a positive length is deprecated)
            self.cached = keep


class NgramDraftSession(DraftSession):
    """Model-free prompt lookup: propose what followed the latest earlier occurrence
    of the context's last n tokens (n from ngram_max down to ngram_min)."""

    def __init__(self, prompt: list[int], gamma: int, lookahead: int, ngram_max: int, ngram_min: int) -> None:
        super().__init__(prompt, gamma, lookahead)
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min

    def _next_token(self) -> Draft | None:
        ctx = self.context
        for n in range(min(self.ngram_max, len(ctx) - 1), self.ngram_min - 1, -1):
            suffix = ctx[-n:]
            for start in range(len(ctx) - n - 1, -1, -1):
                if ctx[start : start + n] == suffix:
                    return Draft(ctx[start + n], 1.0, None)
        return None
