"""The drafter's memory for its sessions' keys/values (drafter.memory) through the real services.

A drafter with a budget of 2 MiB (`--kv-cache-mib 2`: 1,024 tokens of the tiny pair's drafts, 2
layers x keys and values x 2 KV heads x 64 dims x 4 bytes), beside the default stack's verifier,
and a gateway at its defaults. A fixture-only setting, to isolate the mechanism on the tiny pair;
the default (auto) budget runs under every other e2e test, and its value is checked below. The
draft is tiny/draft-same (the target's weights: every draft is accepted, so adaptive gamma never
holds it and the drafter drafts through every request).
  - a prompt whose reserve alone is over the budget is refused at `open` (RESOURCE_EXHAUSTED
    naming kv_cache_mib): its request decodes plainly, exactly, and the drafter keeps serving;
  - a queue of prompts of which two fit at once: every output is exact, no request fails, the
    third prompt's prefill waited (specdec:drafter_kv_waits_total), and what the sessions hold
    never passes the budget when the queue ends;
  - a generation past its reserve (512 generated tokens) whose growth could never fit the budget:
    its session ends (RESOURCE_EXHAUSTED naming kv_cache_mib, specdec:drafter_kv_overflows_total),
    and its request, which speculated until then, decodes the rest plainly and exactly;
  - a generation past its reserve whose growth does not fit beside an older session (a second
    drafter, of 8 MiB, behind a gateway at its defaults): its session is preempted
    (DraftProgress.preempted, specdec:drafter_kv_preemptions_total), its request decodes plainly
    meanwhile, and once the older session ends it is prefilled again from its own keys/values
    and speculates; its output is exact;
  - a prompt that waits for memory longer than its gateway's drafter_timeout_s (a second drafter,
    of 8 MiB, behind a second gateway with drafter_timeout_s 2 s: the fixture-only settings that make
    the wait outlast it) is kept: its drafter reports that it waits
    (DraftProgress.waiting_for_memory), and once the session holding the memory ends it is
    prefilled and speculates; its output is exact.
Before drafter.memory the drafter took up to max_sessions (256) sessions whatever their prompts,
and a session grew past its reserve unbudgeted: a queue of long prompts, or long generations, ran
a drafter pod out of memory (docs/design.md, "The drafter's memory").
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from conftest import Services, vllm_reference
from gen import generate_all, scrape, spec
from transformers import AutoTokenizer

from specdec.wire import pb, rpc

BUDGET_MIB = 2  # 1,024 tokens
QUEUED = 6
QUEUED_TOKENS = 400  # a reserve of 400 + 32 + window (<= 33) + 1 tokens: two fit in 1,024, never three
OVER_TOKENS = 1100  # over the 1,024 tokens alone
MAX_TOKENS = 32
# a reserve of 400 + 512 + window + 1 <= 946 tokens fits; 700 generated tokens need up to 1,134
LONG_PROMPT, LONG_MAX_TOKENS = 400, 700
ROOMY_MIB = 8  # 4,096 tokens
# a session of 3,600 prompt tokens (a reserve of 3,675 with max_tokens 64) leaves less than a
# 20-token prompt's reserve (20 + 512 + window + 1), whose 2,000 tokens then fit alone (<= 2,054)
HOLDER_TOKENS, WAITER_TOKENS, WAITER_MAX_TOKENS = 3600, 20, 2000
DRAFTER_TIMEOUT_S = 2.0  # the "short" gateway's
# an older session of 3,000 prompt tokens (a reserve of 3,074 with gamma 4 and max_tokens 64) leaves
# room for a request of 200 prompt tokens at the gateway's defaults (gamma 4: a reserve of
# 200 + 512 + 9 + 1 = 722 tokens), not for its growth past it (by 512)
OLDER_TOKENS, GROWER_TOKENS, GROWER_MAX_TOKENS = 3000, 200, 1800


@pytest.fixture(scope="module")
def small(default_services: Services, log_dir: Path) -> Iterator[Services]:
    """A drafter of tiny/draft-same with a 2 MiB budget and a gateway at its defaults, beside the
    default stack's verifier."""
    assert default_services.verifier is not None
    s = Services(log_dir / "drafter-memory")
    try:
        s.drafters["small"] = s._start(
            "drafter", ["--model", "tiny/draft-same", "--threads", "1", "--kv-cache-mib", str(BUDGET_MIB)]
        )
        s.gateways["small"] = s.start_gateway(s.drafters["small"].address, default_services.verifier.address)
        # a drafter of 8 MiB (4,096 tokens) behind a gateway that drops a silent drafter sooner
        # (2 s, over the drafter's 1 s between progress reports): a prompt's wait for memory
        # outlasts it (test_a_prompt_that_waits_for_memory_is_kept_and_speculates_once_admitted)
        s.drafters["roomy"] = s._start(
            "drafter", ["--model", "tiny/draft-same", "--threads", "1", "--kv-cache-mib", str(ROOMY_MIB)]
        )
        s.gateways["short"] = s.start_gateway(
            s.drafters["roomy"].address, default_services.verifier.address, ("--drafter-timeout-s", "2")
        )
        s.gateways["roomy"] = s.start_gateway(s.drafters["roomy"].address, default_services.verifier.address)
        s.ready()
        yield s
    finally:
        s.stop()


