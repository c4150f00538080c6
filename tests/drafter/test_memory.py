"""The drafter's memory for its sessions' keys/values (drafter.memory): what a session reserves,
the budget found from the process's cgroup, the worker admitting a prompt's prefill only when
its reserve fits beside the sessions it holds (the others wait, in arrival order), and a session
that generates past its reserve growing it within the budget, or ending."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import model_variants
import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from drafter import memory
from drafter.kvcache import GrowingCache
from drafter.prefix_cache import PrefixCache
from drafter.server import DraftWorker, Emit
from drafter.sessions import DraftSession, ModelDraftSession, NgramDraftSession, Progress, Ready
from specdec import telemetry
from specdec.validation import OverLimit


def test_a_session_reserves_its_prompt_its_generation_up_to_a_cap_and_its_window() -> None:
    assert memory.reserve_slots(3000, 64, 9) == 3000 + 64 + 9 + 1
    assert memory.reserve_slots(3000, None, 9) == 3000 + memory.DECODE_RESERVE + 9 + 1
    assert memory.reserve_slots(10, 100_000, 2) == 10 + memory.DECODE_RESERVE + 2 + 1


def test_a_reserve_grows_by_the_decode_reserve_up_to_what_the_session_can_ever_hold() -> None:
    assert memory.cap_slots(3000, 4096, 9) == 3000 + 4096 + 9 + 1
    assert memory.cap_slots(3000, None, 9) == 0  # no max_tokens: no cap
    reserve = memory.reserve_slots(3000, 4096, 9)
    assert memory.grown_slots(reserve, reserve + 1, memory.cap_slots(3000, 4096, 9)) == reserve + memory.DECODE_RESERVE
    assert memory.grown_slots(reserve, reserve + 1, reserve + 10) == reserve + 10  # the cap
    assert memory.grown_slots(reserve, reserve + 2000, 0) == reserve + 2000  # a commit of many tokens


def test_an_admitted_context_reserves_room_for_its_next_generation_within_its_cap_and_the_budget() -> None:
    """As a prompt of its context's length would (module's terms), never under its reserve."""
    ahead = memory.DECODE_RESERVE + 1
    assert memory.admitted_slots(3522, 3009, 0) == 3522  # a new prompt: its reserve already holds it
    assert memory.admitted_slots(3522, 3809, 0) == 3809 + ahead  # a preempted session's grown context
    assert memory.admitted_slots(3522, 3809, 3809 + 100) == 3809 + 100  # its generation ends sooner
    assert memory.admitted_slots(3522, 3809, 0, most=4000) == 4000  # what the budget can ever hold
    assert memory.admitted_slots(3522, 3809, 0, most=3700) == 3809  # no less than its context


def test_one_tokens_bytes_are_its_keys_and_values_in_every_layer() -> None:
    cache = GrowingCache()
    for layer in range(3):  # [1, 2 KV heads, 5 tokens, 8 dims], float32
        cache.update(torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8), layer)
    views = [(layer.keys, layer.values) for layer in cache.layers]
    assert memory.token_bytes(views) == 3 * 2 * (2 * 8 * 4)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_cgroup_limit_is_the_least_of_the_group_and_the_groups_above_it(tmp_path: Path) -> None:
    # cgroup v2: the process's group (a Kubernetes container's) and its pod's above it
    root = tmp_path / "v2"
    _write(root / "memory.max", "max\n")
    _write(root / "kubepods" / "memory.max", str(8 << 30))
    _write(root / "kubepods" / "pod1" / "memory.max", str(6 << 30))
    _write(root / "kubepods" / "pod1" / "ctr" / "memory.max", "max\n")
    own = tmp_path / "cgroup-v2"
    _write(own, "0::/kubepods/pod1/ctr\n")
    assert memory.cgroup_limit(root, own) == 6 << 30
    # in its own cgroup namespace the container's group is the root
    _write(own, "0::/\n")
    _write(root / "memory.max", str(4 << 30))
    assert memory.cgroup_limit(root, own) == 4 << 30
    # cgroup v1: the memory controller's hierarchy; 2^63 rounded to pages means none
    v1 = tmp_path / "v1"
    _write(v1 / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")
    _write(v1 / "memory" / "job" / "memory.limit_in_bytes", str(3 << 30))
    mine = tmp_path / "cgroup-v1"
    _write(mine, "4:memory:/job\n3:cpu,cpuacct:/\n")
    assert memory.cgroup_limit(v1, mine) == 3 << 30
    _write(mine, "4:memory:/\n")
    assert memory.cgroup_limit(v1, mine) is None
    assert memory.cgroup_limit(tmp_path / "none", tmp_path / "missing") is None


def test_the_auto_budget_takes_a_share_of_the_limit_less_what_the_process_holds(tmp_path: Path) -> None:
    statm, meminfo = tmp_path / "statm", tmp_path / "meminfo"
    import os

    page = os.sysconf("SC_PAGE_SIZE")
    _write(statm, f"100000 {(1 << 30) // page} 0 0 0 0 0\n")  # 1 GiB resident
    _write(meminfo, f"MemTotal:       {24 << 20} kB\nMemFree: 1 kB\n")  # 24 GiB
    cpu = torch.device("cpu")
    budget, how = memory.auto_budget(cpu, 512 << 20, lambda: 6 << 30, meminfo, statm)
    assert budget == int((6 << 30) * memory.AUTO_SHARE_CGROUP) - (1 << 30) - (512 << 20)
    assert "cgroup" in how and "prefix cache" in how
    budget, how = memory.auto_budget(cpu, 0, lambda: None, meminfo, statm)  # no limit: a quarter of the host
    assert budget == 6 << 30 and "quarter" in how
    budget, how = memory.auto_budget(cpu, 512 << 20, lambda: 1 << 30, meminfo, statm)  # nothing left
    assert budget == memory.MIN_AUTO_BYTES and "under" in how


def _small_model() -> torch.nn.Module:
    return model_variants.small_qwen2(64)


# one token's keys and values in it: 2 layers x (keys + values) x 2 KV heads x 16 dims x 4 bytes
SMALL_TOKEN_BYTES = 2 * 2 * 2 * 16 * 4


def _session(
    model: torch.nn.Module, prompt_len: int, seed: int, max_tokens: int = 8, prefixes: PrefixCache | None = None
) -> ModelDraftSession:
    """A greedy model session of `prompt_len` prompt tokens (gamma 4, no lookahead), reserving
    what the servicer would; `prefixes`: the prefix cache its prefills look up (as the servicer's)."""
    slots = memory.reserve_slots(prompt_len, max_tokens, 4)
    session = ModelDraftSession(
        model,
        [3 + (seed * 7 + j) % 50 for j in range(prompt_len)],
        4,
        0,
        temperature=0.0,
        top_k=0,
        top_p=1.0,
        seed=seed,
        q_top_k=4,
        prefill_chunk=prompt_len,
        reserve_slots=slots,
        prefixes=None if prefixes is None else lambda s: prefixes.lookup(np.asarray(s.context, dtype=np.int64)),
    )
    session.slot_cap = memory.cap_slots(prompt_len, max_tokens, 4)
    return session


def _ignore(item: object) -> None:
    assert not isinstance(item, BaseException), item


def _step(worker: DraftWorker) -> list[DraftSession]:
    """One step of the worker, run here (not on its thread); the sessions it advanced."""
    active, _ = worker.pick_work()
    worker.advance(active)
    return [s for s, _ in active]


def test_a_prompt_waits_for_memory_in_arrival_order_and_starts_when_a_session_ends() -> None:
    """Budget for two prompts' reserves: the first two are prefilled; the third waits (once
    counted), and so does a small one behind it (arrival order); an n-gram session (no keys or
    values) is never held up. When the first session ends, the third starts, then the fourth.
    Each cache holds exactly its reserve, and the gauge never shows more than the budget."""
    model = _small_model()
    reserve = memory.reserve_slots(40, 8, 4) * SMALL_TOKEN_BYTES
    budget = memory.KVBudget(2 * reserve + 10 * SMALL_TOKEN_BYTES, SMALL_TOKEN_BYTES)  # 2 reserves, not a third
    metrics = telemetry.DrafterMetrics(CollectorRegistry())
    worker = DraftWorker(metrics=metrics, kv_budget=budget)  # not started: stepped here
    sessions = [_session(model, n, i) for i, n in enumerate([40, 40, 40, 12])]
    ngram = NgramDraftSession([1, 2, 3, 1, 2], gamma=2, lookahead=0, ngram_max=2, ngram_min=1)
    ngram.commit(5, [3])
    got: dict[int, list[object]] = {i: [] for i in range(len(sessions))}

    def emit_to(i: int) -> Emit:
        return lambda item: got[i].append(item)

    for i, s in enumerate(sessions):
        worker.add(s, emit_to(i))
    worker.add(ngram, _ignore)
    for _ in range(6):  # the first two prefill (a chunk each) and become ready; the n-gram session drafts
        _step(worker)
    assert [s.ready for s in sessions] == [True, True, False, False]
    assert [s.cached for s in sessions[2:]] == [0, 0]
    assert sessions[2].kv_waited and not sessions[3].kv_waited  # only the oldest waits; counted once
    assert metrics.registry.get_sample_value("specdec:drafter_kv_waits_total") == 1
    assert ngram.steps > 0
    for s in sessions[:2]:  # the cache allocated its reserve at once, and no more
        assert s.kv_bytes() == budget.need(s.reserve_slots)
    assert worker.kv_held() == 2 * reserve <= budget.budget_bytes
    assert [s for s in _step(worker) if not s.ready] == []  # still no prefill: nothing ended

    worker.remove(sessions[0])
    for _ in range(4):
        _step(worker)
    assert [s.ready for s in sessions[2:]] == [True, False]  # the third; the fourth waits for another end
    assert worker.kv_held() <= budget.budget_bytes
    worker.remove(sessions[1])
    for _ in range(2):
        _step(worker)
    assert sessions[3].ready
    assert all(any(isinstance(x, Ready) for x in got[i]) for i in (0, 1, 2, 3))
    assert metrics.registry.get_sample_value("specdec:drafter_kv_cache_bytes") <= budget.budget_bytes


def test_without_a_budget_every_prefill_starts_in_turn() -> None:
    model = _small_model()
    budget = memory.KVBudget(0, SMALL_TOKEN_BYTES)  # 0: no bound
    worker = DraftWorker(kv_budget=budget)
    sessions = [_session(model, 40, i) for i in range(3)]
    for s in sessions:
        worker.add(s, _ignore)
    for _ in range(3):
        _step(worker)
    assert all(s.ready for s in sessions) and not any(s.kv_waited for s in sessions)


@pytest.mark.parametrize("reserve", [0, 100])
def test_a_reserved_cache_allocates_its_slots_once(reserve: int) -> None:
    """With a reserve the first buffer holds it all: appends up to it never copy the cache, and
    it holds nothing more; without one, the cache grows with spare room (drafter.kvcache)."""
    cache = GrowingCache(reserve)
    cache.update(torch.zeros(1, 2, 40, 8), torch.zeros(1, 2, 40, 8), 0)
    buffer = cache.layers[0].keys.data_ptr()
    for _ in range(60):
        cache.update(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8), 0)
    moved = cache.layers[0].keys.data_ptr() != buffer
    if reserve:
        assert not moved and cache.nbytes() == 2 * reserve * 2 * 8 * 4
    else:
        assert cache.nbytes() > 2 * 100 * 2 * 8 * 4  # it grew past the 100 slots with room to spare


