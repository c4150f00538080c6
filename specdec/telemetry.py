"""One place for telemetry: OpenTelemetry tracing, latency-spike detection, Prometheus metrics.

Tracing
    `setup_tracing(service)` installs a tracer provider. Exporters come from the standard
    OTEL_* variables (`OTEL_TRACES_EXPORTER=otlp|console|none`, `OTEL_EXPORTER_OTLP_ENDPOINT`,
    `OTEL_EXPORTER_OTLP_PROTOCOL=grpc|http/protobuf`, ...); `SPECDEC_TRACE_FILE=path`
    adds a JSON-lines file exporter (one span per line) that `specdec traces` reads.
    W3C trace context travels in gRPC metadata and in the sessions' open/commit messages
    (`trace_context` maps), so one trace links gateway, drafter and verifier.

Spans (names and attributes)
    specdec.generate        gateway, one per request; GenAI semantic-convention attributes
                            (gen_ai.operation.name, gen_ai.request.model, gen_ai.usage.*)
                            and specdec.* totals
    specdec.round           gateway, one per target step; specdec.gamma, .drafted,
                            .accepted, .batch_size, .queue_ms (engine queue time, first
                            round), .stage.{verify,draft,draft_wait,network}_ms
                            (draft: the chain's blocks), .branch_draft_ms (branches
                            drafted beside the step: not a stage, never a spike);
                            a `latency_spike` event and specdec.spike.stage when a stage spikes
    specdec.draft_session   drafter, one per request; a `block` event per block sent
    specdec.verify_session  verifier, one per request; a `step` event per target step

Latency spikes
    Every stage keeps a rolling window of its latencies. A round whose stage exceeds
    max(`spike_min_ms`, `spike_factor` x the window's p95) (after `SPIKE_WARMUP` rounds),
    or the absolute `spike_ms` when set, is a spike: span event, attribute, counter, log line
    with the trace id.

Metrics (Prometheus, `/metrics` on each service; names follow vLLM's spec-decode metrics)
    Each service's metrics are one object built on that service's own registry:
    `GatewayMetrics`, `DrafterMetrics`, `VerifierMetrics` (their docstrings list the families,
    with PromQL). `service_registry(service)` makes the registry with the shared families
    (process_*, python_gc_*, python_info, specdec:build_info{service, version}), so a
    service's /metrics shows its own families and those only. Nothing here registers in
    prometheus_client's default REGISTRY.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter, SpanExportResult
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)

from specdec import __version__

if TYPE_CHECKING:
    from specdec.stats import SpecStep

log = logging.getLogger("specdec.telemetry")

SPIKE_WARMUP = 20
# specdec:drafter_batch_rows: every batch size up to 32 its own bucket, then coarser
DRAFTER_BATCH_ROWS_BUCKETS: tuple[float, ...] = (*range(1, 33), 48, 64, 128, 256)
LONG_LOOP_DELAY_S = 0.01  # a bucket bound of specdec:drafter_loop_delay_seconds: a "long" wait (dashboard, bench)
STAGES = ("verify", "draft", "draft_wait", "network")

# ---- tracing ---------------------------------------------------------------------------


class JsonLinesExporter(SpanExporter):
    """Appends each finished span to a file as one JSON object per line."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._file = open(path, "a")  # noqa: SIM115 (closed in shutdown)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        text = "".join(json.dumps(span_record(s)) + "\n" for s in spans)
        with self._lock:
            self._file.write(text)
            self._file.flush()  # one append per export: services may share the file
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()


def span_record(s: ReadableSpan) -> dict[str, Any]:
    """A span as a plain dict (ids in hex, times in ns since the epoch)."""
    ctx = s.get_span_context()
    assert ctx is not None, "an ended span (what exporters get) has its context"
    return {
        "name": s.name,
        "service": s.resource.attributes.get("service.name", ""),
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{s.parent.span_id:016x}" if s.parent else None,
        "start_ns": s.start_time,
        "end_ns": s.end_time,
        "attributes": dict(s.attributes or {}),
        "events": [{"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})} for e in s.events],
    }


def setup_tracing(service: str) -> trace.Tracer:
    """Install the tracer provider for this process (exporters from the environment)."""
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    exporters = [e.strip() for e in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()]
    if "otlp" in exporters:
        otlp: SpanExporter
        if os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc") == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter

            otlp = GrpcSpanExporter()
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter

            otlp = HttpSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(otlp))
    if "console" in exporters:
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    path = os.environ.get("SPECDEC_TRACE_FILE")
    if path:
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(path)))
    trace.set_tracer_provider(provider)
    return tracer(service)


