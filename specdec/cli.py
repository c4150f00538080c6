"""The `specdec` command line.

    specdec up [--models qwen-coder|tiny]         start gateway, drafter and verifier locally
    specdec serve drafter|verifier|gateway ...    start one service (multi-host deployments)
    specdec generate "text" [--json] ...          a completion and its speculation stats
    specdec demo [--models qwen-coder|tiny]       up + one generation with stats + down
    specdec models list | pull NAME | path REF    the model registry
    specdec eval-draft [--target T --draft D]     draft agreement, step costs, predicted speedups
    specdec traces FILE... [--request ID]         slowest rounds, spikes by stage, one request's timeline
    specdec bench [--quick]                       specdec vs vLLM and transformers, side by side
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from pathlib import Path

from specdec import config
from specdec.models import PAIRS, prepare


def serve_config(args: argparse.Namespace) -> object:
    """The config of `specdec serve KIND`: defaults < `SPECDEC_<FIELD>` < the flags given."""
    overrides = {k: v for k, v in vars(args).items() if k not in ("command", "kind", "func")}
    return config.from_env(config.SERVICE_CONFIGS[args.kind], **overrides)


def _serve(args: argparse.Namespace) -> None:
    from specdec.serving import setup_logging

    setup_logging()
    cfg = serve_config(args)
    if args.kind == "drafter":
        from drafter import server

        asyncio.run(server.main(cfg))
    elif args.kind == "verifier":
        from verifier import server

        asyncio.run(server.main(cfg))
    else:
        from gateway import server

        asyncio.run(server.main(cfg))


_SERVE_HELP = {
    "drafter": "the draft model service",
    "verifier": "the vLLM target service",
    "gateway": "the round-running entry point",
}
_SERVE_DESCRIPTION = """{doc}

Every flag can also be set by its environment variable SPECDEC_<FIELD>;
a flag given wins over the environment, which wins over the default.
The flags are generated from the config dataclasses in specdec/config.py."""


def _add_serve(sub: argparse._SubParsersAction) -> None:
    """`specdec serve KIND`: one flag per field of KIND's config dataclass (`config.add_flags`)."""
    p = sub.add_parser("serve", help="start one service",
                       description="Start one service; `specdec serve KIND --help` lists its flags.")
    kinds = p.add_subparsers(dest="kind", required=True)
    terms = (config.__doc__ or "").partition("Terms:")[2]
    for kind, cls in config.SERVICE_CONFIGS.items():
        k = kinds.add_parser(kind, help=_SERVE_HELP[kind], formatter_class=config.FlagHelpFormatter,
                             description=_SERVE_DESCRIPTION.format(doc=cls.__doc__),
                             epilog=f"terms:{terms}" if terms else None)
        config.add_flags(k, cls)
    p.set_defaults(func=_serve)


def _up(args: argparse.Namespace) -> None:
    from specdec.launch import Cluster

    prepare(args.models)
    cluster = Cluster(
        pair=args.models, draft=args.draft, gateway_port=args.port, drafter_port=args.drafter_port,
        verifier_port=args.verifier_port, log_dir=Path(args.log_dir), pin=not args.no_pin,
    )
    print(f"starting verifier, drafter and gateway ({args.models}); logs in {args.log_dir}", file=sys.stderr)
    cluster.start()
    print(f"ready: gateway on 127.0.0.1:{args.port} (Ctrl-C stops)", file=sys.stderr)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stop the services on SIGTERM too
    try:
        while all(s.proc.poll() is None for s in cluster.services):
            time.sleep(1.0)
        print("a service exited; stopping the others", file=sys.stderr)
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()


def _spec(args: argparse.Namespace):  # -> pb.GenerationSpec
    from gateway.client import generation_spec

    prompt = [int(t) for t in args.prompt.split(",")] if args.token_ids else args.prompt
    return generation_spec(
        prompt, max_tokens=args.max_tokens, gamma=args.gamma, drafter=args.drafter or "", temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop or [], ignore_eos=args.ignore_eos,
    )


def format_stats(stats, usage, total_ms: float, first_ms: float) -> str:
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
    ]
    if s.drafter_fallback:
        lines.append(f"  drafter fallback: {s.fallback_reason}")
    return "\n".join(lines)


