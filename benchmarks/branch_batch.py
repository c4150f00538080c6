"""What batching pre-drafted branches saves: drafting B branches at one position as one batch
through the draft model, against B one after another (drafter.sessions drafts every branch at
a position as one batch).

    python -m benchmarks.branch_batch [--models qwen-coder] [--context 300] [--gamma 4]

For B = 1..4 it times gamma batched draft steps after a `--context`-token cache (the
drafter's `_begin_branches` and `_advance_branches`, with the drafter's own quantisation),
median of `--repeats`, pinned to one core with one thread as the drafter runs, and prints ms
per branch and the batch's cost against B single branches.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch

from drafter.sessions import ModelDraftSession
from specdec.models import PAIRS, load_causal_lm


def time_batch(session: ModelDraftSession, position: int, corrections: list[int]) -> float:
    """ms to draft len(corrections) branches of gamma tokens at `position`, as one batch."""
    t0 = time.perf_counter()
    session._branch_job = session._begin_branches(position, corrections)
    while session._advance_branches() is None:
        pass
    session._branch_job = None
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen-coder", choices=sorted(PAIRS))
    ap.add_argument("--quantize", default="int8", choices=("int8", "none"))
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[-1]})  # the drafter's core
    torch.set_num_threads(1)
    # a transformers causal LM, Any here: its `config` is transformers' (torch types Module attributes as
    # Tensor | Module)
    model: Any = load_causal_lm(PAIRS[args.models].draft, "float32", args.quantize)
    vocab = int(model.config.vocab_size)
    prompt = [(7 * i + 11) % (min(vocab, 30000) - 200) + 100 for i in range(args.context)]
    s = ModelDraftSession(model, prompt, args.gamma, 0, temperature=0.0, top_k=0, top_p=1.0, seed=0, q_top_k=8)
    s._forward(len(prompt))  # the context's cache, as the drafter has it when it branches
    single = statistics.median(time_batch(s, args.context - 2, [101]) for _ in range(args.repeats))
    print(f"{args.models} draft ({args.quantize}), context {args.context}, gamma {args.gamma}, one core")
    print("| branches | batch ms | ms per branch | batch / (B x single) |")
    print("|---|---|---|---|")
    for b in range(1, 5):
        ms = statistics.median(time_batch(s, args.context - 2, list(range(101, 101 + b))) for _ in range(args.repeats))
        print(f"| {b} | {ms:.0f} | {ms / b:.0f} | {ms / (b * single):.2f} |")


if __name__ == "__main__":
    main()