def _generated(n: int, seed: int) -> list[int]:
    """`n` tokens a target could have produced (ids of the small model's vocabulary)."""
    return [3 + (seed * 5 + j) % 50 for j in range(n)]


def _two_long_generations(
    room: int, cache: PrefixCache | None = None
) -> tuple[DraftWorker, list[ModelDraftSession], dict[int, list[object]]]:
    """A worker (stepped here) with two ready sessions of 40-token prompts and max_tokens 2,000,
    each admitted with its reserve (prompt + 512 + window + 1), under a budget of both reserves
    and `room` slots more; and what each session's stream got. With `cache`, the sessions'
    callers accept preemption (as the gateway does), and `cache` is the servicer's prefix cache:
    a retired or preempted session's keys/values go there, and prefills look there."""
    model = _small_model()
    sessions = [_session(model, 40, i, max_tokens=2000, prefixes=cache) for i in range(2)]
    reserve = sessions[0].reserve_slots
    assert reserve == 40 + memory.DECODE_RESERVE + 4 + 1
    budget = memory.KVBudget((2 * reserve + room) * SMALL_TOKEN_BYTES, SMALL_TOKEN_BYTES)

    def retire(session: DraftSession) -> None:  # the servicer's, for a model session
        assert cache is not None and isinstance(session, ModelDraftSession)
        with session.lock:
            cache.store(*session.kv_prefix())

    metrics = telemetry.DrafterMetrics(CollectorRegistry())
    worker = DraftWorker(metrics=metrics, kv_budget=budget, on_retire=None if cache is None else retire)
    got: dict[int, list[object]] = {0: [], 1: []}
    for i, s in enumerate(sessions):
        s.accepts_preemption = s.report_progress = cache is not None
        worker.add(s, lambda item, i=i: got[i].append(item))
    for _ in range(2):  # both prefill and are ready
        _step(worker)
    assert all(s.ready for s in sessions)
    return worker, sessions, got


