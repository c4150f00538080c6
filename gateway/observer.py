"""The stats observer of one generation: its spans, its per-step metrics, its latency spikes.

It reads, never counts: each verdict is counted once, by the generation's SpecStats
(`SpecStats.observe`), and the observer turns the step that returns into

    a `specdec.round` span      from the previous verdict to this one: the step's figures and
                                its latency by stage (verify, draft, draft_wait, network)
    Prometheus                  telemetry.GatewayMetrics.observe(step, stages)
    a latency-spike check       telemetry.SpikeDetector (span event, counter, log line)

and, when the generation ends, sets the `specdec.generate` span's totals from
SpecStats.span_attributes().
"""

from __future__ import annotations

import logging
import time
from typing import Any

from opentelemetry import trace

from gateway.plan import Plan
from specdec import telemetry
from specdec.stats import SpecStats, SpecStep
from specdec.wire import draft_method_name

log = logging.getLogger("specdec.gateway")


class StatsObserver:
    """Spans and metrics of one generation's run on one verifier (a migrated generation gets one
    per verifier, over the same SpecStats). `context` is the generation span's, for the calls
    to the verifier and the drafter (W3C trace context)."""

    def __init__(
        self,
        plan: Plan,
        stats: SpecStats,
        spikes: telemetry.SpikeDetector,
        metrics: telemetry.GatewayMetrics,
        model: str = "",
        parent: Any = None,
    ) -> None:
        self.plan = plan
        self.stats = stats
        self.spikes = spikes
        self.metrics = metrics
        self.tracer = telemetry.tracer("gateway")
        sp = plan.sampling
        self.span = self.tracer.start_span(
            "specdec.generate",
            context=parent,
            attributes={
                "gen_ai.operation.name": "text_completion",
                "gen_ai.request.model": model,
                "gen_ai.request.max_tokens": sp.max_tokens,
                "gen_ai.request.temperature": sp.temperature,
                "gen_ai.request.top_p": sp.top_p if sp.HasField("top_p") else 1.0,
                "gen_ai.usage.input_tokens": len(plan.prompt_token_ids),
                "specdec.request_id": plan.request_id,
                "specdec.gamma": stats.num_spec_tokens,
                "specdec.drafter": draft_method_name(stats.drafter),
            },
        )
        self.context = trace.set_span_in_context(self.span)
        self._last_ns = time.time_ns()

    def observe(self, step: SpecStep) -> None:
        """One target step: a span from the previous verdict to this one, metrics, spike check."""
        now = time.time_ns()
        round_ms = (now - self._last_ns) / 1e6
        stages = {
            "verify": step.step_ms,
            "draft": step.draft_ms,
            "draft_wait": step.draft_wait_ms,
            "network": max(0.0, round_ms - step.step_ms - step.draft_wait_ms),
        }
        number = step.index + 1
        span = self.tracer.start_span(
            "specdec.round",
            context=self.context,
            start_time=self._last_ns,
            attributes={
                "specdec.round": number,
                "specdec.gamma": self.stats.num_spec_tokens,
                "specdec.drafted": step.num_draft_tokens,
                "specdec.accepted": step.num_accepted_tokens,
                "specdec.tokens": step.num_tokens,
                "specdec.batch_size": step.batch_size,
                "specdec.computed_tokens": step.computed_tokens,
                "specdec.queue_ms": round(step.queue_ms, 3),
                "specdec.branch": step.branch,
                "specdec.hold_drafts": step.hold_drafts,
                "specdec.branch_draft_ms": round(step.branch_draft_ms, 3),
                **{f"specdec.stage.{k}_ms": round(ms, 3) for k, ms in stages.items()},
            },
        )
        if step.index == 0:
            self.span.set_attribute("specdec.queue_ms", round(step.queue_ms, 3))
        else:  # the first round is queueing + prefill: time to first token, not a spike
            spiked = self.spikes.check(stages)
            for stage, limit in spiked.items():
                span.add_event(
                    "latency_spike",
                    {
                        "specdec.spike.stage": stage,
                        "specdec.spike.ms": stages[stage],
                        "specdec.spike.threshold_ms": limit,
                    },
                )
                self.metrics.spikes.labels(stage).inc()
            if spiked:
                span.set_attribute("specdec.spike.stage", ",".join(spiked))
                unlogged = self.spikes.loggable()
                if unlogged is not None:
                    log.warning(
                        "latency spike in %s: request %s round %d trace %s stages %s%s",
                        ",".join(spiked),
                        self.plan.request_id,
                        number,
                        telemetry.trace_id_hex(span),
                        {k: round(ms, 1) for k, ms in stages.items()},
                        f" ({unlogged} more spiked rounds since the last line: span events, "
                        "specdec:latency_spikes_total)"
                        if unlogged
                        else "",
                    )
        span.end(end_time=now)
        self._last_ns = now
        self.metrics.observe(step, stages)

    def finish(self) -> None:
        """The run ended: the generation span gets its totals (SpecStats.span_attributes) and ends."""
        self.span.set_attributes(self.stats.span_attributes())
        if self.stats.fallback_reason:
            self.metrics.fallbacks.inc()
        self.span.end()
