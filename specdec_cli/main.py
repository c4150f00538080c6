"""The `specdec` command line.

    specdec up [--models qwen-coder|tiny]         start gateway, drafter and verifier locally
    specdec serve drafter|verifier|gateway ...    start one service (multi-host deployments)
    specdec generate "text" [--json] ...          a completion and its speculation stats
    specdec demo [--models qwen-coder|tiny]       up + one generation with stats + down
    specdec models list [--json] | pull PAIR [--role R] [--tokenizer] | path PAIR[/ROLE]   the model registry
    specdec eval-draft [--target T --draft D]     draft agreement, step costs, predicted speedups
    specdec traces FILE... [--request ID]         slowest rounds, spikes by stage, one request's timeline
    specdec bench [--quick]                       specdec vs vLLM and transformers, side by side
    specdec bench-link [--quick]                  specdec's speedup across a delayed network link
    specdec bench-drafter [--sessions 1,2,...]    a drafter's draft tokens/s and pace against sessions
    specdec bench-turns [--turns N]               a conversation's turns with the prefix caches on
    specdec draft-vocab PATH... [--size N]        a draft vocabulary from a sample of your traffic

An error you can fix prints one line, `specdec: error: <what is wrong>; <what to do>`, and
exits with status 2 (a port already taken: 98; an unexpected error: 1; Ctrl-C: 130). `specdec --debug COMMAND`
or SPECDEC_DEBUG=1 prints the traceback too.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar, overload

from specdec import config
from specdec.errors import EXIT_ADDRESS_IN_USE, UserError
from specdec.models import check_pair, choose

if TYPE_CHECKING:
    from specdec.wire import pb
    from specdec_cli.launch import Cluster

    # argparse's `add_subparsers()` result, which each `add_parser(sub)` extends (generic only to type checkers)
    SubParsers: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]

T = TypeVar("T")


@overload
def serve_config(args: argparse.Namespace) -> config.TransportConfig: ...
@overload
def serve_config(args: argparse.Namespace, cls: type[T]) -> T: ...
def serve_config(args: argparse.Namespace, cls: type[object] | None = None) -> object:
    """The config of `specdec serve KIND`: defaults < `SPECDEC_<FIELD>` < the flags given. `cls`:
    KIND's config dataclass (default: `config.SERVICE_CONFIGS[KIND]`), named to get its type.

    A value the config rejects (a `SPECDEC_*` variable argparse never saw) is a UserError."""
    overrides = {k: v for k, v in vars(args).items() if k not in ("command", "kind", "func", "debug")}
    try:
        return config.from_env(cls or config.SERVICE_CONFIGS[args.kind], **overrides)
    except ValueError as err:
        raise UserError(
            f"invalid {args.kind} setting: {err}",
            f"check its SPECDEC_* environment variables (`specdec serve {args.kind} --help` lists them)",
        ) from err


def _serve(args: argparse.Namespace) -> None:
    import asyncio

    from specdec.serving import setup_logging

    setup_logging()
    if args.kind == "drafter":
        drafter_cfg = serve_config(args, config.DrafterConfig)
        from drafter import server as drafter_server

        asyncio.run(drafter_server.main(drafter_cfg))
    elif args.kind == "verifier":
        verifier_cfg = serve_config(args, config.VerifierConfig)
        from verifier import server as verifier_server

        asyncio.run(verifier_server.main(verifier_cfg))
    else:
        gateway_cfg = serve_config(args, config.GatewayConfig)
        from gateway import server as gateway_server

        asyncio.run(gateway_server.main(gateway_cfg))


_SERVE_HELP = {
    "drafter": "the draft model service",
    "verifier": "the vLLM target service",
    "gateway": "the round-running entry point",
}
_SERVE_DESCRIPTION = """{doc}