def _generate(args: argparse.Namespace) -> int:
    import grpc

    from gateway.client import GatewayClient, stats_dict
    from specdec.wire import pb

    spec = _spec(args)
    with GatewayClient(args.address, timeout_s=args.timeout) as client:
        t0 = time.perf_counter()
        first_ms = 0.0
        text, ids, last = [], [], None
        try:
            for chunk in client.stream(spec):
                if not first_ms:
                    first_ms = (time.perf_counter() - t0) * 1e3
                if not args.json:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                text.append(chunk.text)
                ids.extend(chunk.token_ids)
                last = chunk
        except grpc.RpcError as err:
            print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
            return 2
    total_ms = (time.perf_counter() - t0) * 1e3
    if args.json:
        print(json.dumps({
            "request_id": last.request_id,
            "text": "".join(text),
            "token_ids": ids,
            "finish_reason": pb.FinishReason.Name(last.finish_reason),
            "usage": {"prompt_tokens": last.usage.prompt_tokens, "completion_tokens": last.usage.completion_tokens},
            "stats": stats_dict(last.stats),
            "total_ms": round(total_ms, 1),
            "first_token_ms": round(first_ms, 1),
        }))
    else:
        print("\n---", file=sys.stderr)
        print(format_stats(last.stats, last.usage, total_ms, first_ms), file=sys.stderr)
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
    p.add_argument("--drafter", choices=DRAFT_METHOD_NAMES, help="default: the gateway's")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, stats)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds")


def _demo(args: argparse.Namespace) -> int:
    from specdec.launch import Cluster, free_port

    prepare(args.models)
    ports = [free_port() for _ in range(3)]
    off = ["--metrics-port", "0"]  # a one-shot run needs no metrics or REST ports
    cluster = Cluster(pair=args.models, gateway_port=ports[0], drafter_port=ports[1], verifier_port=ports[2],
                      log_dir=Path(args.log_dir),
                      extra_args={"verifier": off, "drafter": off, "gateway": [*off, "--rest-port", "0"]})
    print(f"starting verifier, drafter and gateway ({args.models}); logs in {args.log_dir}", file=sys.stderr)
    cluster.start()
    try:
        print(f"prompt: {args.prompt!r}\n", file=sys.stderr)
        args.address = f"127.0.0.1:{ports[0]}"
        return _generate(args)
    finally:
        cluster.stop()


def _models(args: argparse.Namespace) -> int:
    from specdec.models import resolve

    if args.action == "list":
        from specdec.models import pull

        for m in pull.list_models():
            print(json.dumps(m))
        print(json.dumps({"name": "tiny", "roles": ["target", "draft-same", "draft-mid", "draft-far"], "built": "on use"}))
    elif args.action == "pull":
        prepare(args.name)
        print(f"{args.name}: ready")
    else:
        print(resolve(args.name, pull=False))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)

    up = sub.add_parser("up", help="start the three services locally")
    up.add_argument("--models", default="qwen-coder", choices=sorted(PAIRS))
    up.add_argument("--draft", help="draft model reference (default: the pair's draft)")
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
    demo.add_argument("--models", default="qwen-coder", choices=sorted(PAIRS))
    demo.add_argument("--prompt", default="def quicksort(items: list[int]) -> list[int]:\n")
    demo.add_argument("--log-dir", default="logs")
    demo.set_defaults(func=lambda a: _demo(_demo_defaults(a)), token_ids=False)

    models = sub.add_parser("models", help="list, pull or locate models")
    models.add_argument("action", choices=["list", "pull", "path"])
    models.add_argument("name", nargs="?", default="qwen-coder", help="pair (pull) or PAIR/ROLE (path)")
    models.set_defaults(func=_models)

    from benchmarks import bench
    from specdec import evaldraft, traces

    evaldraft.add_parser(sub)
    traces.add_parser(sub)
    bench.add_parser(sub)

    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


def _demo_defaults(args: argparse.Namespace) -> argparse.Namespace:
    defaults = argparse.ArgumentParser(add_help=False)
    _add_generate_flags(defaults)
    merged = vars(defaults.parse_args([]))
    merged.update({"max_tokens": 96, "gamma": 4, "json": False})
    merged.update(vars(args))
    return argparse.Namespace(**merged)


if __name__ == "__main__":
    sys.exit(main())
