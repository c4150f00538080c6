"""One generation's speculative-decoding figures, counted in one place.

`SpecStats` is the one accumulator: the gateway calls `observe(verdict)` once per target step
(and `observe_block`, `observe_ready`, `invalid_reply`, `fell_back`, `drafter_preempted`,
`migrated` for what the drafter side adds); every figure that leaves the gateway is read from it:

    the gRPC response's SpeculationStats      SpecStats.to_pb()
    the REST response's usage / metrics       SpecStats.from_pb(...).vllm_metrics()  (and to_pb's fields)
    the generation span's attributes          SpecStats.span_attributes()
    Prometheus (per step)                     telemetry.GatewayMetrics.observe(step), `step` = observe's result

Terms (vLLM's, `vllm/v1/spec_decode/metrics.py`, where vLLM has one):

    target step            one forward pass of the target for this request; it emits 1 + accepted
                           tokens. The first one (the prefill) is not counted in `target_steps`.
    draft (num_drafts)     a target step that verified at least one draft token (specdec's older
                           name: a speculative step)
    num_draft_tokens       draft tokens the target checked (drafted)
    num_accepted_tokens    draft tokens the target accepted (accepted)
    num_accepted_tokens_per_pos
                           [i]: drafts whose token at offset i was accepted (a step accepts a prefix
                           of its drafts, so this never increases with i)
    num_spec_tokens        the gamma the generation ran with (0: plain target decoding)

The ratios are computed here only: acceptance_rate = num_accepted_tokens / num_draft_tokens,
mean_acceptance_length = 1 + num_accepted_tokens / num_drafts (the bonus token counted),
tokens_per_step, branch_hit_rate (per gamma over many generations: `branch_hits_by_gamma`),
mean_tau (drafts sized by confidence: the drafter's threshold, docs/confidence-drafts.md). The
wire's SpeculationStats keeps its field names (clients read them: `drafted_tokens` is
num_draft_tokens, `speculative_steps` is num_drafts, ...), and
so do the span attributes (`specdec.drafted_tokens`: a span says what its response says);
`to_pb`, `from_pb` and `span_attributes` are the one place that maps the names. Prometheus
families carry vLLM's names (`specdec:spec_decode_num_draft_tokens_total` beside the verifier's
own `vllm:spec_decode_num_draft_tokens_total`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from specdec.wire import draft_method_name, pb

if TYPE_CHECKING:
    from specdec.v1.common_pb2 import DraftBlock, DraftReady, SpeculationStats
    from specdec.v1.verifier_pb2 import Verdict


@dataclass(frozen=True)
class SpecStep:
    """One target step's figures, as `SpecStats.observe` read them from its verdict.

    `index`: the step's number in the generation (0: the prefill step, which counts for time
    to first token, not for the step figures). `draft_ms`: the drafter's compute time for the
    chain's blocks relayed since the previous step (the round's `draft` stage).
    `branch_draft_ms`: its compute time for the pre-drafted branches relayed since then. A
    drafter drafts branches only while it has nothing else to do, beside the target's step, so
    that time is not a stage of the round and is never a latency spike: counted in the draft
    stage, a long verify step (the drafter idle, drafting branches) read as a draft spike."""

    index: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_tokens: int  # tokens the step emitted
    computed_tokens: int
    batch_size: int
    step_ms: float
    draft_wait_ms: float
    queue_ms: float
    draft_ms: float
    branch_draft_ms: float
    branch: bool
    hold_drafts: bool

    @property
    def is_draft(self) -> bool:
        """The step verified drafts (vLLM counts it in num_drafts)."""
        return self.num_draft_tokens > 0


@dataclass
class SpecStats:
    """One generation's speculation figures (see the module docstring for the terms).

    Only this class's methods change them. A migrated generation keeps its SpecStats: the run
    on the next verifier goes on counting into it."""

    num_spec_tokens: int  # gamma (0: plain target decoding)
    drafter: pb.DraftMethod.ValueType  # NONE: plain target decoding
    num_verdicts: int = 0  # target steps, the prefill step included
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    rejected_steps: int = 0  # drafts (steps) that rejected one of their draft tokens
    completion_tokens: int = 0
    computed_tokens: int = 0  # tokens the target's engine computed (prefill included)
    blocks_received: int = 0  # blocks relayed to the verifier
    tokens_received: int = 0  # draft tokens in them
    fallback_reason: str = ""  # why the drafter was dropped ("": it was not)
    verify_ms: float = 0.0  # engine step time over target steps after prefill
    draft_wait_ms: float = 0.0  # ... and their time waiting for drafts
    max_draft_wait_ms: float = 0.0
    draft_ms: float = 0.0  # drafter compute time for the blocks received
    drafter_prefill_ms: float = 0.0
    drafter_reused_tokens: int = 0  # prompt tokens the drafter took from its prefix cache
    drafter_preemptions: int = 0  # times the drafter preempted the session (DraftProgress.preempted)
    invalid_blocks: int = 0  # drafter replies dropped or trimmed as invalid (not relayed as sent)
    migrations: int = 0  # times the generation moved to another verifier (or the same one, back)
    branches_drafted: int = 0  # pre-drafted branches relayed
    branches_used: int = 0  # steps whose drafts came from a branch (a branch hit)
    branch_misses: int = 0  # steps after a broken chain that found no branch
    held_steps: int = 0  # verdicts with hold_drafts: adaptive gamma held the drafter
    confidence_cuts: int = 0  # blocks the drafter cut by confidence (DraftBlock.confidence_cut)
    mean_tau: float = 0.0  # mean DraftBlock.tau over the blocks that carried one (0: confidence off)
    _tau_blocks: int = field(default=0, repr=False)  # blocks in mean_tau
    _draft_ms_since_step: float = field(default=0.0, repr=False)  # chain drafting since the latest verdict
    _branch_ms_since_step: float = field(default=0.0, repr=False)  # branch drafting since the latest verdict

    # ---- what changes the figures ----------------------------------------------------------
    def observe(self, v: Verdict) -> SpecStep:
        """Count one verdict; returns the step's figures (for the per-step metrics and span)."""
        index = self.num_verdicts
        self.num_verdicts += 1
        if index > 0:  # the first verdict is the prefill step
            self.verify_ms += v.step_ms
            self.draft_wait_ms += v.draft_wait_ms
            self.max_draft_wait_ms = max(self.max_draft_wait_ms, v.draft_wait_ms)
        self.completion_tokens += len(v.token_ids)
        self.computed_tokens += v.computed_tokens
        self.branch_misses += v.branch_miss
        self.held_steps += v.hold_drafts
        if v.drafted:
            self.num_drafts += 1
            self.num_draft_tokens += v.drafted
            self.num_accepted_tokens += v.accepted
            self.rejected_steps += v.accepted < v.drafted
            self.branches_used += v.branch
            per_pos = self.num_accepted_tokens_per_pos
            if len(per_pos) < v.drafted:
                per_pos.extend([0] * (v.drafted - len(per_pos)))
            for i in range(v.accepted):
                per_pos[i] += 1
        step = SpecStep(
            index=index,
            num_draft_tokens=v.drafted,
            num_accepted_tokens=v.accepted,
            num_tokens=len(v.token_ids),
            computed_tokens=v.computed_tokens,
            batch_size=v.batch_size,
            step_ms=v.step_ms,
            draft_wait_ms=v.draft_wait_ms,
            queue_ms=v.queue_ms,
            draft_ms=self._draft_ms_since_step,
            branch_draft_ms=self._branch_ms_since_step,
            branch=v.branch,
            hold_drafts=v.hold_drafts,
        )
        self._draft_ms_since_step = 0.0
        self._branch_ms_since_step = 0.0
        return step

    def observe_block(self, block: DraftBlock) -> None:
        """A drafter block relayed to the verifier (after its checks)."""
        self.blocks_received += 1
        self.tokens_received += len(block.token_ids)
        self.branches_drafted += block.branch
        self.confidence_cuts += block.confidence_cut
        if block.tau > 0:
            self._tau_blocks += 1
            self.mean_tau += (block.tau - self.mean_tau) / self._tau_blocks
        self.draft_ms += block.draft_ms
        if block.branch:
            self._branch_ms_since_step += block.draft_ms
        else:
            self._draft_ms_since_step += block.draft_ms

    def observe_ready(self, ready: DraftReady) -> None:
        """The drafter's `ready` (its prefill is done), relayed to the verifier."""
        self.drafter_prefill_ms = ready.prefill_ms
        self.drafter_reused_tokens = ready.reused_tokens

    def invalid_reply(self) -> int:
        """A drafter reply dropped or trimmed as invalid; returns how many so far."""
        self.invalid_blocks += 1
        return self.invalid_blocks

    def fell_back(self, reason: str) -> bool:
        """The drafter was dropped for `reason`; False (and nothing changes) when it already was."""
        if self.fallback_reason:
            return False
        self.fallback_reason = reason
        return True

    def drafter_preempted(self) -> int:
        """The drafter preempted the session (DraftProgress.preempted); returns how many times so far."""
        self.drafter_preemptions += 1
        return self.drafter_preemptions

    def migrated(self) -> int:
        """The generation moves to another verifier; returns the migrations so far."""
        self.migrations += 1
        return self.migrations

    # ---- what is read from them --------------------------------------------------------------
    @property
    def target_steps(self) -> int:
        """Target steps after prefill."""
        return max(0, self.num_verdicts - 1)

    @property
    def acceptance_rate(self) -> float:
        """num_accepted_tokens / num_draft_tokens (0 with no drafts)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """1 + num_accepted_tokens / num_drafts: tokens per draft step, the bonus token counted
        (vLLM's mean acceptance length; 1 with no drafts)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def tokens_per_step(self) -> float:
        """Generated tokens per target step after prefill (the prefill step's token excluded)."""
        steps = self.target_steps
        return (self.completion_tokens - 1) / steps if steps else 0.0

    @property
    def branch_hit_rate(self) -> float:
        """branches_used / the steps after a broken chain (see SpeculationStats.branch_hit_rate)."""
        breaks = self.branches_used + self.branch_misses
        return self.branches_used / breaks if breaks else 0.0

    @property
    def acceptance_histogram(self) -> list[int]:
        """[num_spec_tokens + 1]: [j] = draft steps that accepted exactly j draft tokens (vLLM's
        per-request histogram). From num_accepted_tokens_per_pos: a step accepts a prefix of its
        drafts, so steps accepting >= i tokens is per_pos[i - 1] (every draft step for i = 0)."""
        at_least = [self.num_drafts, *self.num_accepted_tokens_per_pos]  # [i]: steps accepting >= i
        size = max(self.num_spec_tokens, len(self.num_accepted_tokens_per_pos)) + 1
        at_least += [0] * (size + 1 - len(at_least))
        return [at_least[j] - at_least[j + 1] for j in range(size)]

    def vllm_metrics(self) -> dict[str, Any]:
        """The generation's speculation under vLLM's per-request names (its
        SpeculativeDecodingMetrics, `metrics.speculative_decoding` of its OpenAI responses)."""
        return {
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_acceptance_rate": self.acceptance_rate,
            "acceptance_histogram": self.acceptance_histogram,
            "num_spec_steps": self.num_drafts,
            "num_accepted_draft_tokens": self.num_accepted_tokens,
            "num_draft_tokens": self.num_draft_tokens,
            "num_spec_tokens": self.num_spec_tokens,
        }

    def span_attributes(self) -> dict[str, Any]:
        """The generation span's attributes at its end: `specdec.` + the figure's name on the wire
        (SpeculationStats), so a span and the response it belongs to say the same thing by the
        same name."""
        attributes: dict[str, Any] = {
            "gen_ai.usage.output_tokens": self.completion_tokens,
            "specdec.target_steps": self.target_steps,
            "specdec.speculative_steps": self.num_drafts,
            "specdec.drafted_tokens": self.num_draft_tokens,
            "specdec.accepted_tokens": self.num_accepted_tokens,
            "specdec.acceptance_rate": self.acceptance_rate,
            "specdec.mean_accepted_length": self.mean_acceptance_length,
            "specdec.drafter_fallback": bool(self.fallback_reason),
            "specdec.invalid_blocks": self.invalid_blocks,
            "specdec.branches_drafted": self.branches_drafted,
            "specdec.branches_used": self.branches_used,
            "specdec.branch_hit_rate": self.branch_hit_rate,
            "specdec.held_steps": self.held_steps,
            "specdec.confidence_cuts": self.confidence_cuts,
            "specdec.mean_tau": self.mean_tau,
            "specdec.migrations": self.migrations,
            "specdec.drafter_preemptions": self.drafter_preemptions,
        }
        if self.fallback_reason:
            attributes["specdec.fallback_reason"] = self.fallback_reason
        return attributes

    def to_pb(self) -> SpeculationStats:
        """The wire's SpeculationStats (its field names: see the module docstring)."""
        return pb.SpeculationStats(
            gamma=self.num_spec_tokens,
            drafter=self.drafter,
            target_steps=self.target_steps,
            speculative_steps=self.num_drafts,
            drafted_tokens=self.num_draft_tokens,
            accepted_tokens=self.num_accepted_tokens,
            accepted_per_position=self.num_accepted_tokens_per_pos,
            acceptance_rate=self.acceptance_rate,
            mean_accepted_length=self.mean_acceptance_length,
            tokens_per_step=self.tokens_per_step,
            blocks_received=self.blocks_received,
            tokens_received=self.tokens_received,
            drafter_fallback=bool(self.fallback_reason),
            fallback_reason=self.fallback_reason,
            target_computed_tokens=self.computed_tokens,
            verify_ms=self.verify_ms,
            draft_wait_ms=self.draft_wait_ms,
            draft_ms=self.draft_ms,
            rejected_steps=self.rejected_steps,
            max_draft_wait_ms=self.max_draft_wait_ms,
            drafter_prefill_ms=self.drafter_prefill_ms,
            drafter_reused_tokens=self.drafter_reused_tokens,
            drafter_preemptions=self.drafter_preemptions,
            migrations=self.migrations,
            branches_drafted=self.branches_drafted,
            branches_used=self.branches_used,
            branch_hit_rate=self.branch_hit_rate,
            branch_misses=self.branch_misses,
            held_steps=self.held_steps,
            confidence_cuts=self.confidence_cuts,
            mean_tau=self.mean_tau,
        )

    @classmethod
    def from_pb(cls, s: SpeculationStats) -> SpecStats:
        """The figures a SpeculationStats carries (a response's, read by a client or the REST
        bridge); the ratios are recomputed from them, by the properties above."""
        return cls(
            num_spec_tokens=s.gamma,
            drafter=s.drafter,
            num_verdicts=s.target_steps + 1 if s.target_steps else 0,
            num_drafts=s.speculative_steps,
            num_draft_tokens=s.drafted_tokens,
            num_accepted_tokens=s.accepted_tokens,
            num_accepted_tokens_per_pos=list(s.accepted_per_position),
            rejected_steps=s.rejected_steps,
            computed_tokens=s.target_computed_tokens,
            blocks_received=s.blocks_received,
            tokens_received=s.tokens_received,
            fallback_reason=s.fallback_reason,
            verify_ms=s.verify_ms,
            draft_wait_ms=s.draft_wait_ms,
            max_draft_wait_ms=s.max_draft_wait_ms,
            draft_ms=s.draft_ms,
            drafter_prefill_ms=s.drafter_prefill_ms,
            drafter_reused_tokens=s.drafter_reused_tokens,
            drafter_preemptions=s.drafter_preemptions,
            migrations=s.migrations,
            branches_drafted=s.branches_drafted,
            branches_used=s.branches_used,
            branch_misses=s.branch_misses,
            held_steps=s.held_steps,
            confidence_cuts=s.confidence_cuts,
            mean_tau=s.mean_tau,
        )

    @property
    def branch_breaks(self) -> int:
        """Steps after a verdict that broke the drafts' chain: branches_used + branch_misses."""
        return self.branches_used + self.branch_misses

    @property
    def drafter_name(self) -> str:
        """The drafter method's user-facing name ("none" for plain decoding)."""
        return draft_method_name(self.drafter) or "none"


@dataclass(frozen=True)
class BranchHits:
    """Branch hits of some generations at one gamma: `hits` (branches_used) out of `breaks`
    (the steps after a broken chain, branches_used + branch_misses)."""

    gamma: int
    hits: int
    breaks: int

    @property
    def rate(self) -> float:
        """hits / breaks (0 with no break)."""
        return self.hits / self.breaks if self.breaks else 0.0


def branch_hits_by_gamma(stats: Iterable[SpecStats]) -> list[BranchHits]:
    """The branch hit rate per gamma (num_spec_tokens, the gamma a generation ran with) over
    `stats`, by gamma ascending; plain generations (gamma 0) are left out."""
    hits: dict[int, int] = {}
    breaks: dict[int, int] = {}
    for s in stats:
        if s.num_spec_tokens:
            hits[s.num_spec_tokens] = hits.get(s.num_spec_tokens, 0) + s.branches_used
            breaks[s.num_spec_tokens] = breaks.get(s.num_spec_tokens, 0) + s.branch_breaks
    return [BranchHits(g, hits[g], breaks[g]) for g in sorted(hits)]