def _overflows(worker: DraftWorker) -> float | None:
    assert worker.metrics is not None
    return worker.metrics.registry.get_sample_value("specdec:drafter_kv_overflows_total")


def test_sessions_past_their_reserves_grow_in_arrival_order_and_the_newest_ends() -> None:
    """Both sessions get commits that take their contexts past their reserves, and the budget
    has room for one growth: the older grows its reserve by 512 slots (its cache's next buffer
    holds exactly that); the newer, the newest admitted, ends (its stream gets RESOURCE_EXHAUSTED
    naming kv_cache_mib, counted), and the older drafts on. What is held never passes the budget."""
    worker, sessions, got = _two_long_generations(memory.DECODE_RESERVE)
    reserve, budget = sessions[0].reserve_slots, worker.kv_budget
    assert budget is not None
    for i, s in enumerate(sessions):  # the target's first tokens, then a long stretch of them
        s.commit(40, _generated(reserve - 40 + 1, i))
    assert sessions[0].slots_wanted() > reserve
    _step(worker)
    grown = reserve + memory.DECODE_RESERVE
    assert sessions[0].reserve_slots == grown and sessions[0].kv_bytes() == budget.need(grown)
    assert sessions[1].closed and worker.sessions() == [sessions[0]]
    (err,) = [x for x in got[1] if isinstance(x, BaseException)]
    assert isinstance(err, OverLimit) and "kv_cache_mib" in str(err) and "its own" in str(err)
    assert _overflows(worker) == 1
    assert worker.kv_held() <= budget.budget_bytes
    steps = sessions[0].steps
    for _ in range(3):
        _step(worker)
    assert sessions[0].steps > steps and not any(isinstance(x, BaseException) for x in got[0])
    assert worker.metrics is not None
    assert worker.metrics.registry.get_sample_value("specdec:drafter_kv_cache_bytes") <= budget.budget_bytes


