"""Target-only reference outputs from a plain vLLM engine (no speculation).

Run as a script: reads a JSON list of requests on stdin
({"prompt_token_ids", "max_tokens", "temperature", "top_p", "seed", "ignore_eos"}),
writes a JSON list of generated token-id lists on stdout.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    model = sys.argv[1]
    requests = json.load(sys.stdin)
    llm = LLM(model=model, dtype="float32", max_model_len=2048, enforce_eager=True, kv_cache_memory_bytes=1 << 30)
    params = [
        SamplingParams(
            temperature=r.get("temperature", 0.0),
            top_p=r.get("top_p", 1.0),
            seed=r.get("seed"),
            max_tokens=r["max_tokens"],
            ignore_eos=r.get("ignore_eos", False),
            detokenize=False,
        )
        for r in requests
    ]
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    json.dump([list(o.outputs[0].token_ids) for o in outputs], sys.stdout)


if __name__ == "__main__":
    main()
