"""What the drafter's batched forwards take past its sessions' keys/values: the peak resident
memory of the draft worker's steps over many long sessions, with and without the bounds on a
forward's workspace (drafter.batch.MAX_FORWARD_TOKENS and MAX_FORWARD_NEW, drafter.rows.SCORES_BYTES).

    python -m benchmarks.forward_memory [--models qwen-coder] [--sessions 38] [--tokens 3000]
        [--modes uncapped,default] [--commit-tokens 32] [--ride 2] [--out forward-memory.json]

Per mode (`uncapped`: the three bounds lifted, every session of a step in one forward and every
query at once; `default`: as the drafter runs), a process of its own loads the draft
as the drafter does by default (quantisation, the lean forward; two torch threads), makes
`--sessions` sessions whose caches already hold `--tokens` cached tokens each (random keys and
values: what a forward's workspace costs depends on their number, not their values), with
riding branch rows as the drafter's default (`--ride`), hands the heap's free pages back, and
runs the worker's steps: the first commit (every session drafts at once), then three rounds of
commits of `--commit-tokens` tokens that reject the drafts (each session feeds them in its next
forward). It reports the resident memory at the start, the peak over it (VmHWM), what is left
over it at the end, and the steps' time.

Why it matters: the sessions' keys/values have a budget (drafter.memory), the forward's
workspace does not. Without the bounds, 38 sessions of 3,000 tokens took the process ~1.7 GiB
past its resident size, more than the budget leaves, and a drafter in the shipped pod's 6 GiB
was killed with its keys/values within budget (`python -m benchmarks.drafter_memory --generate`).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from specdec.models import PAIRS

STATUS = Path("/proc/self/status")


def _status_mib(field: str) -> float:
    match = re.search(rf"{field}:\s+(\d+)", STATUS.read_text())
    assert match is not None, f"no {field} in {STATUS}"
    return int(match.group(1)) / 1024


def measure(models: str, sessions: int, tokens: int, mode: str, commit_tokens: int, ride: int) -> dict[str, Any]:
    """One configuration, in this process (see the module docstring)."""
    from drafter import batch, memory, rows
    from drafter.kvcache import GrowingCache
    from drafter.server import DraftWorker
    from drafter.sessions import ModelDraftSession
    from specdec.config import DrafterConfig
    from specdec.models import load_causal_lm
    from specdec.models.device import draft_placement

    if mode == "uncapped":  # every session of a step in one forward, every query at once
        batch.MAX_FORWARD_TOKENS = batch.MAX_FORWARD_NEW = rows.SCORES_BYTES = 1 << 62
    torch.set_num_threads(2)
    cfg = DrafterConfig(model=PAIRS[models].draft)
    placement = draft_placement(cfg.device, cfg.dtype, cfg.quantize)
    model = load_causal_lm(cfg.model, placement.dtype, placement.quantize, None, placement.device, cfg.forward, None)
    config: Any = model.config
    layers, heads, vocab = int(config.num_hidden_layers), int(config.num_key_value_heads), int(config.vocab_size)
    dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    worker = DraftWorker(kv_budget=memory.KVBudget(0, 1), ride_branches=ride)  # stepped here, not started
    kv = torch.randn(1, heads, tokens - 1, dim)  # [1, kv heads, cached, dim]: one tensor, copied into each cache
    made = []
    for i in range(sessions):
        prompt = [(i * 31 + j * 7) % (vocab - 10) + 10 for j in range(tokens)]
        reserve = memory.reserve_slots(tokens, 4096, 9)
        session = ModelDraftSession(
            model, prompt, 4, 5, temperature=0.0, top_k=0, top_p=1.0, seed=i, q_top_k=8, reserve_slots=reserve
        )
        session.branches = cfg.branches
        cache = GrowingCache(reserve)
        for layer in range(layers):
            cache.update(kv, kv, layer)
        session.cache, session.cached = cache, tokens - 1  # prefilled but for the last prompt token
        worker.add(session, lambda item: None)
        made.append(session)
    del kv
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here
    start, t0, forwards = _status_mib("VmRSS"), time.perf_counter(), 0

    def steps(n: int) -> None:
        nonlocal forwards
        for _ in range(n):
            active, branchy = worker.pick_work()
            if active:
                worker.advance(active)
                forwards += 1
            elif branchy:
                worker._branch_steps(branchy)

    steps(2)  # the `ready`s
    for s in made:
        s.commit(tokens, [11])
    steps(8)
    for r in range(3):
        for s in made:
            s.commit(s.committed, [12 + r + j for j in range(commit_tokens)])
        steps(6)
    return {
        "mode": mode,
        "resident_mib": round(start),
        "peak_over_mib": round(_status_mib("VmHWM") - start),
        "left_over_mib": round(_status_mib("VmRSS") - start),
        "steps": forwards,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.forward_memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen-coder", choices=sorted(PAIRS))
    ap.add_argument("--sessions", type=int, default=38)
    ap.add_argument("--tokens", type=int, default=3000, help="cached tokens per session")
    ap.add_argument("--modes", default="uncapped,default", help="uncapped: the forward's bounds lifted")
    ap.add_argument("--commit-tokens", type=int, default=32)
    ap.add_argument("--ride", type=int, default=2, help="riding branch rows per session (the drafter's default)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: measure this mode
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    shape = (args.models, args.sessions, args.tokens)
    if args.one is not None:
        print(json.dumps(measure(*shape, args.one, args.commit_tokens, args.ride)))
        return
    results = []
    for mode in args.modes.split(","):
        cmd = [sys.executable, "-m", "benchmarks.forward_memory", "--one", mode]
        cmd += ["--models", args.models, "--sessions", str(args.sessions), "--tokens", str(args.tokens)]
        cmd += ["--commit-tokens", str(args.commit_tokens), "--ride", str(args.ride)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    print(f"\n{args.sessions} sessions of {args.tokens} cached tokens, riding rows {args.ride} ({args.models} draft)\n")
    print("| mode | resident at the start MiB | peak over it MiB | left over it MiB | seconds |")
    print("| --- | --- | --- | --- | --- |")
    for r in results:
        sizes = f"{r['resident_mib']:,} | {r['peak_over_mib']:,} | {r['left_over_mib']:,}"
        print(f"| {r['mode']} | {sizes} | {r['seconds']} |")
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "command": "python -m benchmarks.forward_memory",
                    "args": vars(args) | {"out": str(args.out)},
                    "results": results,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