def test_an_older_sessions_growth_ends_the_newest_session() -> None:
    """No room past the two reserves, and only the older session generates past its reserve:
    the newer one is ended for it (newest first, as vLLM preempts), and the older grows."""
    worker, sessions, got = _two_long_generations(0)
    reserve = sessions[0].reserve_slots
    sessions[0].commit(40, _generated(reserve - 40 + 1, 0))
    sessions[1].commit(40, _generated(8, 1))  # well within its reserve
    _step(worker)
    assert sessions[0].reserve_slots == reserve + memory.DECODE_RESERVE and not sessions[0].closed
    assert sessions[1].closed and _overflows(worker) == 1
    (err,) = [x for x in got[1] if isinstance(x, BaseException)]
    assert isinstance(err, OverLimit) and "an older session's" in str(err)
    assert worker.kv_budget is not None and worker.kv_held() <= worker.kv_budget.budget_bytes


def _preemptions(worker: DraftWorker) -> float | None:
    assert worker.metrics is not None
    return worker.metrics.registry.get_sample_value("specdec:drafter_kv_preemptions_total")


def _steps_until(worker: DraftWorker, done: Callable[[], bool], most: int = 20) -> None:
    for _ in range(most):
        if done():
            return
        _step(worker)
    assert done()


def _drafted(session: ModelDraftSession) -> list[int]:
    """The tokens `session` drafted past its committed context."""
    return session.context[session.committed :]