def tracer(service: str) -> trace.Tracer:
    return trace.get_tracer(f"specdec.{service}")


def inject_context_of(context: Context) -> dict[str, str]:
    """A context's W3C trace context (traceparent, tracestate) as a dict."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return carrier


def extract_context(carrier: Mapping[str, str] | Iterable[tuple[str, str | bytes]] | None) -> Context | None:
    """An OpenTelemetry context from a trace_context map or gRPC metadata (its binary values skipped)."""
    if carrier is None:
        return None
    items = carrier.items() if isinstance(carrier, Mapping) else carrier
    return propagate.extract({k: v for k, v in items if isinstance(v, str)})


def trace_id_hex(span: trace.Span) -> str:
    return f"{span.get_span_context().trace_id:032x}"


# ---- latency spikes ----------------------------------------------------------------------


@dataclass
class SpikeDetector:
    """Rolling latency windows per stage; `check` names the stages of a round that spiked;
    `loggable` says whether a spike gets a log line (at most one per `log_every_s`, seconds)."""

    window: int = 256
    factor: float = 3.0
    min_ms: float = 5.0
    absolute_ms: float = 0.0  # > 0: a fixed threshold instead of the relative one
    log_every_s: float = 1.0
    _samples: dict[str, deque[float]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _logged_at: float = float("-inf")  # time.monotonic() of the last spike logged
    _unlogged: int = 0  # spikes since then that got no line

    def threshold(self, stage: str) -> float | None:
        if self.absolute_ms > 0:
            return self.absolute_ms
        samples = self._samples.get(stage)
        if samples is None or len(samples) < SPIKE_WARMUP:
            return None
        ordered = sorted(samples)
        p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
        return max(self.min_ms, self.factor * p95)

    def check(self, stages_ms: Mapping[str, float]) -> dict[str, float]:
        """Record one round's stage latencies; return {stage: threshold} for those over it."""
        spiked: dict[str, float] = {}
        with self._lock:
            for stage, ms in stages_ms.items():
                limit = self.threshold(stage)
                if limit is not None and ms > limit:
                    spiked[stage] = limit
                self._samples.setdefault(stage, deque(maxlen=self.window)).append(ms)
        return spiked

    def loggable(self, now: float | None = None) -> int | None:
        """Whether a spiked round found at `now` (time.monotonic() when None) gets a log line: the
        first after `log_every_s` does. A saturated host spikes on most rounds, and a line for
        each would flood the log; every spike still gets its span event and its count. Returns
        how many spiked rounds went unlogged before this one, or None: this one goes unlogged."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if now - self._logged_at < self.log_every_s:
                self._unlogged += 1
                return None
            unlogged, self._unlogged, self._logged_at = self._unlogged, 0, now
            return unlogged


# ---- metrics ----------------------------------------------------------------------------


def service_registry(service: str) -> CollectorRegistry:
    """A fresh registry for one service's /metrics, holding the families every service shares:
    process_* (CPU, memory, open fds), python_gc_*, python_info, and
    specdec:build_info{service, version} (always 1).

    Build the service's metrics object (GatewayMetrics, DrafterMetrics, VerifierMetrics) on it.
    """
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    build_info = Gauge(
        "specdec:build_info",
        "Service and specdec version of this process (always 1)",
        ["service", "version"],
        registry=registry,
    )
    build_info.labels(service, __version__).set(1)
    return registry


class GatewayMetrics:
    """The gateway's metrics (per request and per round), on `registry`.

    Families:
        specdec:spec_decode_num_drafts_total              target steps that verified a draft block
        specdec:spec_decode_num_draft_tokens_total        draft tokens verified
        specdec:spec_decode_num_accepted_tokens_total     draft tokens accepted
        specdec:spec_decode_num_accepted_tokens_per_pos_total{position}
        specdec:accepted_length                           histogram: tokens per speculative step
        specdec:rounds_total                              target steps (all requests)
        specdec:round_stage_seconds{stage}                histogram: verify, draft, draft_wait, network
        specdec:generation_tokens_total, specdec:prompt_tokens_total
        specdec:requests_total{finish_reason}, specdec:requests_running (queue depth)
        specdec:time_to_first_token_seconds               histogram: a stream's arrival to its first token
        specdec:e2e_request_latency_seconds               histogram: a call's arrival to its end (completed calls)
        specdec:latency_spikes_total{stage}, specdec:drafter_fallbacks_total
        specdec:gateway_refused_total{reason}             unauthenticated, rate_limited, request_too_large
        specdec:gateway_stream_write_timeouts_total       streams ended: their client read nothing for stream_write_timeout_s
        specdec:gateway_migrations_total                  generations resumed on another verifier
        specdec:gateway_replicas{pool, state}             drafter / verifier replicas the gateway knows,
                                                          by their last health check (serving, not_serving)

    PromQL:
        Acceptance rate over 5 minutes:
            rate(specdec:spec_decode_num_accepted_tokens_total[5m])
              / rate(specdec:spec_decode_num_draft_tokens_total[5m])
        Mean accepted length (tokens per speculative step):
            1 + rate(specdec:spec_decode_num_accepted_tokens_total[5m])
              / rate(specdec:spec_decode_num_drafts_total[5m])
        Acceptance at draft position p:
            rate(specdec:spec_decode_num_accepted_tokens_per_pos_total{position="p"}[5m])
              / rate(specdec:spec_decode_num_drafts_total[5m])
        p99 round latency by stage:
            histogram_quantile(0.99, sum by (le, stage) (rate(specdec:round_stage_seconds_bucket[5m])))
        Generated tokens/s:   rate(specdec:generation_tokens_total[1m])
        Spikes by stage:      rate(specdec:latency_spikes_total[5m])
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.num_drafts = Counter(
            "specdec:spec_decode_num_drafts", "Target steps that verified a draft block", registry=registry
        )
        self.num_draft_tokens = Counter(
            "specdec:spec_decode_num_draft_tokens", "Draft tokens verified", registry=registry
        )
        self.num_accepted_tokens = Counter(
            "specdec:spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=registry
        )
        self.accepted_per_pos = Counter(
            "specdec:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by position in the block",
            ["position"],
            registry=registry,
        )
        self.accepted_length = Histogram(
            "specdec:accepted_length",
            "Tokens emitted per speculative target step (accepted + 1)",
            buckets=range(1, 34),
            registry=registry,
        )
        self.rounds = Counter("specdec:rounds", "Target steps seen by the gateway (all requests)", registry=registry)
        self.round_stage = Histogram(
            "specdec:round_stage_seconds",
            "Round latency by stage: verify (engine step), draft (drafter compute), draft_wait "
            "(verifier waiting for drafts), network (the rest of the round)",
            ["stage"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=registry,
        )
        self.generation_tokens = Counter("specdec:generation_tokens", "Generated tokens", registry=registry)
        self.prompt_tokens = Counter("specdec:prompt_tokens", "Prompt tokens", registry=registry)
        self.requests = Counter(
            "specdec:requests", "Finished requests by finish reason", ["finish_reason"], registry=registry
        )
        for reason in ("length", "stop", "abort"):  # every finish reason has a series from the start
            self.requests.labels(reason)
        self.requests_running = Gauge(
            "specdec:requests_running", "Requests in flight at the gateway (queue depth)", registry=registry
        )
        # what a client sees, from the call's arrival at the gateway (admission and queueing included)
        self.time_to_first_token = Histogram(
            "specdec:time_to_first_token_seconds",
            "GenerateStream calls: arrival to the first token",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=registry,
        )
        self.e2e_latency = Histogram(
            "specdec:e2e_request_latency_seconds",
            "Generate and GenerateStream calls that completed: arrival to the end",
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600),
            registry=registry,
        )
        self.spikes = Counter(
            "specdec:latency_spikes", "Rounds with a latency spike, by stage", ["stage"], registry=registry
        )
        for stage in STAGES:
            self.spikes.labels(stage)
        self.migrations = Counter(
            "specdec:gateway_migrations",
            "Generations moved to another verifier mid-way (theirs went away)",
            registry=registry,
        )
        # by reason only: API keys (or their ids) are never metric labels
        self.refused = Counter(
            "specdec:gateway_refused",
            "Calls refused before any work, by reason (unauthenticated, rate_limited, request_too_large)",
            ["reason"],
            registry=registry,
        )
        for reason in ("unauthenticated", "rate_limited"):
            self.refused.labels(reason)
        self.stream_write_timeouts = Counter(
            "specdec:gateway_stream_write_timeouts",
            "Streams ended because their client read nothing for "
            "stream_write_timeout_s (gRPC GenerateStream and REST streams)",
            registry=registry,
        )
        self.fallbacks = Counter(
            "specdec:drafter_fallbacks", "Requests that went on without their drafter", registry=registry
        )
        # read at scrape time from the pools (GatewayServicer binds them): pool = drafter | verifier
        self.replicas = Gauge(
            "specdec:gateway_replicas",
            "Replicas the gateway knows, by their last health check (serving, not_serving)",
            ["pool", "state"],
            registry=registry,
        )
        for pool in ("drafter", "verifier"):
            for state in ("serving", "not_serving"):
                self.replicas.labels(pool, state).set(0)

    def observe(self, step: SpecStep, stages_ms: Mapping[str, float]) -> None:
        """One target step of a generation, as its SpecStats read it (SpecStats.observe), and
        the step's latency by stage (milliseconds)."""
        self.rounds.inc()
        self.generation_tokens.inc(step.num_tokens)
        for stage, ms in stages_ms.items():
            self.round_stage.labels(stage).observe(ms / 1e3)
        if step.is_draft:
            self.num_drafts.inc()
            self.num_draft_tokens.inc(step.num_draft_tokens)
            self.num_accepted_tokens.inc(step.num_accepted_tokens)
            self.accepted_length.observe(step.num_accepted_tokens + 1)
            for i in range(step.num_accepted_tokens):
                self.accepted_per_pos.labels(str(i)).inc()


