"""Every documented `specdec` command works, on the tiny pair.

The documented commands are those of README.md, of the docs site's pages (docs/**/*.md) and of
deploy/README.md (the site's Deployment page includes it). The docs say each of their `specdec`
commands also runs on the tiny pair with `qwen-coder` replaced by `tiny` (`qwen-coder/draft` by
`tiny/draft-mid`; docs/usage.md "Using it"). This module takes every line of their ```bash /
```sh / ```console / ``` blocks that runs `specdec` (after any VAR=value assignments), makes that
replacement and:

- runs the local ones (models, eval-draft) as they are;
- starts `specdec up` as documented (env assignments included, free ports added, /metrics and
  REST off), runs `specdec generate` lines against it (`--address` added) and `specdec traces`
  lines on the spans it wrote (`ID` replaced by a real request id), then stops it with Ctrl-C,
  which must end it cleanly;
- only parses the commands listed in NOT_RUN (long-running services, full benchmarks, runs on
  the real pair), each with its reason: their flags must exist and their values parse (and, for
  `serve`, build the service's config and name models the registry knows).

A command fails its test when it exits non-zero or prints a traceback. A synopsis's optional
`[...]` parts are included; `a|b` alternatives must agree after the replacement. A command
written on several pages is run once. `make` lines are not `specdec` lines (`make demo` and
`make bench` run elsewhere).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from specdec import config, models
from specdec_cli import main as cli
from specdec_cli.launch import free_port

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"


def documented_pages() -> list[Path]:
    """README.md, every page of the docs site (docs/**/*.md) and deploy/README.md."""
    return [README, *sorted((REPO / "docs").rglob("*.md")), REPO / "deploy" / "README.md"]


SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
# The docs' own rule: qwen-coder -> tiny; qwen-coder/draft -> the tiny pair's default draft.
REPLACE = (("qwen-coder/draft", models.PAIRS["tiny"].draft), ("qwen-coder", "tiny"))
TRACEBACK = "Traceback (most recent call last)"
TIMEOUT_S = 300  # one command (models, eval-draft, generate, traces): seconds on tiny
# `specdec up` getting ready: longer than its own start bound (launch.Cluster.start, 900 s), so a start
# that fails ends with `up`'s own error naming the service (300 s was too short here with both cores
# busy with another job: `make test` beside stress-ng --cpu 2)
READY_TIMEOUT_S = 1200

# Documented commands this test does not run, exactly as the docs write them (comment dropped),
# with the reason. test_not_run_lists_only_documented_commands keeps this list honest.
_SERVICE = "a long-running service; `specdec up` (run here) starts the same `specdec serve` commands"
_VOCAB = (
    "a sample of your traffic's text (or this VM's sources, minutes on the real pair); tests/e2e/test_draft_vocab.py "
    "runs `specdec draft-vocab` on stdlib sources for the tiny draft"
)
_BENCH = "the full benchmark takes minutes even on tiny; `specdec bench --quick` runs in tests/benchmarks/test_bench.py"
_SERVE_C8 = (
    "starts vLLM's OpenAI server and the services on the real pair (minutes); "
    "tests/benchmarks/test_serve.py runs the serve-c8, serve-c1, serve-long and serve-queue workloads end to end "
    "on tiny"
)
_LINK = (
    "makes network namespaces and runs the benchmark across them (minutes); `specdec bench-link --quick` "
    "runs in tests/benchmarks/test_link.py"
)
_DRAFTER = (
    "measures 2 s of CPU time per session count (up to 32) and mode (minutes); "
    "tests/benchmarks/test_drafter_capacity.py runs `specdec bench-drafter` on the tiny draft "
    "with tiny settings"
)
_TURNS = (
    "starts vLLM's OpenAI server and the services three times on the real pair (minutes); "
    "tests/benchmarks/test_turns.py runs `specdec bench-turns` end to end on tiny"
)
_DRAFTER_SHAPE = (
    "builds a random-init model of the Qwen2.5-Coder-0.5B draft's shapes (24 layers, "
    "vocab 151,936) and times it: a benchmark of a real-sized model, not run on this shared machine; "
    "the same command on the "
    "tiny draft runs from the line without --shape"
)
_GPU = (
    "needs a CUDA GPU (none here); tests/benchmarks/test_drafter_capacity.py checks that --device cuda "
    "says so, and runs the benchmark on the tiny draft"
)
_QWEN_DEFAULTS = (
    "no pair on the line to replace (eval-draft's defaults are the qwen-coder pair); the same "
    "command on tiny runs from the `specdec eval-draft --target ... --draft ...` line"
)
_HF = (
    "names Hugging Face repo ids that are not in this machine's cache (no hub here); "
    "tests/e2e/test_model_refs.py serves the tiny pair by repo id with HF_HUB_OFFLINE=1"
)
NOT_RUN = {
    "specdec up --target meta-llama/Llama-3.1-8B-Instruct --draft meta-llama/Llama-3.2-1B-Instruct": _HF,
    "specdec demo --target Qwen/Qwen3-8B --draft Qwen/Qwen3-0.6B": _HF,
    "specdec bench --target Qwen/Qwen3-8B --draft Qwen/Qwen3-0.6B --systems target-only,specdec": _HF,
    "specdec serve verifier --model Qwen/Qwen3-8B --revision main --dtype bfloat16": _SERVICE,
    "specdec serve drafter  --model Qwen/Qwen3-0.6B --target Qwen/Qwen3-8B": _SERVICE,
    "specdec serve gateway  --tokenizer Qwen/Qwen3-8B --drafter-address HOST:50052 --verifier-address HOST:50053": _SERVICE,  # noqa: E501 (a README command, verbatim)
    "specdec serve drafter --model Qwen/Qwen3-0.6B --device cuda": _SERVICE,
    "specdec serve drafter --model Qwen/Qwen3-0.6B --device auto": _SERVICE,
    "specdec serve drafter --model qwen-coder/draft": _SERVICE,
    "specdec serve drafter --no-batch-drafts": _SERVICE,
    "specdec serve drafter --forward transformers": _SERVICE,
    "specdec serve drafter --draft-confidence auto": _SERVICE,
    "specdec serve drafter --draft-confidence 0.4": _SERVICE,
    "specdec serve drafter --draft-confidence off": _SERVICE,
    "specdec bench --models qwen-coder --workloads serve-c8 --max-tokens 64 --out bench-serve-c8": _SERVE_C8,
    "specdec bench --models qwen-coder --workloads serve-c8,serve-c1 --max-tokens 64 --out bench-serve": _SERVE_C8,
    "SPECDEC_MAX_NUM_BATCHED_TOKENS=4096 specdec bench --models qwen-coder --workloads serve-c8 --max-tokens 64 "
    "--out bench-serve-c8-4096": _SERVE_C8,
    "specdec bench --models qwen-coder --workloads serve-c8 --max-tokens 64 --serve-vllm-dtype auto "
    "--out bench-serve-c8-auto": _SERVE_C8,
    "specdec bench --models qwen-coder --workloads serve-c8 --max-tokens 64 --dtype bfloat16 "
    "--out bench-serve-c8-bf16": _SERVE_C8,
    "specdec bench --models qwen-coder --workloads serve-c8 --max-tokens 64 --dtype auto "
    "--out bench-serve-c8-untold": _SERVE_C8,
    "specdec bench --models qwen-coder --workloads serve-long --max-tokens 64 --dtype auto "
    "--out bench-serve-long": _SERVE_C8,
    "SPECDEC_MAX_NUM_BATCHED_TOKENS=512 specdec bench --models qwen-coder --workloads serve-c8 --max-tokens 64 "
    "--dtype auto --out bench-serve-c8-512": _SERVE_C8,
    "specdec bench --models qwen-coder --workloads serve-c8 --max-tokens 64 --dtype auto "
    "--out bench-serve-c8": _SERVE_C8,
    "specdec bench --models qwen-coder --workloads serve-c1 --max-tokens 64 --dtype auto "
    "--out bench-serve-c1": _SERVE_C8,
    "specdec bench --models qwen-coder --workloads serve-queue --max-tokens 64 --dtype float32 --serve-rate 0.1 "
    "--out bench-serve-queue": _SERVE_C8,
    "specdec bench --models qwen-coder --workloads serve-queue --max-tokens 64 --dtype float32 --serve-rate 0.05 "
    "--out bench-serve-queue-0.05": _SERVE_C8,
    "specdec bench --models qwen-coder --workloads serve-queue --max-tokens 64 --dtype float32 "
    "--out bench-serve-queue-auto": _SERVE_C8,
    "specdec bench --models qwen-coder --systems target-only,specdec --workloads code --gammas 4 --concurrency 4,16 "
    "--dtype auto --out bench-load": _BENCH,
    "SPECDEC_MAX_NUM_BATCHED_TOKENS=512 specdec bench --models qwen-coder --workloads serve-long --max-tokens 64 "
    "--dtype auto --out bench-serve-long-512": _SERVE_C8,
    "SPECDEC_MAX_NUM_BATCHED_TOKENS=512 specdec bench --models qwen-coder --systems target-only,specdec "
    "--workloads code --gammas 4 --concurrency 4,16 --dtype auto --out bench-load-512": _BENCH,
    ".venv/bin/specdec serve drafter --host 0.0.0.0 --port 50052 --model qwen-coder/draft --threads 4": _SERVICE,
    "specdec serve verifier --model qwen-coder/target --port 50053": _SERVICE,
    "specdec serve drafter  --model qwen-coder/draft  --port 50052": _SERVICE,
    "specdec serve gateway  --drafter-address HOST:50052 --verifier-address HOST:50053 --tokenizer qwen-coder/target": _SERVICE,  # noqa: E501 (a README command, verbatim)
    "specdec serve verifier --host 10.0.0.1 --model qwen-coder/target": _SERVICE,
    "specdec serve drafter --host 10.0.0.2 --model qwen-coder/draft": _SERVICE,
    "SPECDEC_API_KEYS=sk-team-a specdec serve gateway --host 10.0.0.3 --drafter-address 10.0.0.2:50052 "
    "--verifier-address 10.0.0.1:50053": _SERVICE,
    "specdec bench --models qwen-coder --out bench-results": _BENCH,
    "specdec bench --models qwen-coder --workloads long,c8 --systems target-only,specdec --out bench-long-c8": _BENCH,
    "specdec bench --models qwen-coder --systems target-only,specdec --workloads code --gammas 4 "
    "--concurrency 1,4,16 --out bench-load": _BENCH,
    "specdec bench --models qwen-coder --systems target-only,specdec --workloads code --gammas 4 "
    "--concurrency 4,16 --out bench-load-bound": _BENCH,
    "specdec bench --models qwen-coder --systems target-only,specdec --workloads code --gammas 4 "
    "--concurrency 4,16 --dtype auto --out bench-load-auto": _BENCH,
    "specdec bench --models qwen-coder --systems target-only,vllm-draft,specdec,specdec-confidence "
    "--workloads code --gammas 2,4,8 --concurrency 1 --out bench-batch1": _BENCH,
    "specdec bench --models qwen-coder --prompts-file my-prompts.jsonl --systems target-only,vllm-draft,specdec "
    "--gammas 2,4 --concurrency 1,8 --out bench-mine": _BENCH,
    "specdec bench --models tiny --systems specdec --workloads code --gammas 4 --concurrency 1,4,16 --prompts 2 "
    "--max-tokens 16 --out bench-tiny": _BENCH,
    "specdec bench-link --models qwen-coder --out bench-link-results": _LINK,
    "specdec bench-link --quick": _LINK,
    "specdec bench-drafter --core 0 --out bench-drafter": _DRAFTER,
    "specdec bench-turns --models qwen-coder --out bench-turns": _TURNS,
    "specdec bench-turns --models qwen-coder --dtype float32 --out bench-turns-fp32": _TURNS,
    "specdec bench-drafter --core 0 --copies 16 --prompt 256 --shape qwen2.5-0.5b --quantize int8": _DRAFTER_SHAPE,
    "specdec bench-drafter --core 0 --shape qwen2.5-0.5b --quantize int8 --prompt 32 --seconds 2 --min-rounds 3 "
    "--warmup 1 --out bench-drafter-qwen": _DRAFTER_SHAPE,
    "specdec bench-drafter --core 0 --shape qwen2.5-0.5b --quantize int8 --sessions 1,16 --prompt 256 --seconds 2 "
    "--min-rounds 3 --warmup 1 --out bench-drafter-qwen-256": _DRAFTER_SHAPE,
    "specdec bench-drafter --device cuda --shape qwen2.5-0.5b --seconds 1 --out bench-drafter-h200": _GPU,
    "specdec bench-drafter --model qwen-coder/draft --quantize int8 --sessions 1,4 --core 1 --seconds 2 "
    "--out bench-drafter-qwen": _DRAFTER,
    "specdec bench-drafter --model qwen-coder/draft --quantize int8 --forward-ab --sessions 1,4,1,4 --core 1 "
    "--seconds 3 --out forward-ab-qwen": _DRAFTER,
    "specdec bench --models qwen-coder --systems target-only,vllm-draft,specdec --workloads code --gammas 4,8 "
    "--concurrency 1 --dtype auto --out bench-batch1-auto": _BENCH,
    "specdec bench --models qwen-coder --systems target-only,vllm-draft,specdec --workloads code --gammas 4 "
    "--concurrency 1 --dtype auto --out bench-batch1-epyc": _BENCH,
    "SPECDEC_TRACE_FILE=spans.jsonl specdec bench --models qwen-coder --systems specdec --workloads code "
    "--gammas 4 --concurrency 1 --dtype auto --out bench-batch1-trace": _BENCH,
    "specdec bench --models qwen-coder --systems specdec --workloads code --gammas 4 --concurrency 1 "
    "--dtype auto --out bench-batch1-gate": _BENCH,
    "specdec bench --models qwen-coder --systems specdec --workloads code --gammas 4 --concurrency 1 "
    "--dtype auto --out bench-batch1-ride": _BENCH,
    "SPECDEC_RIDE_BRANCHES=0 specdec bench --models qwen-coder --systems specdec --workloads code --gammas 4 "
    "--concurrency 1 --dtype auto --out bench-batch1-ride": _BENCH,
    "specdec bench --models qwen-coder --systems specdec --prompts-file benchmarks/long_source_prompt.jsonl "
    "--max-tokens 128 --gammas 4 --concurrency 1 --dtype auto --out bench-batch1-long": _BENCH,
    "SPECDEC_RIDE_BRANCHES=0 specdec bench --models qwen-coder --systems specdec --prompts-file "
    "benchmarks/long_source_prompt.jsonl --max-tokens 128 --gammas 4 --concurrency 1 --dtype auto "
    "--out bench-batch1-long": _BENCH,
    "specdec bench --models qwen-coder --systems target-only,specdec --workloads code --gammas 4 --concurrency 4,16 "
    "--dtype auto --draft-vocab qwen-vocab-64k.json --out vocab-load": _BENCH,
    "specdec bench --models qwen-coder --systems target-only,vllm-draft,specdec --workloads code --gammas 4 "
    "--concurrency 1 --dtype auto --draft-vocab qwen-vocab-64k.json --out bench-batch1-vocab": _BENCH,
    "specdec bench-drafter --model qwen-coder/draft --quantize int8 --draft-vocab-ab qwen-vocab-64k.json "
    "--sessions 1,4,1,4 --core 1 --seconds 3 --out vocab-ab-qwen": _DRAFTER,
    "specdec draft-vocab ./traffic-sample/ --model qwen-coder/draft --out draft-vocab.json": _VOCAB,
    "specdec serve drafter --draft-vocab draft-vocab.json": _SERVICE,
    "specdec draft-vocab .venv/lib/python3.11/site-packages/transformers /usr/include /usr/lib/node_modules/npm "
    "--size 65536 --out qwen-vocab-64k.json": _VOCAB,
    "OMP_NUM_THREADS=1 specdec eval-draft --threads 1 --max-new-tokens 64": _QWEN_DEFAULTS,
    "OMP_NUM_THREADS=1 specdec eval-draft --threads 1 --max-new-tokens 64 --gammas 4 --quantize int8": _QWEN_DEFAULTS,
    "OMP_NUM_THREADS=1 specdec eval-draft --threads 1 --max-new-tokens 64 --gammas 4 --quantize int8 --draft-vocab "
    "qwen-vocab-64k.json": _QWEN_DEFAULTS,
    "OMP_NUM_THREADS=1 specdec eval-draft --threads 1 --max-new-tokens 48 --limit 4 --gammas 4 --quantize int8": _QWEN_DEFAULTS,  # noqa: E501 (a README command, verbatim)
}
# Commands that need a running gateway (or what it exported) and long-running ones.
AGAINST_UP = {"generate", "traces"}
LONG_RUNNING = {"serve", "bench", "bench-link", "demo"}


@dataclass(frozen=True)
class Command:
    """One documented command: the docs' text and what the test runs."""

    text: str  # as the docs write it, comment dropped (NOT_RUN's key)
    env: tuple[tuple[str, str], ...]  # leading VAR=value assignments
    argv: tuple[str, ...]  # after `specdec`, replaced for the tiny pair, synopsis expanded

    @property
    def name(self) -> str:
        return self.argv[0] if self.argv else ""


