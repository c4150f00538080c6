"""A drafter is untrusted input: a hostile one never changes the output, never fails a request,
never stalls other requests and never grows the verifier's memory (issue "Across hosts, safely").

A hostile DrafterService runs in this process (a plain grpc server on a free port) and answers
each commit with garbage: ids outside the vocabulary, start positions in the prompt or far in the
future, blocks of 100k tokens, thousands of blocks per commit. A real gateway relays it to the
session's real verifier. Each request must come back exactly as a plain vLLM engine decodes it
(tests/conftest.py `vllm_reference`), with the drafter reported as failed (the gateway's
fallback), while a normal request through another gateway runs beside it.

The verifier defends itself too (its caller may be a gateway that does not check): a Verify
session fed directly with a flood of garbage blocks, 100M draft tokens in all, ends exactly, and
the verifier's resident memory stays within RSS_BOUND_MIB of where it was.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from concurrent import futures

import grpc
import pytest
from conftest import DRAFT_WAIT_MARGIN_MS, vllm_reference
from gen import spec
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specdec.wire import pb, rpc

PROMPT = [11, 12, 13, 14, 15, 16]
OTHER = [31, 32, 33, 34, 35]
MAX_TOKENS = 48
GAMMA = 4
HUGE = 100_000  # tokens in a huge block
FLOOD = 5_000  # blocks per commit in a flood
# Resident memory the verifier may gain over a session fed HUGE_BLOCKS blocks of HUGE tokens (a
# board that kept them would hold 100M tokens: ~800 MB as a Python list) and SMALL_BLOCKS small
# ones, besides the KV pages and buffers a plain session of the same length touches.
RSS_BOUND_MIB = 64
HUGE_BLOCKS = 1_000
SMALL_BLOCKS = 6_000
FLOOD_MAX_TOKENS = 600
FLOOD_PROMPT = [41, 42, 43, 44, 45, 46, 47]

# mode -> what the gateway's fallback reason must name
MODES = {
    "open": "outside the vocabulary",  # garbage at once, before any commit (and the target's prefill)
    "ids": "outside the vocabulary",
    "positions": "block.start_position",
    "huge": "more than gamma",
    "flood": "blocks since the latest commit",
}


def _garbage(mode: str, committed: int, gamma: int) -> list["pb.DraftBlock"]:
    """The hostile answer to a commit up to `committed` (or to `open`: mode "open")."""
    if mode == "open":
        return [pb.DraftBlock(start_position=committed, token_ids=[10**9] * gamma, committed_length=committed)] * 3
    if mode == "ids":
        return [
            pb.DraftBlock(start_position=committed, token_ids=[10**9, -5, 1, 2][:gamma], committed_length=committed),
            pb.DraftBlock(start_position=committed, token_ids=[-5] * gamma, committed_length=committed),
        ]
    if mode == "positions":
        return [
            pb.DraftBlock(start_position=0, token_ids=[1] * gamma),  # in the prompt
            pb.DraftBlock(start_position=committed - 2, token_ids=[1, 1], committed_length=committed - 2),  # stale
            pb.DraftBlock(start_position=2**31, token_ids=[1] * gamma, committed_length=committed),
            pb.DraftBlock(start_position=committed + 100_000, token_ids=[1] * gamma, committed_length=committed),
        ]
    if mode == "huge":
        return [pb.DraftBlock(start_position=committed, token_ids=[1] * HUGE, committed_length=committed)]
    if mode == "empty":  # the polite hostile drafter: valid, in time, and never a draft
        return [pb.DraftBlock(start_position=committed, committed_length=committed, final=False)]
    if mode == "flood":
        block = pb.DraftBlock(start_position=committed, token_ids=[1] * gamma, committed_length=committed, final=True)
        return [block] * FLOOD
    raise ValueError(mode)


class HostileDrafter(rpc.DrafterServiceServicer):
    """Says `ready` on open, then answers every commit (mode "open": the open) with
    `_garbage(self.mode, ...)`; counts the garbage blocks it got to send."""

    def __init__(self) -> None:
        self.mode = "ids"
        self.sent = 0

    def GetDrafterInfo(self, request, context) -> "pb.GetDrafterInfoResponse":  # noqa: N802
        return pb.GetDrafterInfoResponse(model="hostile", vocab_size=1 << 20, methods=[pb.DRAFT_METHOD_MODEL])

    def Draft(self, request_iterator, context):  # noqa: N802
        gamma = 1
        for req in request_iterator:
            if req.WhichOneof("kind") == "open":
                gamma, committed = req.open.gamma, len(req.open.prompt_token_ids)
                yield pb.DraftResponse(
                    ready=pb.DraftReady(prefilled_tokens=committed, prefill_ms=1.0, draft_ms_per_token=1.0)
                )
                if self.mode != "open":
                    continue
            else:
                if self.mode == "open":
                    continue
                committed = req.commit.start_position + len(req.commit.token_ids)
            for block in _garbage(self.mode, committed, gamma):
                if not context.is_active():
                    return
                self.sent += 1
                yield pb.DraftResponse(block=block)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class PeakRss(threading.Thread):
    """Samples a process's VmRSS every 20 ms until stopped; `peak` is the largest seen."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self._done = pid, rss_mib(pid), threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.02):
            self.peak = max(self.peak, rss_mib(self.pid))

    def stop(self) -> float:
        self._done.set()
        self.join()
        return self.peak


