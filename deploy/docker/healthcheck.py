"""The gRPC health check of the specdec service in this container: exit 0 when it answers
SERVING, 1 otherwise (not listening yet, NOT_SERVING while it drains, TLS refused, timeout).

It is the image's HEALTHCHECK and, when the services serve TLS, the Kubernetes exec probe
(the kubelet's native `grpc` probe speaks plaintext only; deploy/k8s/components/mtls).

    python healthcheck.py [PORT [SERVICE]]

PORT defaults to SPECDEC_HEALTH_PORT when the service serves its plaintext health port (then no
TLS is needed), else to SPECDEC_PORT (each image sets its role's), SERVICE to "" (the whole server;
"specdec.v1.VerifierService" and the like ask for one service). With SPECDEC_TLS_CERT and
SPECDEC_TLS_KEY set (the service's own settings, so the same environment) it connects with
TLS, verifying the server against SPECDEC_TLS_CA and presenting the service's own
certificate as its client certificate (a server with SPECDEC_TLS_CLIENT_AUTH=require accepts
it: specdec's and deploy/k8s's certificates carry client authentication too). The name
checked against the certificate is HEALTHCHECK_TLS_SERVER_NAME, default "localhost" (both
`specdec certs` and the cert-manager Certificates in deploy/k8s include it).
"""

from __future__ import annotations

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

TIMEOUT_S = float(os.environ.get("HEALTHCHECK_TIMEOUT_S", "4"))


def _read(path: str) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def channel(port: int) -> grpc.Channel:
    address = f"127.0.0.1:{port}"
    cert, key = os.environ.get("SPECDEC_TLS_CERT", ""), os.environ.get("SPECDEC_TLS_KEY", "")
    if not (cert and key) or str(port) == os.environ.get("SPECDEC_HEALTH_PORT"):
        return grpc.insecure_channel(address)
    creds = grpc.ssl_channel_credentials(
        root_certificates=_read(os.environ.get("SPECDEC_TLS_CA", "")),
        private_key=_read(key),
        certificate_chain=_read(cert),
    )
    name = os.environ.get("HEALTHCHECK_TLS_SERVER_NAME", "localhost")
    return grpc.secure_channel(address, creds, options=[("grpc.ssl_target_name_override", name)])


def check(port: int, service: str = "") -> int:
    """0 when the server on `port` says SERVING for `service`, else 1 (the reason on stderr)."""
    try:
        with channel(port) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S
            )
    except grpc.RpcError as err:
        print(f"health check on port {port}: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    except OSError as err:  # a TLS file that cannot be read
        print(f"health check on port {port}: {err}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    if resp.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"health check on port {port}: {status}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str]) -> int:
    default = os.environ.get("SPECDEC_HEALTH_PORT", "0") not in ("", "0") and os.environ["SPECDEC_HEALTH_PORT"]
    port = int(argv[1]) if len(argv) > 1 else int(default or os.environ.get("SPECDEC_PORT", "0") or 0)
    if not port:
        print("health check: no port (argument or SPECDEC_PORT)", file=sys.stderr)
        return 1
    return check(port, argv[2] if len(argv) > 2 else "")


if __name__ == "__main__":
    sys.exit(main(sys.argv))
