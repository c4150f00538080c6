"""`specdec traces`: inspect exported spans (the JSON-lines files of SPECDEC_TRACE_FILE).

    specdec traces FILE [FILE ...]                   slowest rounds and spikes by stage
    specdec traces FILE ... --request ID|--trace ID  one request's round-by-round timeline
    specdec traces FILE ... --waits                  the wait for drafts, by what the verdict did

Each service writes its own file (or all append to one); pass them all to see a request
across gateway, drafter and verifier.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from specdec.errors import UserError
from specdec.telemetry import STAGES

Span = dict[str, Any]


def load(paths: Iterable[str | Path]) -> list[Span]:
    """Every span record in the files (see telemetry.span_record); a line that is not JSON
    is a UserError naming the file and line."""
    spans: list[Span] = []
    for path in paths:
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    spans.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise UserError(
                        f"{path}:{number}: not a JSON span record ({err.msg})",
                        "pass the JSON-lines files that SPECDEC_TRACE_FILE writes",
                    ) from None
    return spans


def _ms(span: Span) -> float:
    end_ns: int = span["end_ns"]
    start_ns: int = span["start_ns"]
    return (end_ns - start_ns) / 1e6


def rounds(spans: list[Span]) -> list[Span]:
    return [s for s in spans if s["name"] == "specdec.round"]


def request_ids(spans: list[Span]) -> dict[str, str]:
    """trace id -> request id, from the gateway's request spans."""
    return {
        s["trace_id"]: s["attributes"].get("specdec.request_id", "") for s in spans if s["name"] == "specdec.generate"
    }


def spikes_by_stage(spans: list[Span]) -> dict[str, list[Span]]:
    """Rounds with a latency_spike event, grouped by the stage that spiked."""
    out: dict[str, list[Span]] = defaultdict(list)
    for r in rounds(spans):
        for e in r["events"]:
            if e["name"] == "latency_spike":
                out[e["attributes"]["specdec.spike.stage"]].append(r)
    return dict(out)


def _stages(r: Span) -> str:
    a = r["attributes"]
    return " ".join(f"{st}={a.get(f'specdec.stage.{st}_ms', 0):.1f}" for st in STAGES)


def summary(spans: list[Span], top: int = 10) -> str:
    """The slowest rounds and the spikes by stage, as text."""
    ids = request_ids(spans)
    lines = [f"{len(rounds(spans))} rounds in {len(ids)} requests"]
    lines.append(f"\nslowest {top} rounds (ms; stages in ms):")
    for r in sorted(rounds(spans), key=_ms, reverse=True)[:top]:
        a = r["attributes"]
        lines.append(
            f"  {_ms(r):9.1f}  request {ids.get(r['trace_id'], '?')} round {a.get('specdec.round')} "
            f"trace {r['trace_id']}  {_stages(r)}"
        )
    spikes = spikes_by_stage(spans)
    lines.append("\nspikes by stage:" if spikes else "\nno latency spikes")
    for stage, rs in sorted(spikes.items(), key=lambda kv: -len(kv[1])):
        worst = max(rs, key=lambda r: r["attributes"].get(f"specdec.stage.{stage}_ms", 0))
        lines.append(
            f"  {stage:<10} {len(rs):4d} rounds; worst {worst['attributes'].get(f'specdec.stage.{stage}_ms', 0):.1f} ms "
            f"(request {ids.get(worst['trace_id'], '?')}, trace {worst['trace_id']})"
        )
    return "\n".join(lines)


def timeline(spans: list[Span], trace_id: str) -> str:
    """One request's rounds in order, with the drafter's and verifier's sessions."""
    mine = [s for s in spans if s["trace_id"] == trace_id]
    if not mine:
        return f"no spans for trace {trace_id}"
    t0 = min(s["start_ns"] for s in mine)
    lines = [f"trace {trace_id}"]
    for s in sorted(mine, key=lambda s: s["start_ns"]):
        if s["name"] == "specdec.round":
            continue
        a = s["attributes"]
        lines.append(
            f"  [{s['service']}] {s['name']} {_ms(s):.1f} ms, {len(s['events'])} events, "
            f"request {a.get('specdec.request_id', '')}"
        )
    lines.append("  round   start_ms     ms  drafted accepted tokens  stages (ms)")
    for r in sorted(rounds(mine), key=lambda s: s["start_ns"]):
        a = r["attributes"]
        spike = f"  SPIKE: {a['specdec.spike.stage']}" if "specdec.spike.stage" in a else ""
        lines.append(
            f"  {a.get('specdec.round', 0):5d} {(r['start_ns'] - t0) / 1e6:10.1f} {_ms(r):6.1f} "
            f"{a.get('specdec.drafted', 0):8d} {a.get('specdec.accepted', 0):8d} {a.get('specdec.tokens', 0):6d}  "
            f"{_stages(r)}{spike}"
        )
    return "\n".join(lines)