def _ids(tiny_target: Path, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    vocab = AutoTokenizer.from_pretrained(tiny_target).vocab_size
    return [rng.randrange(1, vocab) for _ in range(n)]


def _drafter(small: Services) -> dict[str, float]:
    return scrape(small.drafters["small"].metrics_port)


def test_a_prompt_over_the_budget_decodes_plainly_and_the_drafter_keeps_serving(
    small: Services, tiny_target: Path
) -> None:
    over, after = _ids(tiny_target, OVER_TOKENS, 9300), _ids(tiny_target, 100, 9301)
    address = small.gateways["small"].address
    (big,) = generate_all(address, [spec(over, MAX_TOKENS, ignore_eos=True)], concurrency=1)
    (next_one,) = generate_all(address, [spec(after, MAX_TOKENS, ignore_eos=True)], concurrency=1)
    reference = vllm_reference(
        tiny_target, [{"prompt_token_ids": p, "max_tokens": MAX_TOKENS, "ignore_eos": True} for p in (over, after)]
    )
    assert [list(big.token_ids), list(next_one.token_ids)] == reference
    assert big.stats.drafter_fallback
    assert "RESOURCE_EXHAUSTED" in big.stats.fallback_reason and "kv_cache_mib" in big.stats.fallback_reason
    assert not next_one.stats.drafter_fallback, next_one.stats.fallback_reason
    assert next_one.stats.drafter_prefill_ms > 0  # its drafter's `ready` came


def test_a_queue_over_the_budget_waits_for_memory_and_every_output_is_exact(small: Services, tiny_target: Path) -> None:
    ps = [_ids(tiny_target, QUEUED_TOKENS, 9310 + i) for i in range(QUEUED)]
    waits = _drafter(small).get("specdec:drafter_kv_waits_total", 0.0)
    outs = generate_all(
        small.gateways["small"].address, [spec(p, MAX_TOKENS, ignore_eos=True) for p in ps], concurrency=QUEUED
    )
    reference = vllm_reference(
        tiny_target, [{"prompt_token_ids": p, "max_tokens": MAX_TOKENS, "ignore_eos": True} for p in ps]
    )
    assert [list(o.token_ids) for o in outs] == reference
    after = _drafter(small)
    assert after["specdec:drafter_kv_waits_total"] > waits  # the third prompt waited for the first two
    assert after["specdec:drafter_kv_cache_budget_bytes"] == BUDGET_MIB << 20
    assert after["specdec:drafter_kv_cache_bytes"] <= BUDGET_MIB << 20
    # a waiting prompt's request decodes plainly meanwhile (its drafter is silent past
    # drafter_timeout_s, or the generation ends first), and none failed; the first two were
    # prefilled at once (their drafters' `ready` came)
    assert sum(1 for o in outs if o.stats.drafter_prefill_ms > 0) >= 2


def test_a_generation_that_outgrows_the_budget_ends_its_session_and_stays_exact(
    small: Services, tiny_target: Path
) -> None:
    prompt = _ids(tiny_target, LONG_PROMPT, 9320)
    overflows = _drafter(small).get("specdec:drafter_kv_overflows_total", 0.0)
    (out,) = generate_all(
        small.gateways["small"].address, [spec(prompt, LONG_MAX_TOKENS, ignore_eos=True)], concurrency=1
    )
    reference = vllm_reference(
        tiny_target, [{"prompt_token_ids": prompt, "max_tokens": LONG_MAX_TOKENS, "ignore_eos": True}]
    )
    assert [list(out.token_ids)] == reference
    reason = out.stats.fallback_reason
    assert out.stats.drafter_fallback and "RESOURCE_EXHAUSTED" in reason and "kv_cache_mib" in reason, reason
    assert out.stats.accepted_tokens > 0  # it speculated until its context passed what the budget holds
    after = _drafter(small)
    assert after["specdec:drafter_kv_overflows_total"] == overflows + 1
    assert after["specdec:drafter_kv_cache_bytes"] <= BUDGET_MIB << 20


def test_the_default_budget_is_found_from_the_memory_the_drafter_may_use(default_services: Services) -> None:
    """The default stack's drafters (kv_cache_mib 0: auto) hold a budget, and what their
    sessions hold stays within it."""
    for drafter in default_services.drafters.values():
        got = scrape(drafter.metrics_port)
        assert got["specdec:drafter_kv_cache_budget_bytes"] >= 256 << 20  # memory.MIN_AUTO_BYTES at least
        assert got.get("specdec:drafter_kv_cache_bytes", 0.0) <= got["specdec:drafter_kv_cache_budget_bytes"]


def _until(check: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """Poll `check` (an observable state: a service's metrics) until it holds."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _held_session(address: str, prompt: list[int], release: threading.Event) -> Iterator[pb.DraftResponse]:
    """A session opened on the drafter directly (gamma 4, max_tokens 64: another gateway's request
    queued at its target), never committed, open until `release` is set."""

    def requests() -> Iterator[pb.DraftRequest]:
        opened = pb.DraftOpen(prompt_token_ids=prompt, gamma=4, sampling=pb.SamplingParams(max_tokens=64))
        yield pb.DraftRequest(open=opened)
        release.wait(120)

    with grpc.insecure_channel(address) as channel:
        yield from rpc.DrafterServiceStub(channel).Draft(requests())


def test_a_generation_whose_growth_does_not_fit_is_preempted_and_speculates_again(
    small: Services, tiny_target: Path
) -> None:
    """An older session (opened on the drafter directly) holds 3,074 of the 8 MiB drafter's
    4,096 tokens while a request generates; past its reserve (about 513 generated tokens) its
    growth does not fit, and its session, the newest, is preempted. The test ends the older
    session once the drafter counted the preemption (polling its metrics): the request's session
    is admitted again, prefilled from its own keys/values (the prefix cache), and its gateway
    relays its second `ready`, and it speculates again. Its output is exact, and it never fell
    back. The request must outlast the older session's end: about 1,280 tokens of plain decoding
    after the preemption are the room for it (the tiny target's 2,048 positions leave no more)."""
    drafter = small.drafters["roomy"]
    older, prompt = _ids(tiny_target, OLDER_TOKENS, 9340), _ids(tiny_target, GROWER_TOKENS, 9341)
    before = scrape(drafter.metrics_port)
    release = threading.Event()
    with ThreadPoolExecutor(2) as pool:
        held = pool.submit(lambda: list(_held_session(drafter.address, older, release)))
        _until(lambda: scrape(drafter.metrics_port).get("specdec:drafter_kv_cache_bytes", 0.0) > 0)  # admitted
        spec_ = spec(prompt, GROWER_MAX_TOKENS, ignore_eos=True)
        call = pool.submit(generate_all, small.gateways["roomy"].address, [spec_], 1)
        preempted = "specdec:drafter_kv_preemptions_total"
        _until(lambda: scrape(drafter.metrics_port).get(preempted, 0.0) > before.get(preempted, 0.0))
        release.set()
        (out,) = call.result()
        held.result()
    reference = vllm_reference(
        tiny_target, [{"prompt_token_ids": prompt, "max_tokens": GROWER_MAX_TOKENS, "ignore_eos": True}]
    )
    assert [list(out.token_ids)] == reference
    assert not out.stats.drafter_fallback, out.stats.fallback_reason
    assert out.stats.drafter_preemptions == 1
    # the second `ready`: its committed context (over 700 tokens) came back from the prefix cache
    assert out.stats.drafter_reused_tokens > 700, out.stats
    after = scrape(drafter.metrics_port)
    assert after[preempted] == before.get(preempted, 0.0) + 1
    assert after.get("specdec:drafter_kv_overflows_total", 0.0) == before.get("specdec:drafter_kv_overflows_total", 0.0)
    assert after["specdec:drafter_kv_cache_bytes"] <= ROOMY_MIB << 20
    # it speculated after it came back: before the preemption its context, drafts included, was
    # within its reserve of 722 tokens, so at most 522 tokens were committed and 9 more drafted
    assert out.stats.accepted_tokens > 722 - GROWER_TOKENS + 9, out.stats.accepted_tokens


def test_a_prompt_that_waits_for_memory_is_kept_and_speculates_once_admitted(
    small: Services, tiny_target: Path
) -> None:
    """A session opened on the drafter directly (a 3,600-token prompt, never committed: another
    gateway's request queued at its target) holds the 8 MiB drafter while a request's prompt
    waits for memory behind it. The request's target decodes plainly meanwhile; the test keeps
    the session open until drafter_timeout_s + 1.5 s have passed since the request's prompt
    waited (the wait must outlast the timeout, so this is the scenario's length, not a
    synchronisation), then ends it. The waiting drafter reported that it waits, so its gateway
    kept it: once admitted it is prefilled and speculates, and the output is exact. Before
    DraftProgress.waiting_for_memory the gateway dropped it at 2 s."""
    drafter = small.drafters["roomy"]
    holder, waiter_prompt = _ids(tiny_target, HOLDER_TOKENS, 9330), _ids(tiny_target, WAITER_TOKENS, 9331)
    waits = scrape(drafter.metrics_port).get("specdec:drafter_kv_waits_total", 0.0)
    release = threading.Event()
    with ThreadPoolExecutor(2) as pool:
        held = pool.submit(lambda: list(_held_session(drafter.address, holder, release)))
        _until(lambda: scrape(drafter.metrics_port).get("specdec:drafter_kv_cache_bytes", 0.0) > 0)  # admitted
        spec_ = spec(waiter_prompt, WAITER_MAX_TOKENS, ignore_eos=True)
        waiter_call = pool.submit(generate_all, small.gateways["short"].address, [spec_], 1)
        _until(lambda: scrape(drafter.metrics_port)["specdec:drafter_kv_waits_total"] > waits)  # the prompt waits
        time.sleep(DRAFTER_TIMEOUT_S + 1.5)  # the wait's length (see the docstring)
        release.set()
        (waiter,) = waiter_call.result()
        held.result()
    reference = vllm_reference(
        tiny_target, [{"prompt_token_ids": waiter_prompt, "max_tokens": WAITER_MAX_TOKENS, "ignore_eos": True}]
    )
    assert [list(waiter.token_ids)] == reference
    assert not waiter.stats.drafter_fallback, waiter.stats.fallback_reason
    assert waiter.stats.drafter_prefill_ms > 0 and waiter.stats.accepted_tokens > 0
