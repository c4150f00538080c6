"""API keys, per-key rate limits and the prompt limit at a gateway (loopback, plaintext; TLS
and the multi-host set-up: test_multihost.py)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.client import GatewayClient, generation_spec
from specdec_cli.launch import Service

KEYS = ("sk-auth-a1", "sk-auth-b2")


@pytest.fixture(scope="module")
def gateway(services) -> Iterator[Service]:
    gw = services.start_gateway(
        services.drafters["mid"].address,
        services.verifier.address,
        (
            "--api-keys",
            ",".join(KEYS),
            "--rate-limit-rps",
            "0.01",
            "--rate-limit-burst",
            "2",
            "--max-prompt-tokens",
            "8",
        ),
    )
    gw.wait_ready(120)
    yield gw
    gw.stop()


def call(gw: Service, key: str | None, prompt: list[int]) -> grpc.RpcError | None:
    with GatewayClient(gw.address, timeout_s=60, api_key=key) as client:
        try:
            client.generate(generation_spec(prompt, max_tokens=4, gamma=2))
        except grpc.RpcError as err:
            return err
    return None


def test_keys_limits_and_open_health(gateway: Service) -> None:
    assert call(gateway, None, [1, 2, 3]).code() == grpc.StatusCode.UNAUTHENTICATED
    assert call(gateway, "sk-nope", [1, 2, 3]).code() == grpc.StatusCode.UNAUTHENTICATED
    # key a: a burst of 2, then 0.01 requests/s: the third is refused with when to retry
    assert call(gateway, KEYS[0], [1, 2, 3]) is None and call(gateway, KEYS[0], [1, 2, 3]) is None
    err = call(gateway, KEYS[0], [1, 2, 3])
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "rate_limit_rps" in err.details()
    assert int(dict(err.trailing_metadata())["retry-after"]) >= 1
    r = httpx.post(
        f"http://127.0.0.1:{gateway.rest_port}/v1/completions",
        timeout=60,
        headers={"Authorization": f"Bearer {KEYS[0]}"},
        json={"prompt": [1, 2], "max_tokens": 2},
    )
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["type"] == "rate_limit_error"
    # key b has its own bucket; a prompt over max_prompt_tokens is refused before any work, by name
    err = call(gateway, KEYS[1], list(range(1, 10)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_prompt_tokens (8)" in err.details()
    r = httpx.post(
        f"http://127.0.0.1:{gateway.rest_port}/v1/completions", timeout=60, json={"prompt": [1, 2], "max_tokens": 2}
    )
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    with grpc.insecure_channel(gateway.address) as channel:  # health checks need no key
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert httpx.get(f"http://127.0.0.1:{gateway.rest_port}/health", timeout=10).status_code == 200
    metrics = httpx.get(f"http://127.0.0.1:{gateway.rest_port}/metrics/", timeout=10).text  # open by default
    assert 'specdec:gateway_refused_total{reason="unauthenticated"} 3.0' in metrics
    assert 'specdec:gateway_refused_total{reason="rate_limited"} 2.0' in metrics
    assert not any(k in metrics for k in KEYS)


TENANTS = ("sk-tenant-one", "sk-tenant-two")


@pytest.fixture(scope="module")
def tenants_gateway(services) -> Iterator[Service]:
    gw = services.start_gateway(
        services.drafters["mid"].address, services.verifier.address, ("--api-keys", ",".join(TENANTS))
    )
    gw.wait_ready(120)
    yield gw
    gw.stop()


def test_tenants_cannot_touch_each_others_request_ids(tenants_gateway: Service) -> None:
    """Request ids are namespaced per API key at the verifier: while tenant one's "shared" runs,
    tenant two's "shared" and "shared-m1" (one's id after a migration) run too, and one's
    generation is untouched. (One tenant's own duplicate is still refused: test_errors.py.)"""
    import asyncio

    from gateway.client import AsyncGatewayClient

    async def run() -> tuple[list[int], list[int], list[int]]:
        async with (
            AsyncGatewayClient(tenants_gateway.address, timeout_s=120, api_key=TENANTS[0]) as one,
            AsyncGatewayClient(tenants_gateway.address, timeout_s=120, api_key=TENANTS[1]) as two,
        ):
            long = one.stream(
                generation_spec([5, 6, 7, 8], max_tokens=300, gamma=2, ignore_eos=True, request_id="shared")
            )
            first = await long.read()  # tenant one's "shared" is in the verifier now
            same = await two.generate(generation_spec([5, 6, 7, 8], max_tokens=4, request_id="shared"))
            migrated = await two.generate(generation_spec([5, 6, 7, 8], max_tokens=4, request_id="shared-m1"))
            tokens = list(first.token_ids)
            while (chunk := await long.read()) is not grpc.aio.EOF:
                tokens.extend(chunk.token_ids)
            return tokens, list(same.token_ids), list(migrated.token_ids)

    tokens, same, migrated = asyncio.run(run())
    assert len(tokens) == 300 and len(same) == 4 and len(migrated) == 4


def test_a_tenant_reuses_only_its_own_prompts_draft_keys(tenants_gateway: Service, tiny_target) -> None:
    """The drafter's prefix cache is scoped by tenant (DraftOpen.cache_scope): after tenant one's
    long prompt, tenant two's request for the same prompt reuses none of its draft keys (its
    `drafter_reused_tokens` would tell it what tenant one sent), while tenant one's second request
    reuses them all but the last token."""
    import random

    from transformers import AutoTokenizer

    rng = random.Random(9300)
    vocab = AutoTokenizer.from_pretrained(tiny_target).vocab_size
    prompt = [rng.randrange(1, vocab) for _ in range(200)]
    stats = []
    for key in (TENANTS[0], TENANTS[1], TENANTS[0]):
        with GatewayClient(tenants_gateway.address, timeout_s=120, api_key=key) as client:
            stats.append(client.generate(generation_spec(prompt, max_tokens=32, gamma=2, ignore_eos=True)).stats)
    assert all(s.drafter_prefill_ms > 0 for s in stats), stats  # each heard its drafter's `ready` (the count)
    assert [s.drafter_reused_tokens for s in stats] == [0, 0, len(prompt) - 1], stats