Every flag can also be set by its environment variable SPECDEC_<FIELD>;
a flag given wins over the environment, which wins over the default.
The flags are generated from the config dataclasses in specdec/config.py."""


def _add_serve(sub: SubParsers) -> None:
    """`specdec serve KIND`: one flag per field of KIND's config dataclass (`config.add_flags`)."""
    p = sub.add_parser(
        "serve", help="start one service", description="Start one service; `specdec serve KIND --help` lists its flags."
    )
    kinds = p.add_subparsers(dest="kind", required=True)
    terms = (config.__doc__ or "").partition("Terms:")[2]
    for kind, cls in config.SERVICE_CONFIGS.items():
        k = kinds.add_parser(
            kind,
            help=_SERVE_HELP[kind],
            formatter_class=config.FlagHelpFormatter,
            description=_SERVE_DESCRIPTION.format(doc=cls.__doc__),
            epilog=f"terms:{terms}" if terms else None,
        )
        config.add_flags(k, cls)
    p.set_defaults(func=_serve)


def _start(cluster: Cluster) -> None:
    """Start a `launch.Cluster`; a service that exits or never gets ready is a UserError
    pointing at its log (the cluster has stopped the others)."""
    try:
        cluster.start()
    except (RuntimeError, TimeoutError) as err:
        raise UserError(f"a service did not start: {err}", "its log says why") from err


def _checked_pair(args: argparse.Namespace) -> str:
    """Resolve the models `up` / `demo` run (--models with --target, --draft, --tokenizer) and refuse
    a pair that does not fit, before any service starts; returns how to name the pair in messages."""
    chosen = choose(args.models, args.target, args.draft, args.tokenizer)
    check_pair(chosen)
    return (
        args.models
        if chosen.name == args.models and not (args.target or args.draft or args.tokenizer)
        else f"target {chosen.target}, draft {chosen.draft}"
    )


def _add_pair_flags(p: argparse.ArgumentParser) -> None:
    """--models, --target, --draft, --tokenizer of `up` and `demo`."""
    p.add_argument(
        "--models",
        default="qwen-coder",
        metavar="PAIR",
        help="a built-in pair (qwen-coder, tiny) or one of your pairs file (specdec.toml or SPECDEC_PAIRS)",
    )
    p.add_argument(
        "--target",
        metavar="REF",
        help="target model reference replacing the pair's: a folder, PAIR/ROLE or "
        "a Hugging Face repo id ORG/NAME[@REVISION]",
    )
    p.add_argument("--draft", metavar="REF", help="draft model reference (default: the pair's draft)")
    p.add_argument("--tokenizer", metavar="REF", help="the gateway's tokenizer (default: the target's)")


def _up(args: argparse.Namespace) -> None:
    from specdec_cli.launch import Cluster

    what = _checked_pair(args)
    cluster = Cluster(
        pair=args.models,
        draft=args.draft,
        gateway_port=args.port,
        drafter_port=args.drafter_port,
        verifier_port=args.verifier_port,
        log_dir=Path(args.log_dir),
        pin=not args.no_pin,
        target=args.target,
        tokenizer=args.tokenizer,
    )
    print(f"starting verifier, drafter and gateway ({what}); logs in {args.log_dir}", file=sys.stderr)
    _start(cluster)
    print(f"ready: gateway on 127.0.0.1:{args.port} (Ctrl-C stops)", file=sys.stderr)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stop the services on SIGTERM too
    # Ctrl-C stops them even when `up` was started with SIGINT ignored (a background job of a
    # non-interactive shell inherits SIG_IGN, and Python then never raises KeyboardInterrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        while all(s.proc.poll() is None for s in cluster.services):
            time.sleep(1.0)
        print("a service exited; stopping the others", file=sys.stderr)
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()


def _spec(args: argparse.Namespace) -> pb.GenerationSpec:
    from gateway.client import generation_spec

    try:
        prompt = [int(t) for t in args.prompt.split(",")] if args.token_ids else args.prompt
    except ValueError:
        raise UserError(
            f"--token-ids: {args.prompt!r} is not a comma-separated list of token ids",
            'pass ids like "1,2,3", or drop --token-ids to send the prompt as text',
        ) from None
    return generation_spec(
        prompt,
        max_tokens=args.max_tokens,
        gamma=args.gamma,
        drafter=args.drafter or "",
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop or [],
        ignore_eos=args.ignore_eos,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        min_tokens=args.min_tokens,
        stop_token_ids=args.stop_token_ids or [],
        logprobs=args.logprobs,
    )


