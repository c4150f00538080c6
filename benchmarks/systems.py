"""The systems `specdec bench` compares, each measured the same way.

The in-process baselines run in a child process, a list of jobs one after another (one vLLM
import, and each engine after the first starts warm: ~4 s instead of ~28 s for the tiny pair):

    python -m benchmarks.systems '<JSON list of jobs>'

Each job gives its `cores`: the child pins itself to them and sets its thread count before
the job's engine starts. It prints JSON lines on stdout: {"event": "request"} after each
finished request (for the progress bar) and {"event": "result", "job": i, ...} per workload
of job i. (vLLM 0.32: no engine can start in a process after an n-gram engine ran there —
its kernel-override scan trips over a numba object — so `child_groups` puts an n-gram job
last in its child.) specdec itself is measured from a
gRPC client in the parent (`run_specdec`), against the three services.

Terms:
    workload    (concurrency c, prompts): c = 1 runs the prompts one after another; c > 1
                submits c requests at once (prompts cycled) and waits for all of them.
    chunk       the tokens that reach the caller together: one engine step's output for
                vLLM and specdec, one assisted-generation step for transformers. Chunks
                are recorded as (seconds since the request was submitted, token count).

A request record: {"ttft": s, "e2e": s, "chunks": [[t, n], ...], "tokens": [ids...]}.
Speculation counters (drafts, draft_tokens, accepted, steps) come from the engine where
it reports them (vLLM's spec-decode metrics; specdec's per-request stats), else null.
specdec's also carry held_steps (the per-request SpecStats summed) and, given the drafter's
/metrics address, its batch size over the workload (`drafter_batch_rows`: the difference of
its specdec:drafter_batch_rows histogram before and after), its commits' wait, the breaks no
branch could cover and the forwards a rejecting commit stopped (`drafter_counts`,
`DrafterSnapshot`).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specdec.telemetry import LONG_LOOP_DELAY_S  # a bucket bound of LOOP_DELAY: the bench counts the items past it

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from specdec.wire import pb

Emit = Callable[[dict[str, Any]], None]


def _emit_stdout(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _batches(prompts: list[list[int]], concurrency: int) -> list[list[list[int]]]:
    """c = 1: each prompt alone; c > 1: one batch of c requests, prompts cycled."""
    if concurrency == 1:
        return [[p] for p in prompts]
    return [[prompts[i % len(prompts)] for i in range(concurrency)]]


# ---- vLLM in-engine (target-only, draft_model, ngram) -----------------------------------
def run_vllm(job: dict[str, Any], emit: Emit = _emit_stdout) -> None:
    """job: target, speculative_config (None: target-only), threads, prompts, max_tokens,
    concurrency (list), dtype, async_scheduling (optional: None is vLLM's default). The engine's
    context, KV cache, batch size and budget are the verifier's CPU settings, as specdec's rows run."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("NUMBA_NUM_THREADS", "1")
    os.environ["OMP_NUM_THREADS"] = str(job["threads"])
    from vllm import EngineArgs, SamplingParams
    from vllm.outputs import RequestOutput
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.llm_engine import LLMEngine

    from verifier.vllm_hooks import engine_settings_from_env, request_cpu_amx

    settings = engine_settings_from_env("cpu")  # the verifier's context, KV cache, batch size and budget
    request_cpu_amx()  # as the verifier does: vLLM's bfloat16 attention would die of SIGILL without it

    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=job["target"],
            tokenizer=job["target"],
            dtype=job["dtype"],
            max_model_len=settings.max_model_len,  # type: ignore[arg-type]  # vLLM annotates int; -1 is its auto-fit
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            enforce_eager=True,
            enable_prefix_caching=False,
            kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
            speculative_config=job["speculative_config"],
            disable_log_stats=False,
            async_scheduling=job.get("async_scheduling"),  # None: vLLM's default (on where supported)
        )
    )
    params = SamplingParams(
        temperature=0.0,
        max_tokens=job["max_tokens"],
        ignore_eos=True,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
    )
    counter = [0]

    def run(batch: list[list[int]], max_tokens: int | None = None, report: bool = True) -> list[dict[str, Any]]:
        p = params if max_tokens is None else params.clone()
        if max_tokens is not None:
            p.max_tokens = max_tokens
        records: dict[str, dict[str, Any]] = {}
        t0 = time.perf_counter()
        for ids in batch:
            counter[0] += 1
            rid = f"r{counter[0]}"
            engine.add_request(rid, {"prompt_token_ids": ids}, p)
            records[rid] = {"chunks": [], "tokens": []}
        while engine.has_unfinished_requests():
            outs = engine.step()
            now = time.perf_counter() - t0
            for out in outs:
                rec = records.get(out.request_id)
                if rec is None or not isinstance(out, RequestOutput):  # (a generation engine makes no pooling outputs)
                    continue
                new = list(out.outputs[0].token_ids)
                if new:
                    rec["chunks"].append([now, len(new)])
                    rec["tokens"].extend(new)
                if out.finished:
                    rec["e2e"] = now
                    if report:
                        emit({"event": "request"})
        for rec in records.values():
            rec["ttft"] = rec["chunks"][0][0]
        return list(records.values())

    def spec_counters() -> dict[str, float] | None:
        if job["speculative_config"] is None:
            return None
        names = {
            "vllm:spec_decode_num_drafts": "drafts",
            "vllm:spec_decode_num_draft_tokens": "draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "accepted",
        }
        found = {names[m.name]: float(m.value) for m in engine.get_metrics() if m.name in names and hasattr(m, "value")}
        return found if len(found) == 3 else None

    run([job["warmup_prompt"]], max_tokens=8, report=False)
    for c in job["concurrency"]:
        before = spec_counters()
        t0 = time.perf_counter()
        requests = [r for batch in _batches(job["prompts"], c) for r in run(batch)]
        wall = time.perf_counter() - t0
        after = spec_counters()
        spec = {k: after[k] - before[k] for k in after} if before and after else None
        emit({"event": "result", "concurrency": c, "wall_s": wall, "requests": requests, "spec": spec})
    engine.engine_core.shutdown()  # the executor and its model; run_jobs frees the rest