def _strip_comment(line: str) -> str:
    """The line without a trailing `# comment` (a `#` outside quotes after a space)."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def _expand(tokens: list[str]) -> list[str]:
    """A synopsis's tokens with `[...]` groups included and `a|b` alternatives (equal after
    the tiny replacement) made one."""
    out = []
    for token in tokens:
        if token.startswith("["):
            token = token[1:]
        if token.endswith("]"):
            token = token[:-1]
        if "|" in token:
            choices = set(token.split("|"))
            assert len(choices) == 1, f"cannot pick one of the alternatives {token!r} for the tiny pair"
            token = choices.pop()
        if token:
            out.append(token)
    return out


def readme_commands(text: str) -> list[Command]:
    """Every `specdec` command line of the shell blocks of a markdown page's text."""
    commands, lang = [], None
    for raw in text.splitlines():
        fence = re.match(r"^\s*```\s*([\w-]*)", raw)
        if fence:
            lang = None if lang is not None else fence.group(1).lower()
            continue
        if lang not in SHELL_LANGS:
            continue
        line = raw.strip()
        if lang == "console" and line.startswith("$ "):
            line = line[2:]
        words = [w for w in line.split() if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", w)]
        if not words or Path(words[0]).name != "specdec":
            continue  # not a `specdec` line (output, make, python, pip ...)
        line = _strip_comment(line)
        tokens = shlex.split(line)
        env = []
        while tokens and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", tokens[0]):
            env.append(tuple(tokens.pop(0).split("=", 1)))
        if not tokens or Path(tokens[0]).name != "specdec":
            continue
        replaced = line
        for old, new in REPLACE:
            replaced = replaced.replace(old, new)
        argv = _expand(shlex.split(replaced)[len(env) + 1 :])
        commands.append(Command(line, tuple(env), tuple(argv)))
    return commands


def documented_commands(pages: list[Path]) -> tuple[list[Command], dict[str, list[str]]]:
    """Every `specdec` command of `pages`, each once (first page first), and the pages that
    write each (by the command's text)."""
    commands, where = [], {}
    for page in pages:
        for cmd in readme_commands(page.read_text()):
            if cmd.text not in where:
                commands.append(cmd)
                where[cmd.text] = []
            where[cmd.text].append(str(page.relative_to(REPO)))
    return commands, where


COMMANDS, WHERE = documented_commands(documented_pages())
RUN = [c for c in COMMANDS if c.text not in NOT_RUN and c.name not in AGAINST_UP and c.name != "up"]
PARSE = [c for c in COMMANDS if c.text in NOT_RUN]


def _ids(commands: list[Command]) -> list[str]:
    return [c.text for c in commands]


def specdec_cmd() -> list[str]:
    """The venv's `specdec` console script (what `.venv/bin/specdec` is), or the module."""
    script = Path(sys.executable).with_name("specdec")
    return [str(script)] if script.exists() else [sys.executable, "-m", "specdec_cli"]


def run(cmd: Command, cwd: Path, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """Run a documented command in `cwd`; fail its test on a non-zero exit or a traceback."""
    env = {**os.environ, **dict(cmd.env)}
    proc = subprocess.run(
        [*specdec_cmd(), *cmd.argv, *extra], cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    shown = f"`{shlex.join(['specdec', *cmd.argv, *extra])}`"
    assert TRACEBACK not in proc.stdout + proc.stderr, f"{shown} printed a traceback:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, f"{shown} exited with {proc.returncode}:\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder every documented command runs in (relative paths like spans.jsonl land here)."""
    return tmp_path_factory.mktemp("readme")


@dataclass
class Up:
    """`specdec up` as the docs start it, with what the commands that need it use."""

    proc: subprocess.Popen[str]
    argv: tuple[str, ...]
    address: str
    request_id: str
    log: Path


def _stop(proc: subprocess.Popen[str], sig: int) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=120)  # each service drains, then stops (up to 15 s each under load)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def _diagnosis(workdir: Path, ports: list[int]) -> str:
    """What a `specdec up` that never got ready (within READY_TIMEOUT_S) left: its own output, the
    tail of each service's log, and every socket listening on its ports (a second listener would
    take health checks)."""
    parts = [f"up.log:\n{(workdir / 'up.log').read_text()[-2000:]}"]
    parts += [f"{p.name}:\n{p.read_text(errors='replace')[-1500:]}" for p in sorted((workdir / "logs").glob("*.log"))]
    if shutil.which("ss"):
        query = " or ".join(f"sport = :{port}" for port in ports)
        listening = subprocess.run(["ss", "-ltnp", query], capture_output=True, text=True).stdout
        parts.append(f"listening on {ports}:\n{listening}")
    return "\n".join(parts)


@pytest.fixture(scope="module")
def up(workdir: Path) -> Iterator[Up]:
    """The docs' `specdec up` lines (all the same command on tiny; their env assignments
    together, e.g. SPECDEC_TRACE_FILE), on free ports with /metrics and REST off; one
    generation is made so the traces hold a known request id."""
    lines = [c for c in COMMANDS if c.name == "up" and c.text not in NOT_RUN]
    assert lines, "no documented `specdec up` line"
    assert len({c.argv for c in lines}) == 1, f"the `specdec up` lines differ on tiny: {[c.argv for c in lines]}"
    ports = [free_port() for _ in range(3)]
    argv = (*lines[0].argv, "--port", str(ports[0]), "--drafter-port", str(ports[1]), "--verifier-port", str(ports[2]))
    env = {**os.environ, "SPECDEC_METRICS_PORT": "0", "SPECDEC_REST_PORT": "0"}
    for line in lines:
        env.update(dict(line.env))
    log = workdir / "up.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [*specdec_cmd(), *argv],
            cwd=workdir,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while "ready: gateway" not in log.read_text():
            assert proc.poll() is None, f"`specdec up` exited with {proc.returncode}:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"not ready in {READY_TIMEOUT_S} s:\n{_diagnosis(workdir, ports)}"
            time.sleep(0.5)
        address = f"127.0.0.1:{ports[0]}"
        gen = Command("(fixture)", (), ("generate", "def add(a, b):", "--max-tokens", "16", "--json"))
        request_id = json.loads(run(gen, workdir, ("--address", address)).stdout)["request_id"]
        trace_file = env.get("SPECDEC_TRACE_FILE")
        if trace_file:  # spans are written as they end: wait (bounded) for this request's
            from specdec.errors import UserError
            from specdec_cli import traces

            path = workdir / trace_file
            while time.monotonic() < deadline:
                try:
                    if path.exists() and request_id in traces.request_ids(traces.load([path])).values():
                        break
                except UserError:  # a line being written
                    pass
                time.sleep(0.2)
        yield Up(proc, tuple(argv), address, request_id, log)
        # Ctrl-C stops `specdec up` and its three services: exit 0, no traceback. Checked here,
        # after every test that uses it (a test of its own would stop it for the tests that run
        # after it, in the random order the suite runs in): a failure is an error of the module.
        code = _stop(proc, signal.SIGINT)
        assert code == 0 and TRACEBACK not in log.read_text(), (
            f"Ctrl-C: `specdec up` exited with {code}:\n{log.read_text()[-4000:]}"
        )
    finally:
        _stop(proc, signal.SIGINT)
        try:  # whatever `up` left running in its process group (nothing, when it stopped cleanly)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_docs_have_runnable_commands() -> None:
    names = {c.name for c in COMMANDS}
    assert {"up", "generate", "models", "eval-draft", "traces", "serve"} <= names, names
    assert RUN and PARSE


def test_commands_are_followed_to_their_pages() -> None:
    """The commands that moved from README.md into docs/ are found there: the command line of
    docs/usage.md and the benchmark commands of docs/performance.md."""
    assert "docs/usage.md" in WHERE["specdec models pull qwen-coder"]
    assert "docs/performance.md" in WHERE["specdec bench --models qwen-coder --out bench-results"]


def test_not_run_lists_only_documented_commands() -> None:
    """NOT_RUN cannot rot: each entry is a command the docs have, verbatim."""
    texts = {c.text for c in COMMANDS}
    assert sorted(set(NOT_RUN) - texts) == [], "NOT_RUN entries that no documented page has any more"


@pytest.mark.parametrize("cmd", PARSE, ids=_ids(PARSE))
def test_not_run_command_parses(cmd: Command) -> None:
    """A command not run here still has flags that exist and values that parse, and the models
    it names (after the tiny replacement) are ones the registry knows. A model it leaves to a
    default (the gateway's --tokenizer, qwen-coder/target) is not the command's to name."""
    argv = list(cmd.argv)
    args = cli.build_parser(argv).parse_args(argv)
    if cmd.name == "serve":
        cfg = cli.serve_config(args)
        for field in ("model", "tokenizer"):
            if config.flag_name(field) in argv and (ref := getattr(cfg, field, "")):
                if models.hub.is_repo_id(ref) and ref.partition("/")[0] not in models.pair_names():
                    continue  # a Hugging Face repo id: resolved from a cache this machine has not (see _HF)
                assert models.resolve(ref, pull=False).is_dir()


@pytest.mark.parametrize("cmd", RUN, ids=_ids(RUN))
def test_command_runs(cmd: Command, workdir: Path) -> None:
    assert cmd.name not in LONG_RUNNING, (
        f"`{cmd.text}` would not end here: run it in a fixture (as `specdec up`) or add it to NOT_RUN with the reason"
    )
    run(cmd, workdir)


AGAINST = [c for c in COMMANDS if c.name in AGAINST_UP and c.text not in NOT_RUN]


@pytest.mark.parametrize("cmd", AGAINST, ids=_ids(AGAINST))
def test_command_runs_against_up(cmd: Command, up: Up, workdir: Path) -> None:
    """`generate` against the gateway `specdec up` started; `traces` on the spans it wrote."""
    if cmd.name == "generate":
        run(cmd, workdir, ("--address", up.address))
    else:
        argv = tuple(up.request_id if a == "ID" else a for a in cmd.argv)
        run(Command(cmd.text, cmd.env, argv), workdir)


UP = [c for c in COMMANDS if c.name == "up" and c.text not in NOT_RUN]


@pytest.mark.parametrize("cmd", UP, ids=_ids(UP))
def test_up_starts(cmd: Command, up: Up) -> None:
    assert up.argv[: len(cmd.argv)] == cmd.argv and up.proc.poll() is None
