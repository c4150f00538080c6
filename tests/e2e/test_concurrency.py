"""16 concurrent requests through one gateway all finish with exact outputs."""

from __future__ import annotations

from conftest import vllm_reference
from gen import generate_all, prompts, scrape, spec
from transformers import AutoTokenizer

from specdec.wire import pb


def test_sixteen_concurrent_requests_exact(services, tiny_target) -> None:
    ps = prompts(AutoTokenizer.from_pretrained(tiny_target), 16, seed=7)
    max_tokens = [32 + 8 * (i % 5) for i in range(16)]
    reference = vllm_reference(
        tiny_target, [{"prompt_token_ids": p, "max_tokens": m} for p, m in zip(ps, max_tokens, strict=True)]
    )
    specs = [
        spec(p, m, gamma=1 + i % 8, drafter=("model", "ngram")[i % 2])
        for i, (p, m) in enumerate(zip(ps, max_tokens, strict=True))
    ]
    port = services.verifier.metrics_port
    before = scrape(port)
    responses = generate_all(services.gateways["mid"].address, specs, concurrency=16)
    after = scrape(port)
    assert [list(r.token_ids) for r in responses] == reference
    assert all(r.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP) for r in responses)
    assert sum(r.stats.accepted_tokens for r in responses) > 0

    # batched by the engine, not serialised: many steps ran several requests at once
    def multi(m: dict[str, float]) -> float:
        return m["specdec:verifier_batch_size_count"] - m["specdec:verifier_batch_size_bucket{le=1.0}"]

    assert multi(after) - multi(before) > 10
