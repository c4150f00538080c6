"""`specdec bench-link`: specdec's speedup when its services talk across a network link with delay.

The drafter, the verifier and the gateway run on separate hosts: one Linux network namespace
each ("verifier", "drafter", "gateway"), joined by veth pairs to a bridge (in a namespace of
its own) on a private 10.x /24 that the bench makes and deletes at the end (also on Ctrl-C or
an error). Nothing in the root namespace is touched. The gateway reaches the drafter and the
verifier through delay proxies (benchmarks/delay_proxy.py, in the gateway's namespace) that
hold every chunk for a one-way delay d in each direction, so each of the two links has a
round-trip time RTT = 2d. (A userspace proxy, because this kernel has no netem.) The
benchmark client runs in the gateway's namespace.

Cores (as `specdec bench`): the verifier's engine gets the first core; the drafter, the
gateway, the proxies, the client and the verifier's gRPC threads get the last one.

Procedure:
    1. target-only: vLLM, the target alone at batch 1 on the first core (`specdec bench`'s
       baseline, run the same way): the speedups' denominator and the exact tokens.
    2. for each variant (`--variants`; a variant is a name and the extra flags its drafter is
       started with), specdec at d = 0: through the same namespaces and proxies. The first
       variant's zero-delay run measures the verify step: the verifier's engine time per
       target step (`verify_step_ms`, as in `specdec bench`).
    3. for each RTT fraction f (`--rtt-fractions`), d = f x verify step / 2 (RTT = f x verify
       step), and specdec again, every variant. The services stay up; the gateway and the
       proxies restart at each d, the drafter at each variant.
A variant whose drafter does not start (a flag it does not know, say) is reported as failed,
and the bench goes on with the others.

Why fractions: a verify step on this CPU takes ~400-500 ms, on a GPU ~20 ms; what the link
costs depends on RTT relative to the step, so an RTT of 10% of the step here stands for a
2 ms RTT in front of a 20 ms GPU step.

Terms (one row of the table: one variant at one d; every request batch 1, greedy, ignore_eos):
    RTT ms          2d: the round-trip time each link (gateway-drafter, gateway-verifier) adds
    RTT / verify    RTT as a percentage of the reference verify step (the first variant's at d = 0)
    decode tok/s    generated tokens after the first / time after the first token (`specdec bench`)
    speedup         decode tok/s over target-only's
    of 0-delay      speedup / the same variant's speedup at d = 0 (the goals below)
    exact           fraction of requests whose tokens equal target-only's
    branch hits     steps whose drafts came from a pre-drafted branch / steps after a verdict that
                    broke the drafts' chain (`specdec bench`'s branch hit rate)
    verify ms       this row's verify step (engine ms per target step)
    round ms        decode time per target step: the verify step plus what the link and the
                    rest of the round add
Goals: RTT = 10% of the verify step keeps >= 90% of the zero-delay speedup; 25% keeps >= 75%.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.netns import Network, unavailable_reason
from specdec.errors import exit_status
from specdec.models import PAIRS

if TYPE_CHECKING:
    from specdec_cli.launch import Service

QUICK = {"models": "tiny", "prompts": 2, "max_tokens": 16, "rtt_fractions": "0,0.25"}
DEFAULT_FRACTIONS = "0.1,0.25,0.5"
VARIANTS: dict[str, list[str]] = {"branches": [], "no-branches": ["--branches", "0"]}
GOALS = {0.10: 0.90, 0.25: 0.75}  # RTT as a fraction of the verify step -> least fraction of the 0-delay speedup
DTYPE = "float32"
HOSTS = ("verifier", "drafter", "gateway")
PORTS = {"gateway": 50051, "drafter": 50052, "verifier": 50053}  # each on its own host's address
PROXY_PORTS = {"drafter": 60052, "verifier": 60053}  # the delay proxies, on the gateway host's loopback
READY_TIMEOUT_S = 900.0


# ---- hosts: network namespaces (benchmarks/netns.py) -------------------------------------------
NAMESPACE_PREFIX = "sdl-"  # every namespace this bench makes is named sdl-<role>-<pid>


def Hosts(hosts: tuple[str, ...] = HOSTS) -> Network:  # noqa: N802 (a constructor)
    """The bench's hosts: one namespace each, sdl-<role>-<pid>, on 10.232.N.0/24."""
    return Network(hosts, prefix=NAMESPACE_PREFIX, octet=232)


