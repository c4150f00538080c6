"""The drafter's memory for its sessions' keys/values (drafter.memory): what a session reserves,
the budget found from the process's cgroup, and the worker admitting a prompt's prefill only
when its reserve fits beside the sessions it holds (the others wait, in arrival order)."""

from __future__ import annotations

from pathlib import Path

import model_variants
import pytest
import torch
from prometheus_client import CollectorRegistry

from drafter import memory
from drafter.kvcache import GrowingCache
from drafter.server import DraftWorker, Emit
from drafter.sessions import DraftSession, ModelDraftSession, NgramDraftSession, Ready
from specdec import telemetry


def test_a_session_reserves_its_prompt_its_generation_up_to_a_cap_and_its_window() -> None:
    assert memory.reserve_slots(3000, 64, 9) == 3000 + 64 + 9 + 1
    assert memory.reserve_slots(3000, None, 9) == 3000 + memory.DECODE_RESERVE + 9 + 1
    assert memory.reserve_slots(10, 100_000, 2) == 10 + memory.DECODE_RESERVE + 2 + 1


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
    assert budget == int((6 << 30) * memory.AUTO_SHARE) - (1 << 30) - (512 << 20)
    assert "cgroup" in how and "prefix cache" in how
    budget, how = memory.auto_budget(cpu, 0, lambda: None, meminfo, statm)  # no limit: a quarter of the host
    assert budget == 6 << 30 and "quarter" in how
    budget, how = memory.auto_budget(cpu, 512 << 20, lambda: 1 << 30, meminfo, statm)  # nothing left
    assert budget == memory.MIN_AUTO_BYTES and "under" in how


def _small_model() -> torch.nn.Module:
    return model_variants.small_qwen2(64)


# one token's keys and values in it: 2 layers x (keys + values) x 2 KV heads x 16 dims x 4 bytes
SMALL_TOKEN_BYTES = 2 * 2 * 2 * 16 * 4


def _session(model: torch.nn.Module, prompt_len: int, seed: int) -> ModelDraftSession:
    slots = memory.reserve_slots(prompt_len, 8, 4)
    return ModelDraftSession(
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
    )


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
