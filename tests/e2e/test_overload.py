"""Overload, cancellations, deadlines and a hung drafter, on the session's verifier with
gateways and a drafter of this module's own.

- 300 concurrent requests at a gateway admitting 32: each one completes exact or is refused
  at once with RESOURCE_EXHAUSTED (REST: 429 + Retry-After); none hangs or fails otherwise,
  and the gateway's memory stays bounded.
- 1,000 client cancellations at random points: the verifier's sessions, the drafter's
  sessions and the gateway's requests in flight all return to 0, and so do the requests in
  vLLM's own scheduler (running and waiting); memory growth stays under a bound, and the next
  request is exact.
- A client deadline reaches the engine: a request past its deadline is aborted there (vLLM's
  scheduler holds no request afterwards, and ran few steps before it did).
- A drafter that hangs (SIGSTOP: alive, silent) makes its requests fall back, exact.
- A drafter whose prefill outlasts --drafter-timeout-s after the target's first token (slow
  prefill chunks, faultkit's draft_prefill_delay_ms) is not taken for a hung one: it reports
  its progress, the request does not fall back, and it drafts once ready; exact.

The engine checks read specdec:verifier_engine_running / _waiting, which the verifier reads
from vLLM's scheduler itself (Scheduler.get_request_counts), not from its gRPC sessions: a
session ends with its call whether or not the engine request was aborted. A request left
running could still end on its own within the time bound (a single one on a fast machine), so
the tests also bound the engine steps run after the calls ended. These tests fail
when the verifier does not abort (docs/testing-faults.md shows it: the run with
SPECDEC_FAULTS='{"abort_disabled": true}', tests/faultkit.py).
"""

from __future__ import annotations

import asyncio
import random
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from conftest import injected, vllm_reference, wait_drafters_seen
from gen import prompts, scrape, spec, wait_for
from transformers import AutoTokenizer

from gateway.client import AsyncGatewayClient, GatewayClient
from specdec.wire import pb
from specdec_cli.launch import Service, stop_all

MAX_INFLIGHT = 32
N_OVERLOAD = 300
N_CANCEL = 1000
MAX_TOKENS = 12
CANCEL_TOKENS = 1800  # a cancelled stream's length: long enough that none finishes before its cancel
# How long the engine may take to hold no request once the calls ended: aborts reach it within
# a step or two (milliseconds); this bound is far above that, and far below what the aborted
# requests would take to run to their ends (so a missing abort fails the test)
ENGINE_IDLE_BOUND_S = 60.0
# Most engine steps the verifier may run between the calls' end and holding no request: an
# abort reaches the engine within a few steps; a request left running would need a step per
# token it has left (more than 1,000 of a CANCEL_TOKENS request after its 0.5 s deadline). A
# count of steps, not a duration, so it holds on a machine of any speed.
STEPS_AFTER_END_BOUND = CANCEL_TOKENS // 4