# ---- the pure parts: delays, rows, goals ---------------------------------------------------------
def parse_fractions(text: str) -> list[float]:
    """`--rtt-fractions`: the sorted distinct fractions, 0 always first."""
    values = {0.0}
    for item in text.split(","):
        if item.strip():
            f = float(item)
            if not math.isfinite(f) or f < 0:
                raise ValueError(f"an RTT fraction must be >= 0, not {item!r}")
            values.add(f)
    return sorted(values)


def parse_variants(text: str) -> dict[str, list[str]]:
    """`--variants`: a comma list of NAME (one of VARIANTS) or NAME=DRAFTER FLAGS (shell words)."""
    out: dict[str, list[str]] = {}
    for item in text.split(","):
        name, sep, flags = item.strip().partition("=")
        name = name.strip()
        if not name:
            continue
        if sep:
            out[name] = shlex.split(flags)
        elif name in VARIANTS:
            out[name] = list(VARIANTS[name])
        else:
            raise ValueError(f"unknown variant {name!r}: use one of {', '.join(VARIANTS)} or NAME=DRAFTER FLAGS")
    if not out:
        raise ValueError("no variants")
    return out


def one_way_delay_ms(fraction: float, verify_step_ms: float) -> float:
    """d for an RTT of `fraction` x the verify step: RTT = 2d."""
    return fraction * verify_step_ms / 2


def relate_link(rows: list[dict[str, Any]], verify_ref_ms: float | None) -> None:
    """Fill each specdec row's rtt_pct (RTT over the reference verify step, %) and of_zero (its
    speedup over the same variant's at d = 0). `speedup` must be filled (bench.relate)."""
    zero = {r["variant"]: r for r in rows if r.get("variant") and r["delay_ms"] == 0}
    for r in rows:
        if not r.get("variant"):
            continue
        r["rtt_pct"] = 100 * r["rtt_ms"] / verify_ref_ms if verify_ref_ms else None
        z = zero.get(r["variant"])
        r["of_zero"] = r["speedup"] / z["speedup"] if z and z.get("speedup") and r.get("speedup") else None


def link_goals(rows: list[dict[str, Any]], variants: list[str]) -> list[dict[str, Any]]:
    """One entry per (variant, goal): the row at that RTT fraction's of_zero against the target
    (value and met None where the run has no such row)."""
    out = []
    for variant in variants:
        for fraction, target in GOALS.items():
            row = next(
                (
                    r
                    for r in rows
                    if r.get("variant") == variant
                    and r.get("rtt_fraction") is not None
                    and math.isclose(r["rtt_fraction"], fraction)
                ),
                None,
            )
            value = row.get("of_zero") if row else None
            out.append(
                {
                    "variant": variant,
                    "rtt_fraction": fraction,
                    "target": target,
                    "value": value,
                    "met": None if value is None else value >= target,
                }
            )
    return out