def test_the_newest_session_is_preempted_for_an_older_ones_growth_and_comes_back_when_it_fits() -> None:
    """As vLLM's scheduler preempts its newest request: no room past the two reserves, and the
    older session generates past its own. The newer session's caller accepts preemption: its
    keys/values go to the prefix cache, it lets go of them and of its unverified drafts, and its
    caller hears it (a report that says preempted and waiting_for_memory; no error). It waits
    while the older one holds the memory; once that ends it is admitted again, prefills its
    committed context from the prefix cache, says `ready`, and drafts what a session that never
    left would have drafted."""
    cache = PrefixCache(64 << 20, min_tokens=8)
    worker, sessions, got = _two_long_generations(0, cache)
    older, newer = sessions
    reserve = older.reserve_slots
    newer.commit(40, _generated(8, 1))
    _steps_until(worker, lambda: len(_drafted(newer)) >= 2)  # it drafts past its committed 48 tokens
    older.commit(40, _generated(reserve - 40 + 1, 0))
    _step(worker)
    assert older.reserve_slots == reserve + memory.DECODE_RESERVE and not older.closed
    assert not newer.closed and not newer.ready and not newer.admitted and newer.kv_bytes() == 0
    assert len(newer.context) == newer.committed == 48  # its drafts were dropped with its keys/values
    preempted = [x for x in got[1] if isinstance(x, Progress)]
    assert [(p.preempted, p.waiting_for_memory) for p in preempted] == [(True, True)]
    assert not any(isinstance(x, BaseException) for x in got[1])
    assert _preemptions(worker) == 1 and not _overflows(worker) and len(cache) == 1
    budget = worker.kv_budget
    assert budget is not None and worker.kv_held() <= budget.budget_bytes
    for _ in range(3):  # the older one's memory is still held: the newer one waits
        _step(worker)
    assert not newer.admitted and newer.cached == 0

    worker.remove(older)
    _steps_until(worker, lambda: newer.ready and len(_drafted(newer)) >= 3)
    ready = [x for x in got[1] if isinstance(x, Ready)]
    assert len(ready) == 2 and ready[1].prefilled_tokens == 48 and ready[1].reused_tokens >= 39
    assert worker.kv_held() <= budget.budget_bytes
    # drafts as from a session that prefilled the same 48 tokens and never left (greedy: the same ids)
    fresh = _session(newer.model, 47, 0)
    fresh.context = fresh.context[:0] + newer.context[:47]
    fresh.commit(47, [newer.context[47]])
    while len(_drafted(fresh)) < 3:
        fresh.step()
    assert _drafted(newer)[:3] == _drafted(fresh)[:3]


