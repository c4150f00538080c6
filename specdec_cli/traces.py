"""`specdec traces`: inspect exported spans (the JSON-lines files of SPECDEC_TRACE_FILE).

    specdec traces FILE [FILE ...]                   slowest rounds and spikes by stage
    specdec traces FILE ... --request ID|--trace ID  one request's round-by-round timeline

Each service writes its own file (or all append to one); pass them all to see a request
across gateway, drafter and verifier.
"""

from __future__ import annotations

import argparse
import json
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


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("traces", help="inspect exported spans: slowest rounds, spikes, one request's timeline")
    p.add_argument("files", nargs="+", help="JSON-lines span files (SPECDEC_TRACE_FILE of each service)")
    p.add_argument("--request", help="show this request id's timeline")
    p.add_argument("--trace", help="show this trace id's timeline")
    p.add_argument("--top", type=int, default=10, help="how many slowest rounds")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    spans = load(args.files)
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
