"""One generation's rounds: the gateway's synchronisation of drafter and verifier.

    client -> gateway : GenerateRequest
    gateway -> verifier: open (prompt, sampling, gamma)       gateway -> drafter: open
    drafter -> gateway -> verifier: block (start, tokens)     (as soon as drafted)
    verifier -> gateway: verdict (tokens, drafted, accepted)  (one per target step)
    gateway -> client  : the verdict's tokens as text         (at once)
    gateway -> drafter : commit (start, tokens)               (drafter rolls back / goes on)

The verifier never waits for drafts: a target step without a usable block is a plain
decode step. So when the drafter fails, stalls or is killed, the generation goes on
as plain target decoding with the same output, and the stats say so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from specdec.wire import pb

log = logging.getLogger("specdec.gateway")


@dataclass
class Plan:
    """A validated request, ready to run."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: "pb.SamplingParams"
    gamma: int
    drafter: str  # "model", "ngram" or "none"


@dataclass
class Stats:
    """Accumulates specdec.v1.SpeculationStats over a generation's verdicts."""

    gamma: int
    drafter: str
    verdicts: int = 0
    speculative_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    completion_tokens: int = 0
    computed: int = 0
    blocks: int = 0
    block_tokens: int = 0
    fallback_reason: str = ""
    per_position: list[int] = field(default_factory=list)

    def add_verdict(self, v: "pb.VerifyResponse") -> None:
        self.verdicts += 1
        self.completion_tokens += len(v.token_ids)
        self.computed += v.computed_tokens
        if v.drafted:
            self.speculative_steps += 1
            self.drafted += v.drafted
            self.accepted += v.accepted
            if len(self.per_position) < v.drafted:
                self.per_position.extend([0] * (v.drafted - len(self.per_position)))
            for i in range(v.accepted):
                self.per_position[i] += 1

    def to_pb(self) -> "pb.SpeculationStats":
        steps = max(0, self.verdicts - 1)  # the first verdict is the prefill step
        return pb.SpeculationStats(
            gamma=self.gamma,
            drafter=self.drafter,
            target_steps=steps,
            speculative_steps=self.speculative_steps,
            drafted_tokens=self.drafted,
            accepted_tokens=self.accepted,
            accepted_per_position=self.per_position,
            acceptance_rate=self.accepted / self.drafted if self.drafted else 0.0,
            mean_accepted_length=1 + self.accepted / self.speculative_steps if self.speculative_steps else 1.0,
            tokens_per_step=(self.completion_tokens - 1) / steps if steps else 0.0,
            blocks_received=self.blocks,
            tokens_received=self.block_tokens,
            drafter_fallback=bool(self.fallback_reason),
            fallback_reason=self.fallback_reason,
            target_computed_tokens=self.computed,
        )


class Round:
    """Runs one generation between a VerifierService and a DrafterService stub.

    Iterate `verdicts()`; `stats` is complete when the iteration ends.
    """

    def __init__(self, plan: Plan, verifier_stub: object, drafter_stub: object, open_timeout_s: float) -> None:
        self.plan = plan
        self.verifier_stub = verifier_stub
        self.drafter_stub = drafter_stub
        self.open_timeout_s = open_timeout_s
        use_drafter = plan.gamma > 0 and plan.drafter != "none"
        self.stats = Stats(plan.gamma if use_drafter else 0, plan.drafter if use_drafter else "none")
        self._finished = False
        self._commits: asyncio.Queue["pb.DraftRequest | None"] = asyncio.Queue()

    def _fallback(self, reason: str) -> None:
        if not self.stats.fallback_reason and not self._finished:
            self.stats.fallback_reason = reason
            log.warning("request %s: drafter fallback: %s", self.plan.request_id, reason)

    async def _relay_blocks(self, dcall: grpc.aio.StreamStreamCall, vcall: grpc.aio.StreamStreamCall) -> None:
        """drafter -> verifier: forward each block as it arrives."""
        p = self.plan
        try:
            await dcall.write(
                pb.DraftRequest(
                    open=pb.DraftOpen(
                        request_id=p.request_id,
                        prompt_token_ids=p.prompt_token_ids,
                        sampling=p.sampling,
                        gamma=p.gamma,
                        method=p.drafter,
                    )
                )
            )
            first = True
            while True:
                if first and p.drafter == "model":
                    resp = await asyncio.wait_for(dcall.read(), self.open_timeout_s)
                else:
                    resp = await dcall.read()
                first = False
                if resp is grpc.aio.EOF:
                    self._fallback("drafter ended its stream")
                    return
                self.stats.blocks += 1
                self.stats.block_tokens += len(resp.block.token_ids)
                await vcall.write(pb.VerifyRequest(block=resp.block))
        except TimeoutError:
            self._fallback(f"drafter missed its {self.open_timeout_s:g} s deadline for the first block")
        except grpc.aio.AioRpcError as err:
            self._fallback(f"drafter {err.code().name}: {err.details()}")
        except (grpc.aio.UsageError, asyncio.InvalidStateError, RuntimeError) as err:
            if not self._finished:
                self._fallback(f"relay failed: {err}")
        finally:
            dcall.cancel()

    async def _send_commits(self, dcall: grpc.aio.StreamStreamCall) -> None:
        """gateway -> drafter: one commit per verdict, in order, off the verdict path."""
        try:
            while (msg := await self._commits.get()) is not None:
                await dcall.write(msg)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError, RuntimeError) as err:
            self._fallback(f"drafter commit failed: {err}")

    async def verdicts(self) -> AsyncIterator["pb.VerifyResponse"]:
        p = self.plan
        vcall = self.verifier_stub.Verify()
        tasks: list[asyncio.Task] = []
        dcall = None
        try:
            await vcall.write(
                pb.VerifyRequest(
                    open=pb.VerifyOpen(
                        request_id=p.request_id,
                        prompt_token_ids=p.prompt_token_ids,
                        sampling=p.sampling,
                        gamma=self.stats.gamma,
                    )
                )
            )
            if self.stats.gamma:
                dcall = self.drafter_stub.Draft()
                tasks.append(asyncio.create_task(self._relay_blocks(dcall, vcall)))
                tasks.append(asyncio.create_task(self._send_commits(dcall)))
            while True:
                v = await vcall.read()
                if v is grpc.aio.EOF:
                    raise RuntimeError("verifier ended the stream without a finish reason")
                self.stats.add_verdict(v)
                if v.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    self._finished = True
                if dcall is not None and not self._finished:
                    self._commits.put_nowait(
                        pb.DraftRequest(
                            commit=pb.DraftCommit(start_position=v.start_position, token_ids=v.token_ids, accepted=v.accepted)
                        )
                    )
                yield v
                if self._finished:
                    return
        finally:
            self._finished = True
            self._commits.put_nowait(None)
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            if dcall is not None:
                dcall.cancel()
            vcall.cancel()
