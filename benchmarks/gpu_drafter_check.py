"""The drafter on a GPU, checked against the CPU drafter: same draft tokens, and its cost.

A prepared check for a GPU host (minutes; the tiny pair is built in seconds, random weights):

    python -m benchmarks.gpu_drafter_check                 # GPU (cuda) vs the CPU drafter
    python -m benchmarks.gpu_drafter_check --device cpu    # the same run, CPU against itself

It drives the drafter's own sessions (drafter.sessions.ModelDraftSession, as the drafter's
worker does: several sessions advanced a token at a time, each keeping its KV cache across
rounds; rejections roll the cache back; idle sessions draft branches, batched through the
model) with the verdicts of the tiny target (greedy, float32, on the CPU). Each placement runs
twice, as the worker can step its sessions:

    serial      one session's forward at a time (`DrafterConfig.batch_drafts` off)
    batched     every session's next token in one forward of ragged rows (drafter.batch,
                the default)

The committed sequence depends on the target only, so the drafts of two placements of the same
draft model can be compared token for token with the CPU drafter's (serial, float32):

    float32 on --device, serial and batched   every draft and branch token must be equal
                                              (exit status 1 otherwise)
    --dtypes others (default bfloat16)        agreement with the CPU drafts is reported

and prints each run's draft ms per token: the median over rounds of a round's wall clock
(the device synchronised) over the tokens it drafted, each session's first round left out as
warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from drafter.sessions import BlockOut, ModelDraftSession, Ready
from specdec.models import load_causal_lm, resolve, tiny


@dataclass
class Run:
    """What one placement drafted: every block's tokens in order, and per-token costs (ms)."""

    label: str
    blocks: list[tuple[int, int, bool, list[int]]] = field(default_factory=list)  # (session, start, branch, tokens)
    token_ms: list[float] = field(default_factory=list)
    branch_ms: float = 0.0
    branch_tokens: int = 0
    rollbacks: int = 0
    wall_s: float = 0.0

    def tokens(self) -> list[int]:
        return [t for *_, ts in self.blocks for t in ts]


@torch.inference_mode()
def verdict(target: Any, context: list[int], drafts: list[int]) -> list[int]:
    """The target's greedy verdict on `drafts` after `context`: the accepted drafts, then its
    own token (the correction, or the bonus token when all are accepted)."""
    ids = torch.tensor([context + drafts])  # [1, len(context) + len(drafts)]
    preds = target(input_ids=ids).logits[0, len(context) - 1 :].argmax(-1).tolist()  # [len(drafts) + 1]
    out: list[int] = []
    for d, p in zip(drafts, preds):
        out.append(p)
        if d != p:
            return out
    return out + [preds[len(drafts)]]


def _now(model: Any) -> float:
    """The wall clock once `model`'s device has finished its queued work."""
    if getattr(model, "device", torch.device("cpu")).type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def drive(
    label: str,
    draft: Any,
    target: Any,
    prompts: list[list[int]],
    gamma: int,
    tokens: int,
    branches: int,
    batched: bool = False,
) -> Run:
    """Run one draft-model placement through `prompts` (one session each) until each has
    `tokens` committed tokens past its prompt; `batched`: each round's drafts in one forward
    (drafter.batch.draft_step), else one session's step at a time."""
    from drafter import batch  # imports transformers

    run = Run(label)
    sessions = [
        ModelDraftSession(
            draft, p, gamma, 0, temperature=0.0, top_k=0, top_p=1.0, seed=0, q_top_k=8, vocab_limit=tiny.VOCAB_SIZE
        )
        for p in prompts
    ]
    for s in sessions:
        s.branches = branches
        s.flush_ms = float("inf")  # blocks at gamma drafts or when the window is full, never on a timer
    t0 = time.perf_counter()
    rounds = [0] * len(sessions)
    for s in sessions:  # prefill, then the target's first token
        while not isinstance(s.step(), Ready):
            pass
        s.commit(len(s.context), verdict(target, s.context, [])[-1:])
    live = set(range(len(sessions)))
    while live:
        while todo := [i for i in sorted(live) if sessions[i].wants_work()]:  # a token per session a round
            steps = [sessions[i].steps for i in todo]
            r0 = _now(draft)
            if batched:
                results = batch.draft_step([sessions[i] for i in todo])
                for _, exc, _ in results:
                    if exc is not None:
                        raise exc
                outs = [out for out, _, _ in results]
            else:
                outs = [sessions[i].step() for i in todo]
            round_ms = (_now(draft) - r0) * 1e3
            drafted = sum(sessions[i].steps > n for i, n in zip(todo, steps))
            if drafted and all(rounds[i] > 0 for i in todo):
                run.token_ms.append(round_ms / drafted)
            for i, out in zip(todo, outs):
                if isinstance(out, BlockOut) and out.drafts:
                    run.blocks.append((i, out.start_position, False, [d.token_id for d in out.drafts]))
        for i in sorted(live):  # windows full: branches, one batched step at a time
            s = sessions[i]
            while s.wants_branch():
                before = s.branch_ms
                for b in s.branch_step():
                    run.blocks.append((i, b.start_position, True, [d.token_id for d in b.drafts]))
                    run.branch_tokens += len(b.drafts) - 1
                run.branch_ms += s.branch_ms - before
        for i in sorted(live):
            s = sessions[i]
            drafts = s.context[s.committed : s.committed + gamma]
            committed = s.context[: s.committed]
            verified = verdict(target, committed, drafts)
            run.rollbacks += len(verified) <= len(drafts)
            s.commit(s.committed, verified)
            rounds[i] += 1
            if s.committed - len(prompts[i]) >= tokens:
                live.discard(i)
    run.wall_s = time.perf_counter() - t0
    return run