def test_a_session_whose_own_growth_does_not_fit_is_preempted_until_its_grown_reserve_does() -> None:
    """The newest session generates past its reserve while an older one holds the rest: it
    preempts itself, reserving its grown size (at least: as it waits for admission, its context
    and DECODE_RESERVE + 1 more), and is admitted again only once that fits."""
    cache = PrefixCache(64 << 20, min_tokens=8)
    worker, sessions, got = _two_long_generations(0, cache)
    older, newer = sessions
    reserve = newer.reserve_slots
    older.commit(40, _generated(8, 0))
    newer.commit(40, _generated(reserve - 40 + 1, 1))
    _step(worker)
    assert not newer.admitted and newer.reserve_slots >= reserve + memory.DECODE_RESERVE
    assert newer.reserve_slots == memory.admitted_slots(0, len(newer.context) + newer.window, newer.slot_cap)
    assert older.admitted and older.reserve_slots == reserve
    assert any(isinstance(x, Progress) and x.preempted for x in got[1]) and _preemptions(worker) == 1
    worker.remove(older)
    _steps_until(worker, lambda: newer.ready)
    assert newer.admitted and newer.kv_bytes() == SMALL_TOKEN_BYTES * newer.reserve_slots


@pytest.mark.parametrize("room", [100, 0])
def test_a_session_comes_back_with_room_for_its_next_tokens_and_is_not_preempted_again_at_once(room: int) -> None:
    """The newer session is preempted for the older one's growth, and its target decodes 600
    tokens while it waits. When the older one ends, it comes back reserving its context and
    DECODE_RESERVE + 1 more, as a prompt of that length would (with `room` 0 the budget holds
    less: all of it), so its next commits need no growth. (Reserving only its context, it would
    grow at its first step past it, and where that growth did not fit, the newest admitted
    session, itself, would be preempted again.)"""
    cache = PrefixCache(64 << 20, min_tokens=8)
    worker, sessions, got = _two_long_generations(room, cache)
    older, newer = sessions
    budget = worker.kv_budget
    assert budget is not None
    older.commit(40, _generated(older.reserve_slots - 40 + 1, 0))
    _step(worker)
    assert not newer.admitted and _preemptions(worker) == 1
    newer.commit(40, _generated(600, 1))  # its target decodes on while it waits
    worker.remove(older)
    _steps_until(worker, lambda: newer.ready)
    most = budget.budget_bytes // budget.token_bytes
    assert newer.reserve_slots == min(40 + 600 + newer.window + 1 + memory.DECODE_RESERVE, most)
    assert newer.kv_bytes() == budget.need(newer.reserve_slots)  # one buffer of it
    newer.commit(640, _generated(min(300, most - 640 - newer.window - 1), 2))
    _steps_until(worker, lambda: len(_drafted(newer)) >= 2)
    assert newer.admitted and _preemptions(worker) == 1 and worker.kv_held() <= budget.budget_bytes
    assert sum(isinstance(x, Ready) for x in got[1]) == 2