class DrafterMetrics:
    """The drafter's metrics, on `registry`.

    Families:
        specdec:drafter_sessions        open draft sessions (gauge)
        specdec:drafter_requests_total  draft sessions opened (one per generation sent to this drafter)
        specdec:drafter_blocks_total    blocks sent
        specdec:drafter_tokens_total    draft tokens sent
        specdec:drafter_step_seconds    histogram: one draft token's compute
        specdec:drafter_batch_rows      histogram: rows (sessions) per forward of the draft model
                                        that drafts tokens: the drafter's batch size (see below)
        specdec:drafter_branches_total  pre-drafted branches sent
        specdec:drafter_branch_breaks_total{gamma}
                                        commits that broke a session's draft chain (a rejected
                                        draft), by the session's gamma then
        specdec:drafter_branch_hits_total{gamma}
                                        ... of which adopted a pre-drafted branch (a branch hit;
                                        a branch still under way counts, with its drafts so far)
        specdec:drafter_branch_uncovered_total{gamma}
                                        ... of which no branch could have covered: the verdict
                                        (rejected position, correction) was not among the
                                        session's branch candidates (the correction was not among
                                        the draft's alternatives there, or ranked past `branches`)
        specdec:drafter_commit_seconds  histogram: a commit's wait for its session, which the
                                        draft step under way holds, plus applying it: how late
                                        a verdict reaches the drafts
        specdec:drafter_forwards_stopped_total
                                        draft forwards stopped part-way by a commit that
                                        rejected their context (drafter.sessions, `superseded`):
                                        the commit waited a layer for them, not a forward
        specdec:drafter_confidence_cuts_total
                                        blocks cut where the draft's cumulative confidence fell
                                        below tau (DrafterConfig.draft_confidence)
        specdec:drafter_block_tau       histogram: tau of each block sent with confidence on
        specdec:drafter_prompt_tokens_total
                                        prompt tokens of the sessions that became ready (their
                                        prompts in the draft model's cache; a preempted session's
                                        committed context again when it comes back)
        specdec:drafter_prefix_reused_tokens_total
                                        ... of which the prefix cache supplied (copied, not
                                        computed; drafter.prefix_cache)
        specdec:drafter_prefix_cache_bytes
                                        bytes of keys/values the prefix cache holds (gauge)
        specdec:drafter_kv_cache_bytes  bytes of the live sessions' keys/values budget held (gauge;
                                        per admitted session the larger of its reserve and its
                                        cache: drafter.memory)
        specdec:drafter_kv_cache_budget_bytes
                                        ... the budget (kv_cache_mib, or the auto one) (gauge)
        specdec:drafter_kv_waits_total  prompts whose prefill waited for the budget (once each)
        specdec:drafter_kv_overflows_total
                                        sessions ended because their keys/values outgrew their
                                        reserve with no room left in the budget (their requests
                                        decode the rest plainly; drafter.memory's growth)
        specdec:drafter_kv_preemptions_total
                                        sessions preempted for room instead: their keys/values
                                        went to the prefix cache, and they were admitted and
                                        prefilled again when they fit (their requests decoded
                                        plainly meanwhile; drafter.memory's growth)

    Batch rows: the draft worker's step drafts one token for each session that has one to
    make; with batch_drafts those rows share one forward (drafter.batch), which is observed
    once with its rows. A forward of one session (batching off, a step where one session
    drafts, a model that cannot batch) is observed as 1. Prefill chunks, branch batches and
    n-gram sessions (no forward) are not observed. The buckets are the integers 1 to 32
    (exact counts per batch size up to 32), then 48, 64, 128, 256.

    PromQL:
        Draft tokens/s:              rate(specdec:drafter_tokens_total[1m])
        Mean tokens per block:       rate(specdec:drafter_tokens_total[5m]) / rate(specdec:drafter_blocks_total[5m])
        p99 draft-token compute:     histogram_quantile(0.99, rate(specdec:drafter_step_seconds_bucket[5m]))
        Branches per second:         rate(specdec:drafter_branches_total[1m])
        Branch hit rate per gamma:   sum by (gamma) (rate(specdec:drafter_branch_hits_total[5m]))
                                       / sum by (gamma) (rate(specdec:drafter_branch_breaks_total[5m]))
        Breaks no branch could cover: sum(rate(specdec:drafter_branch_uncovered_total[5m]))
                                       / sum(rate(specdec:drafter_branch_breaks_total[5m]))
        Mean commit wait:            rate(specdec:drafter_commit_seconds_sum[5m]) / rate(specdec:drafter_commit_seconds_count[5m])
        Blocks waiting > 10 ms for the event loop (share):
                                     1 - rate(specdec:drafter_loop_delay_seconds_bucket{le="0.01"}[5m])
                                       / rate(specdec:drafter_loop_delay_seconds_count[5m])
        Forwards stopped per break:  sum(rate(specdec:drafter_forwards_stopped_total[5m]))
                                       / sum(rate(specdec:drafter_branch_breaks_total[5m]))
        Mean tau:                    rate(specdec:drafter_block_tau_sum[5m]) / rate(specdec:drafter_block_tau_count[5m])
        Mean batch size:             rate(specdec:drafter_batch_rows_sum[5m]) / rate(specdec:drafter_batch_rows_count[5m])
        Prompt tokens reused (share): rate(specdec:drafter_prefix_reused_tokens_total[5m])
                                       / rate(specdec:drafter_prompt_tokens_total[5m])
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.sessions = Gauge("specdec:drafter_sessions", "Open draft sessions", registry=registry)
        self.requests = Counter("specdec:drafter_requests", "Draft sessions opened", registry=registry)
        self.blocks = Counter("specdec:drafter_blocks", "Blocks sent", registry=registry)
        self.tokens = Counter("specdec:drafter_tokens", "Draft tokens sent", registry=registry)
        self.step_seconds = Histogram(
            "specdec:drafter_step_seconds",
            "One draft token's compute",
            buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1),
            registry=registry,
        )
        self.branches = Counter("specdec:drafter_branches", "Pre-drafted branches sent", registry=registry)
        self.branch_breaks = Counter(
            "specdec:drafter_branch_breaks", "Commits that broke a draft chain, by gamma", ["gamma"], registry=registry
        )
        self.branch_hits = Counter(
            "specdec:drafter_branch_hits",
            "Broken chains a pre-drafted branch covered, by gamma",
            ["gamma"],
            registry=registry,
        )
        self.branch_uncovered = Counter(
            "specdec:drafter_branch_uncovered",
            "Broken chains whose verdict was not among the branch candidates, by gamma",
            ["gamma"],
            registry=registry,
        )
        self.commit_seconds = Histogram(
            "specdec:drafter_commit_seconds",
            "A commit's wait for its session (the draft step under way) and its application",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=registry,
        )
        self.loop_delay_seconds = Histogram(
            "specdec:drafter_loop_delay_seconds",
            "An item's wait for the event loop that writes its stream (a block, a ready, a progress "
            "report), from the worker's making it",
            buckets=(0.001, 0.005, LONG_LOOP_DELAY_S, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
            registry=registry,
        )
        self.forwards_stopped = Counter(
            "specdec:drafter_forwards_stopped",
            "Draft forwards stopped part-way by a commit that rejected their context",
            registry=registry,
        )
        self.confidence_cuts = Counter("specdec:drafter_confidence_cuts", "Blocks cut by confidence", registry=registry)
        self.block_tau = Histogram(
            "specdec:drafter_block_tau",
            "Tau of each block sent with confidence on",
            buckets=(0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
            registry=registry,
        )
        self.batch_rows = Histogram(
            "specdec:drafter_batch_rows",
            "Rows (sessions) per forward of the draft model that drafts tokens",
            buckets=DRAFTER_BATCH_ROWS_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "specdec:drafter_prompt_tokens", "Prompt tokens of the sessions that became ready", registry=registry
        )
        self.prefix_reused_tokens = Counter(
            "specdec:drafter_prefix_reused_tokens",
            "Prompt tokens whose keys/values the prefix cache supplied",
            registry=registry,
        )
        self.prefix_cache_bytes = Gauge(
            "specdec:drafter_prefix_cache_bytes", "Bytes of keys/values the prefix cache holds", registry=registry
        )
        self.kv_cache_bytes = Gauge(
            "specdec:drafter_kv_cache_bytes", "Bytes of the live sessions' keys/values budget held", registry=registry
        )
        self.kv_cache_budget_bytes = Gauge(
            "specdec:drafter_kv_cache_budget_bytes", "The live sessions' keys/values budget, bytes", registry=registry
        )
        self.kv_waits = Counter(
            "specdec:drafter_kv_waits", "Prompts whose prefill waited for the keys/values budget", registry=registry
        )
        self.kv_overflows = Counter(
            "specdec:drafter_kv_overflows",
            "Sessions ended because their keys/values outgrew their reserve with no room in the budget",
            registry=registry,
        )
        self.kv_preemptions = Counter(
            "specdec:drafter_kv_preemptions",
            "Sessions preempted to make room for an older session's keys/values, prefilled again when they fit",
            registry=registry,
        )


class VerifierMetrics:
    """The verifier's metrics (the target engine and its draft board), on `registry`.

    Families:
        specdec:verifier_sessions                       open verify sessions (requests in the engine)
        specdec:verifier_requests_total                 verify sessions opened
        specdec:verifier_engine_running                 requests the engine's scheduler runs (read at scrape)
        specdec:verifier_engine_waiting                 requests the engine's scheduler has waiting (read at scrape)
        specdec:verifier_engine_steps_total             engine steps
        specdec:verifier_step_seconds                   histogram: engine step wall time
        specdec:verifier_batch_size                     histogram: requests per engine step
        specdec:verifier_computed_tokens_total          tokens the target computed
        specdec:verifier_withheld_draft_tokens_total    drafts adaptive gamma left unverified
        specdec:verifier_step_cost_ms{term}             fitted step cost: term="base" | "per_token"
        specdec:verifier_draft_wait_seconds_total       engine time spent waiting for drafts
        specdec:verifier_branches_total                 pre-drafted branches received
        specdec:verifier_branch_hits_total              steps whose drafts came from a branch
        specdec:verifier_branch_misses_total            steps after a rejection that found no branch
        vllm:spec_decode_num_drafts_total               vLLM's own spec-decode counts (its scheduler's
        vllm:spec_decode_num_draft_tokens_total         SpecDecodingStats, under its names); over the same
        vllm:spec_decode_num_accepted_tokens_total      requests they equal the gateway's specdec:spec_decode_*
        vllm:spec_decode_num_accepted_tokens_per_pos_total{position}

    PromQL:
        Queue depth:                specdec:verifier_sessions
        Mean batch size:            rate(specdec:verifier_batch_size_sum[5m]) / rate(specdec:verifier_batch_size_count[5m])
        Share of time waiting for drafts:
            rate(specdec:verifier_draft_wait_seconds_total[5m])
              / (rate(specdec:verifier_draft_wait_seconds_total[5m]) + rate(specdec:verifier_step_seconds_sum[5m]))
        Adaptive gamma back-off:    rate(specdec:verifier_withheld_draft_tokens_total[5m]) (drafts left
                                    unverified because they would cost throughput), with the fitted step
                                    cost specdec:verifier_step_cost_ms{term="base"|"per_token"}
        Branch hit rate:            rate(specdec:verifier_branch_hits_total[5m]) / (rate(specdec:verifier_branch_hits_total[5m])
                                      + rate(specdec:verifier_branch_misses_total[5m]))
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.sessions = Gauge(
            "specdec:verifier_sessions", "Open verify sessions (requests in the engine)", registry=registry
        )
        self.requests = Counter("specdec:verifier_requests", "Verify sessions opened", registry=registry)
        # the engine's own view (vLLM's scheduler), beside the sessions: a request the gRPC layer let go
        # but the engine still runs shows here (set to read the scheduler by verifier.engine)
        self.engine_running = Gauge(
            "specdec:verifier_engine_running", "Requests the engine's scheduler is running", registry=registry
        )
        self.engine_waiting = Gauge(
            "specdec:verifier_engine_waiting", "Requests waiting in the engine's scheduler", registry=registry
        )
        self.engine_steps = Counter("specdec:verifier_engine_steps", "Engine steps", registry=registry)
        self.step_seconds = Histogram(
            "specdec:verifier_step_seconds",
            "Engine step wall time",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=registry,
        )
        self.batch_size = Histogram(
            "specdec:verifier_batch_size",
            "Requests per engine step",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=registry,
        )
        self.computed_tokens = Counter(
            "specdec:verifier_computed_tokens", "Tokens the target computed (prefill + 1 + drafts)", registry=registry
        )
        self.withheld_draft_tokens = Counter(
            "specdec:verifier_withheld_draft_tokens",
            "Drafts that arrived but adaptive gamma left unverified (saturation back-off)",
            registry=registry,
        )
        self.step_cost_ms = Gauge(
            "specdec:verifier_step_cost_ms",
            "Fitted engine step cost T(n) = base + per_token * n, milliseconds",
            ["term"],
            registry=registry,
        )
        self.draft_wait_seconds = Counter(
            "specdec:verifier_draft_wait_seconds", "Engine time spent waiting for drafts", registry=registry
        )
        self.branches = Counter("specdec:verifier_branches", "Pre-drafted branches received", registry=registry)
        self.branch_hits = Counter(
            "specdec:verifier_branch_hits", "Steps whose drafts came from a pre-drafted branch", registry=registry
        )
        self.branch_misses = Counter(
            "specdec:verifier_branch_misses",
            "Steps after a rejection whose drafts were in no branch",
            registry=registry,
        )
        # vLLM's own spec-decode counters (its scheduler's SpecDecodingStats, per engine step), under
        # vLLM's names: they must agree with the gateway's specdec:spec_decode_* over the same requests
        self.vllm_num_drafts = Counter(
            "vllm:spec_decode_num_drafts", "vLLM's count: engine rows that verified drafts", registry=registry
        )
        self.vllm_num_draft_tokens = Counter(
            "vllm:spec_decode_num_draft_tokens", "vLLM's count: draft tokens verified", registry=registry
        )
        self.vllm_num_accepted_tokens = Counter(
            "vllm:spec_decode_num_accepted_tokens", "vLLM's count: draft tokens accepted", registry=registry
        )
        self.vllm_accepted_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "vLLM's count: accepted draft tokens by position",
            ["position"],
            registry=registry,
        )

    def observe_vllm_spec(
        self,
        num_drafts: int,
        num_draft_tokens: int,
        num_accepted_tokens: int,
        num_accepted_tokens_per_pos: Sequence[int],
    ) -> None:
        """One engine step's SpecDecodingStats, as vLLM's scheduler counted them
        (verifier.vllm_hooks.SpecStatsLogger calls it)."""
        self.vllm_num_drafts.inc(num_drafts)
        self.vllm_num_draft_tokens.inc(num_draft_tokens)
        self.vllm_num_accepted_tokens.inc(num_accepted_tokens)
        for position, n in enumerate(num_accepted_tokens_per_pos):
            if n:
                self.vllm_accepted_per_pos.labels(str(position)).inc(n)
