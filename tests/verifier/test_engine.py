"""The engine's translation of vLLM's outputs (verifier/engine.py), without vLLM."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from specdec.config import VerifierConfig
from verifier.engine import _logprobs


@dataclass
class Logprob:  # vllm.logprobs.Logprob's fields
    logprob: float
    rank: int | None
    decoded_token: str | None = None


def test_logprobs_keep_vllms_top_k_by_rank() -> None:
    k = 2
    positions = [
        {5: Logprob(-0.1, 1), 6: Logprob(-2.0, 2)},  # sampled = the best: k entries
        {9: Logprob(-3.0, 4), 5: Logprob(-0.2, 1), 6: Logprob(-1.0, 2)},  # sampled outside the top k
    ]
    out = _logprobs(positions, [5, 9], k)
    assert [(o.token_id, o.logprob, o.rank) for o in out] == [(5, -0.1, 1), (9, -3.0, 4)]
    assert out[0].top_token_ids == [5, 6] and out[0].top_logprobs == [-0.1, -2.0]
    assert out[1].top_token_ids == [5, 6] and out[1].top_logprobs == [-0.2, -1.0]


def test_logprobs_follow_the_tokens_kept() -> None:
    """A verdict cut at max_tokens keeps the logprobs of the tokens it keeps."""
    positions = [{1: Logprob(-0.5, 1)}, {2: Logprob(-0.7, 1)}]
    assert [o.token_id for o in _logprobs(positions, [1], 0)] == [1]
    assert _logprobs(positions, [1, 2], 0)[1].top_token_ids == []


def _bare_engine(cfg: VerifierConfig | None = None):
    """A TargetEngine, not started, over no vLLM engine: the session-facing calls and the draft board."""
    from prometheus_client import CollectorRegistry

    from specdec import telemetry
    from verifier.engine import TargetEngine
    from verifier.proposer import DraftBoard
    from verifier.vllm_hooks import ModelFacts

    metrics = telemetry.VerifierMetrics(CollectorRegistry())
    cfg = cfg or VerifierConfig()
    return TargetEngine(cfg, None, DraftBoard(metrics=metrics), metrics, ModelFacts(100, [0], {0}))


class _Clock:
    """verifier.engine's `time` for one test: sleep advances a fake clock and runs `on_sleep`
    (arrivals during that wait) instead of waiting."""

    def __init__(self, on_sleep: Callable[[], None]) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []
        self.on_sleep = on_sleep

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        self.on_sleep()


def _with_prompts(eng, *lengths: int) -> None:
    """Requests of these prompt lengths just added to the engine (as _add records them)."""
    from types import SimpleNamespace

    from verifier.engine import GenerationRequest, _Live

    params = SimpleNamespace(max_tokens=10, stop_token_ids=None, logprobs=None)  # vllm.SamplingParams's fields
    for n in lengths:
        rid = f"r{len(eng._live)}"  # after those already there
        req = GenerationRequest(rid, [1] * n, gamma=4, params=params)
        eng._live[rid] = _Live(req, lambda v: None, engine_id=f"{rid}-e")


def test_an_idle_engine_gathers_a_burst_only_when_its_prompts_are_cheaper_than_a_step() -> None:
    """c p + 2 w < base: short prompts wait for the rest of their burst, a long one starts at
    once (as on vLLM's server), and nothing waits before the costs are measured."""
    eng = _bare_engine()  # batch_window_ms 20
    _with_prompts(eng, 31)
    assert not eng._gathering_pays()  # no decode step measured yet
    for n in (1, 5, 9) * 4:  # decode steps of qwen-coder at bf16 on one core: ~300 ms, mostly fixed
        eng.board.cost.observe(n, 300.0 + 0.6 * n)
    assert not eng._gathering_pays()  # no warm-up: the prefill cost is not known (as on CUDA)
    eng.board.cost.prefill_ms_per_token = 3.5  # the warm-up's 512 tokens in 1.8 s
    assert eng._gathering_pays()  # 31 x 3.5 + 40 = 148.5 < ~300
    _with_prompts(eng, 266)
    assert not eng._gathering_pays()  # mean 148.5 tokens: 560 ms > ~300
    eng._live.clear()
    _with_prompts(eng, 266)
    assert not eng._gathering_pays()
    off = _bare_engine(VerifierConfig(batch_window_ms=0))
    off.board.cost = eng.board.cost
    _with_prompts(off, 1)
    assert not off._gathering_pays()


def test_a_batch_window_gathers_a_burst_until_a_quiet_window_and_at_most_ten(monkeypatch: pytest.MonkeyPatch) -> None:
    import verifier.engine

    eng = _bare_engine(VerifierConfig(batch_window_ms=62.5))  # 1/16 s: the fake clock adds it exactly
    arrivals = iter([2, 1, 0])  # requests arriving during each window: the third is quiet

    def arrive() -> None:
        for _ in range(next(arrivals, 1)):
            eng._commands.put(("add", None))

    clock = _Clock(arrive)
    monkeypatch.setattr(verifier.engine, "time", clock)
    eng._collect_burst()
    assert clock.sleeps == [0.0625] * 3

    arrivals = iter([])  # arrivals never stop: the wait ends after 10 windows
    clock.sleeps.clear()
    eng._collect_burst()
    assert clock.sleeps == [0.0625] * 10


def test_drafts_ready_and_end_before_the_request_is_added_are_kept_bounded_and_applied() -> None:
    """A session's `end` (say its drafter failed at once) can come before the engine thread has
    added the request: it must not be lost, or every step would wait for drafts that never come."""
    from types import SimpleNamespace

    from specdec.validation import max_blocks_per_commit
    from verifier.engine import GenerationRequest, _Live

    eng = _bare_engine()
    # vllm.SamplingParams's fields the engine reads (verifier.convert makes the real one; this tier imports no vLLM)
    params = SimpleNamespace(max_tokens=10, stop_token_ids=None, logprobs=None)
    req = GenerationRequest("a", [1, 2, 3], gamma=2, params=params)
    eng.submit(req, lambda v: None)
    eng.drafter_ready("a", 5.0)
    eng.offer("a", 3, [7, 8], True, 3)
    for _ in range(1000):  # a flood before the add: kept up to the board's own per-step cap
        eng.offer("a", 3, [1, 1], True, 3)
    eng.end_drafts("a")
    assert len(eng._early["a"].calls) == max_blocks_per_commit(2) and eng._early["a"].ended
    eng.offer("unknown", 3, [1], True, 3)  # no such session: nothing kept
    assert set(eng._early) == {"a"}
    # the engine thread adds it (as _apply_commands does)
    eng.board.register("a-engine", req.gamma, len(req.prompt_token_ids), req.max_tokens)
    eng._apply_early(req, _Live(req, lambda v: None, engine_id="a-engine"))
    e = eng.board._entries["a-engine"]
    assert e.ready and not e.drafting and e.chain == [1, 1]
    assert eng._early == {} and eng._live["a"].engine_id == "a-engine"
    eng.offer("a", 5, [4, 4], True, 5)  # now straight to the board
    assert e.chain == [4, 4]


def test_a_prompt_with_a_chunk_still_to_prefill_counts_as_queued() -> None:
    """A step waits for drafts only while no prefill waits behind it: the board's `queued`
    counts the requests not scheduled yet and those prefilled in chunks with one still to come
    (their next chunk rides in the next step; vllm_hooks.ScheduledStep.prefill_chunks)."""
    from verifier.vllm_hooks import ScheduledStep

    eng = _bare_engine()
    # a 512-token budget: a long prompt's first chunk, a short prompt whole, a decode of 1 + 2 drafts
    eng._on_schedule(ScheduledStep({"long": 409, "short": 100, "dec": 3}, {"dec": 2}, 512, 2, 2, prefill_chunks=1))
    assert eng.board.queued == 2 + 1
    eng._on_schedule(ScheduledStep({"long": 91, "dec": 3}, {"dec": 2}, 94, 0, 0, prefill_chunks=0))  # its last chunk
    assert eng.board.queued == 0
