"""What stopping a superseded forward saves: a rejecting commit's wait for its draft session's
lock, and the time from that commit to the first block the drafter re-drafts after it, with
the stop (as the drafter runs: drafter.sessions, `superseded`) and without it (a session whose
commits never mark it superseded, the drafter before the stop), alternating in one run.

    python -m benchmarks.commit_stop [--models qwen-coder] [--trials 15] [--commits 6]

A real DraftWorker (drafter.server) drafts ahead for one session at a time (gamma 4,
lookahead 5) with the draft loaded as the drafter loads it by default (placement,
quantisation, forward), pinned to one core with one thread, as the drafter runs. The prompt
is the first `--prompt` tokens of `--source` (default: the standard library's json/decoder.py,
real source). Each trial opens a session and, `--commits` times, lets it draft for a random
`--delay-ms` (the worker is then mid-forward, drafting ahead) and commits a verdict that
accepts two drafts and rejects the third, as a verifier's rejection does. Trials alternate
between the stop on and off. It prints, per mode, the commits' mean and median wait for the
lock, the mean and median time from the commit to the first re-drafted block (gamma drafts
after the correction: what a verifier waits for after a rejection no branch covered), and the
forwards stopped.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.drafter_core import add_prompt_args, default_draft, source_ids
from drafter.server import DraftWorker
from drafter.sessions import BlockOut, ModelDraftSession, Ready
from specdec.models import PAIRS

GAMMA, LOOKAHEAD = 4, 5  # the drafter's defaults at gamma 4 (lookahead gamma + 1)


class NeverSuperseded(ModelDraftSession):
    """A session whose commits never mark it superseded: its forwards always run to the end
    (the drafter before the stop)."""

    def _supersedes(self, start: int, tokens: list[int]) -> bool:
        return False


@dataclass
class Mode:
    """One mode's measurements: per rejecting commit, its lock wait and its time to the first
    re-drafted block (ms), and the forwards its sessions stopped."""

    waits: list[float] = field(default_factory=list)
    redrafts: list[float] = field(default_factory=list)
    stopped: int = 0

    def row(self, name: str) -> str:
        w, r = self.waits, self.redrafts
        return (
            f"| {name} | {len(w)} | {statistics.mean(w):.1f} | {statistics.median(w):.1f} "
            f"| {statistics.mean(r):.1f} | {statistics.median(r):.1f} | {self.stopped} |"
        )


class Blocks:
    """What the worker emits for the session under test: its blocks, with their arrival times,
    and the exception that failed its drafting (raised by the next `wait`)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.seen: list[tuple[float, BlockOut]] = []
        self.ready = False
        self.failed: BaseException | None = None

    def emit(self, item: object) -> None:  # on the worker's thread
        with self.cond:
            if isinstance(item, BaseException):
                self.failed = item
            elif isinstance(item, Ready):
                self.ready = True
            elif isinstance(item, BlockOut):
                self.seen.append((time.perf_counter(), item))
            self.cond.notify_all()

    def wait(self, until: Callable[[], bool], what: str) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: self.failed is not None or until(), timeout=120):
                raise RuntimeError(f"no {what} in 120 s")
            if self.failed is not None:
                raise RuntimeError(f"drafting failed while waiting for the {what}") from self.failed

    def redrafted(self, since: int, start: int) -> float | None:
        """When the first block from `start` on arrived, of the blocks after the first `since`."""
        return next((t for t, b in self.seen[since:] if b.start_position == start), None)


def trial(
    worker: DraftWorker,
    session: ModelDraftSession,
    first: int,
    commits: int,
    delay_ms: tuple[float, float],
    rng: random.Random,
    mode: Mode,
) -> None:
    """Open `session` on `worker`, commit the target's `first` token, then `commits` rejecting
    verdicts, each after a random delay, timing each (into `mode`)."""
    blocks = Blocks()
    worker.add(session, blocks.emit)
    blocks.wait(lambda: blocks.ready, "Ready")
    session.commit(len(session.context), [first])
    worker.wake()
    vocab = int(getattr(session.model.config, "vocab_size", 0)) or 1000
    for _ in range(commits):
        time.sleep(rng.uniform(*delay_ms) / 1e3)  # the worker drafts ahead meanwhile
        c = session.committed
        third = c + 3  # the context length with the third draft
        blocks.wait(lambda: len(session.context) >= third, "third draft")  # noqa: B023 - called at once
        context = list(session.context)
        wrong = (context[c + 2] + 1) % vocab  # the target's correction of the third draft
        n = len(blocks.seen)
        t0 = time.perf_counter()
        session.commit(c, context[c : c + 2] + [wrong])
        t1 = time.perf_counter()
        worker.wake()
        blocks.wait(lambda: blocks.redrafted(n, third) is not None, "re-drafted block")  # noqa: B023 - at once
        arrived = blocks.redrafted(n, third)
        assert arrived is not None
        mode.waits.append((t1 - t0) * 1e3)
        mode.redrafts.append((arrived - t0) * 1e3)
    worker.remove(session)
    mode.stopped += session.forwards_stopped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen-coder", choices=sorted(PAIRS))
    ap.add_argument("--trials", type=int, default=15, help="sessions per mode (the modes alternate)")
    ap.add_argument("--commits", type=int, default=6, help="rejecting commits per session")
    add_prompt_args(ap)
    ap.add_argument("--delay-ms", default="60,200", help="min,max drafting time before each commit")
    ap.add_argument("--out", type=Path, help="write the measurements as JSON too")
    args = ap.parse_args()
    low, high = (float(x) for x in args.delay_ms.split(","))
    cfg, placement, model = default_draft(args.models)
    ids = source_ids(cfg.model, args.source, args.prompt + 1)  # the prompt and the target's first token
    prompt, first = ids[: args.prompt], ids[args.prompt]
    worker = DraftWorker(batch=cfg.batch_drafts)
    worker.start()
    rng = random.Random(0)
    modes = {"stop on": Mode(), "stop off": Mode()}
    for i in range(2 * args.trials):
        kind = ModelDraftSession if i % 2 == 0 else NeverSuperseded
        session = kind(model, list(prompt), GAMMA, LOOKAHEAD, 0.0, 0, 1.0, 0, cfg.q_top_k)
        trial(worker, session, first, args.commits, (low, high), rng, modes["stop on" if i % 2 == 0 else "stop off"])
    worker.stop()
    worker.join()
    print(
        f"{cfg.model} ({placement.device}, {placement.dtype}, quantize {placement.quantize}, forward "
        f"{type(model).__name__}), one core; a rejecting commit {low:.0f}-{high:.0f} ms into drafting ahead"
    )
    print("| stop | commits | lock wait ms, mean | median | commit to re-drafted block ms, mean | median | stopped |")
    print("|---|---|---|---|---|---|---|")
    for name, mode in modes.items():
        print(mode.row(name))
    if args.out:
        args.out.write_text(json.dumps({name: vars(mode) for name, mode in modes.items()}, indent=1) + "\n")


if __name__ == "__main__":
    main()
