"""Batched drafting (drafter.batch) drafts exactly what the serial loop drafts.

Both runs drive a real DraftWorker (its `advance`, as its thread does) through one script:
sessions with prompts of different lengths open at different steps, commits accept and
reject different amounts per row (so each row's cache rolls back by its own amount), a
session is held for a while, and sessions close mid-run. Greedy: the same ids; sampled:
the same tokens from the same seeds, and the same q up to float tolerance.
"""

from __future__ import annotations

import model_variants
import pytest
import torch
from transformers import AutoModelForCausalLM

from drafter import batch, rows
from drafter.kvcache import GrowingCache
from drafter.server import DraftWorker, work_order
from drafter.sessions import BlockOut, ModelDraftSession, Ready
from specdec.models import resolve
from specdec.models.lean import LeanDecoder

pytestmark = pytest.mark.e2e  # the tiny draft model, loaded with transformers (tests/conftest.py tiers)

VOCAB = 512  # ids drawn by the script stay in the tiny tokenizer's range
# (open step, prompt length, seed, branches)
OPENS = [(0, 1, 11, 0), (0, 7, 12, 3), (0, 40, 13, 0), (2, 17, 14, 0), (5, 3, 15, 3), (9, 58, 16, 0)]
CLOSES = {1: 14, 3: 30}  # session index -> the step it closes at
HOLDS = {2: (6, 10)}  # session index -> (held from, released at)


@pytest.fixture(scope="module", params=["transformers", "lean"])
def model(request: pytest.FixtureRequest) -> torch.nn.Module:
    """The tiny draft with transformers' forward, and with the lean one the drafter runs on the CPU."""
    loaded = AutoModelForCausalLM.from_pretrained(resolve("tiny/draft-mid")).eval()
    return LeanDecoder(loaded) if request.param == "lean" else loaded


def _run(model: torch.nn.Module, batched: bool, temperature: float, steps: int = 48) -> dict[int, list]:
    """Run the script; per session, what it emitted: (kind, start, [(id, prob, support, conf, alts)])."""
    worker = DraftWorker(batch=batched)
    sessions: dict[int, ModelDraftSession] = {}
    emitted: dict[int, list] = {}
    batch_sizes = []

    def emit_to(k: int):
        def emit(item: object) -> None:
            assert not isinstance(item, BaseException), item
            if isinstance(item, Ready):
                emitted[k].append(("ready", item.prefilled_tokens, []))
            elif isinstance(item, BlockOut):
                emitted[k].append(
                    (
                        "block",
                        item.start_position,
                        [(d.token_id, d.prob, d.support, d.conf, d.alts) for d in item.drafts],
                    )
                )

        return emit

    for step in range(steps):
        for k, (at, length, seed, branches) in enumerate(OPENS):
            if at == step:
                prompt = [(seed * 31 + 7 * j) % VOCAB for j in range(length)]
                s = ModelDraftSession(
                    model,
                    prompt,
                    4,
                    5,
                    temperature=temperature,
                    top_k=0,
                    top_p=1.0,
                    seed=seed,
                    q_top_k=8,
                    prefill_chunk=16,
                )
                s.branches = branches
                s.flush_ms = 1e9  # blocks end at gamma drafts or when final, never on a timer: comparable runs
                sessions[k], emitted[k] = s, []
                worker.add(s, emit_to(k))
                # the target's first token came before the prefill ended: urgent, it joins at once
                s.commit(length, [(seed * 5) % VOCAB])
        for k, s in list(sessions.items()):
            if CLOSES.get(k) == step:
                worker.remove(s)
                del sessions[k]
                continue
            if not s.ready or (step + k) % 4:  # a verdict every fourth step, staggered per row
                continue
            held = HOLDS.get(k, (-1, -1))
            hold = held[0] <= step < held[1]
            drafted = s.sent - s.committed  # the verifier saw these drafts
            if s.started and not drafted and not hold and not s.held:
                continue
            accept = (step + 2 * k) % 5  # 0..4 drafts accepted: each row rolls back its own amount
            if drafted > accept:  # reject the next draft: the correction differs from it
                tokens = s.context[s.committed : s.committed + accept] + [(s.context[s.committed + accept] + 1) % VOCAB]
            else:  # every draft accepted, then a bonus token
                tokens = s.context[s.committed : s.sent] + [(step * 13 + k) % VOCAB]
            s.commit(s.committed, tokens, hold=hold)
        live = [(s, e) for s, e in worker._sessions.values()]
        active = [(s, e) for s, e in live if s.wants_work()]
        active = work_order(active, batched=True)  # the batched worker's order, for both runs
        if active:
            worker.advance(active)
            batch_sizes.append(worker.last_batch)
        else:
            worker._branch_steps([(s, e) for s, e in live if s.wants_branch()])
    emitted["batch sizes"] = batch_sizes
    return emitted