def format_stats(stats: pb.SpeculationStats, usage: pb.Usage, total_ms: float, first_ms: float) -> str:
    """`specdec generate`'s summary of a request: its `usage` and speculation `stats` (the last
    chunk's), `total_ms` from the call to its end and `first_ms` to its first chunk."""
    from gateway.client import stats_dict

    s = stats
    lines = [
        f"tokens: {usage.completion_tokens} generated from {usage.prompt_tokens} prompt tokens in "
        f"{total_ms / 1e3:.2f} s (first token {first_ms:.0f} ms, "
        f"{(usage.completion_tokens - 1) / max(1e-9, (total_ms - first_ms) / 1e3):.1f} tok/s after it)",
        f"speculation: drafter={stats_dict(s)['drafter']} gamma={s.gamma} target_steps={s.target_steps} "
        f"speculative_steps={s.speculative_steps}",
        f"  drafted={s.drafted_tokens} accepted={s.accepted_tokens} acceptance_rate={s.acceptance_rate:.3f} "
        f"mean_accepted_length={s.mean_accepted_length:.2f} tokens_per_step={s.tokens_per_step:.2f}",
        f"  accepted_per_position={list(s.accepted_per_position)} target_computed_tokens={s.target_computed_tokens}",
        f"  branches: drafted={s.branches_drafted} used={s.branches_used} missed={s.branch_misses} "
        f"hit_rate={s.branch_hit_rate:.2f}" + (f" held_steps={s.held_steps}" if s.held_steps else ""),
    ]
    if s.drafter_preemptions:
        lines.append(f"  drafter preemptions: {s.drafter_preemptions} (plain decoding until it was ready again)")
    if s.drafter_fallback:
        lines.append(f"  drafter fallback: {s.fallback_reason}")
    return "\n".join(lines)


def _generate(args: argparse.Namespace) -> int:
    import grpc

    from gateway.client import GatewayClient, stats_dict
    from specdec.wire import pb

    spec = _spec(args)
    with GatewayClient(
        args.address,
        timeout_s=args.timeout,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        api_key=args.api_key or os.environ.get("SPECDEC_API_KEY"),
    ) as client:
        try:
            grpc.channel_ready_future(client.channel).result(timeout=args.connect_timeout)
        except grpc.FutureTimeoutError:
            raise UserError(
                f"cannot reach the gateway at {args.address} (no connection in {args.connect_timeout:g} s)",
                "start one with `specdec up`, or pass --address HOST:PORT of a running gateway",
            ) from None
        t0 = time.perf_counter()
        first_ms = 0.0
        text: list[str] = []
        ids: list[int] = []
        logprobs: list[dict[str, Any]] = []
        last: pb.GenerateStreamResponse | None = None
        try:
            for chunk in client.stream(spec):
                if not first_ms:
                    first_ms = (time.perf_counter() - t0) * 1e3
                if not args.json:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                text.append(chunk.text)
                ids.extend(chunk.token_ids)
                logprobs.extend(
                    {
                        "token_id": lp.token_id,
                        "logprob": lp.logprob,
                        "rank": lp.rank,
                        "top": dict(zip(lp.top_token_ids, lp.top_logprobs)),
                    }
                    for lp in chunk.logprobs
                )
                last = chunk
        except grpc.RpcError as err:
            if not args.json and text:
                print(file=sys.stderr)  # end the partial completion's line
            raise rpc_error(err, f"the gateway at {args.address}") from err
    total_ms = (time.perf_counter() - t0) * 1e3
    if last is None:  # the gateway ends every stream with a chunk carrying the finish reason
        raise RuntimeError("the gateway's stream ended without a chunk")
    if args.json:
        print(
            json.dumps(
                {
                    "request_id": last.request_id,
                    "text": "".join(text),
                    "token_ids": ids,
                    "finish_reason": pb.FinishReason.Name(last.finish_reason),
                    "usage": {
                        "prompt_tokens": last.usage.prompt_tokens,
                        "completion_tokens": last.usage.completion_tokens,
                    },
                    "stats": stats_dict(last.stats),
                    "total_ms": round(total_ms, 1),
                    "first_token_ms": round(first_ms, 1),
                    **({"logprobs": logprobs} if args.logprobs is not None else {}),
                }
            )
        )
    else:
        print("\n---", file=sys.stderr)
        print(format_stats(last.stats, last.usage, total_ms, first_ms), file=sys.stderr)
    return 0