@pytest.fixture(scope="module")
def hostile(services):
    drafter = HostileDrafter()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    rpc.add_DrafterServiceServicer_to_server(drafter, server)
    # the gateway sends requests only to a drafter whose health check says SERVING
    status = health.HealthServicer()
    status.set("specdec.v1.DrafterService", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(status, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    drafter.address = f"127.0.0.1:{port}"
    gateway = services.start_gateway(f"127.0.0.1:{port}", services.verifier.address)
    try:
        gateway.wait_ready(120)
        yield drafter, gateway
    finally:
        gateway.stop()
        server.stop(grace=0)


def _generate(address: str, s: "pb.GenerationSpec") -> "pb.GenerateResponse":
    with grpc.insecure_channel(address) as channel:
        return rpc.GatewayServiceStub(channel).Generate(pb.GenerateRequest(spec=s), timeout=120)


@pytest.fixture(scope="module")
def plain(tiny_target) -> dict[tuple[tuple[int, ...], int], list[int]]:
    """{(prompt, max_tokens): plain vLLM's greedy tokens}: the reference outputs, one engine run."""
    cases = [(PROMPT, MAX_TOKENS), (OTHER, MAX_TOKENS), (FLOOD_PROMPT, FLOOD_MAX_TOKENS)]
    out = vllm_reference(tiny_target, [{"prompt_token_ids": p, "max_tokens": n, "ignore_eos": True} for p, n in cases])
    return {(tuple(p), n): tokens for (p, n), tokens in zip(cases, out, strict=True)}


@pytest.mark.parametrize("mode", list(MODES))
def test_a_hostile_drafter_changes_nothing_and_fails_nothing(services, hostile, plain, mode: str) -> None:
    drafter, gateway = hostile
    drafter.mode = mode
    sent = drafter.sent
    pid = services.verifier.proc.pid
    before = rss_mib(pid)
    with futures.ThreadPoolExecutor(2) as pool:  # a normal request beside the hostile one
        bad = pool.submit(_generate, gateway.address, spec(PROMPT, MAX_TOKENS, gamma=GAMMA, ignore_eos=True))
        good = pool.submit(
            _generate, services.gateways["mid"].address, spec(OTHER, MAX_TOKENS, gamma=GAMMA, ignore_eos=True)
        )
        r, normal = bad.result(timeout=120), good.result(timeout=120)
    assert drafter.sent > sent  # the hostile drafter did get to answer
    assert list(r.token_ids) == plain[tuple(PROMPT), MAX_TOKENS]
    assert r.finish_reason == pb.FINISH_REASON_LENGTH
    assert r.stats.drafter_fallback and MODES[mode] in r.stats.fallback_reason, r.stats.fallback_reason
    assert r.stats.fallback_reason.startswith("drafter sent 3 invalid replies")
    if mode == "open":  # the `end` came before the engine added the request: no step waited for its drafts
        # A step's wait is shared by its batch (the normal request's drafts: milliseconds each); a
        # step that waited for this drafter, which never sends a valid draft, would wait out the
        # whole margin. So no single step may reach it (a bound by definition, not by speed).
        assert r.stats.max_draft_wait_ms < DRAFT_WAIT_MARGIN_MS, r.stats.max_draft_wait_ms
    assert list(normal.token_ids) == plain[tuple(OTHER), MAX_TOKENS]
    assert not normal.stats.drafter_fallback and normal.stats.drafted_tokens > 0
    print(f"\n{mode}: verifier VmRSS {before:.1f} -> {rss_mib(pid):.1f} MiB; fallback: {r.stats.fallback_reason}")


async def _verify(
    address: str,
    request_id: str,
    prompt: list[int],
    max_tokens: int,
    gamma: int,
    flood: bool = False,
    blocks: tuple["pb.DraftBlock", ...] = (),
) -> tuple[list[int], int, dict[str, int]]:
    """One Verify session straight to the verifier (no gateway to filter): `blocks` are written
    right after `open`; with `flood`, garbage blocks are written as fast as the stream takes them
    while the target decodes, then one with ids outside the vocabulary. Returns (tokens, finish
    reason, what was sent)."""
    sent = {"blocks": 0, "tokens": 0, "huge": 0, "invalid": 0}
    options = [("grpc.max_send_message_length", 16 << 20)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        call = rpc.VerifierServiceStub(channel).Verify()
        await call.write(
            pb.VerifyRequest(
                open=pb.VerifyOpen(
                    request_id=request_id,
                    prompt_token_ids=prompt,
                    gamma=gamma,
                    sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                )
            )
        )
        for block in blocks:
            await call.write(pb.VerifyRequest(block=block))
        committed = [len(prompt)]
        done = asyncio.Event()

        async def write(block: "pb.DraftBlock") -> None:
            await call.write(pb.VerifyRequest(block=block))
            sent["blocks"] += 1
            sent["tokens"] += len(block.token_ids)

        async def pump() -> None:
            huge = pb.DraftBlock(token_ids=[7] * HUGE)
            ahead = committed[0]  # where a continuation of the drafts would start
            i = 0
            huge_left = HUGE_BLOCKS
            try:
                while not done.is_set() and sent["blocks"] < HUGE_BLOCKS + SMALL_BLOCKS:
                    c = committed[0]
                    i += 1
                    if i % 2 and huge_left:  # a continuation of 100k tokens: a naive board keeps them all
                        huge.start_position = max(ahead, c)
                        await write(huge)
                        ahead, huge_left = huge.start_position + HUGE, huge_left - 1
                        sent["huge"] += 1
                    elif i % 6 == 0:  # far in the future
                        await write(pb.DraftBlock(start_position=2**31, token_ids=[7] * gamma, committed_length=2**31))
                    elif i % 6 == 2:  # in the past (the prompt)
                        await write(pb.DraftBlock(start_position=0, token_ids=[7] * gamma))
                    else:  # small continuations
                        start = max(ahead, c)
                        await write(pb.DraftBlock(start_position=start, token_ids=[7] * gamma))
                        ahead = start + gamma
                await write(pb.DraftBlock(start_position=committed[0], token_ids=[10**9, -5]))
                sent["invalid"] = 1
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError, RuntimeError):
                pass  # the session ended first

        pumping = asyncio.create_task(pump()) if flood else None
        tokens: list[int] = []
        finish = 0
        while (v := await call.read()) is not grpc.aio.EOF:
            committed[0] = v.start_position + len(v.token_ids)
            if v.preview:
                continue
            tokens.extend(v.token_ids)
            if v.finish_reason:
                finish = v.finish_reason
                break
        done.set()
        if pumping is not None:
            await pumping
        await asyncio.wait_for(call.done_writing(), 10)
        return tokens, finish, sent


def test_the_verifier_survives_a_flood_of_garbage_blocks_in_bounded_memory(services, plain) -> None:
    address, pid = services.verifier.address, services.verifier.proc.pid
    prompt = FLOOD_PROMPT
    reference = plain[tuple(prompt), FLOOD_MAX_TOKENS]
    # a plain session first: the KV pages and buffers a session this long touches (not counted)
    warm, finish, _ = asyncio.run(_verify(address, "plain-before-flood", prompt, FLOOD_MAX_TOKENS, 0))
    assert finish == pb.FINISH_REASON_LENGTH and warm == reference
    before = rss_mib(pid)
    sampler = PeakRss(pid)
    sampler.start()
    t0 = time.monotonic()
    tokens, finish, sent = asyncio.run(_verify(address, "flood", prompt, FLOOD_MAX_TOKENS, GAMMA, flood=True))
    seconds = time.monotonic() - t0
    peak = sampler.stop()
    after = rss_mib(pid)
    print(
        f"\nflood: {sent['blocks']} blocks ({sent['huge']} of {HUGE} tokens), {sent['tokens'] / 1e6:.1f}M draft "
        f"tokens in {seconds:.1f} s (then an invalid block: {bool(sent['invalid'])}); verifier VmRSS "
        f"{before:.1f} MiB before, peak {peak:.1f}, after {after:.1f}"
    )
    assert finish == pb.FINISH_REASON_LENGTH
    assert tokens == reference
    assert sent["huge"] >= 100, sent  # the flood did happen while the target decoded
    assert peak - before < RSS_BOUND_MIB


def test_the_verifier_drops_a_block_with_ids_outside_the_vocabulary_and_goes_on(services, plain) -> None:
    """Its caller should never relay one (the gateway checks); if one comes anyway, the block is
    dropped and the session goes on without drafts: a bad draft never fails the request."""
    address = services.verifier.address
    reference = plain[tuple(PROMPT), MAX_TOKENS]
    n = len(PROMPT)
    blocks = (
        pb.DraftBlock(start_position=n, token_ids=[1, 2], committed_length=n),
        pb.DraftBlock(start_position=n, token_ids=[1, 10**9, -5], committed_length=n),
        pb.DraftBlock(start_position=n, token_ids=[3, 4], committed_length=n),
    )
    tokens, finish, _ = asyncio.run(_verify(address, "bad-block", PROMPT, MAX_TOKENS, GAMMA, blocks=blocks))
    assert finish == pb.FINISH_REASON_LENGTH and tokens == reference


def test_a_polite_drafter_that_never_drafts_is_detected_and_falls_back(services, hostile, plain) -> None:
    """Empty blocks (non-final: "more to come"), in time, on every commit: valid, so no violation,
    but after max_idle_commits (8) such answers in a row the request falls back, exactly."""
    drafter, gateway = hostile
    drafter.mode = "empty"
    sent = drafter.sent
    r = _generate(gateway.address, spec(PROMPT, MAX_TOKENS, gamma=GAMMA, ignore_eos=True))
    assert drafter.sent - sent >= 8
    assert list(r.token_ids) == plain[(tuple(PROMPT), MAX_TOKENS)]
    assert r.stats.drafter_fallback and "max_idle_commits 8" in r.stats.fallback_reason, r.stats.fallback_reason
    assert "invalid" not in r.stats.fallback_reason  # nothing it sent was invalid
    print(f"\nfallback after {drafter.sent - sent} empty answers: {r.stats.fallback_reason}")


def _gaps(address: str, s: "pb.GenerationSpec") -> tuple[list[int], list[float]]:
    """A stream's tokens and the gaps (s) between its chunks after the first (queueing and prefill)."""
    tokens, times = [], []
    with grpc.insecure_channel(address) as channel:
        for chunk in rpc.GatewayServiceStub(channel).GenerateStream(pb.GenerateStreamRequest(spec=s), timeout=120):
            tokens.extend(chunk.token_ids)
            times.append(time.monotonic())
    return tokens, [b - a for a, b in itertools.pairwise(times)]


def _per_token_s(tokens: list[int], gaps: list[float]) -> float:
    """Seconds per token after the first chunk."""
    return sum(gaps) / max(1, len(tokens) - 1)


def test_a_polite_drafter_costs_the_other_requests_of_its_batch_nothing_per_step(services, hostile, plain) -> None:
    """The draft board's rule, end to end: a request whose drafter answers every commit with an
    empty non-final block ("more to come") must not make the steps it shares with a normal
    request wait for it. The detection is off on this gateway (max_idle_commits 0), so the
    polite request stays in the batch for the whole measurement. The normal request's time per
    token beside it over its time per token beside the same request without a drafter (gamma 0:
    the same batch, the same compute), in one run: printed, and bounded at 2 (without the rule
    every shared step waits the verifier's margin, 2 s here, for drafts that never come)."""
    drafter, _ = hostile
    drafter.mode = "empty"
    gateway = services.start_gateway(drafter.address, services.verifier.address, ("--max-idle-commits", "0"))
    normal = spec(OTHER, MAX_TOKENS, gamma=GAMMA, ignore_eos=True)
    measured = {}
    try:
        gateway.wait_ready(120)
        for name, gamma in (("without", 0), ("with", GAMMA)):
            sent = drafter.sent
            with grpc.insecure_channel(gateway.address) as channel:
                other = rpc.GatewayServiceStub(channel).GenerateStream(
                    pb.GenerateStreamRequest(spec=spec(PROMPT, 2000, gamma=gamma, ignore_eos=True)), timeout=600
                )
                assert next(other).token_ids  # it is decoding: its row is in every step from here
                tokens, gaps = _gaps(services.gateways["mid"].address, normal)
                other.cancel()
            assert tokens == plain[(tuple(OTHER), MAX_TOKENS)]
            assert (drafter.sent > sent) == (gamma > 0)  # the polite drafter did answer (only) with gamma
            measured[name] = _per_token_s(tokens, gaps)
    finally:
        gateway.stop()
    ratio = measured["with"] / measured["without"]
    print(
        f"\nnormal request: {measured['without'] * 1e3:.1f} ms/token beside a request without a drafter, "
        f"{measured['with'] * 1e3:.1f} ms/token beside one with a polite hostile drafter: ratio {ratio:.2f}"
    )
    assert ratio < 2.0, measured
