"""A queue of long prompts at one drafter inside a pod's memory limit: does it keep serving?

    python -m benchmarks.drafter_memory [--models qwen-coder] [--limit-mib 6144] [--prompts 80]
        [--tokens 3000] [--modes unbounded,auto] [--generate 0] [--out drafter-memory.json]

Per mode, a drafter (`specdec serve drafter --model <the pair's draft>`, its defaults otherwise,
two torch threads) starts inside a memory cgroup of `--limit-mib` made here (root; cgroup v2 with
the memory controller, or v1), as a Kubernetes pod's container runs under its memory limit
(6,144 MiB: deploy/k8s/base/drafter.yaml). Then `--prompts` Draft streams open at once, each a
different `--tokens`-token prompt cut from real source files (the standard library's, or
`--sources`), with max_tokens 64, and never commit: the drafter prefills them in arrival order
and keeps their keys/values, as it does for a queue whose requests wait for their target. (At
once, and in order: each stream opens as soon as the drafter has answered the one before, its
first report within a step, so that arrival order is stream order in every run.) Every
`--interval` s it records how many are ready, the drafter's resident memory and its keys/values
gauges, until every prompt is ready, the drafter has died, or, once a prompt is ready, nothing
changed for `--idle` s.

With `--generate N`, each stream's request has max_tokens `--max-tokens` (4,096 by default: long
generations), and from `--start-after` s after it opens (its target's first token, after the
target's own queue and prefill) each stream commits `--commit-tokens` tokens every
`--commit-tokens` / `--rate` s until it has committed N, as its gateway commits the target's
tokens while the target decodes (at `--rate` tokens a second, whether the drafter is ready or
not), and keeps its stream open until the run ends, as a request still being served. A start
after the drafter has prefilled the queue is a drafter whose prefill is fast beside its targets'
decoding (a GPU's): every session it admitted grows at once. The
sessions' keys/values grow past what a prompt reserves (512 generated tokens). A stream is done
once it has committed its N tokens and, if its drafter drafts for it, the drafter has applied
them (`applied` in the samples: per stream, where its latest block starts past the prompt); the
run ends at the first sample after every stream is done or has failed, when nothing moved for
`--idle` s, or when the drafter has died.

Each stream accepts preemption, as the gateway's do (DraftOpen.accepts_preemption): a session
whose keys/values the drafter lets go of for an older one's growth hears so
(DraftProgress.preempted), keeps committing, and drafts again after its next `ready`. The table
counts the preemptions and the streams that came back; a stream preempted when its commits end
is done (its generation would end there), and one whose drafter ends it (RESOURCE_EXHAUSTED:
it could never fit) is "ended for memory".

With `--close`, each stream closes once it has committed its tokens, as its gateway closes the
stream when the request ends (at its last commit, whatever the drafter has applied): its
keys/values go to the drafter's prefix cache and its budget to the sessions waiting, preempted
ones first. With `--generate-min M` the streams commit different numbers of tokens, spread
evenly from M to `--generate` in a fixed shuffled order, so their requests end at different
times. Together they measure coming back: per stream, how often it was preempted, how long each
pause lasted (preempted to ready again) and how much of it the drafter reported it waiting for
memory (`waiting_for_memory`; the rest is the prefills ahead of it and its own), and whether it
drafted again once back; and how many tokens the prefix cache gave back (the drafter's
specdec:drafter_prefix_reused_tokens_total).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import json
import os
import random
import re
import statistics
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from specdec.models import PAIRS, resolve
from specdec.wire import pb, rpc
from specdec_cli.launch import Service, free_port, start_service

CGROUP = Path("/sys/fs/cgroup")
MAX_TOKENS = 64  # a queued request's, without --generate
GAMMA = 4
UNBOUNDED_MIB = 1 << 20  # a budget no pod has: the drafter before drafter.memory


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[Path | None]:
    """A new memory cgroup limited to `limit` bytes: the file a process writes its pid to to
    join it (None where this process cannot make one: not root, no memory controller). Removed
    on exit (once its processes have)."""
    name = f"specdec-{uuid.uuid4().hex[:8]}"
    group: Path | None = None
    if os.geteuid() == 0:
        if (CGROUP / "cgroup.controllers").exists():  # v2
            if "memory" in (CGROUP / "cgroup.subtree_control").read_text().split():
                group, limit_file = CGROUP / name, "memory.max"
        elif (CGROUP / "memory").is_dir():  # v1
            group, limit_file = CGROUP / "memory" / name, "memory.limit_in_bytes"
    if group is not None:
        try:
            group.mkdir()
            (group / limit_file).write_text(str(limit))
        except OSError:
            group = None
    # a process must be able to join it (a container's cgroup file system may refuse)
    if group is not None and subprocess.run([*in_cgroup(group / "cgroup.procs"), "true"]).returncode != 0:
        with contextlib.suppress(OSError):
            group.rmdir()
        group = None
    try:
        yield None if group is None else group / "cgroup.procs"
    finally:
        if group is not None:
            with contextlib.suppress(OSError):
                group.rmdir()


def in_cgroup(procs: Path) -> list[str]:
    """A command prefix (start_service's `prefix`): join the cgroup, then run the command."""
    return ["sh", "-c", f'echo $$ > "{procs}" && exec "$@"', "sh"]


def source_prompts(model: str, sources: Path, n: int, tokens: int) -> list[list[int]]:
    """`n` different prompts of `tokens` tokens each (`model`'s tokenizer): consecutive slices of
    the .py files under `sources`, in path order. SystemExit when there are too few."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve(model))
    out: list[list[int]] = []
    for path in sorted(sources.rglob("*.py")):
        ids = tok(path.read_text(errors="replace"))["input_ids"]
        out += [ids[i : i + tokens] for i in range(0, len(ids) - tokens + 1, tokens)]
        if len(out) >= n:
            return out[:n]
    raise SystemExit(f"--sources has {len(out)} slices of {tokens} tokens, --prompts needs {n}")


def resident_mib(pid: int) -> float | None:
    """The process's resident memory, MiB (None: it has exited)."""
    try:
        match = re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text())
    except OSError:
        return None
    return int(match.group(1)) / 1024 if match else None


