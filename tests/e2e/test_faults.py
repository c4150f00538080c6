"""A failing drafter never changes the output: the request goes on as plain target decoding."""

from __future__ import annotations

import grpc
from conftest import vllm_reference, wait_drafters_seen
from gen import spec

from specdec.wire import pb, rpc
from specdec_cli.launch import free_port

PROMPT = [11, 12, 13, 14, 15, 16]
MAX_TOKENS = 1500


def test_killing_the_drafter_mid_generation(services, tiny_target) -> None:
    drafter, gateway = services.start_pair("tiny/draft-mid", services.verifier)
    drafter.wait_ready(120)
    gateway.wait_ready(120)
    wait_drafters_seen(gateway, 1, 120)  # the drafter killed below is the one the request uses
    reference = vllm_reference(
        tiny_target, [{"prompt_token_ids": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True}]
    )[0]
    tokens, last, killed_at = [], None, None
    with grpc.insecure_channel(gateway.address) as channel:
        stream = rpc.GatewayServiceStub(channel).GenerateStream(
            pb.GenerateStreamRequest(spec=spec(PROMPT, MAX_TOKENS, gamma=4, ignore_eos=True)), timeout=600
        )
        for chunk in stream:
            tokens.extend(chunk.token_ids)
            last = chunk
            if killed_at is None and chunk.accepted > 0 and len(tokens) > 20:
                drafter.stop(kill=True)  # SIGKILL: no goodbye on the stream
                killed_at = len(tokens)
    assert killed_at is not None and killed_at < MAX_TOKENS
    assert tokens == reference
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert last.stats.drafter_fallback and last.stats.fallback_reason
    assert last.stats.accepted_tokens > 0  # it did speculate before the kill


def test_unreachable_drafter(services, tiny_target) -> None:
    gateway = services.start_gateway(f"127.0.0.1:{free_port()}", services.verifier.address)
    gateway.wait_ready(120)
    reference = vllm_reference(tiny_target, [{"prompt_token_ids": PROMPT, "max_tokens": 40}])[0]
    with grpc.insecure_channel(gateway.address) as channel:
        r = rpc.GatewayServiceStub(channel).Generate(pb.GenerateRequest(spec=spec(PROMPT, 40, gamma=4)), timeout=120)
    assert list(r.token_ids) == reference
    # the gateway's health check finds it unreachable (no drafter serves), or, before its first
    # check is over, the drafter call fails (UNAVAILABLE): either way, plain decoding
    assert r.stats.drafter_fallback
    assert r.stats.fallback_reason == "no drafter replica serves" or "UNAVAILABLE" in r.stats.fallback_reason