def _same(serial: dict, batched: dict) -> None:
    for k in range(len(OPENS)):
        assert len(serial[k]) == len(batched[k]), k
        for (kind_a, start_a, drafts_a), (kind_b, start_b, drafts_b) in zip(serial[k], batched[k], strict=True):
            assert (kind_a, start_a) == (kind_b, start_b), k
            assert [d[0] for d in drafts_a] == [d[0] for d in drafts_b], (k, start_a)  # the same ids
            for a, b in zip(drafts_a, drafts_b, strict=True):
                assert a[1] == pytest.approx(b[1], rel=1e-4, abs=1e-6)  # q(token)
                assert a[3] == pytest.approx(b[3], rel=1e-4, abs=1e-6)  # conf
                if a[2] is not None:  # sampled: the same support, the same q
                    assert a[2][0] == b[2][0]
                    assert a[2][1] == pytest.approx(b[2][1], rel=1e-4, abs=1e-6)
                assert [t for t, _ in a[4]] == [t for t, _ in b[4]]  # branch alternatives
                assert [q for _, q in a[4]] == pytest.approx([q for _, q in b[4]], rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_batched_drafts_equal_serial_drafts(model: torch.nn.Module, temperature: float) -> None:
    serial = _run(model, batched=False, temperature=temperature)
    batched = _run(model, batched=True, temperature=temperature)
    _same(serial, batched)
    drafted = sum(len(d) for k in range(len(OPENS)) for kind, _, d in batched[k] if kind == "block")
    assert drafted > 100  # the script drafts: the comparison is not vacuous
    assert max(batched["batch sizes"]) >= 4  # rows were batched, with ragged lengths and rollbacks


def test_a_steps_sessions_split_into_forwards_that_read_at_most_the_cap() -> None:
    ones = [1, 1, 1, 1]
    assert batch.forward_groups([0, 1, 2, 3], [10, 20, 30, 40], ones, most=50) == [[0, 1], [2], [3]]
    assert batch.forward_groups([5], [100], [1], most=50) == [[5]]  # a session over the cap alone: its own forward
    assert batch.forward_groups([0, 1], [10, 20], [1, 1]) == [[0, 1]]  # MAX_FORWARD_TOKENS
    # the tokens fed too: a commit's catch-up is a forward's activations
    assert batch.forward_groups([0, 1, 2], [10, 10, 10], [300, 300, 5], most_new=400) == [[0], [1, 2]]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_drafts_split_over_several_forwards_equal_serial_drafts(
    model: torch.nn.Module, temperature: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a cap of 90 context tokens a forward (batch.MAX_FORWARD_TOKENS; ~32,000 in
    production, which bounds a forward's memory), the script's steps split their sessions over
    several forwards, and every draft is the serial one."""
    monkeypatch.setattr(batch, "MAX_FORWARD_TOKENS", 90)
    forwards: list[int] = []
    real = batch.forward_rows

    def counted(m: torch.nn.Module, sessions: list[ModelDraftSession], extra: list[rows.Row]) -> torch.Tensor:
        forwards.append(len(sessions))
        return real(m, sessions, extra)

    monkeypatch.setattr(batch, "forward_rows", counted)
    serial = _run(model, batched=False, temperature=temperature)
    split = _run(model, batched=True, temperature=temperature)
    _same(serial, split)
    assert forwards and max(forwards) < max(split["batch sizes"])  # a step's sessions ran in several forwards


@pytest.mark.parametrize("kind", ["tiny-draft", "qwen2-gqa"])
def test_a_batched_row_equals_a_single_forward(model: torch.nn.Module, kind: str) -> None:
    """forward_rows on rows of different cached lengths and new-token counts gives each row the
    logits of its own serial forward, and leaves each row's cache as the serial forward would."""
    if kind == "qwen2-gqa":
        lean = isinstance(model, LeanDecoder)
        model = model_variants.small_qwen2(VOCAB)  # the batched attention with grouped KV heads
        assert model.config._attn_implementation == "sdpa"
        if lean:
            model = LeanDecoder(model)

    def session(length: int) -> ModelDraftSession:
        return ModelDraftSession(
            model,
            [(5 * j + 3) % VOCAB for j in range(length)],
            4,
            0,
            temperature=0.0,
            top_k=0,
            top_p=1.0,
            seed=0,
            q_top_k=8,
        )

    lengths = [(9, 1), (1, 3), (30, 5), (12, 2)]  # (cached, new)
    rows, twins = [session(c + n) for c, n in lengths], [session(c + n) for c, n in lengths]
    for (cached, _), a, b in zip(lengths, rows, twins, strict=True):
        if cached:
            a._forward(cached)
            b._forward(cached)
    logits = batch.forward_rows(model, rows)  # [B, vocab]
    assert model.config._attn_implementation in ("sdpa", "eager")  # restored after the batched forward
    for i, (a, b) in enumerate(zip(rows, twins, strict=True)):
        want = b._forward(len(b.context))  # [vocab]
        torch.testing.assert_close(logits[i], want, rtol=1e-4, atol=1e-4)
        assert a.cached == b.cached and a.cache.get_seq_length() == b.cache.get_seq_length() == len(a.context)
        for la, lb in zip(a.cache.layers, b.cache.layers, strict=True):
            torch.testing.assert_close(la.keys, lb.keys, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(la.values, lb.values, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scores_bytes", [rows.SCORES_BYTES, 1], ids=["all-queries", "one-query-at-a-time"])
@pytest.mark.parametrize("share_min", [0, rows.SHARE_MIN, None], ids=["shared", "default", "gathered"])
def test_rows_reading_one_cache_equal_their_own_forwards(
    model: torch.nn.Module, share_min: int | None, scores_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows that read one session's cache up to different positions (branch rows: the cache's
    prefix, then keys of their own; a row reading all of it; the session's own row) beside a row
    with a cache of its own, ragged new tokens: each row's logits are its own serial forward's,
    whether the shared prefix is attended where it lies or gathered per row, and whether the
    lean forward attends the step's queries all at once or in chunks (rows.SCORES_BYTES: here one
    query at a time); and the lean forward reads the prefix in one part for the rows that share
    it, at the default only from SHARE_MIN tokens."""
    monkeypatch.setattr(rows, "SCORES_BYTES", scores_bytes)
    assert rows.SHARE_MIN > 40  # this test's prefix: the default gathers it
    context = [(7 * j + 3) % VOCAB for j in range(40)]
    other = [(5 * j + 1) % VOCAB for j in range(12)]

    def cache_of(tokens: list[int]) -> GrowingCache:
        cache = GrowingCache()
        rows.forward(model, [rows.Row(tokens, 0, lambda layer: [], cache)])
        return cache

    session, own, mine = cache_of(context[:30]), cache_of(other[:9]), GrowingCache()
    # a branch at 12 with 3 keys of its own: context[:12] + branch[:3] cached, branch[3:] new
    branch = [(11 * j + 5) % VOCAB for j in range(4)]
    branch_cache = GrowingCache()
    rows.forward(model, [rows.Row(branch[:3], 12, lambda layer: rows.layer_kv(session, layer, 12), branch_cache)])
    batch_rows = [
        rows.Row(context[30:32], 30, lambda layer: rows.layer_kv(session, layer), session),  # the session's own
        rows.Row(
            branch[3:],
            15,
            lambda layer: rows.layer_kv(session, layer, 12) + rows.layer_kv(branch_cache, layer),
            branch_cache,
        ),
        rows.Row([17, 18], 30, lambda layer: rows.layer_kv(session, layer, 30), mine),  # all of it, nothing of its own
        rows.Row([19, 20, 21, 22], 5, lambda layer: rows.layer_kv(session, layer, 5), GrowingCache()),
        rows.Row(other[9:], 9, lambda layer: rows.layer_kv(own, layer), own),  # a cache no other row reads
    ]
    wants = [
        context[:32],
        context[:12] + branch,
        context[:30] + [17, 18],
        context[:5] + [19, 20, 21, 22],
        other,
    ]
    parts: list[int] = []
    partial = rows._partial_attention

    def counted(query: torch.Tensor, keys: torch.Tensor, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
        parts.append(query.shape[0] if keys.shape[0] == 1 else 0)  # rows reading one row's keys; 0: the gathered rest
        return partial(query, keys, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(rows, "_partial_attention", counted)
    logits = rows.forward(model, batch_rows, share_min)  # [5, vocab]
    for i, want in enumerate(wants):
        reference = ModelDraftSession(model, want, 4, 0, temperature=0.0, top_k=0, top_p=1.0, seed=0, q_top_k=8)
        torch.testing.assert_close(logits[i], reference._forward(len(want)), rtol=1e-4, atol=1e-4)
    assert [len(r.cache.layers[0].keys[0, 0]) for r in batch_rows] == [32, 4, 2, 4, 12]  # the new keys appended
    layers = int(model.config.num_hidden_layers)
    if isinstance(model, LeanDecoder) and share_min == 0:
        chunks = 4 if scores_bytes == 1 else 1  # one query at a time: the 4 new slots
        # per layer (and chunk of queries): the gathered rest, then the 4 rows reading the session's cache
        assert parts == [0, 4] * layers * chunks
    else:
        assert parts == []  # gathered whole (transformers' forward: always; the default: a prefix this short)


def _continuation(model: torch.nn.Module, context: list[int], n: int) -> list[int]:
    """The draft model's greedy continuation of `context`, n tokens, drafted by a session of its own."""
    s = ModelDraftSession(model, context[:-1], n, 0, temperature=0.0, top_k=0, top_p=1.0, seed=0, q_top_k=8)
    s.commit(len(context) - 1, context[-1:])
    drafts: list[int] = []
    while s.wants_work():
        out = s.step()
        if isinstance(out, BlockOut):
            drafts += [d.token_id for d in out.drafts]
    return drafts


@pytest.mark.parametrize("ride", [2, 4])
def test_branch_rows_ride_in_the_forward_that_drafts_ahead(model: torch.nn.Module, ride: int) -> None:
    """With ride_branches (`ride` rows a batch), each session's branch rows are drafted in the
    forwards that draft its lookahead (its row, its branch rows and the other session's row in
    one forward): branches finish while the window fills, with no forward of their own; every
    branch (those finished in idle time after it included) is the draft's greedy continuation
    of context[:p] + [t]; and the sessions' own drafts are a worker's without riding."""
    gamma = 3
    prompts = [[(7 * j + 3) % VOCAB for j in range(11)], [(5 * j + 1) % VOCAB for j in range(4)]]

    def run(ride: int) -> tuple[list[ModelDraftSession], list[list[BlockOut]], list[int]]:
        worker = DraftWorker(batch=True, ride_branches=ride)
        sessions, out, rows = [], [], []
        for prompt in prompts:
            s = ModelDraftSession(model, prompt, gamma, gamma + 1, 0.0, 0, 1.0, 0, 8)
            s.branches, s.flush_ms = 4, 1e9
            emitted: list[BlockOut] = []

            def emit(item: object, emitted: list[BlockOut] = emitted) -> None:
                assert not isinstance(item, BaseException), item
                if isinstance(item, BlockOut):
                    emitted.append(item)

            worker.add(s, emit)
            s.commit(len(prompt), [35])
            sessions.append(s)
            out.append(emitted)
        while active := [(s, e) for s, e in worker._sessions.values() if s.wants_work()]:
            worker.advance(active)
            rows.append(worker.last_batch)
        rows.append(-1)  # the window is full: then the branches left, in idle time
        rows.append(sum(b.branch for blocks in out for b in blocks))  # ... after those that rode
        while branchy := [(s, e) for s, e in worker._sessions.values() if s.wants_branch()]:
            worker._branch_steps(branchy)
        return sessions, out, rows

    plain, plain_out, plain_rows = run(0)
    rode, rode_out, rode_rows = run(ride)
    assert rode_rows[:-1] == plain_rows[:-1]  # the same forwards: the branch rows added none
    assert plain_rows[-1] == 0 and rode_rows[-1] >= 2 * ride  # branches finished in the forwards they rode in
    for s, t, blocks, plain_blocks in zip(rode, plain, rode_out, plain_out, strict=True):
        assert s.context == t.context
        assert [(b.start_position, [d.token_id for d in b.drafts]) for b in blocks if not b.branch] == [
            (b.start_position, [d.token_id for d in b.drafts]) for b in plain_blocks if not b.branch
        ]
        branches = [b for b in blocks if b.branch]
        candidates = {(p, c) for _, p, c in s.branch_candidates()}
        drafted = {(b.start_position, b.drafts[0].token_id) for b in branches}
        assert len(candidates) == 4 and candidates <= drafted and len(drafted) == len(branches) == s.branches_drafted
        assert not s.wants_branch()  # nothing is left
        for b in branches:
            p, c = b.start_position, b.drafts[0].token_id
            assert [d.token_id for d in b.drafts[1:]] == _continuation(model, s.context[:p] + [c], gamma), (p, c)


def test_branch_rows_ride_only_where_no_verifier_waits(model: torch.nn.Module) -> None:
    """A forward with an urgent row (a verifier waits for its drafts) carries no branch rows, even
    for a session drafting ahead that has candidates; the next forward without one does."""
    gamma = 3
    ahead = ModelDraftSession(model, [(7 * j + 3) % VOCAB for j in range(9)], gamma, gamma + 1, 0.0, 0, 1.0, 0, 8)
    urgent = ModelDraftSession(model, [(5 * j + 1) % VOCAB for j in range(6)], gamma, gamma + 1, 0.0, 0, 1.0, 0, 8)
    ahead.branches = urgent.branches = 4
    for s in (ahead, urgent):
        while not isinstance(s.step(), Ready):
            pass
    ahead.commit(9, [35])
    while len(ahead.context) - ahead.committed < gamma:  # the block being verified is drafted
        ahead.step()
    urgent.commit(6, [36])
    assert ahead.rides() and not ahead.urgent() and urgent.urgent()
    rows: list[int] = []
    for _, exc, blocks in batch.draft_step([ahead, urgent], rows.append, ride=2):
        assert exc is None and not blocks
    assert rows == [2] and ahead._branch_job is None  # no branch rows joined
    batch.draft_step([ahead], rows.append, ride=2)
    assert rows == [2, 3] and ahead._branch_job is not None  # alone, drafting ahead: its 2 best ride
