"""A specdec client run inside a network namespace (tests/e2e/test_multihost.py).

    ip netns exec NS python netns_client.py < tasks.json  ->  one JSON line of results

Tasks (a JSON list), each {"op": ..., ...}; the answers come back in the same order:
    ready     wait until each address's gRPC health check says SERVING (TLS files given)
    generate  GenerationSpecs through the gateway; token ids and speculation counts
    probe     one small Generate; the status code name it ends with (OK when it succeeds)
    rest      one HTTPS request to the REST bridge; status, Retry-After and the body
    peer      the serial number of the certificate a TLS server presents
    info      a verifier's or drafter's own info call (GetVerifierInfo / GetDrafterInfo), made
              directly, not through a gateway: the status code name it ends with
TLS files are {"ca": path, "cert": path, "key": path} (any may be empty: no TLS / no client
certificate).
"""

from __future__ import annotations

import json
import socket
import ssl
import sys
import time
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.client import GatewayClient, generation_spec
from specdec.security import channel_credentials
from specdec.wire import pb


def _channel(address: str, tls: dict[str, str] | None) -> grpc.Channel:
    if tls and tls.get("ca"):
        return grpc.secure_channel(address, channel_credentials(tls["ca"], tls.get("cert", ""), tls.get("key", "")))
    return grpc.insecure_channel(address)


def ready(task: dict[str, Any]) -> str:
    deadline = time.monotonic() + task["timeout_s"]
    for address in task["addresses"]:
        with _channel(address, task.get("tls")) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == 1:
                        break
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    return f"{address} not ready"
                time.sleep(0.5)
    return "ready"


def _client(task: dict[str, Any], timeout_s: float) -> GatewayClient:
    tls = task.get("tls") or {}
    return GatewayClient(
        task["address"],
        timeout_s,
        tls_ca=tls.get("ca", ""),
        tls_cert=tls.get("cert", ""),
        tls_key=tls.get("key", ""),
        api_key=task.get("api_key"),
    )


def generate(task: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    with _client(task, 120) as client:
        for prompt in task["prompts"]:
            r = client.generate(generation_spec(prompt, max_tokens=task["max_tokens"], gamma=task["gamma"]))
            out.append(
                {
                    "token_ids": list(r.token_ids),
                    "drafted": r.stats.drafted_tokens,
                    "fallback": r.stats.drafter_fallback,
                }
            )
    return out


def probe(task: dict[str, Any]) -> dict[str, str]:
    with _client(task, 10) as client:
        try:
            client.stub.Generate(
                pb.GenerateRequest(spec=generation_spec([1, 2, 3], max_tokens=2)), timeout=10, metadata=client.metadata
            )
            return {"code": "OK", "details": ""}
        except grpc.RpcError as err:
            return {"code": err.code().name, "details": err.details() or ""}


def info(task: dict[str, Any]) -> dict[str, str]:
    from specdec.wire import rpc

    with _channel(task["address"], task.get("tls")) as channel:
        try:
            if task["service"] == "verifier":
                rpc.VerifierServiceStub(channel).GetVerifierInfo(pb.GetVerifierInfoRequest(), timeout=10)
            else:
                rpc.DrafterServiceStub(channel).GetDrafterInfo(pb.GetDrafterInfoRequest(), timeout=10)
            return {"code": "OK", "details": ""}
        except grpc.RpcError as err:
            return {"code": err.code().name, "details": err.details() or ""}


def _context(tls: dict[str, str]) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=tls["ca"])
    if tls.get("cert"):
        ctx.load_cert_chain(tls["cert"], tls["key"])
    return ctx


def rest(task: dict[str, Any]) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {task['api_key']}"} if task.get("api_key") else {}
    with httpx.Client(verify=_context(task["tls"]), timeout=120) as client:
        r = client.request(task["method"], task["url"], json=task.get("body"), headers=headers)
    try:
        body: Any = r.json()
    except ValueError:
        body = r.text
    return {"status": r.status_code, "retry_after": r.headers.get("retry-after"), "body": body}


def peer(task: dict[str, Any]) -> int:
    ctx = _context(task["tls"])
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    with socket.create_connection((task["host"], task["port"]), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=task["host"]) as tls:
            from cryptography import x509

            return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number


OPS = {"ready": ready, "generate": generate, "probe": probe, "rest": rest, "peer": peer, "info": info}


def main() -> None:
    tasks = json.load(sys.stdin)
    print(json.dumps([OPS[t["op"]](t) for t in tasks]))


if __name__ == "__main__":
    main()
