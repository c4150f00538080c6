"""`specdec bench-turns`: the turns of one conversation, with every prefix cache on, as users run.

A chat's next turn, an editor's next completion, an agent's next step resend what came before.
vLLM's engine computes the shared start once (its prefix cache, on by default), and so does the
drafter (drafter.prefix_cache, on by default). `specdec bench` turns both off, so that a repeated
prompt costs the same each time; this benchmark measures them on, side by side in one run, one
system after the other (never two in memory), on the bench's placement:

    target-only          vLLM's OpenAI server on the target (benchmarks.serve.vllm_server:
                         the bench's engine settings, the prefix cache on), the target's core
    specdec              the three services at their defaults (both prefix caches on), the
                         verifier on the target's core, drafter and gateway on the other
    specdec-no-reuse     the same with the drafter's prefix cache off (`--prefix-cache-mib 0`):
                         what the drafter did before it had one

The conversation: turn 1 is the opening of a real source file (a Python standard-library module,
`--prompt-tokens` tokens); turn k + 1 is turn k's prompt, target-only's output to it, and the next
`--added-tokens` tokens of the file (the user kept typing). Every system gets the same prompts
(built from target-only's outputs), one request at a time, greedy, `--max-tokens` tokens each
(`ignore_eos`), streamed from /v1/completions.

Per turn and system: TTFT (request sent to the first streamed token), decode tok/s (tokens after
the first / time after it), latency; for specdec, from the final chunk's usage.speculation:
drafter_reused_tokens (prompt tokens whose draft keys/values the drafter copied instead of
prefilling), speculative_steps and accepted_tokens; and `exact`: the text equals target-only's.
Ratios are against target-only for the same turn. Turn 1 is cold everywhere; the turns after it
are where the caches pay.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx

HELP = (
    "the turns of one conversation with every prefix cache on: specdec vs vLLM target-only, and the drafter's cache off"
)
SOURCE = "typing.py"  # the standard-library module the conversation types out
SYSTEMS = ("target-only", "specdec", "specdec-no-reuse")
TIMEOUT_S = 1800.0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`specdec bench-turns`."""
    p = sub.add_parser(
        "bench-turns", help=HELP, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", default="qwen-coder", metavar="PAIR", help="the model pair (default: qwen-coder)")
    p.add_argument("--dtype", default="auto", help="the target's dtype on both servers (default: auto, as users run)")
    p.add_argument("--turns", type=int, default=4, help="turns of the conversation (default: 4)")
    p.add_argument("--prompt-tokens", type=int, default=2000, help="turn 1's prompt, tokens (default: 2000)")
    p.add_argument("--added-tokens", type=int, default=100, help="new tokens of the file per turn (default: 100)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per turn (default: 64)")
    p.add_argument("--out", type=Path, default=Path("bench-turns"), help="results folder (default: bench-turns)")
    p.set_defaults(func=main)


def _check(args: argparse.Namespace) -> tuple[int, int]:
    """Values argparse cannot judge alone (a UserError naming the flag); the cores (target, drafter)."""
    from specdec.errors import UserError

    for flag, value in (
        ("--turns", args.turns),
        ("--prompt-tokens", args.prompt_tokens),
        ("--added-tokens", args.added_tokens),
        ("--max-tokens", args.max_tokens),
    ):
        if value < 1:
            raise UserError(f"{flag} {value}: must be at least 1", f"pass {flag} 1 or more")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise UserError(f"one core ({cpus[0]}): the target and the drafter need one each", "run it on 2 cores or more")
    return cpus[0], cpus[-1]


def source_ids(tokenizer: Any) -> list[int]:
    """The source file (SOURCE), as token ids."""
    import sysconfig

    ids: list[int] = tokenizer((Path(sysconfig.get_paths()["stdlib"]) / SOURCE).read_text())["input_ids"]
    return ids


def ask(url: str, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One greedy streamed completion: text, ttft_ms, latency_ms, tokens, decode tok/s, and the
    final usage chunk's `speculation` (specdec's; {} from vLLM)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, first = "", None
    usage: dict[str, Any] = {}
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", timeout=TIMEOUT_S, json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data:") :])
            for choice in chunk.get("choices") or []:
                if choice.get("text") and first is None:
                    first = time.perf_counter()
                text += choice.get("text") or ""
            usage = chunk.get("usage") or usage
    end = time.perf_counter()
    tokens = int(usage.get("completion_tokens", 0))
    after = end - first if first is not None else 0.0
    return {
        "text": text,
        "ttft_ms": (first - t0) * 1e3 if first is not None else None,
        "latency_ms": (end - t0) * 1e3,
        "tokens": tokens,
        "decode_tok_s": (tokens - 1) / after if tokens > 1 and after > 0 else None,
        "speculation": usage.get("speculation") or {},
    }