COLUMNS = [
    ("rtt_ms", "RTT ms", "{:.1f}"),
    ("rtt_pct", "RTT / verify", "{:.0f}%"),
    ("variant", "variant", "{}"),
    ("decode_tok_s", "decode tok/s", "{:.2f}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("of_zero", "of 0-delay", "{:.0%}"),
    ("exact", "exact", "{:.0%}"),
    ("branch_hit_rate", "branch hits", "{:.0%}"),
    ("verify_step_ms", "verify ms", "{:.0f}"),
    ("round_ms", "round ms", "{:.0f}"),
    ("fallbacks", "fallbacks", "{}"),
]


def table(rows: list[dict[str, Any]], failed: dict[str, str] | None = None) -> str:
    """A Markdown table of the rows (target-only first, as variant "target-only"), then one line
    per failed variant."""
    lines = ["| " + " | ".join(h for _, h, _ in COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for r in rows:
        cells = [("–" if r.get(k) is None else fmt.format(r[k])) for k, _, fmt in COLUMNS]
        if r.get("system") == "target-only":
            cells[2] = "target-only (vLLM)"
        lines.append("| " + " | ".join(cells) + " |")
    for name, reason in (failed or {}).items():
        lines.append(f"\nvariant {name} failed: {reason}")
    return "\n".join(lines)


def goal_lines(goals: list[dict[str, Any]], failed: dict[str, str] | None = None) -> list[str]:
    """The goals as text, one line each."""
    out = []
    for g in goals:
        missing = "n/a (the variant failed)" if g["variant"] in (failed or {}) else "n/a (not run)"
        value = missing if g["value"] is None else f"{g['value']:.2f}"
        verdict = "" if g["met"] is None else " met" if g["met"] else " NOT met"
        out.append(
            f"goal RTT {g['rtt_fraction']:.0%} of the verify step, {g['variant']}: {value} of the zero-delay "
            f"speedup (>= {g['target']:.2f}){verdict}"
        )
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Speedup, and its fraction of the zero-delay speedup, against RTT as % of the verify step:
    one line per variant, the goals as markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.6))
    variants = list(dict.fromkeys(r["variant"] for r in rows if r.get("variant")))
    for i, v in enumerate(variants):
        color = f"C{i}"
        pts = sorted(
            (r["rtt_pct"], r["speedup"], r["of_zero"])
            for r in rows
            if r.get("variant") == v and r.get("rtt_pct") is not None and r.get("speedup")
        )
        if not pts:
            continue
        x, y, frac = zip(*pts)
        ax.plot(x, y, "o-", color=color, label=v)
        bx.plot(
            [a for a, f in zip(x, frac) if f is not None],
            [f for f in frac if f is not None],
            "o-",
            color=color,
            label=v,
        )
        zero = next((s for p, s, _ in pts if p == 0), None)
        if zero:
            for f, target in GOALS.items():
                ax.plot(
                    [100 * f],
                    [target * zero],
                    "v",
                    color=color,
                    mfc="none",
                    ms=10,
                    label=f"goals ({v})" if f == min(GOALS) else None,
                )
    for f, target in GOALS.items():
        bx.plot([100 * f], [target], "v", color="k", mfc="none", ms=10, label="goals" if f == min(GOALS) else None)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(
        xlabel="RTT, % of the verify step",
        ylabel="decode speedup over vLLM target-only",
        title="specdec across a delayed link (batch 1)",
    )
    bx.set(
        xlabel="RTT, % of the verify step",
        ylabel="fraction of the zero-delay speedup",
        ylim=(0, 1.1),
        title="what the link keeps",
    )
    for a in (ax, bx):
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- the services on their hosts ------------------------------------------------------------------
class ServiceFailed(RuntimeError):
    """A service process exited before it was ready (its log's error line says why)."""


def _error_line(log: Path | None) -> str:
    """The most telling line of a log: the last one that says error, else the last line."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()] if log else []
    except OSError:
        return ""
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (errors or lines or [""])[-1][:300]


def _child_env() -> dict[str, str]:
    # `ip netns exec` keeps the environment; the repo's packages must import from any folder
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "OMP_NUM_THREADS": "1"}


def _pin(cpus: set[int]) -> Callable[[], None]:
    return lambda: os.sched_setaffinity(0, cpus)


class Link:
    """The three services on their hosts and the two delay proxies; `close()` stops every
    process started here and deletes the hosts. Use as a context manager."""

    def __init__(self, pair: str, logs: Path, verifier_args: tuple[str, ...] = ()) -> None:
        cpus = sorted(os.sched_getaffinity(0))
        self.engine_cpus, self.side_cpus = {cpus[0]}, {cpus[-1]}
        self.pair, self.logs, self.verifier_args = PAIRS[pair], logs, list(verifier_args)
        self.hosts = Hosts()
        self.verifier: Service | None = None
        self.drafter: Service | None = None
        self.gateway: Service | None = None
        self.proxies: list[subprocess.Popen[str]] = []

    def __enter__(self) -> Link:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def address(self, kind: str) -> str:
        """Where `kind` listens (its host's address)."""
        return f"{self.hosts.address(kind)}:{PORTS[kind]}"

    def _start(self, kind: str, args: list[str], cpus: set[int], log_dir: Path) -> Service:
        from specdec_cli.launch import start_service

        service = start_service(
            kind,
            PORTS[kind],
            ["--host", self.hosts.address(kind), *args],
            log_dir,
            cpus,
            env={"PYTHONPATH": _child_env()["PYTHONPATH"]},
            metrics_port=0,
            prefix=self.hosts.prefix(kind),
        )
        service.host = self.hosts.address(kind)  # its address on its host (the default is loopback)
        return service

    def wait_ready(self, services: list[Service], timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until each service's health check (from the gateway's host) says SERVING; ServiceFailed
        when one exits first, TimeoutError past timeout_s."""
        job = {"addresses": [s.address for s in services], "timeout_s": timeout_s}
        probe = subprocess.Popen(
            [*self.hosts.prefix("gateway"), sys.executable, "-m", "benchmarks.link", "ready", json.dumps(job)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=_child_env(),
            preexec_fn=_pin(self.side_cpus),
        )
        try:
            while probe.poll() is None:
                for s in services:
                    if s.proc.poll() is not None:
                        raise ServiceFailed(
                            f"{s.kind} exited with {exit_status(s.proc.returncode)}: {_error_line(s.log_path)} (log: {s.log_path})"
                        )
                time.sleep(0.2)
            out = probe.stdout.read() if probe.stdout else ""
            if probe.returncode != 0:
                raise TimeoutError(f"not ready after {timeout_s:g} s: {out.strip()} (logs in {self.logs})")
        finally:
            if probe.poll() is None:
                probe.kill()
                probe.wait()
            if probe.stdout:
                probe.stdout.close()

    def start_verifier(self, target: str) -> None:
        """The verifier on its host: its engine on the first core, its gRPC threads on the last."""
        self.verifier = self._start(
            "verifier",
            [
                "--model",
                target,
                "--threads",
                str(len(self.engine_cpus)),
                "--io-cpus",
                ",".join(map(str, sorted(self.side_cpus))),
                "--dtype",
                DTYPE,
                "--no-prefix-caching",
                *self.verifier_args,
            ],
            self.engine_cpus,
            self.logs,
        )
        self.wait_ready([self.verifier])

    def start_drafter(self, draft: str, extra: list[str], log_dir: Path) -> None:
        """(Re)start the drafter with a variant's extra flags; ServiceFailed if it does not start."""
        self.stop_drafter()
        self.drafter = self._start(
            "drafter",
            # the prefix cache off, as the verifier's: a repeated prompt costs the same each time
            [
                "--model",
                draft,
                "--threads",
                "1",
                "--dtype",
                DTYPE,
                "--quantize",
                "int8",
                "--prefix-cache-mib",
                "0",
                *extra,
            ],
            self.side_cpus,
            log_dir,
        )
        self.wait_ready([self.drafter])

    def start_gateway(self, delay_ms: float, log_dir: Path) -> str:
        """(Re)start both delay proxies at one-way delay `delay_ms` and the gateway behind them;
        the gateway's address."""
        self.stop_gateway()
        log_dir.mkdir(parents=True, exist_ok=True)
        for kind in ("drafter", "verifier"):
            with open(log_dir / f"proxy-{kind}.log", "ab") as err:
                proc = subprocess.Popen(
                    [
                        *self.hosts.prefix("gateway"),
                        sys.executable,
                        "-m",
                        "benchmarks.delay_proxy",
                        "--listen",
                        f"127.0.0.1:{PROXY_PORTS[kind]}",
                        "--upstream",
                        self.address(kind),
                        "--delay-ms",
                        repr(delay_ms),
                    ],
                    stdout=subprocess.PIPE,
                    stderr=err,
                    text=True,
                    env=_child_env(),
                    preexec_fn=_pin(self.side_cpus),
                )
            self.proxies.append(proc)
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"the delay proxy to the {kind} did not start; log: {log_dir / f'proxy-{kind}.log'}")
        self.gateway = self._start(
            "gateway",
            [
                "--tokenizer",
                self.pair.tokenizer,
                "--drafter-address",
                f"127.0.0.1:{PROXY_PORTS['drafter']}",
                "--verifier-address",
                f"127.0.0.1:{PROXY_PORTS['verifier']}",
                "--rest-port",
                "0",
            ],
            self.side_cpus,
            log_dir,
        )
        self.wait_ready([self.gateway])
        return self.gateway.address

    def measure(self, job: dict[str, Any], on_request: Callable[[], None], log: Path) -> dict[str, Any]:
        """One workload (`measure` below) by a client on the gateway's host; its result."""
        from benchmarks.bench import read_events

        with open(log, "ab") as err:
            proc = subprocess.Popen(
                [*self.hosts.prefix("gateway"), sys.executable, "-m", "benchmarks.link", "measure", json.dumps(job)],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=_child_env(),
                preexec_fn=_pin(self.side_cpus),
            )
            assert proc.stdout is not None
            results = read_events(proc.stdout, on_request)
            result = results[-1] if results else None
            proc.stdout.close()
            if proc.wait() != 0 or result is None:
                raise RuntimeError(f"the client failed (exit {proc.returncode}); see {log} and the service logs")
        return result

    def alive(self) -> str | None:
        """None while the verifier runs; else what happened to it."""
        if self.verifier is not None and self.verifier.proc.poll() is not None:
            return f"the verifier exited with {exit_status(self.verifier.proc.returncode)}: {_error_line(self.verifier.log_path)}"
        return None

    def stop_gateway(self) -> None:
        """Stop the gateway and the proxies."""
        if self.gateway is not None:
            self.gateway.stop()
            self.gateway = None
        for proc in self.proxies:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            if proc.stdout:
                proc.stdout.close()
        self.proxies.clear()

    def stop_drafter(self) -> None:
        """Stop the gateway, the proxies and the drafter."""
        self.stop_gateway()
        if self.drafter is not None:
            self.drafter.stop()
            self.drafter = None

    def close(self) -> None:
        """Stop everything started here, then delete the hosts."""
        try:
            self.stop_drafter()
            if self.verifier is not None:
                self.verifier.stop()
                self.verifier = None
        finally:
            self.hosts.close()


# ---- the command -----------------------------------------------------------------------------
HELP = "specdec's speedup across a delayed network link (namespaces, delay proxies), with and without branches"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "bench-link", help=HELP, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", choices=sorted(PAIRS), default="qwen-coder")
    p.add_argument("--prompts", type=int, default=3, help="prompts from the built-in code set, each run at batch 1")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per request (ignore_eos)")
    p.add_argument("--gamma", type=int, default=4, help="draft tokens per target step")
    p.add_argument(
        "--rtt-fractions",
        default=DEFAULT_FRACTIONS,
        help=f"RTTs as fractions of the verify step (0 is always run); default {DEFAULT_FRACTIONS}",
    )
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="comma list of NAME or NAME=DRAFTER FLAGS; known: "
        + "; ".join(f"{k} ({shlex.join(v) or 'no flags'})" for k, v in VARIANTS.items()),
    )
    p.add_argument("--out", default="bench-link-results", help="folder for link.json, link.png, logs/")
    p.add_argument(
        "--quick", action="store_true", help="tiny pair, 2 prompts x 16 tokens, RTT fractions 0,0.25: a smoke run (CI)"
    )
    p.set_defaults(func=main)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM cleans up as Ctrl-C does: processes stopped, hosts deleted


