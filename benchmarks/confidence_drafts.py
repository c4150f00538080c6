"""Drafts sized by confidence against fixed blocks: the same requests through specdec with the
drafter's `draft_confidence` off, auto and fixed taus (docs/confidence-drafts.md).

    python -m benchmarks.confidence_drafts [--models tiny] [--modes off,auto,0.3,0.6] [--gammas 4,8]

For each mode it starts the three services (specdec_cli.launch.Cluster, the drafter with
`--draft-confidence MODE`), runs every prompt at each gamma one request at a time (greedy,
ignore_eos, `--max-tokens`), checks each output against the gamma-0 run's (plain target
decoding through the same verifier, its row first), and prints one row per (mode, gamma):
output tokens per second, mean acceptance length (1 + accepted / draft steps), target steps per request, the
blocks cut by confidence per request, mean tau, and the branch hit rate (branches_used /
(branches_used + branch_misses), the hits and breaks beside it). `--verifier-args` is passed
to the verifier (e.g. "--no-adaptive-gamma"), `--drafter-args` to the drafter.
"""

from __future__ import annotations

import argparse
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

from specdec.models import PAIRS
from specdec.stats import SpecStats, branch_hits_by_gamma

PROMPTS = [
    "def add(a, b):\n    return",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n",
    "def fib(n):\n    if n < 2:\n        return n\n",
    "with open(path) as f:\n    data = f.read()\n",
]


@dataclass
class Row:
    """One (mode, gamma) run over every prompt."""

    mode: str
    gamma: int
    tokens_per_s: float
    stats: list[SpecStats]
    exact: int  # outputs equal to the gamma-0 run's

    def line(self) -> str:
        n = len(self.stats)
        drafts = sum(s.num_drafts for s in self.stats)
        accepted = sum(s.num_accepted_tokens for s in self.stats)
        mal = 1 + accepted / drafts if drafts else 1.0
        steps = sum(s.target_steps for s in self.stats) / n
        cuts = sum(s.confidence_cuts for s in self.stats) / n
        taus = [s.mean_tau for s in self.stats if s.mean_tau > 0]
        tau = f"{sum(taus) / len(taus):.2f}" if taus else "-"
        per_gamma = branch_hits_by_gamma(self.stats)  # one gamma per row
        branch = "-" if not per_gamma else f"{per_gamma[0].rate:.2f} ({per_gamma[0].hits}/{per_gamma[0].breaks})"
        return (
            f"| {self.mode} | {self.gamma} | {self.tokens_per_s:.1f} | {mal:.2f} | {steps:.1f} | {cuts:.1f} | "
            f"{tau} | {branch} | {self.exact}/{n} |"
        )


def run(
    address: str, prompts: list[list[int]], max_tokens: int, gamma: int
) -> tuple[list[list[int]], list[SpecStats], float]:
    """Every prompt through the gateway at `address`, one at a time: outputs, stats, tokens/s."""
    from gateway.client import GatewayClient, generation_spec

    client = GatewayClient(address)
    outputs, stats = [], []
    t0 = time.perf_counter()
    try:
        for ids in prompts:
            spec = generation_spec(
                ids, max_tokens=max_tokens, gamma=gamma, drafter="model" if gamma else "none", ignore_eos=True
            )
            tokens: list[int] = []
            last = None
            for msg in client.stream(spec):
                tokens.extend(msg.token_ids)
                last = msg
            assert last is not None
            outputs.append(tokens)
            stats.append(SpecStats.from_pb(last.stats))
    finally:
        client.close()
    wall = time.perf_counter() - t0
    return outputs, stats, sum(len(o) for o in outputs) / wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny", choices=sorted(PAIRS))
    ap.add_argument("--modes", default="off,auto,0.3,0.6", help="draft_confidence values, comma list")
    ap.add_argument("--gammas", default="4,8")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--branches", type=int, default=6)
    ap.add_argument("--verifier-args", default="", help="extra verifier flags (one string)")
    ap.add_argument("--drafter-args", default="", help="extra drafter flags (one string)")
    ap.add_argument("--out", default="confidence-results", help="folder for the services' logs")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from specdec.models import resolve
    from specdec_cli.launch import ANY_PORT, Cluster

    tokenizer = AutoTokenizer.from_pretrained(str(resolve(PAIRS[args.models].target)))
    prompts = [list(tokenizer.encode(p)) for p in PROMPTS]
    gammas = [int(g) for g in args.gammas.split(",")]
    rows: list[Row] = []
    reference: list[list[int]] | None = None
    for mode in args.modes.split(","):
        cluster = Cluster(
            pair=args.models,
            gateway_port=ANY_PORT,
            drafter_port=ANY_PORT,
            verifier_port=ANY_PORT,
            log_dir=Path(args.out) / "logs",
            metrics_port=dict.fromkeys(("verifier", "drafter", "gateway"), 0),
            rest_port=0,
            extra_args={
                "verifier": shlex.split(args.verifier_args),
                "drafter": [
                    "--draft-confidence",
                    mode,
                    "--branches",
                    str(args.branches),
                    *shlex.split(args.drafter_args),
                ],
            },
        )
        cluster.start()
        try:
            address = cluster.gateway.address
            run(address, prompts[:1], 8, gammas[0])  # warm-up
            if reference is None:  # plain target decoding through the same services: the output to match
                reference, plain, rate = run(address, prompts, args.max_tokens, 0)
                rows.append(Row("(plain decoding)", 0, rate, plain, len(prompts)))
                print(rows[-1].line(), flush=True)
            for gamma in gammas:
                outputs, stats, rate = run(address, prompts, args.max_tokens, gamma)
                rows.append(Row(mode, gamma, rate, stats, sum(o == r for o, r in zip(outputs, reference))))
                print(rows[-1].line(), flush=True)
        finally:
            cluster.stop()
    print(f"\n{args.models}, {len(prompts)} prompts x {args.max_tokens} tokens, one request at a time")
    print(
        "| draft_confidence | γ | tok/s | MAL | target steps / req | cuts / req | mean τ "
        "| branch hit rate (hits/breaks) | exact |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(row.line())
    return 0 if all(r.exact == len(r.stats) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
