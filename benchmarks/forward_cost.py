"""Where a CPU draft step's time goes: one session's draft step (one forward of one token and
the token's pick), with the draft loaded as the drafter loads it by default (placement,
quantisation, the lean forward), pinned to one core with one thread, as the drafter runs.

    python -m benchmarks.forward_cost [--models qwen-coder] [--prompt 300] [--rounds 8] [--draft-vocab FILE]

Three modes, alternating in one run (`--rounds` rounds of `--steps` steps each):
    whole         the step as the drafter runs it
    free layers   every decoder layer's projections (q/k/v, o, gate/up, down) made free: each
                  returns a zero tensor of its output's shape, reading no weights
    free layers and head   the output layer made free too
So whole - free layers is what reading and multiplying the layers' weights costs, free layers -
free layers and head the output layer's, and what is left everything else: the norms, RoPE,
attention over the session's cache, the pick, the Python around them. The step's thread's CPU
time (time.thread_time), the median of each mode's steps. The prompt is the first `--prompt`
tokens of `--source` (default: the standard library's json/decoder.py, real source).

Why it matters: a draft step that is mostly weight reads is memory-bound, and only fewer bytes
make it faster (a draft vocabulary, `--draft-vocab`: the output layer reads only its ids).
Needs the lean forward (specdec.models.lean.LeanDecoder), whose layers it can reach.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.drafter_core import add_prompt_args, default_draft, source_ids
from drafter.sessions import ModelDraftSession
from specdec.models import PAIRS
from specdec.models.lean import LeanDecoder

PROJECTIONS = ("qkv", "o", "gate_up", "down")  # a LeanDecoder layer's Linear modules
MODES = ("whole", "free layers", "free layers and head")


class Free(torch.nn.Module):
    """A projection that reads no weights: zeros [..., out_features] for input [..., in]."""

    def __init__(self, out_features: int) -> None:
        super().__init__()
        self.out_features = out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(*x.shape[:-1], self.out_features)


def out_features(module: torch.nn.Module) -> int:
    """A Linear's output width (torch's dynamically quantised Linear keeps it as an attribute too),
    or a draft vocabulary's output layer's (specdec.models.vocab.SubsetHead: the whole vocabulary)."""
    width = getattr(module, "out_features", None) or getattr(module, "vocab_size", None)
    assert isinstance(width, int), f"{type(module).__name__} is not a Linear"
    return width


def step_ms(model: LeanDecoder, prompt: list[int], steps: int, q_top_k: int) -> list[float]:
    """CPU ms of each of `steps` greedy draft steps of a new session on `prompt` (5 warm ones first)."""
    session = ModelDraftSession(model, list(prompt), steps + 5, 0, 0.0, 0, 1.0, 0, q_top_k)
    while not session.ready:  # the prefill, in the session's chunks
        session.step()
    session.commit(len(prompt), [prompt[-1]])  # the target's first token: drafting starts
    times = []
    for i in range(steps + 5):
        drafted = len(session.context)
        t0 = time.thread_time()
        session.step()
        ms = (time.thread_time() - t0) * 1e3
        if len(session.context) != drafted + 1:  # a step that drafted nothing timed no forward
            raise RuntimeError(f"draft step {i} drafted no token (context {drafted} -> {len(session.context)})")
        if i >= 5:
            times.append(ms)
    session.close()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen-coder", choices=sorted(PAIRS))
    add_prompt_args(ap)
    ap.add_argument("--rounds", type=int, default=8, help="rounds of the three modes, alternating")
    ap.add_argument("--steps", type=int, default=10, help="draft steps per mode and round")
    ap.add_argument("--draft-vocab", help="a draft vocabulary (the drafter's --draft-vocab)")
    ap.add_argument("--out", type=Path, help="write the steps' times as JSON too")
    args = ap.parse_args()
    cfg, placement, model = default_draft(args.models, "lean", args.draft_vocab)
    if not isinstance(model, LeanDecoder):
        raise SystemExit(f"{cfg.model}: the lean forward does not run this draft, so its layers are out of reach")
    prompt = source_ids(cfg.model, args.source, args.prompt)[: args.prompt]
    layers = [(layer, name, getattr(layer, name)) for layer in model.layers for name in PROJECTIONS]
    head = model.lm_head
    free_layers = [Free(out_features(module)) for _, _, module in layers]
    free_head = Free(out_features(head))
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):  # alternating: the VM's drift falls on every mode alike
        for mode in MODES:
            for (layer, name, module), free in zip(layers, free_layers):
                setattr(layer, name, module if mode == "whole" else free)
            model.lm_head = free_head if mode == "free layers and head" else head
            times[mode] += step_ms(model, prompt, args.steps, cfg.q_top_k)
    whole, no_layers, neither = (statistics.median(times[mode]) for mode in MODES)
    print(
        f"{cfg.model} ({placement.device}, {placement.dtype}, quantize {placement.quantize}, lean forward"
        f"{f', draft vocabulary {args.draft_vocab}' if args.draft_vocab else ''}), one core, "
        f"{args.prompt}-token prompt; CPU ms a draft step, median of {args.rounds * args.steps}"
    )
    print("| the step | layers' weights | output layer | the rest |")
    print("|---|---|---|---|")
    print(f"| {whole:.1f} | {whole - no_layers:.1f} | {no_layers - neither:.1f} | {neither:.1f} |")
    if args.out:
        args.out.write_text(json.dumps({"model": cfg.model, "prompt": args.prompt, "steps_ms": times}, indent=1) + "\n")


if __name__ == "__main__":
    main()
