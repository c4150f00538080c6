"""Drafter capacity: draft tokens per second and per-session pace against the number of
sessions, the batched worker (drafter.batch) against the serial loop, in one run.

    specdec bench-drafter [--model tiny/draft-mid] [--quantize none] [--device auto]
        [--sessions 1,2,4,8,16,32] [--core 0] [--out bench-drafter]

(`python -m benchmarks.drafter_capacity` takes the same flags.)

Terms:
    sessions    draft sessions the worker serves at once, all drafting (none held)
    round       one `DraftWorker.advance` over every session: each drafts one token
    tok/s       draft tokens made per second (CPU time, see below), all sessions together
    pace        ms between two draft tokens of one session (a round's duration): what a
                verifier waiting for that session's drafts sees

Each session has its own prompt (`--prompt` tokens plus 8 per session index, so rows are
ragged), is prefilled (not timed) and gets its first commit; then the worker drafts round
after round. Every `--gamma` tokens a session gets a verdict that accepts `--accept` of its
drafts and corrects the next, so its cache rolls back and the next step feeds the
correction, as under a verifier. A mode runs at least `--min-rounds` rounds and `--seconds`
seconds after `--warmup` rounds. One core, one torch thread (the drafter's default
`--threads 1`); pin the process too: `--core 0` (as `taskset -c 0`).

Time, on the CPU, is the CPU time of the worker's thread (time.thread_time), so tok/s is per
CPU-second of one core: on a core shared with other work, wall-clock rates fall with the share
the process gets, CPU-time rates much less (the wall-clock rate is in the CSV and JSON too). On
a core of its own the two agree.

`--device` places the draft model as the drafter's own `--device`/`--dtype` do
(specdec.models.device.draft_placement: auto is cuda when torch sees a GPU; on cuda, bfloat16,
or float16 without bf16, and no int8). On a GPU, time is the wall clock between synchronised
points (the GPU's work is not the thread's CPU time): the first row's warm-up rounds also take
the CUDA kernels' first-use costs.

`--shape qwen2.5-0.5b`: a random-init Qwen2 with the Qwen2.5-Coder-0.5B draft's shapes (24
layers, hidden 896, 14 heads, 2 KV heads, vocab 151,936) instead of `--model`'s weights: the
same cost per forward, without the weights (its drafts are meaningless; their speed is not).

`--forward` picks the draft's forward as the drafter's `--forward` does (auto: the lean one,
specdec.models.lean, where it applies). `--forward-ab`: instead, for each `--sessions` count,
the batched worker with transformers' forward and with the lean one, one after the other in
one run (the same weights, the same sessions): the lean forward's gain, as a ratio of tok/s.

`--draft-vocab FILE` cuts the draft's output layer to a draft vocabulary, as the drafter's
`--draft-vocab` does (specdec.models.vocab; not with `--shape`). `--draft-vocab-ab FILE`:
instead, for each `--sessions` count, the batched worker with the whole output layer and with
it cut to FILE's ids, one after the other in one run (OUT/draft-vocab-ab.json).

`--copies N`: instead, time one batched step of N sessions and, apart, the cache copies it
makes (gathering each row's cache into the padded batch, appending the new token to it):
what a single batched cache, which copies nothing, could save (docs/batched-drafting.md).

Writes OUT/drafter-capacity.csv and OUT/drafter-capacity.json, OUT/drafter-capacity.png when
matplotlib is installed, and prints a markdown table.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from drafter.server import DraftWorker, Emit
from drafter.sessions import DraftSession, ModelDraftSession, Ready
from specdec.models import load_causal_lm
from specdec.models.device import DEVICES, Placement, draft_placement, to_device

# Qwen2.5-Coder-0.5B-Instruct's shapes (its config.json), for `--shape qwen2.5-0.5b`.
QWEN_05B: dict[str, Any] = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
)


@dataclass
class Row:
    """One (sessions, mode) measurement."""

    sessions: int
    mode: str  # "batched" or "serial"
    rounds: int
    tokens: int
    seconds: float  # CPU time of the worker's thread; on a GPU the wall clock (see the module's docstring)
    wall_seconds: float

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def pace_ms(self) -> float:
        return self.seconds * 1e3 / self.rounds

    @property
    def wall_tok_s(self) -> float:
        return self.tokens / self.wall_seconds


def placement(args: argparse.Namespace) -> Placement:
    """Where the draft model runs: `--device`, `--dtype` and `--quantize` decided as the
    drafter decides them (a UserError naming the setting when the host cannot)."""
    return draft_placement(args.device, args.dtype, args.quantize)


def load(
    args: argparse.Namespace, where: Placement, forward: str | None = None, draft_vocab: str | None = None
) -> torch.nn.Module:
    """The draft model: `--model` (with `--quantize`) or a random-init `--shape`, placed at `where`,
    with `forward` (default `--forward`; specdec.models.load_causal_lm's) and `draft_vocab` (a
    file; default `--draft-vocab`)."""
    forward = forward or args.forward
    draft_vocab = draft_vocab or args.draft_vocab
    if args.shape == "qwen2.5-0.5b":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        from specdec.models.lean import LeanDecoder

        torch.manual_seed(0)
        model: torch.nn.Module = Qwen2ForCausalLM(Qwen2Config(**QWEN_05B)).eval()
        if where.device != "cpu" or where.dtype != "float32":
            return to_device(model, where.device, getattr(torch, where.dtype))
        if forward != "transformers":
            model = LeanDecoder(model)
        if where.quantize == "int8":  # as specdec.models.load_causal_lm quantises
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
        return model
    if not draft_vocab:
        return load_causal_lm(args.model, where.dtype, where.quantize, device=where.device, forward=forward)
    from specdec.models import compat, resolve
    from specdec.models.vocab import read

    width = compat.from_folder(resolve(args.model), args.model).vocab_size
    cut = read(draft_vocab, args.model, width)  # checked before the weights load, as the drafter does
    return load_causal_lm(
        args.model, where.dtype, where.quantize, device=where.device, forward=forward, draft_vocab=cut
    )


class Clock:
    """The benchmark's time: the worker thread's CPU time on the CPU; on a GPU the wall clock,
    read after the device finished its queued work."""

    def __init__(self, device: str) -> None:
        self.gpu = device != "cpu"

    def __call__(self) -> float:
        if self.gpu:
            torch.cuda.synchronize()
            return time.perf_counter()
        return time.thread_time()


def _vocab(model: torch.nn.Module) -> int:
    """The model's vocabulary size, at most 30,000 (the range the prompts and corrections use)."""
    config: Any = model.config  # a transformers PretrainedConfig (torch types a Module's attributes as Tensor | Module)
    return min(int(config.vocab_size), 30000)


