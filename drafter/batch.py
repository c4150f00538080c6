"""Batched drafting: one forward of the draft model advances every session that drafts a token.

The draft worker serves one model. In a step, each session that has a draft token to make
(drafter.sessions.ModelDraftSession) needs `new` = context[cached:] fed through the model:
one token in steady state, a few after a commit. `draft_step` runs all of them as ONE
forward (drafter.rows: ragged rows, each session's own cache gathered per step), then lets
each session pick its token from its own row's logits (greedy, or sampled with its own
torch.Generator), exactly as its serial `step` would.

Each session keeps its own transformers DynamicCache (commit rolls it back with `crop`, as in
the serial path), and each row's new keys/values are appended to it after the forward. So
rows join and leave between steps freely: a step batches whichever sessions have work.

A session's branch rows (drafter.sessions, "branch") are rows too: a branch batch is a
forward of its own (in idle time), or, with `ride`, its rows join the forward that drafts the
session's own token ahead.

Not batched (stepped per session as before): prefill chunks (a prompt chunk is up to
`prefill_chunk` tokens: padding a batch of 1-token rows to it would waste the step), the
steps that only flush or resend a block, and n-gram sessions.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence

import torch

from drafter.rows import Row, batchable, forward, layer_kv
from drafter.sessions import DRAFT_NEEDED, BlockOut, DraftSession, ModelDraftSession, Ready
from specdec.models.lean import Stopped

StepResult = BlockOut | Ready | None

# Most context tokens one batched forward reads (each session's context, once per row: its own
# and its riding branch rows'); a step whose sessions read more runs several forwards. The
# forward's workspace (the gathered keys/values, the attention scores, the activations, one
# layer at a time) grows with them, and it is not the sessions' keys/values budget
# (drafter.memory): 36 sessions of 3,000 tokens catching up 300-token commits peaked 3.2 GiB over
# their start in forwards without this bound, MAX_FORWARD_NEW and rows.SCORES_BYTES, 1.2 GiB with
# them (`python -m benchmarks.forward_memory --sessions 36 --commit-tokens 300`). At this many
# (the qwen-coder draft: gathered keys/values ~32 MiB a layer) a split's extra weight reads are
# small beside the attention.
MAX_FORWARD_TOKENS = 32_768
# Most tokens one batched forward feeds (its rows' new tokens: one a session in steady state, a
# commit's worth when a session catches up on its target's tokens): the layers' activations, the
# MLP's above all (~40 KiB a token for the qwen-coder draft), grow with them.
MAX_FORWARD_NEW = 1024


def session_row(session: ModelDraftSession) -> Row:
    """A session's row: context[cached:] after its whole cache."""
    return Row(
        session.context[session.cached :], session.cached, lambda layer: layer_kv(session.cache, layer), session.cache
    )


def forward_rows(
    model: torch.nn.Module, sessions: Sequence[ModelDraftSession], extra: Sequence[Row] = ()
) -> torch.Tensor:
    """Feed each session's context[cached:] through `model` in one forward (`forward`), then
    the `extra` rows (branch rows riding in it); each session's `cached` becomes len(context).
    Returns the logits of each row's last token [sessions + extra, vocab]. The caller holds
    every session's lock. The forward stops (specdec.models.lean.Stopped, nothing changed)
    once every session is superseded (drafter.sessions): none of its rows would be used."""

    def stop() -> bool:
        return all(s.superseded for s in sessions)

    logits = forward(model, [session_row(s) for s in sessions] + list(extra), stop=stop)
    for s in sessions:
        s.forward_tokens += len(s.context) - s.cached
        s.cached = len(s.context)
    return logits


Stepped = tuple[StepResult, BaseException | None, list[BlockOut]]


