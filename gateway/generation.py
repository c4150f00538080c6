"""One generation's run across drafter and verifier: the gateway's synchronisation of the two.

    client -> gateway  : GenerateRequest
    gateway -> verifier: open (prompt, sampling, gamma)       gateway -> drafter: open
    drafter -> gateway -> verifier: ready (prompt prefilled; while the target prefills)
    verifier -> gateway: preview (tokens sampled, from inside the step)
    gateway -> drafter : commit (start, tokens)               (drafter keeps or rolls back)
    drafter -> gateway -> verifier: block (start, tokens)     (as soon as drafted)
    verifier -> gateway: verdict (tokens, drafted, accepted)  (one per target step)
    gateway -> client  : the preview's tokens as text, then what the verdict adds (at once)

A target step waits for drafts at most the verifier's `draft_wait_ms` (less: about as
long as the drafter is expected to take), and not at all once the gateway has told it
(`end`) that the drafter is gone: a step without a usable block is a plain decode step.
So when the drafter fails, stalls or is killed, the generation goes on as plain target
decoding with the same output, and the stats say so.

The run is split by concern, one module each:

    gateway.transport   the stream transport: one writer per call, the verifier's steps read
    gateway.relay       the drafter relay: checks, deadline, hold, polite-drafter detection, fallback
    gateway.observer    the stats observer: spans, per-step metrics, latency spikes
    gateway.migration   what happens when the verifier goes away (the caller resumes the
                        generation elsewhere, with the same SpecStats)
    specdec.stats       the one accumulator of the figures (SpecStats)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import grpc

from gateway.observer import StatsObserver
from gateway.plan import Plan
from gateway.relay import DrafterRelay
from gateway.transport import Outbox, read_step
from specdec import telemetry
from specdec.stats import SpecStats
from specdec.steps import Step
from specdec.wire import pb

if TYPE_CHECKING:
    from gateway.transport import VerifyCall

log = logging.getLogger("specdec.gateway")


class Generation:
    """One generation's run between a VerifierService and a DrafterService stub.

    Iterate `steps()`: previews (pb.Preview, tokens certain to be in the next verdict, sent
    from inside the target step) and verdicts (pb.Verdict); `stats` (SpecStats, verdicts only)
    is complete when the iteration ends. A migrated generation passes its `stats` on to the
    Generation that resumes it. Metrics go to `metrics` (the gateway's, telemetry.GatewayMetrics),
    latency spikes to `spikes`.

    `drafter_stub` None: no drafter serves (none resolved, or every one failed its health
    check): the generation runs as plain target decoding from its first step, and the stats say
    why. `vocab_size`: the target's, for checking drafted ids (None: asked from the verifier
    once). `on_drafter_unavailable()` is called when the drafter's call ends with UNAVAILABLE
    (its process went away), so the caller's pool skips it until it serves again.
    `verdict_timeout_s` (> 0): once the verifier has sent its first verdict (queueing and prefill
    never count), a silence this long while it still owes verdicts ends the run with
    UNAVAILABLE, which the gateway treats as a verifier gone (migration).
    `max_idle_commits` (> 0): idle windows in a row (gateway.relay) before the drafter is
    treated as failed; 0: never. `replicas`: the caller's (verifier, drafter) replicas this run
    uses, kept for it (the gateway counts their load and reports failures to their pools).
    """

    def __init__(
        self,
        plan: Plan,
        verifier_stub: Any,
        drafter_stub: Any,
        drafter_timeout_s: float,
        spikes: telemetry.SpikeDetector,
        metrics: telemetry.GatewayMetrics,
        model: str = "",
        parent: Any = None,
        vocab_size: int | None = None,
        stats: SpecStats | None = None,
        on_drafter_unavailable: Callable[[], None] | None = None,
        verdict_timeout_s: float = 0.0,
        max_idle_commits: int = 0,
        replicas: tuple[Any, Any] = (None, None),
        drafter_prefill_timeout_s: float | None = None,
    ) -> None:
        self.plan = plan
        self.replicas = replicas
        self.verifier_stub = verifier_stub
        self.verdict_timeout_s = verdict_timeout_s
        self.metrics = metrics
        gamma = plan.gamma if plan.uses_drafter else 0
        # `stats`: a migrated generation's, which this run goes on counting into
        self.stats = stats or SpecStats(gamma, plan.drafter if gamma else pb.DRAFT_METHOD_NONE)
        self.gamma = self.stats.num_spec_tokens
        self.observer = StatsObserver(plan, self.stats, spikes, metrics, model=model, parent=parent)
        self._to_verifier: Outbox[pb.VerifyRequest] = Outbox()
        self.relay = DrafterRelay(
            plan,
            self.gamma,
            self.stats,
            self._to_verifier,
            drafter_stub,
            verifier_stub,
            drafter_timeout_s,
            vocab_size=vocab_size,
            max_idle_commits=max_idle_commits,
            on_unavailable=on_drafter_unavailable,
            prefill_timeout_s=drafter_prefill_timeout_s,
        )

    async def _write_verifier(self, vcall: VerifyCall) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError, RuntimeError):
            await self._to_verifier.write_all(vcall)  # errors surface on the read side

    async def steps(self) -> AsyncIterator[Step]:
        """The verifier's previews and verdicts, as they come; ends after the verdict with a
        finish reason. A verifier error is raised (AioRpcError; UNAVAILABLE when it went away)."""
        p = self.plan
        carrier = telemetry.inject_context_of(self.observer.context)
        metadata = tuple(carrier.items())
        vcall = self.verifier_stub.Verify(metadata=metadata)
        tasks = [asyncio.create_task(self._write_verifier(vcall), name="verifier writer")]
        self._to_verifier.put(
            pb.VerifyRequest(
                open=pb.VerifyOpen(
                    request_id=p.backend_id,
                    prompt_token_ids=p.prompt_token_ids,
                    sampling=p.sampling,
                    gamma=self.gamma,
                    trace_context=carrier,
                    typed_steps=True,
                )
            )
        )
        try:
            tasks += self.relay.start(metadata, carrier)
            while True:
                step = await read_step(vcall, self.verdict_timeout_s if self.stats.num_verdicts else 0.0)
                self.relay.commit(step)
                if isinstance(step, pb.Preview):
                    yield step  # the client gets the tokens now, not after the next block's wait
                    continue
                self.observer.observe(self.stats.observe(step))
                finished = step.finish_reason != pb.FINISH_REASON_UNSPECIFIED
                if finished:  # stop writing, then half-close: the verifier ends the call after that
                    self.relay.finish()
                    self._to_verifier.close()
                    await asyncio.wait({tasks[0]}, timeout=5.0)
                    with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError, RuntimeError):
                        await vcall.done_writing()
                yield step
                if finished:
                    return
        finally:
            self.relay.finish()
            self.observer.finish()
            self._to_verifier.close()
            for t in tasks:
                t.cancel()
            for t in tasks:
                try:
                    await t
                except asyncio.CancelledError:
                    pass  # cancelled just above: the run is over
                except Exception:  # a bug in a helper (they handle the errors they expect): say so
                    log.exception("request %s: generation helper %s failed", p.request_id, t.get_name())
            self.relay.cancel()
            vcall.cancel()