def _after(r: Span, following: Span | None) -> str:
    """What round r's verdict did, for `waits`: its step was plain (no drafts), accepted every
    draft, or rejected one; then whether the next step's drafts came from a pre-drafted branch."""
    a = r["attributes"]
    drafted, accepted = a.get("specdec.drafted", 0), a.get("specdec.accepted", 0)
    if not drafted:
        return "plain step"
    if accepted == drafted:
        return "all drafts accepted"
    hit = following is not None and following["attributes"].get("specdec.branch", False)
    return "a draft rejected, a branch hit" if hit else "a draft rejected, no branch"


def waits(spans: list[Span]) -> str:
    """Where the wait for drafts goes: each speculative request's rounds grouped by what the
    round's verdict did (`_after`), with their wait. A request's first round is left out: its
    verdict is the prefill's token, and the wait after it is for the drafter's first block.

    A round's `stage.draft_wait_ms` is the verifier's wait, after the round's verdict, for the
    drafts of the next step: vLLM asks its proposer for the next step's drafts at the end of a
    step (verifier.vllm_hooks.ExternalDraftProposer.propose), so the wait follows this round's
    verdict, and the next round's `branch` says whether its drafts came from a pre-drafted branch.
    """
    by_trace: dict[str, list[Span]] = defaultdict(list)
    for r in rounds(spans):
        by_trace[r["trace_id"]].append(r)
    groups: dict[str, list[float]] = defaultdict(list)
    total_ms = 0.0  # the rounds' time
    for rs in by_trace.values():
        rs.sort(key=lambda r: r["attributes"].get("specdec.round", 0))
        if not any(r["attributes"].get("specdec.drafted", 0) for r in rs):
            continue  # plain decoding throughout
        for r, following in zip(rs[1:], [*rs[2:], None]):
            groups[_after(r, following)].append(r["attributes"].get("specdec.stage.draft_wait_ms", 0.0))
            total_ms += _ms(r)
    n = sum(len(v) for v in groups.values())
    if not n:
        return "no speculative rounds"
    waited = sum(sum(v) for v in groups.values())
    lines = [
        f"{n} rounds, {total_ms / n:.1f} ms a round, of which {waited / n:.1f} ms waiting for drafts "
        f"({waited / total_ms:.0%} of the rounds' time)",
        "",
        f"  {'after the verdict':32} {'rounds':>7} {'wait ms, mean':>14} {'median':>7} {'share of the wait':>18}",
    ]
    for name in ("all drafts accepted", "a draft rejected, a branch hit", "a draft rejected, no branch", "plain step"):
        v = groups.get(name, [])
        if v:
            share = sum(v) / waited if waited else 0.0
            lines.append(f"  {name:32} {len(v):7d} {sum(v) / len(v):14.1f} {statistics.median(v):7.1f} {share:18.0%}")
    return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("traces", help="inspect exported spans: slowest rounds, spikes, one request's timeline")
    p.add_argument("files", nargs="+", help="JSON-lines span files (SPECDEC_TRACE_FILE of each service)")
    p.add_argument("--request", help="show this request id's timeline")
    p.add_argument("--trace", help="show this trace id's timeline")
    p.add_argument("--top", type=int, default=10, help="how many slowest rounds")
    p.add_argument(
        "--waits",
        action="store_true",
        help="the wait for drafts, by what each round's verdict did (all accepted, a rejection a branch covered or not)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    spans = load(args.files)
    if args.waits:
        print(waits(spans))
        return 0
    trace_id = args.trace
    if args.request:
        matches = [t for t, rid in request_ids(spans).items() if rid == args.request]
        if not matches:
            raise UserError(
                f"no request {args.request!r} in {', '.join(args.files)}",
                "the summary (`specdec traces FILE...` alone) names the requests they hold",
            )
        trace_id = matches[0]
    print(timeline(spans, trace_id) if trace_id else summary(spans, args.top))
    return 0