def gauges(port: int) -> dict[str, float]:
    """The drafter's keys/values gauges, from its /metrics ({} when it does not answer)."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    except OSError:
        return {}
    out = {}
    for name in (
        "kv_cache_bytes",
        "kv_cache_budget_bytes",
        "kv_waits_total",
        "kv_overflows_total",
        "kv_preemptions_total",
        "prefix_reused_tokens_total",
    ):
        match = re.search(rf"^specdec:drafter_{name} (\S+)", text, re.M)
        if match:
            out[name] = float(match.group(1))
    return out


async def queue(
    svc: Service,
    prompts: list[list[int]],
    interval_s: float,
    idle_s: float,
    generate: int = 0,
    max_tokens: int = 4096,
    commit_tokens: int = 32,
    rate: float = 8.0,
    start_after: float = 0.0,
    generate_min: int = 0,
    close: bool = False,
) -> dict[str, Any]:
    """Open every prompt's stream at once and sample until done (module docstring)."""
    lengths = stream_lengths(len(prompts), generate_min or generate, generate)
    ready: set[int] = set()
    finished: set[int] = set()  # --generate: committed every token
    generated: dict[int, int] = {}
    reached: dict[int, int] = {}  # --generate: of a ready stream's commits, the tokens its drafter applied
    preemptions: dict[int, int] = {}  # per stream, times the drafter preempted it
    back: set[int] = set()  # streams ready again after a preemption
    preempted_at: dict[int, float] = {}  # streams preempted and not ready again yet: when (monotonic s)
    pauses: list[float] = []  # s from a preemption to the stream's next ready
    # of each pause, s until the drafter's first report that the stream no longer waits for
    # memory (the rest: the prefills ahead of it in arrival order, and its own)
    memory_waits: list[float] = []
    room_at: dict[int, float] = {}  # a paused stream's first such report (monotonic s)
    paused_to_end: list[float] = []  # s from a preemption to the stream's close, never ready again
    drafted_back: set[int] = set()  # streams that drafted a block after coming back
    closed: set[int] = set()  # --close: streams whose call ended after they closed it
    errors: dict[int, str] = {}
    samples: list[dict[str, Any]] = []
    async with grpc.aio.insecure_channel(svc.address) as channel:
        stub = rpc.DrafterServiceStub(channel)

        heard = [asyncio.Event() for _ in prompts]  # the drafter answered stream i: it has arrived

        async def one(i: int) -> None:
            if i:
                await heard[i - 1].wait()  # arrival order is stream order (module docstring)
            opened = pb.DraftOpen(
                request_id=f"q{i}",
                prompt_token_ids=prompts[i],
                gamma=GAMMA,
                sampling=pb.SamplingParams(max_tokens=max_tokens if generate else MAX_TOKENS),
                report_progress=True,
                accepts_preemption=True,  # as the gateway's streams
            )
            commits: asyncio.Queue[pb.DraftRequest | None] = asyncio.Queue()

            async def requests() -> Any:
                yield pb.DraftRequest(open=opened)
                while (commit := await commits.get()) is not None:  # None: --close, the request ended
                    yield commit

            async def generating() -> None:
                """The target's tokens, paced at `rate` (the prompt's own, over again: real text)."""
                n, length = len(prompts[i]), lengths[i]
                await asyncio.sleep(start_after)  # the target's queue and prefill, not a synchronisation
                for start in range(0, length, commit_tokens):
                    await asyncio.sleep(commit_tokens / rate)  # the target decoding, not a synchronisation
                    chunk = [prompts[i][(start + k) % n] for k in range(min(commit_tokens, length - start))]
                    commit = pb.DraftCommit(start_position=n + start, token_ids=chunk)
                    commits.put_nowait(pb.DraftRequest(commit=commit))
                    generated[i] = start + len(chunk)
                finished.add(i)
                if close:
                    commits.put_nowait(None)

            target = asyncio.create_task(generating()) if generate else None
            try:
                async for reply in stub.Draft(requests()):
                    heard[i].set()
                    if reply.HasField("ready"):
                        ready.add(i)
                        if i in preempted_at:
                            back.add(i)
                            now = time.monotonic()
                            since = preempted_at.pop(i)
                            pauses.append(now - since)
                            memory_waits.append(room_at.pop(i, now) - since)
                    elif reply.HasField("progress") and reply.progress.preempted:
                        preemptions[i] = preemptions.get(i, 0) + 1
                        preempted_at[i] = time.monotonic()
                    elif reply.HasField("progress") and i in preempted_at and not reply.progress.waiting_for_memory:
                        room_at.setdefault(i, time.monotonic())
                    elif reply.HasField("block"):  # drafts after what the drafter has applied of the commits
                        reached[i] = max(reached.get(i, 0), reply.block.start_position - len(prompts[i]))
                        if i in back:
                            drafted_back.add(i)
                if i in preempted_at:  # closed while paused: its request decoded plainly to its end
                    paused_to_end.append(time.monotonic() - preempted_at.pop(i))
                    room_at.pop(i, None)
                closed.add(i)
            except grpc.aio.AioRpcError as err:
                errors[i] = f"{err.code().name}: {err.details()}"
            finally:
                heard[i].set()  # failed or ended before a reply: the next one opens anyway
                if target is not None:
                    target.cancel()

        tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
        t0 = last_change = time.monotonic()
        state: tuple[int, int, int] = (-1, -1, -1)
        try:
            while True:
                await asyncio.sleep(interval_s)
                now = time.monotonic()
                rss = resident_mib(svc.proc.pid)
                sample = {"s": round(now - t0, 1), "ready": len(ready), "errors": len(errors), "rss_mib": rss}
                if generate:
                    sample.update(finished=len(finished), generated=sum(generated.values()))
                    sample.update(applied=sum(reached.values()))
                samples.append(sample | gauges(svc.metrics_port))
                print(json.dumps(samples[-1]), flush=True)
                progress = (len(ready), len(errors), sum(generated.values()) + sum(reached.values()) + len(back))
                if progress != state:
                    state, last_change = progress, now
                if close:  # closed by the stream once committed (its request ended), or failed
                    done = len(closed) + len(errors)
                elif generate:  # committed, and applied by its drafter if it drafts for it at all
                    drafts = ready - preempted_at.keys()
                    done = sum(1 for i in finished if i not in drafts or reached.get(i, 0) >= lengths[i]) + len(errors)
                else:
                    done = len(ready) + len(errors)
                # idle only once a prompt is ready (or failed): a slow first prefill is not idle
                if rss is None or done == len(prompts) or (done and now - last_change > idle_s):
                    break
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "samples": samples,
        "ready": len(ready),
        "finished": len(finished),
        "generated": sum(generated.values()),
        "applied": sum(reached.values()),
        "errors": sorted(set(errors.values()))[:3],
        # ended by the drafter's budget (drafter.memory: its gateway decodes the rest plainly)
        "ended_for_memory": sum(1 for e in errors.values() if e.startswith("RESOURCE_EXHAUSTED")),
        "failed": sum(1 for e in errors.values() if not e.startswith("RESOURCE_EXHAUSTED")),
        "preemptions": sum(preemptions.values()),
        "preempted_streams": len(preemptions),
        "back_after_preemption": len(back),
        "most_preemptions_per_stream": max(preemptions.values(), default=0),
        "drafted_after_coming_back": len(drafted_back),
        "pauses_s": [round(p, 1) for p in pauses],
        "pauses_waiting_for_memory_s": [round(p, 1) for p in memory_waits],
        "paused_to_end_s": [round(p, 1) for p in paused_to_end],
        "closed": len(closed),
    }


