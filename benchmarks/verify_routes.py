"""Which vLLM route verifies external drafts faster? Measured side by side in one run.

Route "custom_class": the verifier's engine (vLLM's scheduler, KV cache and rejection
sampler verify drafts offered by our proposer; the request's KV cache stays in the engine).
Route "prompt_logprobs": each round submits prefix + draft as a new request with
prompt_logprobs and prefix caching; the draft is checked against the top-1 prompt
log-probs (greedy), recomputing up to a 32-token block per round on CPU.

Same workload for both: one greedy generation with gamma-token drafts taken from the
target's own output (every third block wrong at its last token), so both routes verify
the same blocks. Prints ms per round, rounds, tokens/s and the ratio.

    python -m benchmarks.verify_routes --model tiny/target
    python -m benchmarks.verify_routes --model qwen-coder/target --prompt-len 256 --tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from specdec.config import VerifierConfig
from specdec.models import resolve

if TYPE_CHECKING:
    from verifier.engine import EngineFailed, Verdict

# Route B's plain vLLM engine (LLMEngine) and its outputs are Any here: vLLM types step() as generation or
# pooling outputs and each prompt log-prob as optional, which this greedy, prompt_logprobs=1 use never meets.
PlainEngine = Any


def _drafts(reference: list[int], offset: int, gamma: int, block: int) -> list[int]:
    d = reference[offset : offset + gamma]
    if block % 3 == 2 and d:
        d = d[:-1] + [(d[-1] + 1) % 100]
    return d


def custom_class_route(model: str, prompt: list[int], n_tokens: int, gamma: int) -> tuple[list[int], dict[str, Any]]:
    """Drive the served engine in-process: first plain greedy (the reference), then with
    drafts offered on each preview, as the gateway does. Returns (reference, result)."""
    from specdec.wire import pb
    from verifier.convert import engine_params
    from verifier.engine import GenerationRequest, TargetEngine

    engine = TargetEngine.load(VerifierConfig(model=model, max_gamma=gamma, threads=0), model)
    params = engine_params(pb.SamplingParams(max_tokens=n_tokens, ignore_eos=True))  # greedy
    reference: list[int] = []
    rounds = [0]
    done = threading.Event()

    def on_verdict(v: Verdict | EngineFailed) -> None:  # runs on the engine thread
        if isinstance(v, Exception):
            raise v  # the engine thread died: the message says why
        if v.preview and reference:
            offset = v.start_position + len(v.token_ids) - len(prompt)
            engine.offer("spec", offset + len(prompt), _drafts(reference, offset, gamma, rounds[0]))
            rounds[0] += 1
        elif not v.preview:
            collected.extend(v.token_ids)
            if v.finish_reason:
                done.set()

    collected: list[int] = []
    engine.submit(GenerationRequest("plain", prompt, 0, params), on_verdict)
    done.wait()
    reference, collected = list(collected), []
    done.clear()
    t0 = time.perf_counter()
    engine.submit(GenerationRequest("spec", prompt, gamma, params), on_verdict)
    done.wait()
    elapsed = time.perf_counter() - t0
    engine.stop()
    assert collected == reference, "route A must reproduce the greedy output"
    return reference, {"route": "custom_class", "seconds": elapsed, "rounds": rounds[0]}


def _run_one(engine: PlainEngine, rid: str, ids: list[int], read_cache: bool) -> Any:  # -> RequestOutput
    from vllm import SamplingParams

    params = SamplingParams(
        max_tokens=1, temperature=0.0, prompt_logprobs=1, detokenize=False, skip_reading_prefix_cache=not read_cache
    )
    engine.add_request(rid, {"prompt_token_ids": ids}, params)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out = o
    return out


def prompt_logprobs_route(
    engine: PlainEngine, prompt: list[int], reference: list[int], gamma: int, vocab: int
) -> dict[str, Any]:
    """Each round: prefix + draft as a new request; accept while the draft is the top-1 prompt log-prob.

    When the whole prefix is cached, vLLM leaves the first draft position's log-prob
    uninitialised; that round is re-run without reading the cache (counted in `recomputed`).
    """
    context = list(prompt)
    rounds = recomputed = 0
    t0 = time.perf_counter()
    while len(context) - len(prompt) < len(reference):
        offset = len(context) - len(prompt)
        draft = _drafts(reference, offset, gamma, rounds)
        out = _run_one(engine, f"r{rounds}", context + draft, read_cache=True)
        first = out.prompt_logprobs[len(context)]
        if not first or not all(0 <= t < vocab for t in first):
            out = _run_one(engine, f"r{rounds}-again", context + draft, read_cache=False)
            recomputed += 1
        lp = out.prompt_logprobs  # [len(context + draft)] dicts token -> Logprob (rank 1 = top-1)
        accepted, new = 0, []
        for i, d in enumerate(draft):
            top = min(lp[len(context) + i].items(), key=lambda kv: kv[1].rank)[0]
            if top != d:
                new.append(top)
                break
            accepted += 1
            new.append(d)
        else:
            new.append(out.outputs[0].token_ids[0])  # bonus
        context += new
        rounds += 1
    elapsed = time.perf_counter() - t0
    assert context[len(prompt) :][: len(reference)] == reference, "route B must reproduce the greedy output"
    return {"route": "prompt_logprobs", "seconds": elapsed, "rounds": rounds, "recomputed_rounds": recomputed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny/target")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=4)
    args = ap.parse_args()
    cfg = VerifierConfig()
    from verifier.vllm_hooks import configure_vllm_env

    configure_vllm_env(cfg)
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    model = str(resolve(args.model))
    prompt = [(37 * i) % 400 + 10 for i in range(args.prompt_len)]
    reference, route_a = custom_class_route(model, prompt, args.tokens, args.gamma)
    plain = LLMEngine.from_engine_args(
        EngineArgs(
            model=model,
            dtype="float32",
            max_model_len=2048,
            enforce_eager=True,
            enable_prefix_caching=True,
            kv_cache_memory_bytes=1 << 30,
            disable_log_stats=True,
        )
    )
    route_b = prompt_logprobs_route(plain, prompt, reference, args.gamma, plain.model_config.get_vocab_size())
    results = [route_b, route_a]
    for r in results:
        r["ms_per_round"] = 1e3 * r["seconds"] / r["rounds"]
        r["tokens_per_s"] = args.tokens / r["seconds"]
    print(
        json.dumps(
            {
                "model": args.model,
                "prompt_len": args.prompt_len,
                "tokens": args.tokens,
                "gamma": args.gamma,
                "routes": results,
            },
            indent=1,
        )
    )
    a, b = results
    print(
        f"custom_class is {b['tokens_per_s'] / a['tokens_per_s']:.2f}x the tokens/s of prompt_logprobs "
        f"({b['ms_per_round']:.1f} vs {a['ms_per_round']:.1f} ms per round)"
    )


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    main()