def test_a_growth_that_could_never_fit_ends_the_session_though_its_caller_accepts_preemption() -> None:
    """Preempted, it would never come back: its stream ends, as for a caller that does not
    accept preemption (RESOURCE_EXHAUSTED naming kv_cache_mib)."""
    worker, sessions, got = _two_long_generations(0, PrefixCache(64 << 20, min_tokens=8))
    budget = worker.kv_budget
    assert budget is not None
    newer = sessions[1]
    newer.commit(40, _generated(budget.budget_bytes // SMALL_TOKEN_BYTES, 1))  # more than the whole budget
    _step(worker)
    assert newer.closed and _overflows(worker) == 1 and not _preemptions(worker)
    (err,) = [x for x in got[1] if isinstance(x, BaseException)]
    assert isinstance(err, OverLimit) and "kv_cache_mib" in str(err)


def test_a_context_that_grew_while_its_prompt_waited_is_reserved_whole() -> None:
    """A request's target decodes while its drafter's prefill waits: the commits that come
    meanwhile are part of what the prefill computes, and its reserve covers them."""
    model = _small_model()
    session = _session(model, 40, 0, max_tokens=4000)
    worker = DraftWorker(kv_budget=memory.KVBudget(0, SMALL_TOKEN_BYTES))  # no bound: admitted at once
    worker.add(session, _ignore)
    session.commit(40, _generated(700, 0))
    for _ in range(40):  # the prefill, in chunks of 40 tokens, then a draft step
        if session.steps:
            break
        _step(worker)
    assert session.ready and session.reserve_slots >= 40 + 700 + session.window
    assert session.kv_bytes() == session.reserve_slots * SMALL_TOKEN_BYTES  # one buffer of the reserve


def test_a_grown_reserve_is_the_next_buffer_and_a_step_past_it_gets_little_spare_room() -> None:
    """drafter.kvcache: after `reserve(n)` the buffer that replaces a full one has exactly n
    slots; a step past a reserve its session had no time to grow (a commit that landed after
    the worker's check) gets GROW_SLOTS spare slots, not half again of the cache."""
    from drafter.kvcache import GROW_SLOTS

    cache = GrowingCache(50)
    cache.update(torch.zeros(1, 2, 50, 8), torch.zeros(1, 2, 50, 8), 0)  # the reserve, full
    slot = 2 * 2 * 8 * 4  # keys and values of one token: [1, 2 KV heads, 1, 8 dims], float32
    cache.reserve(120)
    cache.update(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8), 0)
    assert cache.nbytes() == 120 * slot
    cache.update(torch.zeros(1, 2, 100, 8), torch.zeros(1, 2, 100, 8), 0)  # 151 tokens: past 120
    assert cache.nbytes() == (151 + GROW_SLOTS) * slot
    assert cache.get_seq_length() == 151


def test_prompts_waiting_for_memory_hear_that_they_wait() -> None:
    """While the oldest waiting prompt does not fit, the prefill queue does not move: its
    sessions' progress reports say waiting_for_memory (without it their queued tokens, which
    grow with the target's tokens, would show no progress, and their gateways would drop them
    at drafter_timeout_s). Once a session ends and the prompt is admitted, its next report is a
    plain one, sent even with more tokens queued than the last."""
    model = _small_model()
    reserve = memory.reserve_slots(40, 8, 4) * SMALL_TOKEN_BYTES
    budget = memory.KVBudget(reserve, SMALL_TOKEN_BYTES)  # one prompt at a time
    worker = DraftWorker(kv_budget=budget, progress_interval_s=0.0)
    sessions = [_session(model, 40, i) for i in range(3)]
    got: dict[int, list[object]] = {i: [] for i in range(3)}
    for i, s in enumerate(sessions):
        s.report_progress = True
        worker.add(s, lambda item, i=i: got[i].append(item))
    for _ in range(3):  # the first prompt's prefill and `Ready`; the second does not fit
        _step(worker)
    assert sessions[0].ready and worker.memory_blocked
    for _ in range(2):
        worker.report_progress()
    for i in (1, 2):
        reports = [x for x in got[i] if isinstance(x, Progress)]
        assert len(reports) == 2 and all(r.waiting_for_memory for r in reports)
        assert reports[0].queued_tokens == reports[1].queued_tokens  # no progress, and still reported
    sessions[1].commit(40, _generated(5, 1))  # its target decodes meanwhile: more to prefill
    worker.remove(sessions[0])
    active, _ = worker.pick_work()
    assert not worker.memory_blocked and sessions[1] in [s for s, _ in active]
    worker.report_progress()
    last = [x for x in got[1] if isinstance(x, Progress)][-1]
    assert not last.waiting_for_memory and last.queued_tokens > 39  # 44 tokens to prefill now
