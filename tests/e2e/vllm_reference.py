"""Target-only reference outputs from a plain vLLM engine (no speculation).

Run as a script, it serves one model for a whole test session (tests/conftest.py
`vllm_reference` starts it once per model, on first use): each line on stdin is a JSON list of
requests ({"prompt_token_ids", "max_tokens"} and any other vllm.SamplingParams fields by name;
temperature defaults to 0, greedy),
answered by one line on stdout, the JSON list of generated token-id lists, in order. One
engine start per session instead of one per call (a cold vLLM start costs 15-20 s here).
Prefix caching is off, so an answer never depends on what earlier calls left in the cache. The
dtype is the second argument, or the one the verifier takes for the model here (its "auto", or
SPECDEC_DTYPE: verifier.vllm_hooks.engine_settings).
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    # answers go to the real stdout alone; everything else printed (vLLM's logs) to stderr
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM, SamplingParams

    from verifier.vllm_hooks import engine_settings_from_env, request_cpu_amx

    request_cpu_amx()  # as the verifier does: vLLM's bfloat16 attention would die of SIGILL without it

    model = sys.argv[1]
    settings = engine_settings_from_env("cpu", model)  # the verifier's context and KV cache
    llm = LLM(
        model=model,
        dtype=sys.argv[2] if len(sys.argv) > 2 else settings.dtype,
        max_model_len=settings.max_model_len,
        enforce_eager=True,
        kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
        enable_prefix_caching=False,
    )
    for line in sys.stdin:
        requests = json.loads(line)
        params = [
            SamplingParams(
                **{"temperature": 0.0, **{k: v for k, v in r.items() if k != "prompt_token_ids"}}, detokenize=False
            )
            for r in requests
        ]
        prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        out.write(json.dumps([list(o.outputs[0].token_ids) for o in outputs]) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