def rss_mib(svc: Service) -> float:
    for line in Path(f"/proc/{svc.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def own(services) -> Iterator[dict[str, Service]]:
    """A drafter and a gateway of this module's own (the drafter gets SIGSTOPped)."""
    drafter = services._start("drafter", ["--model", "tiny/draft-mid", "--threads", "1", "--quantize", "none"])
    gateway = services.start_gateway(
        drafter.address, services.verifier.address, ("--max-inflight", str(MAX_INFLIGHT), "--drafter-timeout-s", "2")
    )
    for svc in (drafter, gateway):
        svc.wait_ready(300)
    wait_drafters_seen(gateway, 1, 300)
    yield {"drafter": drafter, "gateway": gateway}
    stop_all((gateway, drafter))


@pytest.fixture(scope="module")
def cases(tiny_target: Path) -> tuple[list[list[int]], list[list[int]]]:
    """10 prompts and a plain vLLM engine's greedy outputs for them (the reference)."""
    ps = prompts(AutoTokenizer.from_pretrained(tiny_target), 10, seed=11)
    return ps, vllm_reference(tiny_target, [{"prompt_token_ids": p, "max_tokens": MAX_TOKENS} for p in ps])


def engine_requests(verifier: Service) -> tuple[float, float]:
    """(running, waiting) requests in the verifier's vLLM scheduler (-1: not exported)."""
    m = scrape(verifier.metrics_port)
    return m.get("specdec:verifier_engine_running", -1.0), m.get("specdec:verifier_engine_waiting", -1.0)


def wait_engine_idle(verifier: Service, what: str) -> None:
    """Wait (bounded by ENGINE_IDLE_BOUND_S) until vLLM's scheduler holds no request."""
    wait_for(
        lambda: engine_requests(verifier) == (0, 0),
        ENGINE_IDLE_BOUND_S,
        f"{what}: the engine holds no request (running, waiting now: {engine_requests(verifier)})",
    )


def engine_steps(verifier: Service) -> float:
    """Engine steps the verifier has run (each one a step of vLLM's engine with work in it)."""
    return scrape(verifier.metrics_port)["specdec:verifier_engine_steps_total"]


def settle(service: Service, gauge: str, timeout_s: float = 60) -> None:
    """Wait (bounded) until `service`'s `gauge` reads 0: counters of other processes catch up
    asynchronously."""
    wait_for(
        lambda: scrape(service.metrics_port).get(gauge) == 0,
        timeout_s,
        f"{gauge} back to 0 (now {scrape(service.metrics_port).get(gauge)})",
    )


def test_overload_is_refused_at_once_never_queued(own, cases) -> None:
    ps, ref = cases
    gw = own["gateway"]
    before = rss_mib(gw)

    async def run() -> list[object]:
        async with AsyncGatewayClient(gw.address, timeout_s=300) as client:

            async def one(i: int) -> object:
                try:
                    r = await client.generate(spec(ps[i % len(ps)], MAX_TOKENS, gamma=4))
                    return list(r.token_ids)
                except grpc.aio.AioRpcError as err:
                    return err

            return await asyncio.gather(*(one(i) for i in range(N_OVERLOAD)))

    results = asyncio.run(run())
    done = [(i, r) for i, r in enumerate(results) if isinstance(r, list)]
    refused = [r for r in results if not isinstance(r, list)]
    assert all(
        r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_inflight (32)" in r.details() for r in refused
    ), {r.code() for r in refused}
    assert all(int(dict(r.trailing_metadata())["retry-after"]) >= 1 for r in refused)
    assert done and refused  # 300 at once at a gateway admitting 32: both happen
    assert all(ids == ref[i % len(ps)] for i, ids in done)
    grown = rss_mib(gw) - before
    print(f"overload: {len(done)} completed, {len(refused)} refused; gateway RSS +{grown:.0f} MiB")
    assert grown < 200

    async def rest() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300) as http:
            body = {"prompt": ps[0], "max_tokens": MAX_TOKENS, "temperature": 0}
            return await asyncio.gather(
                *(http.post(f"http://127.0.0.1:{gw.rest_port}/v1/completions", json=body) for _ in range(100))
            )

    answers = asyncio.run(rest())
    assert {r.status_code for r in answers} <= {200, 429}
    assert all(
        int(r.headers["retry-after"]) >= 1 and r.json()["error"]["type"] == "rate_limit_error"
        for r in answers
        if r.status_code == 429
    )
    assert all(r.json()["choices"][0]["text"] is not None for r in answers if r.status_code == 200)


def test_cancellations_free_everything(own, services, cases) -> None:
    ps, ref = cases
    gw = own["gateway"]
    wait_engine_idle(services.verifier, "before the cancellations")
    rng = random.Random(5)
    delays = [rng.uniform(0, 0.25) for _ in range(N_CANCEL)]
    before = {k: rss_mib(v) for k, v in (("gateway", gw), ("verifier", services.verifier), ("drafter", own["drafter"]))}

    async def run() -> int:
        sem = asyncio.Semaphore(MAX_INFLIGHT)
        async with AsyncGatewayClient(gw.address, timeout_s=300) as client:

            async def one(i: int) -> bool:
                async with sem:
                    call = client.stream(spec(ps[i % len(ps)], CANCEL_TOKENS, gamma=4, ignore_eos=True))
                    await asyncio.sleep(delays[i])  # cancel at a random point: queued, prefill, mid-stream
                    return call.cancel()

            return sum(await asyncio.gather(*(one(i) for i in range(N_CANCEL))))

    cancelled = asyncio.run(run())
    steps_at_end = engine_steps(services.verifier)
    # a call that finished before its cancel is not cancelled: with CANCEL_TOKENS each, finishing
    # inside the 0.25 s window would take a machine over 100x this one's decode speed
    assert cancelled >= N_CANCEL // 2, cancelled
    # the engine first: every cancelled request aborted in vLLM's scheduler, within a few steps
    wait_engine_idle(services.verifier, f"after {cancelled} cancellations")
    ran_on = engine_steps(services.verifier) - steps_at_end
    print(f"engine steps after the last cancel: {ran_on:.0f}")
    assert ran_on < STEPS_AFTER_END_BOUND, f"the engine ran {ran_on:.0f} steps after the cancellations"
    settle(gw, "specdec:requests_running")
    settle(own["drafter"], "specdec:drafter_sessions")
    settle(services.verifier, "specdec:verifier_sessions")
    with grpc.insecure_channel(services.verifier.address) as channel:
        from specdec.wire import rpc

        info = rpc.VerifierServiceStub(channel).GetVerifierInfo(pb.GetVerifierInfoRequest(), timeout=10)
    assert info.active_sessions == 0
    grown = {
        k: rss_mib(v) - before[k]
        for k, v in (("gateway", gw), ("verifier", services.verifier), ("drafter", own["drafter"]))
    }
    print(f"{cancelled} cancellations; RSS growth MiB: " + ", ".join(f"{k} {v:+.0f}" for k, v in grown.items()))
    assert all(v < 300 for v in grown.values()), grown
    with GatewayClient(gw.address, timeout_s=120) as client:  # the next request is exact
        assert list(client.generate(spec(ps[0], MAX_TOKENS, gamma=4)).token_ids) == ref[0]


