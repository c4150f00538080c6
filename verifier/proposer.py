"""External drafts into vLLM: the draft board (no vLLM in this module).

vLLM's V1 engine calls the `custom_class` proposer (verifier.vllm_hooks.ExternalDraftProposer)
at the end of every step, after sampling, for the next step; it hands each speculative
request's row to the board (`preview`, then `propose_batch`), which:
  1. previews the tokens just sampled (the callback sends them to the gateway, which
     commits them to the drafter), so the drafter can draft from the exact context
     while the engine finishes the step;
  2. decides each request's budget for the step: its gamma, or with `adaptive` on, the
     number of drafts that raises the step's expected tokens per ms under the measured
     step cost and the request's recent acceptance (verifier.budget: this is adaptive
     gamma, and the back-off to plain decoding when the verifier is saturated);
  3. waits for a block that continues that context, and returns its first budget tokens.
     A row is waited for only while its drafts can be expected: its drafter has not
     ended, and the wait stays within the drafts' expected arrival (missing tokens x the
     drafter's pace x (1 + slack), plus a margin; a drafter that has not announced `ready`
     yet, i.e. is still prefilling or is stalled, gets the margin alone, once: after that
     wait expired it is `late` and not waited for until its `ready`; one that paused, having
     preempted the session for memory (`pause`), is `late` at once, until its next `ready`);
     the whole step waits at most `wait_s`, and with `adaptive` only while the missing drafts
     are worth the wait and no prefill waits behind the step (`queued`: requests not
     scheduled yet, or prefilled in chunks with one still to come; or submitted and not yet
     added to the engine, `arrival`). One request never holds the others up: once any row
     of the batch has its
     drafts (or needs none), the rows still missing theirs are waited for at most the
     margin from the step's start, and in a batch of more than one a row whose drafter let
     a wait expire with nothing usable (`late`, until a block with drafts arrives) is not
     waited for at all. So a drafter that answers politely with nothing (empty or stale
     blocks) costs the other requests of its batch at most one margin, once. A request
     with no block in time gets [] and decodes plainly this step. A request adaptive gamma
     gives no drafts at all is `held`: its verdicts say so (VerifyResponse.hold_drafts) and
     its drafter stops drafting until the budget comes back (as its acceptance history
     fades, verifier.budget.DECAY). A wait that expires with none of a ready drafter's
     drafts counts against its acceptance (verifier.budget.Acceptance.miss), so a drafter
     too slow to keep up is held too, rather than drafting blocks that arrive stale; but
     only once that drafter has sent drafts since the request started or was last released
     from a hold (`delivering`): until then it has had none to send late (it prefills, or
     catches up on the tokens it was held through), and counting those steps held it again
     before it could draft.
vLLM then verifies the drafts in its next step with its own scheduler, KV cache (no
recompute of verified tokens) and rejection sampler (one-hot q, which is exact).

Terms:
    chain      per request, the draft tokens received so far: chain[i] is the drafter's
               token for position chain_start + i
    pace       per request, the drafter's wall-clock ms per draft token as seen here: first
               the drafter's own estimate (in `ready`), then measured from arrivals, each
               block's time since the drafter last had reason to draft (the latest preview,
               i.e. commit, or the previous block) over its tokens
    proposal   the tokens handed to vLLM for a context of length L: chain[L - chain_start:]
               (at most gamma), valid only when the chain agrees with the context up to L
    committed  per request, the context length the board has seen (the prompt, then each
               preview's and proposal's context): what drafts must lie ahead of
    branch     per request, an alternative chain pre-drafted for a rejection the target has
               not made yet (DraftBlock.branch: drafts after a correction token, drafted from
               the chain up to the rejected position). Kept beside the chain, never over it;
               when the context disagrees with the chain, the branch that agrees with it
               becomes the chain in the same step (a branch hit: the step after a rejection
               has its drafts with no round trip). At most MAX_BRANCHES per request, dropped
               once the chain moves on.

A drafter is untrusted (the gateway checks its blocks; the board still bounds itself), so a
block can only be useless, never costly: the chain never reaches past committed + horizon
(specdec.validation.draft_horizon(gamma), 4 gamma + 4: a drafter drafts at most gamma +
lookahead ahead), a block that starts past that or lies wholly before `committed` (or starts
more than the horizon before it) leaves the chain alone, at most max_blocks_per_commit(gamma)
blocks are taken between two previews (the rest are dropped without waking a waiting step),
and at most MAX_PROPOSALS proposals are remembered per request. Per request the board thus
holds O(gamma) tokens whatever arrives.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from prometheus_client import CollectorRegistry

from specdec import telemetry
from specdec.validation import draft_horizon, max_blocks_per_commit, reported_ms
from verifier.budget import Acceptance, StepCost, allocate, worth_waiting

# (start_position, tokens) of a preview
PreviewCallback = Callable[[int, list[int]], None]

# Proposals remembered per request until their verdict (normally 2: the step being verified
# and the next one's, proposed before the first's verdict is read).
MAX_PROPOSALS = 4
# Branches kept per request (a drafter sends a few per round; the oldest go first).
MAX_BRANCHES = 8


@dataclass
class _Entry:
    gamma: int
    prompt_len: int
    max_tokens: int
    on_preview: PreviewCallback | None
    drafting: bool = True  # False once the drafter ended: stop waiting for it
    final_end: int = -1  # the drafter drafts nothing past this position until the next commit
    chain_start: int = 0
    chain: list[int] = field(default_factory=list)
    # context length -> tokens proposed for it (read back when the verdict arrives)
    proposals: dict[int, list[int]] = field(default_factory=dict)
    acceptance: Acceptance = field(default_factory=Acceptance)
    draft_ms_per_token: float | None = None  # the drafter's recent compute time per draft token
    ready: bool = False  # the drafter's prefill is done: its drafts can be waited for
    pace_ms: float = 0.0  # the drafter's wall-clock ms per draft token (see the module docstring)
    clock: float = 0.0  # monotonic time the drafter last had reason to draft (preview or block)
    committed: int = 0  # the context length seen so far (see the module docstring)
    offers: int = 0  # blocks offered since the latest preview
    branches: list[tuple[int, list[int]]] = field(default_factory=list)  # (start, tokens) alternative chains
    branch_offers: int = 0  # branches offered since the latest preview
    rejected_at: int = -1  # the context length at which the chain was last found rejected (-1: none open)
    hit_at: int = -1  # the context length whose drafts came from a branch
    from_branch: set[int] = field(default_factory=set)  # lengths whose proposal came from a branch
    missed: set[int] = field(default_factory=set)  # lengths whose step found no branch after a break
    broken: tuple[int, list[int]] = (0, [])  # the chain the target last broke (start, tokens)
    held: bool = False  # adaptive gamma backed it off: its drafter is told to stop (see `holding`)
    late: bool = False  # a wait for its drafts expired with nothing usable (see the module docstring)
    # its drafter has sent drafts since the request started or was last released from a hold:
    # until then a step that finds none counts no miss (see the module docstring)
    delivering: bool = False


class DraftBoard:
    """Thread-safe drafts by engine request id, shared by the gRPC side and the proposer.

    `metrics`: the verifier's (withheld drafts are counted there); None gives the board a
    throwaway registry of its own (tests, tools).
    """

    def __init__(
        self,
        max_model_len: int = 1 << 30,
        wait_s: float = 0.0,
        wait_slack: float = 0.5,
        wait_margin_s: float = 0.05,
        adaptive: bool = False,
        metrics: telemetry.VerifierMetrics | None = None,
    ) -> None:
        self.metrics = metrics if metrics is not None else telemetry.VerifierMetrics(CollectorRegistry())
        self._cond = threading.Condition()
        self._entries: dict[str, _Entry] = {}
        self.max_model_len = max_model_len  # the engine's: no draft past it
        self.wait_s = wait_s  # the longest a step waits for drafts (0: never waits)
        self.wait_slack = wait_slack  # expected arrival x (1 + slack) ...
        self.wait_margin_s = wait_margin_s  # ... + margin: the longest a step waits for a row's drafts
        self.waited_s = 0.0  # total time steps spent waiting for drafts
        self.adaptive = adaptive  # budgets from verifier.budget instead of each request's gamma
        self.cost = StepCost()  # the engine's measured step cost (fed by the engine thread)
        # requests whose prefill is not done: not scheduled yet, or a chunk still to come (the engine sets it each step)
        self.queued = 0
        self._unadded = 0  # requests submitted and not yet added to the engine (one ends an adaptive wait)

    def register(
        self, req_id: str, gamma: int, prompt_len: int, max_tokens: int, on_preview: PreviewCallback | None = None
    ) -> None:
        with self._cond:
            self._entries[req_id] = _Entry(
                gamma, prompt_len, max_tokens, on_preview, drafting=gamma > 0, committed=prompt_len
            )

    def unregister(self, req_id: str) -> None:
        with self._cond:
            self._entries.pop(req_id, None)

    def ready(self, req_id: str, pace_ms: float) -> None:
        """The request's drafter has prefilled the prompt and drafts at about `pace_ms` per token."""
        with self._cond:
            e = self._entries.get(req_id)
            if e is not None:
                e.ready = True
                e.late = False  # its drafts can come now: worth waiting for
                e.pace_ms = e.pace_ms or reported_ms(pace_ms)
            self._cond.notify_all()

    def pause(self, req_id: str) -> None:
        """The request's drafter preempted its session (VerifyRequest.pause): it drafts nothing
        until its next `ready`. Its chain and branches are dropped, and steps do not wait for it
        (`late`, and not ready: not even the margin), nor count a miss against its acceptance
        (not `delivering`), until that `ready` or a block with drafts."""
        with self._cond:
            e = self._entries.get(req_id)
            if e is not None:
                e.ready = e.delivering = False
                e.late = True
                e.chain_start, e.chain, e.branches, e.final_end = e.committed, [], [], -1
                e.broken = (0, [])
            self._cond.notify_all()

    def end(self, req_id: str) -> None:
        """The drafter of this request is gone: never wait for it again."""
        with self._cond:
            e = self._entries.get(req_id)
            if e is not None:
                e.drafting = False
            self._cond.notify_all()

    def offer(
        self,
        req_id: str,
        start: int,
        tokens: list[int],
        final: bool = True,
        committed: int | None = None,
        draft_ms: float = 0.0,
        branch: bool = False,
    ) -> None:
        """Add a block of drafts for positions start, start + 1, ...

        `committed`: the committed context length the drafter drafted from. A block that
        starts there (or says nothing: None) was drafted from verified context and replaces
        older drafts; one that starts later continues the chain when contiguous.
        `final`: the drafter drafts no further past this block until the next commit.
        `draft_ms`: the drafter's compute time for the block (feeds the wait decision).
        `branch`: a pre-drafted branch (see the module docstring), kept beside the chain when
        it was drafted from the chain's context (committed == the chain's start) and continues it.
        The board's bounds (see the module docstring) drop or trim what cannot be useful.
        """
        with self._cond:
            e = self._entries.get(req_id)
            if e is None or e.gamma == 0:
                return
            if branch:
                self._offer_branch(e, start, tokens, committed)
                return
            e.offers += 1
            if e.offers > max_blocks_per_commit(e.gamma):
                return  # a flood: not even a wake-up for a waiting step
            horizon = draft_horizon(e.gamma)
            limit = min(e.committed + horizon, self.max_model_len)  # no draft is kept past here
            if start > limit:
                return  # far in the future: nothing a step could verify
            tokens = tokens[: limit - start]
            draft_ms = reported_ms(draft_ms)
            if tokens and draft_ms > 0:
                per_token = draft_ms / len(tokens)
                old = e.draft_ms_per_token
                e.draft_ms_per_token = per_token if old is None else 0.8 * old + 0.2 * per_token
            if tokens:
                e.late = False  # drafts again: worth waiting for
                e.delivering = True
                now = time.monotonic()
                if e.clock:
                    observed = (now - e.clock) * 1e3 / len(tokens)
                    e.pace_ms = observed if not e.pace_ms else 0.8 * e.pace_ms + 0.2 * observed
                e.clock = now
                e.ready = True  # a block means the prefill is done, whatever the order of arrival
            e.final_end = start + len(tokens) if final else -1
            if start < e.committed and (start + len(tokens) <= e.committed or start < e.committed - horizon):
                self._cond.notify_all()  # stale (verified context by now) or no draft: the chain stays
                return
            fresh = committed is None or start == committed
            if (
                not fresh
                and e.chain
                and start == e.chain_start + len(e.chain)
                and e.chain_start >= e.committed - horizon
            ):
                e.chain.extend(tokens)  # ends by `limit`: the chain stays within 2 x horizon
            elif tokens:
                e.chain_start, e.chain = start, list(tokens)
                e.broken = (0, [])
            self._cond.notify_all()

    def _offer_branch(self, e: _Entry, start: int, tokens: list[int], committed: int | None) -> None:
        self.metrics.branches.inc()
        e.branch_offers += 1
        # what it branches off: the chain, or the one the target just broke (a late branch)
        chain_start, chain = (e.chain_start, e.chain) if e.chain else e.broken
        if e.branch_offers > MAX_BRANCHES or not tokens or not chain or committed != chain_start:
            return  # a flood, or drafted from a context the chain has left behind
        if not chain_start <= start <= chain_start + len(chain):
            return
        limit = min(e.committed + draft_horizon(e.gamma), self.max_model_len)
        full = chain[: start - chain_start] + list(tokens)
        e.branches.append((chain_start, full[: max(0, limit - chain_start)]))
        del e.branches[:-MAX_BRANCHES]
        self._cond.notify_all()  # a step waiting after a rejection may find its drafts here

    def _adopt_branch(self, e: _Entry, context: np.ndarray) -> bool:
        """Make the branch that agrees with `context` [L] and reaches past it the chain."""
        length = len(context)
        for start, tokens in e.branches:
            offset = length - start
            if 0 <= offset < len(tokens) and np.array_equal(context[start:length], tokens[:offset]):
                e.chain_start, e.chain = start, list(tokens)
                e.branches, e.broken = [], (0, [])
                e.hit_at = length
                if e.rejected_at == length:
                    e.rejected_at = -1
                self.metrics.branch_hits.inc()
                return True
        return False

    def _budget(self, e: _Entry, length: int) -> int:
        remaining = e.prompt_len + e.max_tokens - length - 1  # tokens still to come after the bonus
        room = self.max_model_len - length - 1
        return max(0, min(e.gamma, remaining, room))

    def _peek(self, req_id: str, context: np.ndarray, k_max: int) -> list[int]:
        """The drafts usable after `context` [L]; drops the chain when it disagrees with the context."""
        e = self._entries.get(req_id)
        if e is None:
            return []
        length = len(context)
        e.committed = max(e.committed, length)
        if not e.chain and not (e.branches and self._adopt_branch(e, context)):
            return []
        offset = length - e.chain_start
        if (
            offset < 0
            or offset > len(e.chain)
            or (offset and not np.array_equal(context[e.chain_start : length], e.chain[:offset]))
        ):
            if 0 < offset <= len(e.chain):
                e.rejected_at = length  # the target rejected a draft (or the guess of its bonus token)
                e.broken = (e.chain_start, e.chain)
            e.chain = []  # stale or rejected by the target: a branch, or wait for the re-draft
            if not (e.branches and self._adopt_branch(e, context)):
                return []
            offset = length - e.chain_start
        elif offset:
            e.branches = []  # the chain held: its branches are for verdicts not given
        del e.chain[:offset]  # now verified context
        e.chain_start = length
        return e.chain[: min(k_max, self._budget(e, length))]

    def _wants_more(self, req_id: str, length: int, have: int, want: int) -> bool:
        """Whether a row with `have` drafts should wait for more: its drafter is alive, still
        drafting for this context, and the row's budget is `want` > have."""
        e = self._entries.get(req_id)
        if e is None or not e.drafting or have >= want:
            return False
        chain_end = e.chain_start + len(e.chain) if e.chain else length
        return e.final_end != max(chain_end, length)

    def _speed(self, req_id: str) -> float | None:
        """ms until the row's next draft token (for the adaptive wait): the drafter's wall-clock
        pace when known (it counts the sessions sharing the drafter), else its compute time."""
        e = self._entries.get(req_id)
        if e is None:
            return None
        return e.pace_ms or e.draft_ms_per_token

    def _late(self, req_id: str) -> bool:
        e = self._entries.get(req_id)
        return e is not None and e.late

    def _expected_wait_s(self, req_id: str, missing: int) -> float:
        """How long a row's `missing` drafts may be waited for (see the module docstring)."""
        e = self._entries.get(req_id)
        if e is None or missing <= 0:
            return 0.0
        if not e.ready:  # still prefilling (or stalled): its pace is unknown, the margin only, once
            return 0.0 if e.late else min(self.wait_s, self.wait_margin_s)
        return min(self.wait_s, missing * e.pace_ms / 1e3 * (1.0 + self.wait_slack) + self.wait_margin_s)

    def preview(self, req_id: str, start: int, tokens: list[int]) -> None:
        with self._cond:
            e = self._entries.get(req_id)
            if e is not None:
                e.clock = time.monotonic()  # the commit leaves now: the drafter drafts from here
                e.committed = max(e.committed, start + len(tokens))
                e.offers = 0
                e.branch_offers = 0
            callback = e.on_preview if e is not None and e.drafting else None
        if callback is not None:
            callback(start, tokens)

    def arrival(self) -> None:
        """A request was submitted: until the engine has added it (`added`), no step waits for
        drafts (adaptive), so its prefill is not held up. A request that arrives while a step
        runs is added after it; the step's own wait, at its end, must not hold it either."""
        with self._cond:
            self._unadded += 1
            self._cond.notify_all()

    def added(self) -> None:
        """The engine has taken a submitted request (added it, or refused it)."""
        with self._cond:
            self._unadded -= 1

    def record(self, req_id: str, drafted: int, accepted: int) -> None:
        """A verdict for the request: `accepted` of its `drafted` drafts (feeds its alpha)."""
        with self._cond:
            e = self._entries.get(req_id)
            if e is not None:
                e.acceptance.record(drafted, accepted)

    def _budgets(self, rows: list[tuple[str, np.ndarray]], k_max: int) -> tuple[list[int], list[float]]:
        """Each row's budget (drafts to verify this step) and its alpha."""
        entries = [self._entries.get(rid) for rid, _ in rows]
        caps = [min(k_max, self._budget(e, len(ctx))) if e is not None else 0 for e, (_, ctx) in zip(entries, rows)]
        alphas = [e.acceptance.alpha if e is not None else 0.0 for e in entries]
        if not self.adaptive:
            return caps, alphas
        return allocate(alphas, caps, self.cost), alphas

    def propose_batch(self, rows: list[tuple[str, np.ndarray]], k_max: int) -> list[list[int]]:
        """Drafts for each (request id, context [L]) row, within its budget, waiting up to
        `wait_s` (adaptive: and only while worth it) for missing ones."""
        t0 = time.monotonic()
        with self._cond:
            drafts = [self._peek(rid, ctx, k_max) for rid, ctx in rows]
            want, alphas = self._budgets(rows, k_max)
            # each row is waited for until its missing drafts are expected (plus slack and margin);
            # a row whose drafter was told to hold is not: it drafts again from this step's verdict
            held = self._hold(rows, want, k_max)
            until = [
                t0 if h else t0 + self._expected_wait_s(rid, w - len(d))
                for (rid, _), d, w, h in zip(rows, drafts, want, held)
            ]
            waited: set[int] = set()  # rows the step waited for
            while True:
                now = time.monotonic()
                wanting = [
                    i for i, (rid, ctx) in enumerate(rows) if self._wants_more(rid, len(ctx), len(drafts[i]), want[i])
                ]
                if len(rows) > 1:  # a late row never holds up the others
                    until = [t0 if self._late(rid) else u for (rid, _), u in zip(rows, until)]
                if len(wanting) < len(rows):  # a row has its drafts: the others may cost it the margin only
                    until = [min(u, t0 + self.wait_margin_s) for u in until]
                missing = [i for i in wanting if now < until[i]]
                if not missing:
                    break
                waited.update(missing)
                left = min(t0 + self.wait_s, max(until[i] for i in missing)) - now
                if left <= 0:
                    break
                if self.adaptive:
                    if self.queued or self._unadded > 0:
                        break  # requests are waiting for their prefill: do not hold the step
                    have = [min(len(d), w) for d, w in zip(drafts, want)]
                    wanted = [w if i in missing else h for i, (h, w) in enumerate(zip(have, want))]
                    speeds = [self._speed(rid) for rid, _ in rows]
                    if not worth_waiting(have, wanted, alphas, speeds, self.cost, (now - t0) * 1e3):
                        break
                self._cond.wait(left)
                for i in missing:
                    drafts[i] = self._peek(rows[i][0], rows[i][1], k_max)
            for i in waited:  # waited for and still missing drafts: late until its drafter sends some
                rid, ctx = rows[i]
                e = self._entries.get(rid)
                if e is not None and self._wants_more(rid, len(ctx), len(drafts[i]), want[i]):
                    e.late = True
                    if self.adaptive and e.ready and e.delivering and not drafts[i]:
                        e.acceptance.miss()  # asked for, none in time: adaptive gamma counts it
            withheld = sum(max(0, len(d) - w) for d, w in zip(drafts, want))
            drafts = [d[:w] for d, w in zip(drafts, want)]
            for (rid, ctx), d in zip(rows, drafts):
                e = self._entries.get(rid)
                if e is not None and e.rejected_at == len(ctx):
                    e.rejected_at = -1
                    self.metrics.branch_misses.inc()  # after a rejection, no branch had its drafts
                    e.missed.add(len(ctx))
                    while len(e.missed) > MAX_PROPOSALS:
                        e.missed.discard(min(e.missed))
                if d:
                    entry = self._entries[rid]  # `e` itself: a row with drafts has its entry
                    proposals = entry.proposals
                    proposals[len(ctx)] = d
                    if entry.hit_at == len(ctx):
                        entry.from_branch.add(len(ctx))
                    while len(proposals) > MAX_PROPOSALS:
                        del proposals[min(proposals)]
                    entry.from_branch &= proposals.keys()
        self.waited_s += time.monotonic() - t0
        if withheld:
            self.metrics.withheld_draft_tokens.inc(withheld)
        return drafts

    def _hold(self, rows: list[tuple[str, np.ndarray]], want: list[int], k_max: int) -> list[bool]:
        """Update each row's hold from its budget (adaptive only): a drafting row that could verify
        drafts (gamma, room left) but got none is held, one that got some is released. Returns
        whether each row was held before (its drafter has not drafted since)."""
        before = []
        for (rid, ctx), w in zip(rows, want):
            e = self._entries.get(rid)
            if e is None:
                before.append(False)
                continue
            before.append(e.held)
            cap = min(k_max, self._budget(e, len(ctx)))
            held = self.adaptive and e.drafting and cap > 0 and w == 0
            if e.held and not held:
                e.delivering = False  # released: its drafter catches up before it can draft again
            e.held = held
        return before

    def holding(self, req_id: str) -> bool:
        """Whether adaptive gamma holds the request's drafts (VerifyResponse.hold_drafts): it
        verified none of them in the step just proposed for, though it could have."""
        with self._cond:
            e = self._entries.get(req_id)
            return e is not None and e.held

    def take_proposal(self, req_id: str, length: int) -> list[int]:
        """The drafts proposed when the context had `length` tokens (forgotten after)."""
        return self.take_proposal_info(req_id, length)[0]

    def take_proposal_info(self, req_id: str, length: int) -> tuple[list[int], bool, bool]:
        """take_proposal, whether those drafts came from a pre-drafted branch (a hit), and
        whether the step followed a broken chain with no branch for it (a miss)."""
        with self._cond:
            e = self._entries.get(req_id)
            if e is None:
                return [], False, False
            for k in [k for k in e.proposals if k < length]:
                del e.proposals[k]
            hit, missed = length in e.from_branch, length in e.missed
            e.from_branch = {k for k in e.from_branch if k > length}
            e.missed = {k for k in e.missed if k > length}
            proposal = e.proposals.pop(length, [])
            return proposal, hit and bool(proposal), missed
