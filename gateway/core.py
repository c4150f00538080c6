"""The gateway core: `GatewayCore` (validation, tokenisation, the generation, streaming) and
its typed API, what a generation yields and how it fails.

`GatewayCore.generate(spec, ...)` is an async generator of `Chunk`s;
it raises `GatewayError` (code, field, message) for every refusal and failure. Two thin
adapters sit on it, in the same process and event loop:

    gRPC (GatewayServicer, gateway/server.py)   GatewayError -> status code + details (+ retry-after)
    REST (gateway/rest/, OpenAI's API)          GatewayError -> HTTP status + {"error": {..., "param"}}

so an error's field crosses as a field, never as text to parse back. The REST adapter
depends only on `Core` below (a fake core in a test or a benchmark fits it).

Terms:
    chunk        what one step of the generation gives the client: text (detokenised, stop
                 strings applied), its token ids, and the step's drafted / accepted counts
    final chunk  the one whose finish_reason is set; it carries the request's usage,
                 speculation stats and timings. Every generation that ends without an error
                 ends with one.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from gateway.generation import Generation
from gateway.migration import migrates, resumed_plan
from gateway.plan import Plan, tenant_of
from gateway.pool import NoReplica, Pool, Replica, affinity_key
from gateway.text import TextStream, Tokenizer
from specdec import security, serving, telemetry
from specdec.config import GatewayConfig
from specdec.models import compat
from specdec.stats import SpecStats
from specdec.validation import InvalidField, check_gamma, check_request_id, check_sampling, check_sizes, check_token_ids
from specdec.wire import DRAFT_METHOD_NAMES, draft_method, finish_reason_name, pb, rpc


class ErrorCode(enum.Enum):
    """Why a generation failed: the canonical codes (google.rpc.Code), which gRPC uses as they
    are and which the REST adapter maps to HTTP statuses (gateway.rest.serving.HTTP_STATUS)."""

    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class GatewayError(Exception):
    """A refused or failed generation.

    code          what kind of failure (ErrorCode)
    message       what is wrong, for the client (names no backend address)
    field         the GenerationSpec field at fault as a path ("spec.sampling.top_p",
                  "spec.stop[1]"), or None when no field is
    retry_after_s when to retry, whole seconds (RESOURCE_EXHAUSTED), or None

    str() is "field: message" (the gRPC details), or the message alone."""

    def __init__(
        self, code: ErrorCode, message: str, field: str | None = None, retry_after_s: str | None = None
    ) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.code, self.message, self.field, self.retry_after_s = code, message, field, retry_after_s


@dataclass
class Chunk:
    """What one preview or verdict gives the client (see the module's terms)."""

    text: str
    token_ids: list[int]
    drafted: int
    accepted: int
    finish_reason: pb.FinishReason.ValueType  # FINISH_REASON_UNSPECIFIED until the final chunk
    logprobs: list["pb.TokenLogprobs"] = field(default_factory=list)  # [len(token_ids)] when asked for
    request_id: str = ""
    # the final chunk's (None / 0 on the others):
    usage: "pb.Usage | None" = None
    stats: "pb.SpeculationStats | None" = None
    first_token_ms: float = 0.0  # after validation: to the first token
    total_ms: float = 0.0  # after validation: to the end


class Core(Protocol):
    """What an adapter needs of the gateway core (GatewayCore implements it)."""

    def generate(
        self,
        spec: "pb.GenerationSpec",
        *,
        authorization: str | None = None,
        parent: Any = None,
        deadline_s: float | None = None,
        stream: bool = False,
    ) -> AsyncGenerator[Chunk, None]:
        """The generation's chunks; raises GatewayError. `authorization`: the caller's
        "Bearer <key>" (checked when API keys are configured); `parent`: an OpenTelemetry
        context to trace under; `deadline_s`: DEADLINE_EXCEEDED after that many seconds;
        `stream`: the caller streams the chunks (its first token is timed as such)."""
        ...

    def serving(self) -> bool:
        """False once the gateway drains (shutting down): new generations are refused."""
        ...

    def ended_by_drain(self, task: asyncio.Task[Any] | None) -> str | None:
        """The notice for a generation (the task that runs it) that the drain ended, having
        run past shutdown_timeout_s; None: the drain did not end it."""
        ...


log = logging.getLogger("specdec.gateway")

# How long a request waits for the drafters' pool's first pass (resolve, health checks) after the
# gateway started; with no drafter serving after it, the request runs as plain target decoding.
DRAFTER_FIRST_CHECK_S = 5.0
# How long a serving verifier may take to answer GetVerifierInfo (asked once per gateway).
INFO_TIMEOUT_S = 30.0
# After a certificate rotation, how long calls on the old channels may take to finish.
CHANNEL_DRAIN_S = 3600.0


def _hosts(addresses: str) -> list[str]:
    """The hosts of a drafter_address / verifier_address value (a list, or dns:///NAME:PORT)."""
    hosts = []
    for address in addresses.split(","):
        address = address.strip().removeprefix("dns:///")
        if address:
            hosts.append(address if address.startswith("unix:") else address.rsplit(":", 1)[0])
    return hosts


def exposure_warnings(cfg: GatewayConfig, keys: security.KeyStore) -> list[str]:
    """What the gateway logs as warnings at start-up about settings that expose it: serving other
    hosts without API keys, and plaintext to drafters or verifiers on other hosts (no tls_ca)."""
    out = []
    if not keys.enabled and not security.is_loopback(cfg.host):
        out.append(
            f"gateway: serving {cfg.host}, which other hosts can reach, with NO API KEYS: anyone who "
            "reaches it can generate. Set SPECDEC_API_KEY_FILE (a file of keys, one per line)."
        )
    if not cfg.tls_ca:
        for role, addresses in (("verifier", cfg.verifier_address), ("drafter", cfg.drafter_address)):
            remote = [h for h in _hosts(addresses) if not security.is_loopback(h)]
            if remote:
                out.append(
                    f"gateway: PLAINTEXT gRPC to the {role}s on {', '.join(remote)} (tls_ca is unset): "
                    "prompts and tokens cross the network unencrypted and unauthenticated. Set "
                    "SPECDEC_TLS_CA (and SPECDEC_TLS_CERT / _KEY for mTLS), see `specdec certs`."
                )
    return out


# Makes the (verifiers, drafters) replica pools of a gateway's config, not started yet.
PoolFactory = Callable[[GatewayConfig], tuple[Pool, Pool]]


def replica_pools(cfg: GatewayConfig) -> tuple[Pool, Pool]:
    """The verifiers' and drafters' pools (gateway.pool) over gRPC channels, TLS when tls_ca is set."""

    def connect(address: str, server_name: str) -> grpc.aio.Channel:
        return security.client_channel(address, cfg, server_name)

    def pool(spec: str, make_stub: Callable[[grpc.aio.Channel], Any], service: str) -> Pool:
        return Pool(
            spec, connect, make_stub, service, health_every_s=cfg.health_every_s, resolve_every_s=cfg.resolve_every_s
        )

    return (
        pool(cfg.verifier_address, rpc.VerifierServiceStub, "specdec.v1.VerifierService"),
        pool(cfg.drafter_address, rpc.DrafterServiceStub, "specdec.v1.DrafterService"),
    )


class VerifierUnavailable(Exception):
    """No verifier serves (or answers) within verifier_retry_s. Its message is for clients: it
    names no backend address (the log has them)."""


@dataclass
class TargetInfo:
    vocab_size: int
    max_model_len: int
    max_gamma: int


class ClientStalled(Exception):
    """A stream's client took no message for stream_write_timeout_s (see GenerateStream)."""


class _Refusals:
    """What serving.SessionSlots.hold calls `context`: its refusals (draining, max_inflight)
    and its shutdown notice become GatewayErrors, whichever adapter's call holds the slot."""

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: Any = ()) -> None:
        retry = dict(trailing_metadata or ()).get("retry-after")
        raise GatewayError(ErrorCode[code.name], details, retry_after_s=retry)


