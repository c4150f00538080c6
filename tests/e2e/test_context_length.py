"""The verifier's context length when it is left unset: vLLM's auto-fit on the CPU.

`--max-model-len` unset (0) runs the model's own context length, reduced to what the KV cache
holds for one request (vLLM 0.32's max_model_len -1; verifier.vllm_hooks.CPU_MAX_MODEL_LEN). A
fixed 2048 refused real source files that `vllm serve` accepts (2,533 tokens of argparse.py on
the qwen-coder pair). The session's stacks run it already: the tiny target's context, 2048 tokens,
fits its 1 GiB cache. This module isolates the reduction: a verifier with a KV cache of ~1,000
tokens, every other setting its default. It must report the length vLLM chose, serve a prompt
that fills it (greedy output equal to plain vLLM's), and refuse one token more with an error
naming the prompt, over gRPC and REST, and keep serving.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from conftest import Services, one_setting_stack, vllm_reference
from gen import generate_all, spec

from specdec.models.tiny import MAX_POSITIONS
from specdec.wire import pb, rpc

# ~1,000 tokens of the tiny target's KV cache (2 layers x keys and values x 2 heads x 64 x 4 bytes
# = 2 KiB a token), well under its 2,048-token context
KV_CACHE_GIB = 0.002
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def small_cache_stack(tiny_target: Path, log_dir: Path) -> Iterator[Services]:
    with one_setting_stack(log_dir, "--kv-cache-gib", str(KV_CACHE_GIB)) as s:
        yield s


@pytest.fixture(scope="module")
def context(small_cache_stack: Services) -> int:
    """The context length the verifier reports (GetVerifierInfo.max_model_len)."""
    assert small_cache_stack.verifier is not None
    with grpc.insecure_channel(small_cache_stack.verifier.address) as channel:
        info = rpc.VerifierServiceStub(channel).GetVerifierInfo(pb.GetVerifierInfoRequest(), timeout=30)
    return int(info.max_model_len)


def test_the_context_is_what_the_cache_holds(small_cache_stack: Services, context: int) -> None:
    assert small_cache_stack.verifier is not None
    log = small_cache_stack.verifier.log_path.read_text()
    fitted = re.search(r"Auto-fit max_model_len: reduced from (\d+) to (\d+)", log)
    assert fitted is not None, log[-3000:]
    assert (int(fitted[1]), int(fitted[2])) == (MAX_POSITIONS, context)
    assert 0 < context < MAX_POSITIONS
    assert f"max_model_len {context}" in log


def test_a_prompt_that_fills_the_context_is_served_exactly(
    small_cache_stack: Services, context: int, tiny_target: Path
) -> None:
    prompt = [(7 * i) % 500 + 3 for i in range(context - MAX_TOKENS)]  # prompt + completion = the context
    (reference,) = vllm_reference(tiny_target, [{"prompt_token_ids": prompt, "max_tokens": MAX_TOKENS}])
    (response,) = generate_all(small_cache_stack.gateways["mid"].address, [spec(prompt, MAX_TOKENS)])
    assert list(response.token_ids) == reference


def test_one_token_more_is_refused_naming_the_prompt(small_cache_stack: Services, context: int) -> None:
    gateway = small_cache_stack.gateways["mid"]
    too_long = [5] * context  # the prompt alone leaves no room for a token
    with pytest.raises(grpc.RpcError) as refused:
        generate_all(gateway.address, [spec(too_long, 1)])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt" in (refused.value.details() or "") and str(context - 1) in (refused.value.details() or "")
    url = f"http://127.0.0.1:{gateway.rest_port}/v1"
    model = httpx.get(f"{url}/models", timeout=30).json()["data"][0]["id"]
    r = httpx.post(f"{url}/completions", json={"model": model, "prompt": too_long, "max_tokens": 1}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt" and str(context - 1) in error["message"], error
    # and the stack still serves
    r = httpx.post(f"{url}/completions", json={"model": model, "prompt": [5, 6, 7], "max_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text
