"""Real-model check (slow, `make test-slow`): the qwen-coder pair end to end.

Pulls the pair on first use, starts the three services as `specdec up` does (target on
its own core(s), drafter on the last core), and checks that decoupled greedy output is
token for token vLLM target-only greedy, with real speculation happening.
"""

from __future__ import annotations

import pytest
from conftest import vllm_reference
from gen import generate_all, spec
from transformers import AutoTokenizer

from specdec.models import resolve
from specdec_cli.launch import ANY_PORT, Cluster

pytestmark = pytest.mark.slow

PROMPTS = [
    "def quicksort(items: list[int]) -> list[int]:\n",
    "class LRUCache:\n    def __init__(self, capacity: int):\n",
]
MAX_TOKENS = 48


def test_qwen_coder_pair_exact_and_speculating(tmp_path) -> None:
    target = resolve("qwen-coder/target")
    tok = AutoTokenizer.from_pretrained(target)
    ids = [list(tok.encode(p)) for p in PROMPTS]
    reference = vllm_reference(target, [{"prompt_token_ids": p, "max_tokens": MAX_TOKENS} for p in ids])
    cluster = Cluster(
        pair="qwen-coder",
        gateway_port=ANY_PORT,
        drafter_port=ANY_PORT,
        verifier_port=ANY_PORT,
        log_dir=tmp_path,
        metrics_port=dict.fromkeys(("verifier", "drafter", "gateway"), 0),
        rest_port=0,
    )
    cluster.start()
    try:
        responses = generate_all(cluster.gateway.address, [spec(p, MAX_TOKENS, gamma=4) for p in ids], 2)
    finally:
        cluster.stop()
    assert [list(r.token_ids) for r in responses] == reference
    assert "return" in responses[0].text  # coherent code, not noise
    for r in responses:
        assert r.stats.acceptance_rate > 0.5 and r.stats.tokens_per_step > 2.0, r.stats