def _certs_doc() -> str:
    from specdec_cli import certs

    return certs.__doc__ or ""


def _certs(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specdec_cli.certs import write_certs

    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    try:
        paths = write_certs(
            Path(args.dir), hosts, days=args.days, overwrite=args.force, ca_dir=Path(args.ca) if args.ca else None
        )
    except FileExistsError as err:
        raise UserError(str(err).split(";")[0], "pass --force to replace them, or choose another DIR") from None
    for path in paths:
        print(path)
    return 0


def _add_generate_flags(p: argparse.ArgumentParser) -> None:
    from specdec.wire import DRAFT_METHOD_NAMES

    p.add_argument("--address", default=f"127.0.0.1:{config.DEFAULT_GATEWAY_PORT}", help="gateway host:port")
    p.add_argument("--gamma", type=int, help="draft tokens per target step (0: plain decoding)")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop sequence (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--min-tokens", type=int, default=0, help="no stop before this many tokens")
    p.add_argument(
        "--stop-token-ids",
        type=lambda v: [int(t) for t in v.split(",")],
        metavar="IDS",
        help="comma-separated token ids that end the generation",
    )
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="K",
        help="with --json: the target's logprob of each token and of its K best alternatives",
    )
    p.add_argument("--tls-ca", default="", metavar="PATH", help="connect with TLS, verifying the gateway with this CA")
    p.add_argument("--tls-cert", default="", metavar="PATH", help="client certificate (mutual TLS)")
    p.add_argument("--tls-key", default="", metavar="PATH", help="its private key")
    p.add_argument("--api-key", default=None, help="sent as `authorization: Bearer KEY` (default: $SPECDEC_API_KEY)")
    p.add_argument("--drafter", choices=DRAFT_METHOD_NAMES, help="default: the gateway's")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, stats)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds")
    p.add_argument("--connect-timeout", type=float, default=10.0, help="seconds to wait for the gateway's connection")


def _demo(args: argparse.Namespace) -> int:
    from specdec_cli.launch import ANY_PORT, Cluster

    what = _checked_pair(args)
    cluster = Cluster(
        pair=args.models,
        gateway_port=ANY_PORT,
        drafter_port=ANY_PORT,
        verifier_port=ANY_PORT,
        log_dir=Path(args.log_dir),
        target=args.target,
        draft=args.draft,
        tokenizer=args.tokenizer,
        metrics_port=dict.fromkeys(("verifier", "drafter", "gateway"), 0),  # a one-shot run needs no metrics
        rest_port=0,  # nor the REST bridge
    )
    print(f"starting verifier, drafter and gateway ({what}); logs in {args.log_dir}", file=sys.stderr)
    _start(cluster)
    try:
        print(f"prompt: {args.prompt!r}\n", file=sys.stderr)
        args.address = cluster.gateway.address
        return _generate(args)
    finally:
        cluster.stop()


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"