def draft_step(
    sessions: Sequence[DraftSession], on_forward: Callable[[int], None] | None = None, ride: int = 0
) -> list[Stepped]:
    """One step of each session, as `session.step()` would do it, with the model sessions
    that draft a token batched into one forward per model. Returns, per session in order,
    (its step's result, None, the branch blocks the step finished) or (None, the exception
    that failed it, []).

    `ride` (> 0): in a forward where no row is urgent (no verifier waits for it), a model
    session whose token drafts ahead (`ModelDraftSession.rides`) adds the rows of its branch
    batch, starting a batch of its `ride` best candidates if none is under way: the branch rows
    ride in the forward that drafts the session's own token, which reads the weights anyway
    (drafter.sessions, "ride"). 0: branches only in idle time.

    `on_forward(rows)` is called after each forward of the draft model that drafted tokens:
    a batched forward with its rows (branch rows included), a model session's own forward with
    1 (what the drafter's `specdec:drafter_batch_rows` histogram observes). n-gram sessions
    make no forward."""
    results: list[Stepped] = [(None, None, [])] * len(sessions)
    with contextlib.ExitStack() as locks:
        rows: dict[int, list[int]] = {}  # id(model) -> indices of the sessions that draft with it
        for i, s in enumerate(sessions):
            locks.enter_context(s.lock)
            try:
                first = s.step_begin_locked()
            except Exception as exc:  # noqa: BLE001 - handed to the worker, which removes the session
                results[i] = (None, exc, [])
                continue
            if first is not DRAFT_NEEDED:
                results[i] = (first, None, [])
            elif isinstance(s, ModelDraftSession) and batchable(s.model):
                rows.setdefault(id(s.model), []).append(i)
            else:
                try:
                    results[i] = (s.step_draft_locked(time.perf_counter()), None, [])
                except Exception as exc:  # noqa: BLE001
                    results[i] = (None, exc, [])
                    continue
                if on_forward is not None and isinstance(s, ModelDraftSession):
                    on_forward(1)
        for members in rows.values():
            batch = [s for i in members if isinstance(s := sessions[i], ModelDraftSession)]
            assert len(batch) == len(members)
            # branch rows ride only where no verifier waits for this forward (no row is urgent)
            ride_here = ride > 0 and not any(s.urgent() for s in batch)
            riders = {i: s.branch_rows_locked(ride) if ride_here and s.rides() else [] for i, s in zip(members, batch)}
            # a batch of one: the serial step itself (no mask, no gather)
            if len(members) == 1 and not riders[members[0]]:
                i = members[0]
                stopped = batch[0].forwards_stopped
                try:
                    results[i] = (sessions[i].step_draft_locked(time.perf_counter()), None, [])
                except Exception as exc:  # noqa: BLE001
                    results[i] = (None, exc, [])
                    continue
                if on_forward is not None and batch[0].forwards_stopped == stopped:
                    on_forward(1)
                continue
            reads = [len(s.context) * (1 + len(riders[i])) for i, s in zip(members, batch)]  # context tokens read
            fed = [len(s.context) - s.cached + sum(len(r.new) for r in riders[i]) for i, s in zip(members, batch)]
            for group in forward_groups(members, reads, fed):
                _forward_group([sessions[i] for i in group], group, riders, results, on_forward)
    return results


def forward_groups(
    members: list[int], tokens: list[int], new: list[int], most: int | None = None, most_new: int | None = None
) -> list[list[int]]:
    """`members` (sessions' indices, in order) in consecutive groups whose `tokens` (each
    session's context, once per row it adds) sum to `most` (None: MAX_FORWARD_TOKENS) at most and
    whose `new` (the tokens each feeds) to `most_new` (None: MAX_FORWARD_NEW), but for a group of
    one session over them alone: one forward each."""
    most = MAX_FORWARD_TOKENS if most is None else most
    most_new = MAX_FORWARD_NEW if most_new is None else most_new
    groups: list[list[int]] = [[]]
    total = fed = 0
    for i, n, m in zip(members, tokens, new, strict=True):
        if groups[-1] and (total + n > most or fed + m > most_new):
            groups.append([])
            total = fed = 0
        groups[-1].append(i)
        total, fed = total + n, fed + m
    return groups


def _forward_group(
    batch: list[DraftSession],
    members: list[int],
    riders: dict[int, list[Row]],
    results: list[Stepped],
    on_forward: Callable[[int], None] | None,
) -> None:
    """One forward for the model sessions `batch` (at `members` of the step's sessions) and their
    riding branch rows; each session's step result goes to `results` (draft_step's)."""
    models = [s for s in batch if isinstance(s, ModelDraftSession)]
    assert len(models) == len(batch)  # only model sessions are batched
    t0 = time.perf_counter()
    done: set[int] = set()
    try:
        branch_rows = [r for i in members for r in riders[i]]
        logits = forward_rows(models[0].model, models, branch_rows)  # [B + branch rows, vocab]
        share_ms = (time.perf_counter() - t0) * 1e3 / (len(models) + len(branch_rows))  # each row's share
        if on_forward is not None:
            on_forward(len(models) + len(branch_rows))
        at = len(models)  # the first branch row's logits
        for row, (i, s) in enumerate(zip(members, models)):
            out = s.step_draft_locked(t0, s.pick_locked(logits[row]), share_ms)
            n = len(riders[i])
            blocks = s.branch_picked_locked(logits[at : at + n], share_ms * n) if n else []
            at += n
            results[i] = (out, None, blocks)
            done.add(i)
    except Stopped:  # every session was superseded mid-forward: no step happened
        for s in models:
            s.forwards_stopped += 1
    except Exception as exc:  # noqa: BLE001 - the forward failed: every row's step did
        for i in members:
            if i not in done:
                results[i] = (None, exc, [])