def _kv(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A DynamicCache layer's keys and values, [1, heads, L, dim] each (Any: transformers types a layer as
    possibly a linear-attention one, and its tensors as optional, which a Qwen2 session's never are)."""
    return layer.keys, layer.values


def make_sessions(model: torch.nn.Module, n: int, args: argparse.Namespace) -> list[ModelDraftSession]:
    """n sessions with ragged prompts, prefilled and started (their first commit given)."""
    vocab = _vocab(model)
    out: list[ModelDraftSession] = []
    for i in range(n):
        prompt = [(7 * j + 13 * i + 11) % (vocab - 200) + 100 for j in range(args.prompt + 8 * i)]
        s = ModelDraftSession(
            model,
            prompt,
            args.gamma,
            1 << 20,
            temperature=0.0,
            top_k=0,
            top_p=1.0,
            seed=i,
            q_top_k=8,
            prefill_chunk=1 << 20,
        )
        s.flush_ms = 1e9  # blocks at gamma drafts: no timer in the measurement
        while not isinstance(s.step(), Ready):
            pass
        s.commit(len(prompt), [(31 * i + 5) % vocab])
        out.append(s)
    return out


def verdicts(sessions: Sequence[DraftSession], gamma: int, accept: int, vocab: int) -> None:
    """A verdict for each session with gamma drafts past its committed context: accept
    `accept` of them, correct the next (a rollback of gamma - accept tokens)."""
    for s in sessions:
        if len(s.context) - s.committed >= gamma:
            c = s.committed
            s.commit(c, s.context[c : c + accept] + [(s.context[c + accept] + 1) % vocab])


def _fail(item: object) -> None:
    """The benchmark's emit: blocks are dropped; a failed step ends the run."""
    if isinstance(item, BaseException):
        raise RuntimeError("a draft step failed") from item


def measure(model: torch.nn.Module, n: int, batched: bool, args: argparse.Namespace, clock: Clock) -> Row:
    sessions = make_sessions(model, n, args)
    worker = DraftWorker(batch=batched)
    active: list[tuple[DraftSession, Emit]] = [(s, _fail) for s in sessions]
    vocab = _vocab(model)
    for _ in range(args.warmup):
        worker.advance(active)
        verdicts(sessions, args.gamma, args.accept, vocab)
    before = sum(s.steps for s in sessions)
    rounds, c0 = 0, clock()
    t0 = time.perf_counter()
    while rounds < args.min_rounds or clock() - c0 < args.seconds:
        worker.advance(active)
        rounds += 1
        verdicts(sessions, args.gamma, args.accept, vocab)
    cpu = clock() - c0
    wall = time.perf_counter() - t0
    return Row(n, "batched" if batched else "serial", rounds, sum(s.steps for s in sessions) - before, cpu, wall)


def copy_share(
    model: torch.nn.Module, n: int, args: argparse.Namespace, clock: Clock, repeats: int = 5
) -> tuple[float, float]:
    """(ms of one batched step of n one-token rows, ms of its cache copies alone): the same
    gathers into [n, heads, Lp + 1, dim] and appends of one token per row and layer, timed
    apart from the forward (medians of `repeats`; the benchmark's Clock). What one batched cache
    would save."""
    import statistics

    from drafter import batch

    sessions = make_sessions(model, n, args)
    steps, copies = [], []
    for _ in range(repeats):
        for s in sessions:
            s.context.append(101)
        c0 = clock()
        batch.forward_rows(model, sessions)
        steps.append(clock() - c0)
        c0 = clock()
        padded = max(s.cached for s in sessions)
        for layer in range(len(sessions[0].cache.layers)):
            k0, _ = _kv(sessions[0].cache.layers[layer])  # [1, heads, L, dim]
            keys = k0.new_zeros(n, k0.shape[1], padded + 1, k0.shape[3])
            values = torch.zeros_like(keys)
            for i, s in enumerate(sessions):
                own_keys, own_values = _kv(s.cache.layers[layer])
                keys[i, :, : own_keys.shape[-2]] = own_keys[0]
                values[i, :, : own_values.shape[-2]] = own_values[0]
            for i, s in enumerate(sessions):
                own_keys, own_values = _kv(s.cache.layers[layer])
                torch.cat([own_keys, keys[i : i + 1, :, -1:]], dim=-2)
                torch.cat([own_values, values[i : i + 1, :, -1:]], dim=-2)
        copies.append(clock() - c0)
    return statistics.median(steps) * 1e3, statistics.median(copies) * 1e3


def table(rows: list[Row]) -> str:
    by = {(r.sessions, r.mode): r for r in rows}
    lines = [
        "| sessions | serial tok/s | batched tok/s | batched / serial | serial pace ms | batched pace ms |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for n in sorted({r.sessions for r in rows}):
        s, b = by[(n, "serial")], by[(n, "batched")]
        lines.append(
            f"| {n} | {s.tok_s:.0f} | {b.tok_s:.0f} | {b.tok_s / s.tok_s:.2f}x | {s.pace_ms:.1f} | {b.pace_ms:.1f} |"
        )
    return "\n".join(lines)


def plot(rows: list[Row], title: str, path: Path) -> bool:
    """tok/s and pace against sessions, both modes; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in ("serial", "batched"):
        pts = sorted((r.sessions, r.tok_s, r.pace_ms) for r in rows if r.mode == mode)
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
        ax2.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=mode)
    for ax, label in ((ax1, "draft tokens / s (all sessions)"), (ax2, "pace: ms per token of one session")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sessions")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


HELP = "the drafter's capacity: draft tokens/s and per-session pace against sessions, batched vs serial"


def session_counts(text: str) -> list[int]:
    """`--sessions`: a comma-separated list of positive session counts."""
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more session counts, each at least 1")
    return counts


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The benchmark's flags (`specdec bench-drafter` and `python -m benchmarks.drafter_capacity`)."""
    ap.add_argument("--model", default="tiny/draft-mid", help="draft model reference (specdec.models)")
    ap.add_argument("--shape", default="", choices=("", "qwen2.5-0.5b"), help="random-init model of these shapes")
    ap.add_argument("--quantize", default="none", choices=("none", "int8"))
    ap.add_argument(
        "--device", default="auto", choices=DEVICES, help="as the drafter's: auto is cuda when torch sees a GPU"
    )
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="as the drafter's: auto is float32 on the CPU, bfloat16 (or float16) on a GPU",
    )
    ap.add_argument(
        "--sessions",
        type=session_counts,
        default=session_counts("1,2,4,8,16,32"),
        metavar="N,N,...",
        help="session counts to measure (default: 1,2,4,8,16,32)",
    )
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens of session 0 (session i: + 8 i)")
    ap.add_argument("--gamma", type=int, default=8)
    ap.add_argument("--accept", type=int, default=4, help="drafts each verdict accepts (of gamma)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--min-rounds", type=int, default=4)
    ap.add_argument(
        "--seconds",
        type=float,
        default=2.0,
        help="least time measured per (sessions, mode): CPU time, or a GPU's wall clock",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--core",
        type=int,
        default=None,
        metavar="N",
        help="pin the process to this core first (as `taskset -c N`; default: not pinned)",
    )
    ap.add_argument(
        "--forward",
        default="auto",
        choices=("auto", "lean", "transformers"),
        help="the draft's forward, as the drafter's --forward (auto: lean where it applies)",
    )
    ap.add_argument(
        "--forward-ab",
        action="store_true",
        help="instead: the batched worker with transformers' forward and with the lean one, in one run",
    )
    ap.add_argument(
        "--draft-vocab", metavar="FILE", help="cut the draft's output layer to this draft vocabulary (the drafter's)"
    )
    ap.add_argument(
        "--draft-vocab-ab",
        metavar="FILE",
        help="instead: the batched worker with the whole output layer and with it cut to FILE, in one run",
    )
    ap.add_argument("--out", default="bench-drafter")
    ap.add_argument(
        "--copies",
        type=int,
        default=0,
        help="instead: time one batched step of this many sessions and its cache copies alone",
    )


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`specdec bench-drafter`."""
    p = sub.add_parser(
        "bench-drafter", help=HELP, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(p)
    p.set_defaults(func=main)


def _check(args: argparse.Namespace) -> None:
    """Values argparse cannot judge alone: a UserError naming the flag."""
    from specdec.errors import UserError

    if args.shape and (args.draft_vocab or args.draft_vocab_ab):
        raise UserError("--draft-vocab and --draft-vocab-ab need --model's weights, not --shape", "drop --shape")
    if args.core is not None:
        cores = sorted(os.sched_getaffinity(0))
        if args.core not in cores:
            raise UserError(f"--core {args.core}: not one of this process's cores {cores}", "pick one of them")
    for flag, value, least in (
        ("--prompt", args.prompt, 1),
        ("--gamma", args.gamma, 1),
        ("--threads", args.threads, 1),
        ("--min-rounds", args.min_rounds, 1),
        ("--warmup", args.warmup, 0),
        ("--copies", args.copies, 0),
    ):
        if value < least:
            raise UserError(f"{flag} {value}: must be at least {least}", f"pass {flag} {least} or more")
    if not 0 <= args.accept < args.gamma:
        raise UserError(
            f"--accept {args.accept}: must be 0 to gamma - 1 ({args.gamma - 1})",
            "a verdict accepts fewer drafts than gamma and corrects the next",
        )


def main(args: argparse.Namespace) -> int:
    """Run the benchmark (see the module docstring); returns the exit status."""
    _check(args)
    if args.core is not None:
        os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(args.threads)
    where = placement(args)
    model = load(args, where, "transformers" if args.forward_ab else None)
    clock = Clock(where.device)
    name = args.shape or args.model
    on = f"{where.device} {where.dtype}" + (f" {where.quantize}" if where.quantize != "none" else "")
    if where.device == "cuda":
        on += f" ({torch.cuda.get_device_name(0)})"
    if args.copies:
        step_ms, copy_ms = copy_share(model, args.copies, args, clock)
        basis = "wall clock" if clock.gpu else "CPU"
        print(
            f"{name} ({on}), {args.copies} sessions, prompts {args.prompt}+: batched step {step_ms:.1f} ms "
            f"({basis}), of which cache copies {copy_ms:.1f} ms ({100 * copy_ms / step_ms:.0f} %)"
        )
        return 0
    title = f"{name} ({on}), {args.threads} thread(s), gamma {args.gamma}, accept {args.accept}"
    if args.forward_ab:
        return forward_ab(model, load(args, where, "lean"), title, args, clock)
    if args.draft_vocab_ab:
        cut = load(args, where, draft_vocab=args.draft_vocab_ab)
        what = f"the whole output layer against a draft vocabulary ({args.draft_vocab_ab})"
        return side_by_side(model, cut, ("whole", "cut"), what, "draft-vocab-ab", title, args, clock)
    rows: list[Row] = []
    for n in args.sessions:
        for batched in (False, True):
            rows.append(measure(model, n, batched, args, clock))
            r = rows[-1]
            print(
                f"{n:3d} sessions {r.mode:8s} {r.tok_s:8.1f} tok/s  pace {r.pace_ms:7.1f} ms  ({r.rounds} rounds; "
                f"wall clock {r.wall_tok_s:.1f} tok/s)",
                flush=True,
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "drafter-capacity.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            ["sessions", "mode", "rounds", "tokens", "cpu_seconds", "wall_seconds", "tok_s", "pace_ms", "wall_tok_s"]
        )
        for r in rows:
            w.writerow(
                [
                    r.sessions,
                    r.mode,
                    r.rounds,
                    r.tokens,
                    f"{r.seconds:.4f}",
                    f"{r.wall_seconds:.4f}",
                    f"{r.tok_s:.2f}",
                    f"{r.pace_ms:.3f}",
                    f"{r.wall_tok_s:.2f}",
                ]
            )
    rates = [asdict(r) | {"tok_s": r.tok_s, "pace_ms": r.pace_ms, "wall_tok_s": r.wall_tok_s} for r in rows]
    settings = {k: v for k, v in vars(args).items() if k not in ("func", "command", "debug")}  # the CLI's own
    summary = {"title": title, "args": settings, "rows": rates}
    (out / "drafter-capacity.json").write_text(json.dumps(summary, indent=1))
    plotted = plot(rows, title, out / "drafter-capacity.png")
    print(f"\n{title}\n\n{table(rows)}\n\nwrote {out}/drafter-capacity.csv, .json" + (", .png" if plotted else ""))
    return 0


def forward_ab(own: torch.nn.Module, lean: torch.nn.Module, title: str, args: argparse.Namespace, clock: Clock) -> int:
    """`--forward-ab`: per session count, the batched worker with `own` (transformers' forward)
    then with `lean` (the same weights); prints and writes OUT/forward-ab.json."""
    from specdec.models.lean import LeanDecoder

    if not isinstance(lean, LeanDecoder):
        from specdec.errors import UserError

        raise UserError(f"--forward-ab: the lean forward does not apply to {args.shape or args.model}", "drop it")
    what = "transformers' forward against the lean one"
    return side_by_side(own, lean, ("transformers", "lean"), what, "forward-ab", title, args, clock)


def side_by_side(
    first: torch.nn.Module,
    second: torch.nn.Module,
    names: tuple[str, str],
    what: str,
    stem: str,
    title: str,
    args: argparse.Namespace,
    clock: Clock,
) -> int:
    """Per `--sessions` count, the batched worker with `first` then with `second` (named `names`,
    compared as `what`): prints the table and writes OUT/`stem`.json."""
    a_name, b_name = names
    lines = [
        f"| sessions | {a_name} tok/s | {b_name} tok/s | {b_name} / {a_name} | {a_name} pace ms | {b_name} pace ms |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    results = []
    for n in args.sessions:
        a, b = measure(first, n, True, args, clock), measure(second, n, True, args, clock)
        results.append({"sessions": n, a_name: asdict(a) | {"tok_s": a.tok_s}, b_name: asdict(b) | {"tok_s": b.tok_s}})
        lines.append(
            f"| {n} | {a.tok_s:.1f} | {b.tok_s:.1f} | {b.tok_s / a.tok_s:.2f}x | {a.pace_ms:.1f} | {b.pace_ms:.1f} |"
        )
        print(lines[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("func", "command", "debug")}
    (out / f"{stem}.json").write_text(json.dumps({"title": title, "args": settings, "rows": results}, indent=1))
    print(f"\n{title}: the batched worker, {what}\n\n" + "\n".join(lines))
    print(f"\nwrote {out}/{stem}.json")
    return 0


if __name__ == "__main__":  # the same as `specdec bench-drafter`
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