def main(args: argparse.Namespace) -> int:
    from specdec.errors import UserError

    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    try:
        fractions = parse_fractions(args.rtt_fractions)
        variants = parse_variants(args.variants)
    except ValueError as err:
        raise UserError(str(err), "see `specdec bench-link --help`") from err
    reason = unavailable_reason()
    if reason is not None:
        raise UserError(
            f"bench-link cannot make network namespaces ({reason})", "run it as root on Linux with iproute2 installed"
        )
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return _run(args, fractions, variants)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace, fractions: list[float], variants: dict[str, list[str]]) -> int:
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from benchmarks.bench import (
        QUICK_VERIFIER_ARGS,
        _cpu_model,
        _run_child,
        _versions,
        relate,
        summarise,
        workload_prompts,
    )
    from specdec.models import resolve

    t_start = time.time()
    out = Path(args.out).resolve()
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    pair = PAIRS[args.models]
    target, draft = str(resolve(pair.target)), str(resolve(pair.draft))
    tokenizer = AutoTokenizer.from_pretrained(str(resolve(pair.tokenizer)))
    ids, texts = workload_prompts("code", tokenizer, args.prompts + 1)
    prompts = [tokenizer(t)["input_ids"] for t in texts[: args.prompts]]
    warmup = tokenizer(texts[-1])["input_ids"]  # the code prompt after the measured ones
    cpus = sorted(os.sched_getaffinity(0))
    points = len(variants) * len(fractions)
    print(
        f"specdec bench-link: {args.models}, {len(prompts)} prompts x {args.max_tokens} tokens, gamma {args.gamma}, "
        f"RTT fractions {fractions}, variants {list(variants)}; engine core {cpus[0]}, other core {cpus[-1]}",
        file=sys.stderr,
    )
    bar = tqdm(total=len(prompts) * (1 + points), unit="req", file=sys.stderr, dynamic_ncols=True)
    rows: list[dict[str, Any]] = []
    failed: dict[str, str] = {}
    verify_ref: float | None = None
    try:
        bar.set_description("target-only")
        job = {
            "kind": "vllm",
            "target": target,
            "prompts": prompts,
            "max_tokens": args.max_tokens,
            "dtype": DTYPE,
            "warmup_prompt": warmup,
            "concurrency": [1],
            "speculative_config": None,
        }
        base_run = {"system": "target-only", "kind": "vllm", "gamma": 0, "cores": [cpus[0]], "workload": "code"}
        base = summarise(base_run, _run_child(job, [cpus[0]], lambda: bar.update(1), logs / "baseline.log")[0])
        rows.append(base)
        spec_run = {"system": "specdec", "kind": "specdec", "gamma": args.gamma, "cores": [cpus[0]], "workload": "code"}
        bar.set_description("starting the hosts and the verifier")
        with Link(args.models, logs, QUICK_VERIFIER_ARGS if args.quick else ()) as link:
            link.start_verifier(target)
            for name, extra in variants.items():
                vlogs = logs / name
                try:
                    bar.set_description(f"{name}: starting the drafter")
                    link.start_drafter(draft, extra, vlogs)
                    for f in fractions:
                        if not f:
                            d = 0.0
                        elif verify_ref is None:
                            raise RuntimeError("no verify step measured at zero delay: cannot set the delays")
                        else:
                            d = one_way_delay_ms(f, verify_ref)
                        bar.set_description(f"{name}: RTT {2 * d:.1f} ms")
                        address = link.start_gateway(d, vlogs / f"rtt-{2 * d:.1f}ms")
                        mjob = {
                            "gateway": address,
                            "prompts": prompts,
                            "warmup": warmup,
                            "max_tokens": args.max_tokens,
                            "gamma": args.gamma,
                        }
                        result = link.measure(mjob, lambda: bar.update(1), vlogs / "client.log")
                        row = summarise(spec_run, result)
                        row.update(variant=name, drafter_flags=extra, rtt_fraction=f, delay_ms=d, rtt_ms=2 * d)
                        row.setdefault("branch_hit_rate", None)  # as `specdec bench` reports it
                        rows.append(row)
                        if not f and verify_ref is None and row["verify_step_ms"]:
                            verify_ref = row["verify_step_ms"]
                except (ServiceFailed, RuntimeError, TimeoutError, OSError) as err:
                    failed[name] = " ".join(str(err).split())
                    bar.write(f"variant {name} failed: {failed[name]}", file=sys.stderr)
                    gone = link.alive()
                    if gone:
                        raise RuntimeError(gone) from err
                finally:
                    link.stop_drafter()
    finally:
        bar.close()
    relate(rows, {"code": prompts})
    relate_link(rows, verify_ref)
    goals = link_goals(rows, list(variants))
    for r in rows:
        r.pop("_tokens", None)
    report: dict[str, Any] = {
        "meta": {
            "command": "specdec bench-link " + " ".join(sys.argv[2:])
            if sys.argv[1:2] == ["bench-link"]
            else " ".join(sys.argv),
            "models": {"pair": args.models, "target": pair.target, "draft": pair.draft, "dtype": DTYPE},
            "prompts": ids[: args.prompts],
            "prompt_tokens": [len(p) for p in prompts],
            "max_tokens": args.max_tokens,
            "gamma": args.gamma,
            "rtt_fractions": fractions,
            "variants": variants,
            "verify_step_ms": verify_ref,
            "delays_ms": {str(f): one_way_delay_ms(f, verify_ref) if verify_ref else None for f in fractions},
            "topology": {
                "hosts": list(HOSTS),
                "proxies": "on the gateway's host, one per link (gateway-drafter, "
                "gateway-verifier), one-way delay d each direction: RTT 2d",
            },
            "cores": {"engine": cpus[0], "other": cpus[-1], "all": cpus},
            "cpu": _cpu_model(),
            "versions": _versions(),
            "started": dt.datetime.fromtimestamp(t_start, dt.UTC).isoformat(),
            "duration_s": round(time.time() - t_start, 1),
        },
        "rows": rows,
        "failed": failed,
        "goals": goals,
    }
    (out / "link.json").write_text(json.dumps(report, indent=2))
    plot(rows, out / "link.png")
    print(table(rows, failed))
    print()
    ref = f"{verify_ref:.0f} ms" if verify_ref else "not measured"
    print(f"verify step (reference, zero delay): {ref}")
    for line in goal_lines(goals, failed):
        print(line)
    print(
        f"\n{len(rows)} rows in {report['meta']['duration_s']:.0f} s; wrote {out / 'link.json'} and {out / 'link.png'}"
    )
    return 0