def format_models(entries: list[dict[str, Any]]) -> str:
    """`specdec models list` as a table: one row per role of each pair (`models.list_pairs()`)."""
    rows = [("PAIR", "ROLE", "STATUS", "SIZE", "FOLDER", "UPSTREAM")]
    for pair in entries:
        tiny = pair["name"] == "tiny"
        for role in pair["roles"]:
            if role["installed"]:
                status, folder = ("built" if tiny else "pulled"), str(role["path"])
            else:
                status = "not built" if tiny else "not pulled"
                folder = f"(`specdec models pull {pair['name']}`{', or on first use' if tiny else ''})"
            rows.append((pair["name"], role["role"], status, _size(role["size"]), folder, role["upstream"]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows)


def _models(args: argparse.Namespace) -> int:
    from specdec import models

    if args.action == "list":
        entries = models.list_pairs()
        print(json.dumps(entries, indent=2, default=str) if args.json else format_models(entries))
    elif args.action == "pull":
        if os.environ.get("TMPDIR"):  # it may be on the volume pulled into (deploy/k8s/components/pull-models)
            import tempfile

            Path(os.environ["TMPDIR"]).mkdir(parents=True, exist_ok=True)
            tempfile.tempdir = None  # not a fallback chosen while it did not exist
        pair, _, role = args.name.partition("/")  # PAIR/ROLE is PAIR --role ROLE
        role = args.role or role
        if args.tokenizer:
            ref = (
                f"{pair}/{role}" if role else models.PAIRS[pair].tokenizer if pair in models.PAIRS else f"{pair}/target"
            )
            print(models.resolve_tokenizer(ref))
        elif role:
            print(models.prepare(pair, [role])[role])
        else:
            models.prepare(pair)
            print(f"{pair}: ready")
    elif "/" in args.name or Path(args.name).expanduser().is_dir():
        print(models.resolve(args.name, pull=False))  # one model: its folder
    else:  # a pair: every role's folder
        folders = models.folders(args.name)
        width = max(len(role) for role in folders)
        for role, folder in folders.items():
            print(f"{role.ljust(width)}  {folder}")
    return 0


def _add_models(sub: SubParsers) -> None:
    """`specdec models list|pull|path`."""
    p = sub.add_parser(
        "models",
        help="list, pull or locate models",
        description="The model registry: pairs of a target and its draft (specdec/models/).",
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="{list,pull,path}")
    ls = actions.add_parser("list", help="every pair and role: pulled or not, size, folder")
    ls.add_argument("--json", action="store_true", help="one JSON array (the folders as strings)")
    pull = actions.add_parser("pull", help="download, verify and convert a pair once (tiny: build it)")
    pull.add_argument(
        "name",
        nargs="?",
        default="qwen-coder",
        metavar="PAIR[/ROLE]",
        help="a pair, or one model of it (PAIR/ROLE: as --role); default: qwen-coder",
    )
    pull.add_argument(
        "--role",
        metavar="ROLE",
        help="only this role's model (e.g. target for a verifier, draft for a drafter); prints its folder",
    )
    pull.add_argument(
        "--tokenizer",
        action="store_true",
        help="only the tokenizer (of the pair's target, or of --role), not the weights: what a gateway "
        "needs; prints its folder",
    )
    path = actions.add_parser("path", help="the folder of each role of PAIR, or of one PAIR/ROLE")
    path.add_argument(
        "name",
        nargs="?",
        default="qwen-coder",
        metavar="PAIR[/ROLE]",
        help="a pair (every role's folder) or PAIR/ROLE (that folder); default: qwen-coder",
    )
    p.set_defaults(func=_models)


# Subcommands defined in the tools' own modules, imported only when one of them runs (or shows
# its --help): the others get a placeholder with the same help line (tests/specdec/test_cli.py
# checks they match).
_TOOLS = {
    "eval-draft": "measure a draft's agreement with the target and predict speedups",
    "traces": "inspect exported spans: slowest rounds, spikes, one request's timeline",
    "bench": "specdec vs vLLM (target-only, draft_model, ngram) and transformers, one run",
    "bench-link": "specdec's speedup across a delayed network link (namespaces, delay proxies), with and without branches",
    "bench-drafter": "the drafter's capacity: draft tokens/s and per-session pace against sessions, batched vs serial",
    "bench-turns": "the turns of one conversation with every prefix cache on: specdec vs vLLM target-only, and the drafter's cache off",
    "draft-vocab": "make a draft vocabulary (the ids the draft may propose) from a sample of your traffic's text",
}


def _add_tool(sub: SubParsers, name: str) -> None:
    if name == "eval-draft":
        from specdec_cli import evaldraft

        evaldraft.add_parser(sub)
    elif name == "traces":
        from specdec_cli import traces

        traces.add_parser(sub)
    elif name == "bench-link":
        from benchmarks import link

        link.add_parser(sub)
    elif name == "bench-drafter":
        from benchmarks import drafter_capacity

        drafter_capacity.add_parser(sub)
    elif name == "bench-turns":
        from benchmarks import turns

        turns.add_parser(sub)
    elif name == "draft-vocab":
        from specdec_cli import draftvocab

        draftvocab.add_parser(sub)
    else:
        from benchmarks import bench

        bench.add_parser(sub)


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The `specdec` parser for `argv`: only the tool `argv` names (if any) is imported."""
    parser = argparse.ArgumentParser(
        prog="specdec", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error (or SPECDEC_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)

    up = sub.add_parser("up", help="start the three services locally")
    _add_pair_flags(up)
    up.add_argument("--port", type=int, default=config.DEFAULT_GATEWAY_PORT)
    up.add_argument("--drafter-port", type=int, default=config.DEFAULT_DRAFTER_PORT)
    up.add_argument("--verifier-port", type=int, default=config.DEFAULT_VERIFIER_PORT)
    up.add_argument("--log-dir", default="logs")
    up.add_argument("--no-pin", action="store_true", help="do not give the drafter its own core")
    up.set_defaults(func=_up)

    gen = sub.add_parser("generate", help="generate a completion through the gateway")
    gen.add_argument("prompt", help="prompt text (or comma-separated ids with --token-ids)")
    gen.add_argument("--token-ids", action="store_true", help="the prompt is token ids")
    _add_generate_flags(gen)
    gen.set_defaults(func=_generate)

    demo = sub.add_parser("demo", help="start the services, run one generation with stats, stop")
    _add_pair_flags(demo)
    demo.add_argument("--prompt", default="def quicksort(items: list[int]) -> list[int]:\n")
    demo.add_argument("--log-dir", default="logs")
    demo.set_defaults(func=lambda a: _demo(_demo_defaults(a)), token_ids=False)

    _add_models(sub)

    certs = sub.add_parser(
        "certs",
        help="write a development PKI: a CA and a certificate per role, and an end users' CA and certificate",
        description=_certs_doc(),
    )
    certs.add_argument("dir", metavar="DIR", help="folder to write them to")
    certs.add_argument(
        "--hosts",
        default="",
        help="comma-separated DNS names and IP addresses the services are "
        "reached at (localhost and 127.0.0.1 are always added)",
    )
    certs.add_argument("--days", type=int, default=365, help="validity (default: 365)")
    certs.add_argument(
        "--ca",
        default=None,
        metavar="DIR",
        help="issue from the CAs in DIR (ca.pem, ca-key.pem, "
        "client-ca.pem, client-ca-key.pem) instead of new ones: rotation, or more hosts",
    )
    certs.add_argument("--force", action="store_true", help="replace certificates already in DIR")
    certs.set_defaults(func=_certs)

    command = next((a for a in argv if not a.startswith("-")), None)
    for name, help in _TOOLS.items():
        if name == command:
            _add_tool(sub, name)
        else:
            sub.add_parser(name, help=help, add_help=False)
    return parser


def rpc_error(err: Exception, peer: str) -> UserError:
    """A failed gRPC call to `peer` ("the gateway at HOST:PORT") as a UserError: what the
    status code means for the caller, and what to do."""
    code = getattr(err, "code", lambda: None)()
    name = getattr(code, "name", "UNKNOWN")
    details = getattr(err, "details", lambda: "")() or str(err)
    if name == "UNAVAILABLE":
        return UserError(
            f"{peer} is unavailable ({details})", "check that it is running (`specdec up` starts one) and the address"
        )
    if name == "DEADLINE_EXCEEDED":
        return UserError(f"{peer} did not finish in time ({details})", "raise --timeout, or ask for fewer tokens")
    if name in ("INVALID_ARGUMENT", "OUT_OF_RANGE", "FAILED_PRECONDITION"):
        return UserError(f"{peer} refused the request: {details}", "fix the value it names")
    if name in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
        return UserError(f"{peer} refused the request ({name}): {details}", "check the credentials it expects")
    if name == "RESOURCE_EXHAUSTED":
        return UserError(f"{peer} is over a limit: {details}", "retry later, or ask its operator to raise the limit")
    return UserError(f"{peer} failed ({name}): {details}", "its log says why")


def _debug_env() -> bool:
    return os.environ.get("SPECDEC_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


def explain(err: BaseException) -> tuple[str, int]:
    """What `specdec` prints for an exception (`<what>; <what to do>`) and its exit status:
    2 for errors the user can fix (EXIT_ADDRESS_IN_USE when a port is taken), 1 for
    unexpected ones."""
    if isinstance(err, UserError):
        return str(err), 2
    if isinstance(err, subprocess.CalledProcessError):
        cmd = err.cmd if isinstance(err.cmd, str) else " ".join(map(str, err.cmd))
        cmd = cmd if len(cmd) <= 80 else cmd[:77] + "..."
        return f"`{cmd}` failed with exit status {err.returncode}; its output above says why", 2
    if isinstance(err, OSError):
        what = f"{err.strerror}: {err.filename}" if err.strerror and err.filename else str(err)
        if err.errno == errno.EADDRINUSE:
            return f"{what}; stop what holds the port (`ss -ltnp`) or choose another", EXIT_ADDRESS_IN_USE
        if isinstance(err, (FileNotFoundError, IsADirectoryError, NotADirectoryError)):
            return f"{what}; check the path", 2
        if isinstance(err, PermissionError):
            return f"{what}; check its permissions", 2
        return f"{what}; check the system's state (ports, disk, network) and retry", 2
    grpc = sys.modules.get("grpc")
    if grpc is not None and isinstance(err, grpc.RpcError):
        return str(rpc_error(err, "a service")), 2
    return (
        f"unexpected {type(err).__name__}: {err}; rerun as `specdec --debug ...` (or with SPECDEC_DEBUG=1) "
        "for the traceback, and report it"
    ), 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run `specdec ARGV...` (default: the process's arguments) and return its exit status.

    Every error ends as one line on stderr, `specdec: error: <what>; <what to do>`: status 2
    for errors the user can fix (argparse's usage errors included), 1 for unexpected ones;
    Ctrl-C returns 130 quietly. With `--debug` or SPECDEC_DEBUG=1 the traceback comes first.
    `specdec serve` always logs the traceback of an unexpected error: a service's stderr is
    its log, and a crash there is not rerun by hand.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    debug = args.debug or _debug_env()
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        return 130
    except BrokenPipeError:  # `specdec ... | head`: the reader left
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        except (OSError, ValueError):
            pass
        return 1
    except Exception as err:  # noqa: BLE001 (the one place errors become messages)
        message, status = explain(err)
        if debug or (status == 1 and args.command == "serve"):
            traceback.print_exc()
        print(f"specdec: error: {' '.join(message.split())}", file=sys.stderr)
        return status


def _demo_defaults(args: argparse.Namespace) -> argparse.Namespace:
    defaults = argparse.ArgumentParser(add_help=False)
    _add_generate_flags(defaults)
    merged = vars(defaults.parse_args([]))
    merged.update({"max_tokens": 96, "gamma": 4, "json": False})
    merged.update(vars(args))
    return argparse.Namespace(**merged)


if __name__ == "__main__":
    sys.exit(main())
