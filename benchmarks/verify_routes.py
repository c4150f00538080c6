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

from specdec.config import VerifierConfig
from specdec.models import resolve


def _drafts(reference: list[int], offset: int, gamma: int, block: int) -> list[int]:
    d = reference[offset : offset + gamma]
    if block % 3 == 2 and d:
        d = d[:-1] + [(d[-1] + 1) % 100]
    return d


def custom_class_route(model: str, prompt: list[int], reference: list[int], gamma: int) -> dict:
    """Drive the served engine in-process: offer each block on the preview, as the gateway does."""
    from verifier.engine import GenerationRequest, TargetEngine

    engine = TargetEngine(VerifierConfig(model=model, max_gamma=gamma, threads=0), model)
    done = threading.Event()
    rounds = [0]

    def on_verdict(v) -> None:  # runs on the engine thread
        if v.preview:
            offset = v.start_position + len(v.token_ids) - len(prompt)
            engine.offer("bench", offset + len(prompt), _drafts(reference, offset, gamma, rounds[0]))
            rounds[0] += 1
        elif v.finish_reason:
            done.set()

    t0 = time.perf_counter()
    engine.submit(GenerationRequest("bench", prompt, 0.0, 1.0, -1, None, len(reference), True, gamma), on_verdict)
    done.wait()
    elapsed = time.perf_counter() - t0
    engine.stop()
    return {"route": "custom_class", "seconds": elapsed, "rounds": rounds[0]}


def prompt_logprobs_route(engine, prompt: list[int], reference: list[int], gamma: int) -> dict:
    """Each round: prefix + draft as a new request; accept while the draft is the top-1 prompt log-prob."""
    from vllm import SamplingParams

    context = list(prompt)
    rounds = 0
    t0 = time.perf_counter()
    while len(context) - len(prompt) < len(reference):
        offset = len(context) - len(prompt)
        draft = _drafts(reference, offset, gamma, rounds)
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, detokenize=False,
                                skip_reading_prefix_cache=False)
        engine.add_request(f"r{rounds}", {"prompt_token_ids": context + draft}, params)
        out = None
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    out = o
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
    assert context[len(prompt):][: len(reference)] == reference[: len(context) - len(prompt)][: len(reference)]
    return {"route": "prompt_logprobs", "seconds": elapsed, "rounds": rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny/target")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=4)
    args = ap.parse_args()
    cfg = VerifierConfig()
    from verifier.engine import configure_vllm_env

    configure_vllm_env(cfg)
    from vllm import EngineArgs, SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine

    model = str(resolve(args.model))
    prompt = [(37 * i) % 400 + 10 for i in range(args.prompt_len)]
    plain = LLMEngine.from_engine_args(EngineArgs(
        model=model, dtype="float32", max_model_len=2048, enforce_eager=True, enable_prefix_caching=True,
        kv_cache_memory_bytes=1 << 30, disable_log_stats=True))
    plain.add_request("ref", {"prompt_token_ids": prompt},
                      SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True, detokenize=False))
    reference: list[int] = []
    t0 = time.perf_counter()
    while plain.has_unfinished_requests():
        for o in plain.step():
            if o.finished:
                reference = list(o.outputs[0].token_ids)
    plain_s = time.perf_counter() - t0
    results = [prompt_logprobs_route(plain, prompt, reference, args.gamma)]
    del plain
    results.append(custom_class_route(model, prompt, reference, args.gamma))
    for r in results:
        r["ms_per_round"] = 1e3 * r["seconds"] / r["rounds"]
        r["tokens_per_s"] = args.tokens / r["seconds"]
    print(json.dumps({"model": args.model, "prompt_len": args.prompt_len, "tokens": args.tokens, "gamma": args.gamma,
                      "plain_decode_s_incl_prefill": plain_s, "routes": results}, indent=1))
    a, b = results
    print(f"custom_class is {b['tokens_per_s'] / a['tokens_per_s']:.2f}x the tokens/s of prompt_logprobs "
          f"({b['ms_per_round']:.1f} vs {a['ms_per_round']:.1f} ms per round)")


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    main()