# ---- transformers assisted generation -------------------------------------------------------
def run_hf_assisted(job: dict[str, Any], emit: Emit = _emit_stdout) -> None:
    """job: target, draft, gamma, threads, prompts, max_tokens, dtype (batch 1 only)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    torch.set_num_threads(int(job["threads"]))
    dtype = job["dtype"] if job["dtype"] == "auto" else getattr(torch, job["dtype"])  # auto: the checkpoint's
    # transformers' auto models, Any at this boundary: their declared types contradict this use (eval() is
    # untyped, generate() asks for a `self` the auto class is not)
    target: Any = AutoModelForCausalLM.from_pretrained(job["target"], dtype=dtype)
    draft: Any = AutoModelForCausalLM.from_pretrained(job["draft"], dtype=dtype)
    target.eval()
    draft.eval()
    # a fixed gamma (transformers reads these from the assistant's generation config)
    draft.generation_config.num_assistant_tokens = int(job["gamma"])
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0

    class Clock(BaseStreamer):
        """Timestamps each step's new tokens (the first put is the prompt)."""

        def __init__(self, t0: float) -> None:
            self.t0, self.prompt_seen = t0, False
            self.chunks: list[list[float]] = []  # [seconds since t0, new tokens] per step
            self.tokens: list[int] = []

        def put(self, value: Any) -> None:
            if not self.prompt_seen:
                self.prompt_seen = True
                return
            ids = value.reshape(-1).tolist()
            self.chunks.append([time.perf_counter() - self.t0, len(ids)])
            self.tokens.extend(ids)

        def end(self) -> None:
            pass

    def generate(ids: list[int], max_tokens: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        clock = Clock(t0)
        with torch.inference_mode():
            target.generate(
                input_ids=torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                assistant_model=draft,
                do_sample=False,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                streamer=clock,
                pad_token_id=0,
            )
        return {
            "chunks": clock.chunks,
            "tokens": clock.tokens,
            "ttft": clock.chunks[0][0],
            "e2e": time.perf_counter() - t0,
        }

    generate(job["warmup_prompt"], 8)
    t0 = time.perf_counter()
    requests = []
    for ids in job["prompts"]:
        requests.append(generate(ids, job["max_tokens"]))
        emit({"event": "request"})
    emit({"event": "result", "concurrency": 1, "wall_s": time.perf_counter() - t0, "requests": requests, "spec": None})


# ---- specdec, over gRPC ----------------------------------------------------------------------
BATCH_ROWS = "specdec:drafter_batch_rows"  # the drafter's histogram of rows per draft forward
COMMITS = "specdec:drafter_commit_seconds"  # the drafter's histogram of a commit's wait for its session
UNCOVERED = "specdec:drafter_branch_uncovered"  # the drafter's broken chains no branch could cover, by gamma
STOPPED = "specdec:drafter_forwards_stopped"  # the drafter's forwards a rejecting commit stopped part-way
LOOP_DELAY = "specdec:drafter_loop_delay_seconds"  # the drafter's histogram of an item's wait for its event loop


@dataclass(frozen=True)
class Histogram:
    """One Prometheus histogram as scraped: cumulative counts by upper bound `le` (the last
    bound is +inf), the observations' sum and count."""

    buckets: dict[float, float]
    sum: float
    count: float


def scrape(metrics_url: str) -> dict[str, Metric]:
    """A service's Prometheus families (`http://HOST:PORT/metrics`), one GET: {family name: family}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def histogram(families: dict[str, Metric], name: str, where: str) -> Histogram:
    """The histogram `name` of scraped `families` (`where`: their endpoint, for the error)."""
    family = families.get(name)
    if family is None:
        raise RuntimeError(f"{where} has no histogram {name}")
    buckets: dict[float, float] = {}
    total, count = 0.0, 0.0
    for sample in family.samples:
        if sample.name == f"{name}_bucket":
            buckets[float(sample.labels["le"])] = float(sample.value)
        elif sample.name == f"{name}_sum":
            total = float(sample.value)
        elif sample.name == f"{name}_count":
            count = float(sample.value)
    return Histogram(dict(sorted(buckets.items())), total, count)


def scrape_histogram(metrics_url: str, name: str) -> Histogram:
    """The histogram `name` from a service's Prometheus endpoint."""
    return histogram(scrape(metrics_url), name, metrics_url)


@dataclass(frozen=True)
class DrafterSnapshot:
    """What the bench reads from the drafter's /metrics before and after a workload, in one
    scrape: its batch rows (BATCH_ROWS, see `batch_rows`), its commits' wait (COMMITS), the
    broken chains no branch could cover (UNCOVERED, summed over gamma), the forwards a
    rejecting commit stopped (STOPPED) and its items' wait for the event loop (LOOP_DELAY)."""

    rows: Histogram
    commits: Histogram
    uncovered: float
    stopped: float
    delays: Histogram

    @classmethod
    def scrape(cls, metrics_url: str) -> DrafterSnapshot:
        families = scrape(metrics_url)

        def total(name: str) -> float:  # a counter's value, summed over its labels
            found = families.get(name)
            if found is None:
                raise RuntimeError(f"{metrics_url} has no counter {name}")
            return sum(float(s.value) for s in found.samples if s.name == f"{name}_total")

        return cls(
            histogram(families, BATCH_ROWS, metrics_url),
            histogram(families, COMMITS, metrics_url),
            total(UNCOVERED),
            total(STOPPED),
            histogram(families, LOOP_DELAY, metrics_url),
        )

    def since(self, before: DrafterSnapshot) -> dict[str, float]:
        """The workload's commits, their seconds, its uncovered breaks, its stopped forwards, and
        the items it sent, their seconds waiting for the event loop and how many waited more than
        LONG_LOOP_DELAY_S (`spec["drafter_counts"]`)."""
        delays = self.delays.count - before.delays.count
        quick = self.delays.buckets.get(LONG_LOOP_DELAY_S, 0.0) - before.delays.buckets.get(LONG_LOOP_DELAY_S, 0.0)
        return {
            "commits": self.commits.count - before.commits.count,
            "commit_s": self.commits.sum - before.commits.sum,
            "uncovered": self.uncovered - before.uncovered,
            "stopped": self.stopped - before.stopped,
            "items": delays,
            "loop_delay_s": self.delays.sum - before.delays.sum,
            "long_loop_delays": delays - quick,
        }


def batch_rows(before: Histogram, after: Histogram) -> dict[str, Any]:
    """The drafter's batch size over a workload, from its specdec:drafter_batch_rows histogram
    scraped before and after: `forwards` (draft forwards made), `mean` rows per forward,
    `max` (the bound of the highest bucket that gained; exact up to 32 rows, whose buckets are
    the integers) and `histogram` {bound: forwards with rows in (the previous bound, bound]}
    (rows 1 to 32: that many rows exactly). mean and max are None when no forward was made;
    max is None too when a forward had more rows than the last finite bound (256).

    `mean` comes from the buckets when every forward fell in a one-integer bucket (rows up to
    32), else from `_sum`. The buckets are one snapshot, but `_sum` is not part of it: the
    drafter keeps drafting while it is scraped, and prometheus_client adds an observation to
    `_sum` before its bucket and reads the buckets before `_sum`, so a scrape can count an
    observation's rows but not the observation (one bench row read a mean of 51/52 rows)."""
    forwards = int(after.count - before.count)
    histogram: dict[str, int] = {}
    rows, exact = 0, True  # rows counted from the buckets; exact while each was a one-integer bucket
    below, previous = 0, 0.0
    for le, cumulative in after.buckets.items():
        gained = int(cumulative - before.buckets.get(le, 0.0))
        if gained > below:
            histogram["+Inf" if le == float("inf") else f"{le:g}"] = gained - below
            exact = exact and le - previous <= 1 and le == round(le)  # rows in (b - 1, b]: exactly b
            rows += int(le) * (gained - below) if exact else 0
        below, previous = gained, le
    top = next(reversed(histogram), None)  # more than the last finite bound (256): no max to give
    mean = (rows if exact else after.sum - before.sum) / forwards if forwards else None
    return {
        "forwards": forwards,
        "mean": mean,
        "max": int(float(top)) if top is not None and top != "+Inf" else None,
        "histogram": histogram,
    }


def run_specdec(
    gateway: str,
    prompts: list[list[int]],
    max_tokens: int,
    gamma: int,
    concurrency: int,
    on_request: Callable[[], None] = lambda: None,
    drafter_metrics: str | None = None,
) -> dict[str, Any]:
    """One workload through a running gateway; per-request chunks and speculation stats.
    `drafter_metrics`: the drafter's /metrics URL, to record its batch size over the workload
    (`spec["drafter_batch_rows"]`, see `batch_rows`)."""
    from gateway.client import GatewayClient, generation_spec

    client = GatewayClient(gateway)  # one channel for the workload, as a client service keeps

    def one(ids: list[int], out: dict[str, Any]) -> None:
        spec = generation_spec(
            ids, max_tokens=max_tokens, gamma=gamma, drafter="model" if gamma else "none", ignore_eos=True
        )
        chunks: list[list[float]] = []  # [seconds since t0, new tokens] per message
        tokens: list[int] = []
        last: pb.GenerateStreamResponse | None = None
        t0 = time.perf_counter()
        for msg in client.stream(spec):
            if msg.token_ids:
                chunks.append([time.perf_counter() - t0, len(msg.token_ids)])
                tokens.extend(msg.token_ids)
            last = msg
        e2e = time.perf_counter() - t0
        if last is None:  # the gateway ends every stream with a chunk carrying the finish reason
            raise RuntimeError("the gateway's stream ended without a chunk")
        s = last.stats
        out.update(
            chunks=chunks,
            tokens=tokens,
            ttft=chunks[0][0],
            e2e=e2e,
            stats={
                "drafts": s.speculative_steps,
                "draft_tokens": s.drafted_tokens,
                "accepted": s.accepted_tokens,
                "steps": s.target_steps,
                "verify_ms": s.verify_ms,
                "draft_wait_ms": s.draft_wait_ms,
                "draft_ms": s.draft_ms,
                "draft_tokens_sent": s.tokens_received,
                "rejections": s.rejected_steps,
                "fallback": s.fallback_reason,
                "max_draft_wait_ms": s.max_draft_wait_ms,
                "branches_drafted": s.branches_drafted,
                "branches_used": s.branches_used,
                "branch_misses": s.branch_misses,
                "held_steps": s.held_steps,
            },
        )
        on_request()

    before = DrafterSnapshot.scrape(drafter_metrics) if drafter_metrics else None
    t0 = time.perf_counter()
    requests: list[dict[str, Any]] = []
    for batch in _batches(prompts, concurrency):
        outs: list[dict[str, Any]] = [{} for _ in batch]
        threads = [threading.Thread(target=one, args=(ids, o)) for ids, o in zip(batch, outs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if any("tokens" not in o for o in outs):
            raise RuntimeError("a specdec request failed (see the service logs)")
        requests.extend(outs)
    wall = time.perf_counter() - t0
    client.close()
    keys = (
        "drafts",
        "draft_tokens",
        "accepted",
        "steps",
        "verify_ms",
        "draft_wait_ms",
        "draft_ms",
        "draft_tokens_sent",
        "rejections",
        "branches_drafted",
        "branches_used",
        "branch_misses",
        "held_steps",
    )
    spec: dict[str, Any] = {k: float(sum(r["stats"][k] for r in requests)) for k in keys}
    if drafter_metrics and before is not None:
        after = DrafterSnapshot.scrape(drafter_metrics)
        spec["drafter_batch_rows"] = batch_rows(before.rows, after.rows)
        spec["drafter_counts"] = after.since(before)
    spec["fallbacks"] = sum(1 for r in requests if r["stats"]["fallback"])
    spec["max_draft_wait_ms"] = max((r["stats"]["max_draft_wait_ms"] for r in requests), default=0.0)
    return {"event": "result", "concurrency": concurrency, "wall_s": wall, "requests": requests, "spec": spec}


def _tagged(emit: Emit, job: int) -> Emit:
    """`emit` with each event tagged "job": `job`."""
    return lambda obj: emit({**obj, "job": job})


def run_jobs(jobs: list[dict[str, Any]], emit: Emit = _emit_stdout) -> None:
    """Each job in order, pinned to its `cores` with as many threads; results tagged "job": i."""
    import torch

    set_threads = torch.set_num_threads  # vLLM's CPU worker replaces it once an engine started
    for i, job in enumerate(jobs):
        os.sched_setaffinity(0, set(job["cores"]))
        set_threads(len(job["cores"]))
        runner = {"vllm": run_vllm, "hf-assisted": run_hf_assisted}[job["kind"]]
        runner({**job, "threads": len(job["cores"])}, _tagged(emit, i))
        if job["kind"] == "vllm":
            # vLLM freezes the garbage collector's generations once it built an engine (gc.freeze),
            # so a plain gc.collect never frees the engine's cycles: on a 24 GiB host the second
            # qwen-coder engine found 0.3 GiB for its KV cache. This unfreezes, tears the process
            # groups down and collects.
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
        gc.collect()  # the job's engine and its KV cache go before the next one starts


def child_groups(jobs: list[dict[str, Any]]) -> list[list[int]]:
    """Which jobs (indices) share a child: every job in one, except that an n-gram vLLM job
    ends its child (see the module docstring), so a second one starts another."""
    ngram = [
        i
        for i, j in enumerate(jobs)
        if j["kind"] == "vllm" and (j.get("speculative_config") or {}).get("method") == "ngram"
    ]
    rest = [i for i in range(len(jobs)) if i not in ngram]
    groups = [rest + ngram[:1], *([i] for i in ngram[1:])]
    return [g for g in groups if g]


def main() -> None:
    job = json.loads(sys.argv[1])
    run_jobs(job if isinstance(job, list) else [job])


if __name__ == "__main__":
    main()