def stream_lengths(n: int, low: int, high: int) -> list[int]:
    """Tokens each of `n` streams commits: spread evenly from `low` to `high`, in an order shuffled
    with a fixed seed (the same for every mode and run), so that requests end at different times
    and not in arrival order."""
    spread = [high if n == 1 else round(low + (high - low) * k / (n - 1)) for k in range(n)]
    random.Random(0).shuffle(spread)
    return spread


def run_mode(mode: str, args: argparse.Namespace, prompts: list[list[int]], logs: Path) -> dict[str, Any]:
    extra = [*args.drafter_args.split(), *(["--kv-cache-mib", str(UNBOUNDED_MIB)] if mode == "unbounded" else [])]
    with memory_cgroup(args.limit_mib << 20) as procs:
        if procs is None:
            raise SystemExit("needs root and a memory cgroup it can make (cgroup v2 with the memory controller, or v1)")
        svc = start_service(
            "drafter",
            free_port(),
            ["--model", PAIRS[args.models].draft, "--threads", str(args.threads), *extra],
            logs / mode,
            metrics_port=free_port(),
            prefix=in_cgroup(procs),
        )
        try:
            svc.wait_ready(600)
            loaded = resident_mib(svc.proc.pid)
            knobs = ("generate", "max_tokens", "commit_tokens", "rate", "start_after", "generate_min", "close")
            pace = {k: getattr(args, k) for k in knobs}
            result = asyncio.run(queue(svc, prompts, args.interval, args.idle, **pace))
            result["alive"] = svc.proc.poll() is None
        finally:
            svc.stop()
    rss = [s["rss_mib"] for s in result["samples"] if s["rss_mib"] is not None]
    held = [s.get("kv_cache_bytes", 0.0) / 2**20 for s in result["samples"]]
    last: dict[str, Any] = next((s for s in reversed(result["samples"]) if "kv_cache_budget_bytes" in s), {})
    result.update(
        mode=mode,
        loaded_rss_mib=loaded,
        peak_rss_mib=max(rss, default=None),
        peak_kv_mib=max(held, default=0.0),
        budget_mib=last.get("kv_cache_budget_bytes", 0.0) / 2**20,
        waits=last.get("kv_waits_total", 0.0),
    )
    return result


