"""Every slot comes back, down to the verifier's engine (issue 22, "Slots held forever").

Clients that leave without a word, or stay and stop reading, must not leave work behind: not
a gateway slot (specdec:requests_running), not a verify session (specdec:verifier_sessions),
and not a request in vLLM's scheduler (specdec:verifier_engine_running / _waiting, read from
the engine itself, not from the gRPC layer).

- 50 non-streaming REST requests whose clients close their connections while the engine runs
  them: the engine holds 0 requests within IDLE_BOUND_S.
- a gRPC GenerateStream whose client never reads: the gateway ends it after
  stream_write_timeout_s (here STREAM_WRITE_TIMEOUT_S), and the engine holds 0 requests.

Bounds are about 10x what is expected (cancellation reaches the engine within a step or two).
"""

from __future__ import annotations

import json
import socket

import grpc
import pytest
from gen import scrape, spec, wait_for

from specdec.wire import pb, rpc

PROMPT = [11, 12, 13, 14, 15, 16]
N_REST = 50
MAX_TOKENS = 1500  # far more than the time the test takes: the requests are running when their clients go
STREAM_WRITE_TIMEOUT_S = 2.0
IDLE_BOUND_S = 30.0


@pytest.fixture(scope="module")
def gateway(services):
    gw = services.start_gateway(
        services.drafters["mid"].address,
        services.verifier.address,
        ("--stream-write-timeout-s", str(STREAM_WRITE_TIMEOUT_S)),
    )
    try:
        gw.wait_ready(120)
        yield gw
    finally:
        gw.stop()


def _engine(services) -> dict[str, float]:
    m = scrape(services.verifier.metrics_port)
    return {k: m.get(f"specdec:verifier_{k}", -1.0) for k in ("sessions", "engine_running", "engine_waiting")}


def _idle(services) -> bool:
    return all(v == 0 for v in _engine(services).values())


def test_rest_clients_that_disconnect_leave_no_request_in_the_engine(services, gateway) -> None:
    wait_for(lambda: _idle(services), IDLE_BOUND_S, "the verifier idle before the test")
    body = json.dumps({"prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "gamma": 4}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    clients = []
    try:
        for _ in range(N_REST):
            s = socket.create_connection(("127.0.0.1", gateway.rest_port), timeout=30)
            s.sendall(head + body)
            clients.append(s)

        def all_in_the_engine() -> bool:
            e = _engine(services)
            return e["engine_running"] + e["engine_waiting"] >= N_REST

        wait_for(all_in_the_engine, 120, f"{N_REST} requests in the verifier's engine")
        print(f"\nwith {N_REST} clients connected: {_engine(services)}")
    finally:
        for s in clients:
            s.close()  # the clients go away, without reading an answer
    wait_for(lambda: _idle(services), IDLE_BOUND_S, "no request left in the verifier's engine")
    wait_for(
        lambda: scrape(gateway.metrics_port).get("specdec:requests_running") == 0,
        IDLE_BOUND_S,
        "no slot held at the gateway",
    )
    print(f"after the clients left: {_engine(services)}")


def test_a_grpc_stream_whose_client_never_reads_is_ended_and_leaves_nothing(services, gateway) -> None:
    wait_for(lambda: _idle(services), IDLE_BOUND_S, "the verifier idle before the test")
    before = scrape(gateway.metrics_port).get("specdec:gateway_stream_write_timeouts_total", 0.0)
    # a small stream window and no BDP growth: the gateway's writes wait once a few KB are unread
    options = [("grpc.http2.lookahead_bytes", 4096), ("grpc.http2.bdp_probe", 0)]
    with grpc.insecure_channel(gateway.address, options=options) as channel:
        call = rpc.GatewayServiceStub(channel).GenerateStream(
            pb.GenerateStreamRequest(spec=spec(PROMPT, MAX_TOKENS, gamma=4, ignore_eos=True)), timeout=600
        )
        wait_for(lambda: _engine(services)["engine_running"] >= 1, 120, "the stream's request in the engine")
        # never read: the gateway must end it
        wait_for(
            lambda: scrape(gateway.metrics_port).get("specdec:gateway_stream_write_timeouts_total", 0.0) > before,
            10 * STREAM_WRITE_TIMEOUT_S + IDLE_BOUND_S,
            "the stream ended by stream_write_timeout_s",
        )
        wait_for(lambda: _idle(services), IDLE_BOUND_S, "no request left in the verifier's engine")
        wait_for(
            lambda: scrape(gateway.metrics_port).get("specdec:requests_running") == 0,
            IDLE_BOUND_S,
            "no slot held at the gateway",
        )
        tokens = []
        with pytest.raises(grpc.RpcError) as info:
            for chunk in call:  # what was sent before the end, then the status
                tokens.extend(chunk.token_ids)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert 0 < len(tokens) < MAX_TOKENS
    print(f"\nthe unread stream was ended after {len(tokens)} tokens: {info.value.details()}")