WORKERS = {False: "serial", True: "batched"}


def _ms(run: Run) -> str:
    med = statistics.median(run.token_ms) if run.token_ms else float("nan")
    per_branch = run.branch_ms / run.branch_tokens if run.branch_tokens else float("nan")
    return (
        f"{run.label:<32} draft {med:7.2f} ms/token (median of {len(run.token_ms)}), branches "
        f"{per_branch:6.2f} ms/token ({run.branch_tokens}), {len(run.blocks)} blocks, {run.rollbacks} rollbacks, "
        f"{run.wall_s:.1f} s"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="the placement checked (default: cuda)")
    ap.add_argument(
        "--dtypes",
        default="float32,bfloat16",
        help="dtypes on --device; float32 must equal the CPU drafter, the others report agreement",
    )
    ap.add_argument("--draft", default="tiny/draft-mid", help="draft model reference (default: tiny/draft-mid)")
    ap.add_argument("--target", default="tiny/target", help="the verdicts' model (default: tiny/target)")
    ap.add_argument("--sessions", type=int, default=4, help="sessions drafted together (default: 4)")
    ap.add_argument("--tokens", type=int, default=64, help="committed tokens per session (default: 64)")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--branches", type=int, default=3, help="branches per round (0: off; default: 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads, as a drafter's (default: 1)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_drafter_check: torch sees no CUDA GPU; run it on a GPU host, or pass --device cpu", file=sys.stderr)
        return 2
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    target_dir = resolve(args.target)  # the tiny pair is built on first use (seconds)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(target_dir)
    prompts = [tok.encode(p) for p in tiny.SAMPLE_PROMPTS]
    prompts = [prompts[i % len(prompts)] + [i + 1] for i in range(args.sessions)]  # distinct sessions
    if args.device == "cuda":
        print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    common = (target, prompts, args.gamma, args.tokens, args.branches)
    reference = drive("cpu float32 serial (reference)", load_causal_lm(args.draft, "float32", "none"), *common)
    print(_ms(reference))
    failed = False
    for dtype in [d for d in args.dtypes.split(",") if d]:
        model = load_causal_lm(args.draft, dtype, "none", device=args.device)
        drive(f"{args.device} {dtype} warm-up", model, target, prompts[:2], args.gamma, 8, args.branches, True)
        for batched in (False, True):
            run = drive(f"{args.device} {dtype} {WORKERS[batched]}", model, *common, batched)
            print(_ms(run))
            ref, got = reference.tokens(), run.tokens()
            same = sum(a == b for a, b in zip(ref, got))
            equal = run.blocks == reference.blocks
            print(
                f"  draft tokens equal to the CPU drafter's: {'yes' if equal else 'NO'} "
                f"({same}/{max(len(ref), len(got))} tokens agree, {len(run.blocks)} vs {len(reference.blocks)} blocks)"
            )
            if dtype == "float32" and not equal:
                failed = True
    if failed:
        print("gpu_drafter_check: FAILED: float32 drafts differ from the CPU drafter's", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