# ---- the helpers that run on the gateway's host ------------------------------------------------------
def _ready(job: dict[str, Any]) -> int:
    """Wait until every address's gRPC health check says SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + float(job["timeout_s"])
    for address in job["addresses"]:
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                try:
                    answer: health_pb2.HealthCheckResponse = stub.Check(  # type: ignore[attr-defined]  # types-grpcio-health-checking's HealthStub lacks Check (the generated __init__ sets it)
                        health_pb2.HealthCheckRequest(), timeout=2
                    )
                    if answer.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    print(f"{address} not ready", flush=True)
                    return 1
                time.sleep(0.2)
    print("ready", flush=True)
    return 0


def _measure(job: dict[str, Any]) -> int:
    """A warm-up request, then the prompts one after another (batch 1) through the gateway; JSON
    lines on stdout as `benchmarks.systems` prints them."""
    from benchmarks.systems import _emit_stdout, run_specdec

    run_specdec(job["gateway"], [job["warmup"]], 8, job["gamma"], 1)
    _emit_stdout(
        run_specdec(
            job["gateway"],
            job["prompts"],
            job["max_tokens"],
            job["gamma"],
            1,
            lambda: _emit_stdout({"event": "request"}),
        )
    )
    return 0


def _helper(argv: list[str]) -> int:
    """`python -m benchmarks.link ready|measure JOB_JSON` (what Link runs on the gateway's host)."""
    ops = {"ready": _ready, "measure": _measure}
    if len(argv) != 2 or argv[0] not in ops:
        raise SystemExit(f"usage: python -m benchmarks.link {{{'|'.join(ops)}}} JOB_JSON")
    return ops[argv[0]](json.loads(argv[1]))


if __name__ == "__main__":
    sys.exit(_helper(sys.argv[1:]))