def table(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    tokens = f"{args.generate_min} to {args.generate}" if args.generate_min else f"{args.generate}"
    ending = ", then closing" if args.close else ""
    growing = f", each committing {tokens} tokens from {args.start_after:g} s on{ending}" if args.generate else ""
    lines = [
        f"{args.prompts} prompts of {args.tokens} tokens at once{growing}, one drafter ({args.models}) in a "
        f"{args.limit_mib} MiB memory cgroup",
        "",
        "| mode | budget MiB | prompts ready | streams done | streams ended for memory | failed streams "
        "| preemptions (streams, most per stream, back, drafted again) | pause s (median, max) "
        "| peak resident MiB | peak keys/values MiB | prompts that waited | drafter alive |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        budget = "none" if r["mode"] == "unbounded" else f"{r['budget_mib']:.0f}"
        done = r["finished"] if args.generate else r["ready"]
        lines.append(
            f"| {r['mode']} | {budget} | {r['ready']} | {done} | {r['ended_for_memory']} | {r['failed']} "
            f"| {r['preemptions']} ({r['preempted_streams']}, {r['most_preemptions_per_stream']}, "
            f"{r['back_after_preemption']}, {r['drafted_after_coming_back']}) | {pauses(r['pauses_s'])} "
            f"| {r['peak_rss_mib']:.0f} "
            f"| {r['peak_kv_mib']:.0f} | {r['waits']:.0f} | {'yes' if r['alive'] else 'no'} |"
        )
    return "\n".join(lines)


def pauses(seconds: list[float]) -> str:
    """A table cell: the median and the longest pause, or '–' when none ended."""
    return f"{statistics.median(seconds):.0f}, {max(seconds):.0f}" if seconds else "–"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.drafter_memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen-coder", choices=sorted(PAIRS))
    ap.add_argument("--limit-mib", type=int, default=6144, help="the cgroup's memory limit (the manifest's: 6144)")
    ap.add_argument("--prompts", type=int, default=80)
    ap.add_argument("--tokens", type=int, default=3000, help="tokens per prompt")
    ap.add_argument("--modes", default="unbounded,auto")
    ap.add_argument("--generate", type=int, default=0, help="tokens each stream commits (0: none, a queue)")
    ap.add_argument("--max-tokens", type=int, default=4096, help="with --generate: each request's max_tokens")
    ap.add_argument("--commit-tokens", type=int, default=32, help="with --generate: tokens per commit")
    ap.add_argument("--rate", type=float, default=8.0, help="with --generate: tokens a second per stream")
    ap.add_argument("--start-after", type=float, default=0.0, help="with --generate: seconds before the first commit")
    ap.add_argument(
        "--generate-min",
        type=int,
        default=0,
        help="with --generate: the fewest tokens a stream commits (streams spread from it to --generate; 0: all equal)",
    )
    ap.add_argument("--close", action="store_true", help="with --generate: a stream closes once committed (it ended)")
    ap.add_argument("--threads", type=int, default=2, help="the drafter's torch threads")
    ap.add_argument("--drafter-args", default="", help="more drafter flags, one string (e.g. '--kv-cache-mib 1024')")
    ap.add_argument("--sources", type=Path, default=Path(inspect.getfile(json)).parent.parent)
    ap.add_argument("--interval", type=float, default=10.0, help="seconds between samples")
    ap.add_argument("--idle", type=float, default=120.0, help="stop when idle this long, once a prompt is ready")
    ap.add_argument("--logs", type=Path, default=Path("drafter-memory-logs"))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    prompts = source_prompts(PAIRS[args.models].draft, args.sources, args.prompts, args.tokens)
    results = [run_mode(mode, args, prompts, args.logs) for mode in args.modes.split(",")]
    print(table(results, args))
    if args.out:
        meta = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        report = {"command": "python -m benchmarks.drafter_memory", "args": meta, "results": results}
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