class GatewayCore:
    """The gateway, whatever the transport: `generate()` runs one generation, `serving()` says
    whether new ones are taken. Its `metrics` (telemetry.GatewayMetrics) live on a registry that
    the REST bridge's /metrics serves too (`self.metrics.registry`)."""

    def __init__(
        self,
        cfg: GatewayConfig,
        metrics: telemetry.GatewayMetrics,
        tokenizer: Tokenizer,
        pools: PoolFactory | None = None,
    ) -> None:
        """A gateway with a loaded `tokenizer` (the target's); `pools(cfg)` makes the verifiers'
        and drafters' replica pools, now and after each certificate rotation (default
        `replica_pools`: gRPC channels). Call it in the event loop that serves it (the pools
        start there). `build(cfg, registry)` loads the tokenizer and makes one."""
        self.cfg = cfg
        self.default_drafter = draft_method(cfg.default_drafter)  # a bad name stops the start-up, naming the known
        telemetry.setup_tracing("gateway")  # a Generation takes its tracer from the provider
        self.metrics = metrics
        self.spikes = telemetry.SpikeDetector(
            factor=cfg.spike_factor,
            min_ms=cfg.spike_min_ms,
            absolute_ms=cfg.spike_ms,
            log_every_s=cfg.spike_log_every_s,
        )
        self.tokenizer = tokenizer
        self.vocabulary = compat.from_tokenizer(self.tokenizer, cfg.tokenizer)
        # drafter address -> its check: compat.mismatch's line, None when it fits (_fitting_drafter)
        self._drafter_checks: dict[str, asyncio.Future[str | None]] = {}
        self._target_vocabulary: compat.Vocabulary | None = None  # from GetVerifierInfo (None: not sent)
        # prompts are tokenised (and chat templates rendered, by the REST bridge) on this thread,
        # never on the event loop that carries every stream; one thread: the tokenizer is shared
        self.tokenizer_executor = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        self.keys = security.KeyStore.from_config(cfg)
        for warning in exposure_warnings(cfg, self.keys):
            log.warning(warning)
        self.limits = security.RateLimiter.from_config(cfg, self.keys.enabled)
        self.slots = serving.SessionSlots("gateway", cfg.max_inflight, "max_inflight")
        self._client_files = security.CertFiles(cfg.tls_ca, cfg.tls_cert, cfg.tls_key)
        self._make_pools = pools or replica_pools
        self._pools: list[Pool] = []
        self._connect()
        for role in ("drafter", "verifier"):  # read at scrape time: a certificate rotation remakes the pools
            serving_now, not_serving_now = self._replica_gauges(role)
            self.metrics.replicas.labels(role, "serving").set_function(serving_now)
            self.metrics.replicas.labels(role, "not_serving").set_function(not_serving_now)
        self._target: TargetInfo | None = None

    def _connect(self) -> None:
        """(Re)make the replica pools of verifiers and drafters (`pools`; TLS when tls_ca is
        set). A certificate rotation makes new ones for new requests; calls on the old ones finish."""
        self._client_files.read()
        old = self._pools
        self.verifiers, self.drafters = self._make_pools(self.cfg)
        self._pools = [self.verifiers, self.drafters]
        for pool in self._pools:  # both resolved and health-checked from now on, not only when picked
            pool.start()
        for pool in old:
            asyncio.get_running_loop().create_task(pool.close(grace_s=CHANNEL_DRAIN_S))

    def _pool(self, role: str) -> Pool:
        """The current pool of `role` (drafter | verifier)."""
        return self.drafters if role == "drafter" else self.verifiers

    def _replica_gauges(self, role: str) -> tuple[Callable[[], float], Callable[[], float]]:
        """The replicas of `role` that serve, and those that do not, counted in its current pool
        when called (at scrape time)."""
        return (lambda: self._pool(role).serving(), lambda: len(self._pool(role).replicas) - self._pool(role).serving())

    def serving(self) -> bool:
        """False once the drain began (serving.serve, at SIGTERM): new generations are refused."""
        return not self.slots.draining

    def ended_by_drain(self, task: asyncio.Task[Any] | None) -> str | None:
        """The notice for a generation the drain ended (serving.SessionSlots.ended_by_drain)."""
        return self.slots.ended_by_drain(task)

    @contextlib.asynccontextmanager
    async def admitted(self, authorization: str | None) -> AsyncIterator[str]:
        """Authenticate and rate-limit one call of a caller whose credentials are `authorization`
        ("Bearer <key>"): UNAUTHENTICATED without a known API key (when keys are configured),
        RESOURCE_EXHAUSTED with retry_after_s over the key's limits. Yields the key id (never the key)."""
        key = self.keys.identify(authorization) if self.keys.enabled else "anonymous"
        if key is None:
            self.metrics.refused.labels("unauthenticated").inc()
            raise GatewayError(
                ErrorCode.UNAUTHENTICATED, "missing or unknown API key: send `authorization: Bearer <key>`"
            )
        admission = self.limits.acquire(key)
        if not admission.ok:
            self.metrics.refused.labels("rate_limited").inc()
            raise GatewayError(
                ErrorCode.RESOURCE_EXHAUSTED, admission.reason, retry_after_s=self.limits.retry_after_header(admission)
            )
        try:
            yield key
        finally:
            self.limits.release(key)

    async def target_info(self) -> TargetInfo:
        """The verifier's limits, asked once; with no verifier that serves within verifier_retry_s,
        or one that serves but does not answer within INFO_TIMEOUT_S, raises VerifierUnavailable."""
        if self._target is None:
            wait_s = self.cfg.verifier_retry_s
            try:
                replica = await self.verifiers.pick(wait_s)
                # it serves (its health check says so): a slow answer is a busy verifier, not a gone one
                info = await replica.stub.GetVerifierInfo(
                    pb.GetVerifierInfoRequest(), wait_for_ready=True, timeout=max(wait_s, INFO_TIMEOUT_S)
                )
            except NoReplica as err:
                log.warning("verifier: %s", err)
                raise VerifierUnavailable(
                    f"verifier: none serves within verifier_retry_s ({wait_s:g} s); retry later"
                ) from err
            except grpc.aio.AioRpcError as err:
                log.warning(
                    "verifier %s: GetVerifierInfo failed: %s %s", replica.address, err.code().name, err.details()
                )
                raise VerifierUnavailable(
                    f"verifier: no answer to GetVerifierInfo ({err.code().name}); retry later"
                ) from err
            target = compat.from_pb(info.vocabulary, info.model)
            if target is not None:  # the gateway's tokenizer must be the target's
                compat.check(target, self.vocabulary, "gateway tokenizer")
            self._target = TargetInfo(info.vocab_size, info.max_model_len, info.max_gamma)
            self._target_vocabulary = target
        return self._target

    async def plan(self, spec: "pb.GenerationSpec", key: str = "anonymous") -> Plan:
        """Validate a request of API key `key` (its key id) and fill in the defaults; raises InvalidField.
        The request's id is namespaced by the key at the verifier and drafter (Plan.backend_id)."""
        if spec.request_id:
            check_request_id("spec.request_id", spec.request_id)
        check_sizes("spec.sampling", spec.sampling)  # bounded before any work, the verifier's answer included
        if self._client_files.changed():
            self._connect()
        target = await self.target_info()
        if spec.prompt_text and spec.prompt_token_ids:
            raise InvalidField("spec.prompt_token_ids", "give either prompt_text or prompt_token_ids, not both")
        if spec.prompt_text:
            prompt = list(
                await asyncio.get_running_loop().run_in_executor(
                    self.tokenizer_executor, self.tokenizer.encode, spec.prompt_text
                )
            )
            if not prompt:
                raise InvalidField("spec.prompt_text", "encodes to no tokens")
        else:
            prompt = list(spec.prompt_token_ids)
            if not prompt:
                raise InvalidField("spec.prompt_text", "the prompt is empty (set prompt_text or prompt_token_ids)")
        limit = self.cfg.max_prompt_tokens or target.max_model_len - 1
        if len(prompt) > limit:
            raise InvalidField(
                "spec.prompt_token_ids",
                f"the prompt has {len(prompt)} tokens, more than "
                f"{'max_prompt_tokens' if self.cfg.max_prompt_tokens else 'max_model_len - 1'} ({limit})",
            )
        check_token_ids("spec.prompt_token_ids", prompt, target.vocab_size)
        gamma = spec.gamma if spec.HasField("gamma") else min(self.cfg.default_gamma, target.max_gamma)
        check_gamma("spec.gamma", gamma, target.max_gamma)
        drafter = spec.drafter or self.default_drafter
        if drafter not in pb.DraftMethod.values():
            raise InvalidField(
                "spec.drafter", f"unknown drafter method {drafter}; known: {', '.join(DRAFT_METHOD_NAMES)}"
            )
        sampling = pb.SamplingParams()
        sampling.CopyFrom(spec.sampling)
        if not sampling.HasField("max_tokens"):
            sampling.max_tokens = min(self.cfg.default_max_tokens, target.max_model_len - len(prompt))
        check_sampling("spec.sampling", sampling, len(prompt), target.max_model_len, target.vocab_size)
        return Plan(spec.request_id or uuid.uuid4().hex, prompt, sampling, gamma, drafter, tenant_of(key))

    async def _generation(self, plan: Plan, parent: Any, stats: SpecStats | None = None) -> Generation:
        """A Generation on the least-loaded serving verifier and drafter (gateway.pool), traced under
        `parent` (a caller's trace, or None); with no verifier serving within verifier_retry_s,
        GatewayError UNAVAILABLE."""
        key = affinity_key(plan.prompt_token_ids, self.cfg.prefix_affinity_tokens)  # a long prompt's home replicas
        try:
            verifier = await self.verifiers.pick(self.cfg.verifier_retry_s, key=key)
        except NoReplica as err:
            log.warning("verifier: %s", err)  # the addresses go to the log, not to the client
            raise GatewayError(
                ErrorCode.UNAVAILABLE,
                f"verifier: none serves within verifier_retry_s ({self.cfg.verifier_retry_s:g} s); retry later",
            ) from err
        drafter = None
        if plan.gamma > 0 and plan.drafter != pb.DRAFT_METHOD_NONE:
            await self.drafters.checked(DRAFTER_FIRST_CHECK_S)  # only the first requests after start wait
            model = plan.drafter == pb.DRAFT_METHOD_MODEL
            drafter = await self._fitting_drafter(key) if model else self.drafters.choose(key=key)
        vocab = self._target.vocab_size if self._target is not None else None
        return Generation(
            plan,
            verifier.stub,
            drafter.stub if drafter is not None else None,
            self.cfg.drafter_timeout_s,
            self.spikes,
            self.metrics,
            model=self.cfg.tokenizer,
            parent=parent,
            vocab_size=vocab,
            stats=stats,
            verdict_timeout_s=self.cfg.verdict_timeout_s,
            drafter_prefill_timeout_s=self.cfg.drafter_prefill_timeout_s,
            max_idle_commits=self.cfg.max_idle_commits,
            on_drafter_unavailable=(lambda: self.drafters.failed(drafter)) if drafter is not None else None,
            replicas=(verifier, drafter),
        )

    async def _fitting_drafter(self, key: bytes | None = None) -> Replica | None:
        """A serving drafter replica (chosen for the affinity `key`, gateway.pool) whose draft model
        fits the target (specdec.models.compat), asked once per replica with GetDrafterInfo
        (concurrent requests share the one call); None when none serves or fits: the round decodes
        plainly. A misfit is logged once, as the line naming both models and the difference. (The
        n-gram method has no model and is never checked: the caller only asks for method MODEL.)"""
        target = self._target_vocabulary

        async def misfit(drafter: Replica) -> str | None:
            info = await drafter.stub.GetDrafterInfo(pb.GetDrafterInfoRequest(), timeout=self.cfg.drafter_timeout_s)
            draft = compat.from_pb(info.vocabulary, info.model)
            line = compat.mismatch(target, draft) if target is not None and draft is not None else None
            if line:
                log.error("drafter %s refused: %s", drafter.address, line)
            return line

        tried: set[str] = set()
        while (drafter := self.drafters.choose(exclude=tried, key=key)) is not None:
            if target is None:  # a verifier that sent no vocabulary: nothing to check against
                return drafter
            check = self._drafter_checks.get(drafter.address)
            if check is None:
                check = self._drafter_checks[drafter.address] = asyncio.ensure_future(misfit(drafter))
            try:
                if not await asyncio.shield(check):
                    return drafter
            except grpc.aio.AioRpcError:
                self._drafter_checks.pop(drafter.address, None)  # asked again next time
                return drafter  # unknown for now: its health check and its Draft call decide
            tried.add(drafter.address)
        return None

    async def _chunks(self, generation: Generation, parent: Any = None) -> AsyncIterator[Chunk]:
        """The generation's tokens as text chunks, as early as they are certain; ends at the finish
        reason or a stop sequence.

        A preview's tokens are streamed at once; its verdict then adds only what the preview
        did not carry (with the step's drafted/accepted counts). A request that asks for
        logprobs gets its tokens with the verdicts, which carry them.

        Migration: when the verifier goes away mid-generation (UNAVAILABLE: it died, hung past
        its keepalive, or is draining), the generation resumes on a serving verifier (another
        replica, or the same one once it serves again, within verifier_retry_s) from the prompt
        plus the tokens already streamed: the client's stream goes on with no gap and no
        duplicate (stats.migrations counts it; a resumed round is traced under `parent` too). Any
        other verifier error is a GatewayError with its status code ("verifier: ...").
        """
        plan = generation.plan
        sampling = plan.sampling
        text = TextStream(
            self.tokenizer,
            list(sampling.stop),
            include_stop=sampling.include_stop_str_in_output,
            skip_special_tokens=sampling.skip_special_tokens if sampling.HasField("skip_special_tokens") else True,
        )
        with_logprobs = sampling.HasField("logprobs")
        finish = pb.FINISH_REASON_ABORT
        streamed: list[int] = []  # tokens that reached the client
        self.metrics.requests_running.inc()
        self.metrics.prompt_tokens.inc(len(plan.prompt_token_ids))
        try:
            while True:
                sent = len(generation.plan.prompt_token_ids)  # position up to which tokens reached the client
                verifier, drafter = generation.replicas
                verifier.in_flight += 1
                if drafter is not None:
                    drafter.in_flight += 1
                try:
                    async for v in generation.steps():
                        if isinstance(v, pb.Preview) and with_logprobs:
                            continue  # the verdict brings these tokens with their logprobs
                        skip = max(0, sent - v.start_position)
                        new = list(v.token_ids[skip:])
                        sent = max(sent, v.start_position + len(v.token_ids))
                        if isinstance(v, pb.Preview):
                            if new:
                                delta = text.add(new, final=False)
                                new = new[: text.kept]  # a stop sequence: the tokens up to the one completing it
                                streamed += new
                                yield Chunk(
                                    delta,
                                    new,
                                    0,
                                    0,
                                    pb.FINISH_REASON_STOP if text.stopped else pb.FINISH_REASON_UNSPECIFIED,
                                )
                                if text.stopped:
                                    finish = pb.FINISH_REASON_STOP
                                    return
                            continue
                        finish = v.finish_reason
                        delta = text.add(new, final=finish != pb.FINISH_REASON_UNSPECIFIED, stop_token=v.stop_token)
                        if text.stopped:
                            finish = pb.FINISH_REASON_STOP
                        if new or v.drafted or finish != pb.FINISH_REASON_UNSPECIFIED:
                            kept = text.kept
                            streamed += new[:kept]
                            yield Chunk(
                                delta, new[:kept], v.drafted, v.accepted, finish, list(v.logprobs[skip : skip + kept])
                            )
                        if text.stopped:
                            return  # leaving the loop cancels the verifier's request
                    return
                except grpc.aio.AioRpcError as err:
                    migrations = generation.stats.migrations
                    if not migrates(err.code(), migrations):
                        raise GatewayError(ErrorCode[err.code().name], f"verifier: {err.details()}") from err
                    self.verifiers.failed(verifier)
                    if len(streamed) >= sampling.max_tokens:  # the client has every token: nothing to resume
                        log.warning(
                            "request %s: verifier %s went away (%s) after the last token; ending the stream",
                            plan.request_id,
                            verifier.address,
                            err.details(),
                        )
                        finish = pb.FINISH_REASON_LENGTH
                        yield Chunk(text.add([], final=True), [], 0, 0, finish)
                        return
                    log.warning(
                        "request %s: verifier %s went away (%s) after %d tokens; resuming elsewhere",
                        plan.request_id,
                        verifier.address,
                        err.details(),
                        len(streamed),
                    )
                    self.metrics.migrations.inc()
                    stats = generation.stats
                    generation = await self._generation(resumed_plan(plan, streamed, stats.migrated()), parent, stats)
                finally:
                    verifier.in_flight -= 1
                    if drafter is not None:
                        drafter.in_flight -= 1
        finally:
            self.metrics.requests_running.dec()
            self.metrics.requests.labels(finish_reason_name(finish) or "unspecified").inc()

    async def _checked_plan(self, spec: "pb.GenerationSpec", key: str) -> Plan:
        """`plan`, its failures as GatewayErrors: a bad field INVALID_ARGUMENT naming it, no
        verifier UNAVAILABLE, a verifier whose model does not fit FAILED_PRECONDITION."""
        try:
            return await self.plan(spec, key)
        except InvalidField as err:
            raise GatewayError(ErrorCode.INVALID_ARGUMENT, str(err).removeprefix(f"{err.field}: "), err.field) from err
        except VerifierUnavailable as err:
            raise GatewayError(ErrorCode.UNAVAILABLE, str(err)) from err
        except compat.IncompatibleModels as err:
            raise GatewayError(ErrorCode.FAILED_PRECONDITION, str(err)) from err

    async def generate(
        self,
        spec: "pb.GenerationSpec",
        *,
        authorization: str | None = None,
        parent: Any = None,
        deadline_s: float | None = None,
        stream: bool = False,
    ) -> AsyncGenerator[Chunk, None]:
        """One generation (gateway.core.Core.generate): admitted (API key, rate limits, a
        max_inflight slot), validated (`plan`), then its round's chunks, the final one with the
        usage, stats and timings. Every failure is a GatewayError. Leaving the iteration early
        (aclose, a cancelled task) ends the round, whose verifier and drafter calls are
        cancelled, and frees the slot at once."""
        started = time.perf_counter()
        untimed = stream  # a stream's first token is observed as its time to first token
        async with self.admitted(authorization) as key, self.slots.hold(_REFUSALS):
            chunks = self._generate(spec, key, parent)
            deadline = None if deadline_s is None else asyncio.get_running_loop().time() + deadline_s
            async with contextlib.aclosing(chunks):  # leaving early ends the round now, not at GC
                while True:
                    try:
                        if deadline is None:
                            chunk = await anext(chunks)
                        else:
                            timeout = asyncio.timeout_at(deadline)
                            try:
                                async with timeout:
                                    chunk = await anext(chunks)
                            except TimeoutError as err:
                                if not timeout.expired():
                                    raise
                                raise GatewayError(
                                    ErrorCode.DEADLINE_EXCEEDED, f"the client's deadline ({deadline_s:g} s) passed"
                                ) from err
                    except StopAsyncIteration:
                        break
                    if untimed and chunk.token_ids:
                        self.metrics.time_to_first_token.observe(time.perf_counter() - started)
                        untimed = False
                    yield chunk
        self.metrics.e2e_latency.observe(time.perf_counter() - started)

    async def _generate(self, spec: "pb.GenerationSpec", key: str, parent: Any) -> AsyncGenerator[Chunk, None]:
        """The chunks of one admitted generation of API key `key` (its id); the final chunk
        (finish reason set) carries usage, stats and the timings from after validation."""
        plan = await self._checked_plan(spec, key)
        t0 = time.perf_counter()
        first_ms = 0.0
        generation = await self._generation(plan, parent)
        n = 0
        async for chunk in self._chunks(generation, parent):
            if not first_ms:
                first_ms = (time.perf_counter() - t0) * 1e3
            n += len(chunk.token_ids)
            chunk.request_id = plan.request_id
            if chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                chunk.usage = pb.Usage(prompt_tokens=len(plan.prompt_token_ids), completion_tokens=n)
                chunk.stats = generation.stats.to_pb()
                chunk.first_token_ms, chunk.total_ms = first_ms, (time.perf_counter() - t0) * 1e3
            yield chunk

    async def close(self) -> None:
        await asyncio.gather(*(pool.close() for pool in self._pools))
        self.tokenizer_executor.shutdown(wait=False)


_REFUSALS = _Refusals()