def test_a_deadline_reaches_the_engine(own, services, cases) -> None:
    ps, _ = cases
    wait_engine_idle(services.verifier, "before the request")
    with GatewayClient(own["gateway"].address, timeout_s=0.5) as client:
        with pytest.raises(grpc.RpcError) as info:
            client.generate(spec(ps[1], CANCEL_TOKENS, gamma=4, ignore_eos=True))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    steps_at_deadline = engine_steps(services.verifier)
    settle(services.verifier, "specdec:verifier_sessions", 30)
    wait_engine_idle(services.verifier, "after the deadline")
    ran_on = engine_steps(services.verifier) - steps_at_deadline
    print(f"engine steps after the deadline: {ran_on:.0f}")
    assert ran_on < STEPS_AFTER_END_BOUND, f"the engine ran {ran_on:.0f} steps after the deadline: not aborted"


def test_a_hung_drafter_falls_back(own, cases) -> None:
    ps, ref = cases
    drafter = own["drafter"]
    drafter.proc.send_signal(signal.SIGSTOP)
    try:
        with GatewayClient(own["gateway"].address, timeout_s=120) as client:
            r = client.generate(spec(ps[2], MAX_TOKENS, gamma=4))
    finally:
        drafter.proc.send_signal(signal.SIGCONT)
    assert list(r.token_ids) == ref[2]
    assert r.stats.drafter_fallback and r.stats.fallback_reason


# A prompt the drafter prefills in 5 chunks of 128 (DrafterConfig.prefill_chunk), each made
# PREFILL_CHUNK_DELAY_MS slow: 5 s of prefill after the target's first token, 2.5x the gateway's
# --drafter-timeout-s (2), with a progress report after each chunk (1 s apart, under it).
SLOW_PREFILL_TOKENS = 600
PREFILL_CHUNK_DELAY_MS = 1000
# The target made slow too (every step, faultkit's step_delay_ms), so that its plain decoding of
# SLOW_PREFILL_MAX_TOKENS lasts at least 12 s: longer than the drafter's prefill, on any machine.
TARGET_STEP_DELAY_MS = 20
SLOW_PREFILL_MAX_TOKENS = 600


def test_a_drafter_slower_to_prefill_than_its_deadline_is_not_hung(services, own, tiny_target: Path) -> None:
    rng = random.Random(5)
    tok = AutoTokenizer.from_pretrained(tiny_target)
    prompt = [rng.randrange(1, tok.vocab_size) for _ in range(SLOW_PREFILL_TOKENS)]
    ref = vllm_reference(
        tiny_target, [{"prompt_token_ids": prompt, "max_tokens": SLOW_PREFILL_MAX_TOKENS, "ignore_eos": True}]
    )[0]
    with (
        injected(own["drafter"], draft_prefill_delay_ms=PREFILL_CHUNK_DELAY_MS),
        injected(services.verifier, step_delay_ms=TARGET_STEP_DELAY_MS, step_every=1),
        GatewayClient(own["gateway"].address, timeout_s=300) as client,
    ):
        r = client.generate(spec(prompt, SLOW_PREFILL_MAX_TOKENS, gamma=4, ignore_eos=True))
    assert list(r.token_ids) == ref
    assert not r.stats.drafter_fallback, r.stats.fallback_reason
    # the drafter's prefill took its 5 slow chunks, and it drafted once ready
    assert r.stats.drafter_prefill_ms >= 5 * PREFILL_CHUNK_DELAY_MS
    assert r.stats.drafted_tokens > 0
