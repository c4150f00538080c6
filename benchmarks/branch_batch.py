"""What batching pre-drafted branches saves: drafting B branches at one position as one batch
through the draft model, against B one after another (drafter.sessions drafts every branch at
a position as one batch).

    python -m benchmarks.branch_batch [--models qwen-coder] [--context 300] [--gamma 4]
    python -m benchmarks.branch_batch --ride 2 [--contexts 300,1500,3000]

For B = 1..4 it times gamma batched draft steps after a `--context`-token cache (the
drafter's `_begin_branches` and `_advance_branches`, with the drafter's own quantisation and
forward: `--forward`, default auto as the drafter's),
median of `--repeats`, pinned to one core with one thread as the drafter runs, and prints ms
per branch and the batch's cost against B single branches.

`--ride N` times instead what riding branch rows add to a session's drafting forward
(drafter.batch, `ride_branches`): at each of `--contexts` cached tokens, the session's step
alone (its serial forward), then its row with N branch rows beside it (each reads the session's
cache up to its position and has 2 keys of its own, as mid-batch), their shared prefix gathered
per row and attended where it lies (drafter.rows, "Shared prefixes"), one after the other in
one run. ms are medians of `--repeats` (at least 9) forwards of one new token a row.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import Cache

from drafter import rows
from drafter.kvcache import GrowingCache
from drafter.sessions import ModelDraftSession
from specdec.models import FORWARDS, PAIRS, load_causal_lm


def time_batch(session: ModelDraftSession, position: int, corrections: list[int]) -> float:
    """ms to draft len(corrections) branches of gamma tokens at `position`, as one batch."""
    t0 = time.perf_counter()
    session._branch_job = session._begin_branches(position, corrections)
    while session._advance_branches() is None:
        pass
    session._branch_job = None
    return (time.perf_counter() - t0) * 1e3


def reading(cache: Cache, upto: int | None, own: Cache | None = None) -> Callable[[int], list[rows.Segment]]:
    """A row's segments (drafter.rows.Row): `cache` up to `upto` (None: all of it), then `own`."""

    def segments(layer: int) -> list[rows.Segment]:
        return rows.layer_kv(cache, layer, upto) + ([] if own is None else rows.layer_kv(own, layer))

    return segments


def time_ride(session: ModelDraftSession, riders: int, repeats: int) -> tuple[float, float, float]:
    """(ms of the session's step alone, with `riders` branch rows gathered, with them sharing its
    cache) for one new token a row after the session's whole context (module docstring)."""
    model, cached = session.model, len(session.context)
    token = session.context[-1]
    branches = []  # (its position, its own cache of 2 keys)
    for r in range(riders):
        position = cached - 2 - r
        own = GrowingCache()
        rows.forward(model, [rows.Row([101 + r, 7], position, reading(session.cache, position), own)])
        branches.append((position, own))

    def step(how: str) -> float:
        batch = [rows.Row([token], cached, reading(session.cache, None), session.cache)]
        batch += [rows.Row([9], position + 2, reading(session.cache, position, own), own) for position, own in branches]
        t0 = time.perf_counter()
        if how == "alone":
            with torch.inference_mode():
                model(
                    input_ids=torch.tensor([[token]]), past_key_values=session.cache, use_cache=True, logits_to_keep=1
                )
        else:
            rows.forward(model, batch, share_min=0 if how == "shared" else None)
        ms = (time.perf_counter() - t0) * 1e3
        session.cache.crop(-1)  # back to the context (negative: drop that many)
        for _, own in branches:
            if how != "alone":
                own.crop(-1)
        return ms

    step("alone")  # warm up each path once
    step("gathered")
    step("shared")
    times: dict[str, list[float]] = {"alone": [], "gathered": [], "shared": []}
    for _ in range(repeats):  # interleaved: the VM's drift falls on every variant alike
        for how, got in times.items():
            got.append(step(how))
    alone, gathered, shared = (statistics.median(times[how]) for how in ("alone", "gathered", "shared"))
    return alone, gathered, shared


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen-coder", choices=sorted(PAIRS))
    ap.add_argument("--quantize", default="int8", choices=("int8", "none"))
    ap.add_argument("--forward", default="auto", choices=FORWARDS, help="the draft's forward (the drafter's --forward)")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ride", type=int, default=0, help="time N branch rows riding in a drafting forward instead")
    ap.add_argument("--contexts", default="300,1500,3000", help="--ride: cached tokens, comma-separated")
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[-1]})  # the drafter's core
    torch.set_num_threads(1)
    # a transformers causal LM, Any here: its `config` is transformers' (torch types Module attributes as
    # Tensor | Module)
    model: Any = load_causal_lm(PAIRS[args.models].draft, "float32", args.quantize, forward=args.forward)
    vocab = int(model.config.vocab_size)

    def synthetic(n: int) -> list[int]:  # n token ids, none special
        return [(7 * i + 11) % (min(vocab, 30000) - 200) + 100 for i in range(n)]

    if args.ride:
        print(
            f"{args.models} draft ({args.quantize}, forward {args.forward}), {args.ride} branch rows riding, one core"
        )
        print("| context | alone ms | riding, gathered ms | riding, shared ms | gathered / alone | shared / alone |")
        print("|---|---|---|---|---|---|")
        for context in (int(c) for c in args.contexts.split(",")):
            s = ModelDraftSession(
                model, synthetic(context), args.gamma, 0, temperature=0.0, top_k=0, top_p=1.0, seed=0, q_top_k=8
            )
            for upto in range(512, context, 512):  # the context's cache, in chunks of 512 (not timed)
                s._forward(upto)
            s._forward(context)
            alone, gathered, shared = time_ride(s, args.ride, max(args.repeats, 9))
            print(
                f"| {context} | {alone:.1f} | {gathered:.1f} | {shared:.1f} "
                f"| {gathered / alone:.2f} | {shared / alone:.2f} |"
            )
        return
    prompt = synthetic(args.context)
    s = ModelDraftSession(model, prompt, args.gamma, 0, temperature=0.0, top_k=0, top_p=1.0, seed=0, q_top_k=8)
    s._forward(len(prompt))  # the context's cache, as the drafter has it when it branches
    single = statistics.median(time_batch(s, args.context - 2, [101]) for _ in range(args.repeats))
    print(
        f"{args.models} draft ({args.quantize}, forward {args.forward}), context {args.context}, "
        f"gamma {args.gamma}, one core"
    )
    print("| branches | batch ms | ms per branch | batch / (B x single) |")
    print("|---|---|---|---|")
    for b in range(1, 5):
        ms = statistics.median(time_batch(s, args.context - 2, list(range(101, 101 + b))) for _ in range(args.repeats))
        print(f"| {b} | {ms:.0f} | {ms / b:.0f} | {ms / (b * single):.2f} |")


if __name__ == "__main__":
    main()