def run_system(
    server: AbstractContextManager[str], prompts: list[str], added: list[str], max_tokens: int, follow: bool
) -> list[dict[str, Any]]:
    """Every turn on one server, one at a time. `follow`: build turn k + 1's prompt from turn k's
    output (target-only, appending to `prompts`); else take `prompts` as they are."""
    from benchmarks.serve import served_model

    out = []
    with server as url:
        model = served_model(url)
        for k in range(len(added) + 1):
            r = ask(url, model, prompts[k], max_tokens)
            if follow and k < len(added):
                prompts.append(prompts[k] + r["text"] + added[k])
            out.append(r)
            print(f"  turn {k + 1}: ttft {r['ttft_ms']:.0f} ms, {r['decode_tok_s'] or 0:.2f} tok/s", file=sys.stderr)
    return out


def table(report: dict[str, Any]) -> str:
    """The report as a Markdown table: per turn and system, the figures and their ratios."""
    lines = [
        "| turn | prompt tokens | system | TTFT ms | decode tok/s | latency ms | TTFT vs target-only | "
        "latency vs target-only | drafter reused | spec steps | accepted | exact |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for turn in report["turns"]:
        base = turn["systems"]["target-only"]
        for name, r in turn["systems"].items():
            sp = r["speculation"] or {}
            ratios = [f"{r[k] / base[k]:.2f}x" if r[k] and base[k] else "-" for k in ("ttft_ms", "latency_ms")]
            spec = [str(sp.get(k, "-")) for k in ("drafter_reused_tokens", "speculative_steps", "accepted_tokens")]
            cells = [
                str(turn["turn"]),
                str(turn["prompt_tokens"]),
                name,
                f"{r['ttft_ms']:.0f}",
                f"{r['decode_tok_s'] or 0:.2f}",
                f"{r['latency_ms']:.0f}",
                *ratios,
                *spec,
                "yes" if r["exact"] else "no",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Run the benchmark (the module docstring); writes turns.json and turns.md under --out."""
    from transformers import AutoTokenizer

    from benchmarks.serve import specdec_services, vllm_server
    from specdec.models import check_pair, choose

    cores = _check(args)
    found = check_pair(choose(args.models))  # pulled, and a draft that fits the target
    target = str(found["target"])
    tokenizer = AutoTokenizer.from_pretrained(str(found["tokenizer"]))
    ids = source_ids(tokenizer)
    need = args.prompt_tokens + args.added_tokens * (args.turns - 1)
    if len(ids) < need:
        from specdec.errors import UserError

        raise UserError(f"{SOURCE} has {len(ids)} tokens, under the {need} the turns need", "ask for fewer tokens")
    first = str(tokenizer.decode(ids[: args.prompt_tokens]))
    added = [
        str(tokenizer.decode(ids[args.prompt_tokens + k * args.added_tokens :][: args.added_tokens]))
        for k in range(args.turns - 1)
    ]
    out: Path = args.out
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    servers: dict[str, Callable[[], AbstractContextManager[str]]] = {
        "target-only": lambda: vllm_server(target, args.dtype, cores[0], logs / "vllm-server.log", prefix_caching=True),
        "specdec": lambda: specdec_services(args.models, None, None, args.dtype, cores, logs, prefix_caching=True),
        "specdec-no-reuse": lambda: specdec_services(
            args.models,
            None,
            None,
            args.dtype,
            cores,
            logs,
            prefix_caching=True,
            drafter_args=("--prefix-cache-mib", "0"),
        ),
    }
    prompts = [first]
    results: dict[str, list[dict[str, Any]]] = {}
    for name in SYSTEMS:
        print(f"{name}:", file=sys.stderr)
        results[name] = run_system(servers[name](), prompts, added, args.max_tokens, follow=name == "target-only")
    report: dict[str, Any] = {
        "meta": {
            "command": "specdec bench-turns " + " ".join(sys.argv[2:])
            if sys.argv[1:2] == ["bench-turns"]
            else " ".join(sys.argv),
            "models": args.models,
            "dtype": args.dtype,
            "source": SOURCE,
            "max_tokens": args.max_tokens,
            "cores": {"target": cores[0], "drafter_and_client": cores[1]},
        },
        "turns": [
            {
                "turn": k + 1,
                "prompt_tokens": len(tokenizer(prompts[k])["input_ids"]),
                "systems": {
                    name: {**results[name][k], "exact": results[name][k]["text"] == results["target-only"][k]["text"]}
                    for name in SYSTEMS
                },
            }
            for k in range(args.turns)
        ],
    }
    (out / "turns.json").write_text(json.dumps(report, indent=1))
    md = table(report)
    (out / "turns.md").write_text(md + "\n")
    print(md)
    return 0
