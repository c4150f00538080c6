"""Across hosts, with mutual TLS everywhere: the three services and a client on four hosts.

The hosts are Linux network namespaces on one private bridged subnet (tests/e2e/netns.py);
each service binds only its host's address, so every hop crosses a real (virtual) network
link, and the client runs in a fourth namespace (tests/e2e/netns_client.py). `specdec certs`
issues one certificate per role from the services' CA and the end user's from a CA of its own;
each host gets only its own role's files. Every gRPC server requires a client certificate
(SPECDEC_TLS_CLIENT_AUTH=require): the gateway one from the users' CA (SPECDEC_TLS_CLIENT_CA)
plus an API key; the drafter and the verifier one that names the gateway's identity
(SPECDEC_TLS_ALLOWED_PEERS=spiffe://specdec/gateway). The REST bridge serves HTTPS. Skips, with
the reason, where namespaces cannot be made.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import vllm_reference
from gen import wait_for
from netns import Network, unavailable_reason

from specdec_cli.certs import GATEWAY_IDENTITY, write_certs
from specdec_cli.launch import Service, start_service, stop_all

HERE = Path(__file__).resolve().parent
KEY = "sk-multihost-7f3a9c2e51d8"  # the API key; must never show up in logs, traces or metrics
PORTS = {"verifier": 50053, "drafter": 50052, "gateway": 50051}
REST_PORT = 8443
PROMPTS = [[31, 7, 99, 12, 5], [200, 201, 202, 203], [17, 17, 17, 3, 150, 9]]

pytestmark = pytest.mark.skipif(
    unavailable_reason() is not None, reason=f"no network namespaces: {unavailable_reason()}"
)


class Stack:
    """The hosts, the certificates and the running services."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.net = Network(["verifier", "drafter", "gateway", "client"])
        self.services: dict[str, Service] = {}
        hosts = [self.net.address(h) for h in ("verifier", "drafter", "gateway")]
        self.pki = root / "pki"
        write_certs(self.pki, hosts)
        write_certs(root / "rogue", hosts)  # another CA: its certificates must be refused
        self.trace_file = root / "spans.jsonl"
        self.logs = root / "logs"

    def tls(self, who: str = "client") -> dict[str, str]:
        """TLS files: the client's, the services' (who="server"), or a rogue CA's client's."""
        if who == "rogue":
            return {
                "ca": str(self.pki / "ca.pem"),
                "cert": str(self.root / "rogue/client.pem"),
                "key": str(self.root / "rogue/client-key.pem"),
            }
        return {
            "ca": str(self.pki / "ca.pem"),
            "cert": str(self.pki / f"{who}.pem"),
            "key": str(self.pki / f"{who}-key.pem"),
        }  # who: client (an end user) or a role

    def cert_dir(self, kind: str) -> Path:
        """Each service reads its own role's certificate from a folder of its own (as from its own
        Secret); the gateway also the users' CA."""
        d = self.root / f"certs-{kind}"
        if not d.exists():
            d.mkdir()
            for name in (f"{kind}.pem", f"{kind}-key.pem", "ca.pem", *(["client-ca.pem"] if kind == "gateway" else [])):
                shutil.copy(self.pki / name, d / name)
        return d

    def address(self, kind: str) -> str:
        return f"{self.net.address(kind)}:{PORTS[kind]}"

    def start(self) -> None:
        args = {
            "verifier": ["--model", "tiny/target", "--threads", "1", "--max-gamma", "8"],
            "drafter": ["--model", "tiny/draft-mid", "--threads", "1", "--quantize", "none"],
            "gateway": [
                "--tokenizer",
                "tiny/target",
                "--drafter-address",
                self.address("drafter"),
                "--verifier-address",
                self.address("verifier"),
                "--rest-port",
                str(REST_PORT),
                "--metrics-auth",
            ],
        }
        for kind in ("verifier", "drafter", "gateway"):
            d = self.cert_dir(kind)
            tls = [
                "--tls-cert",
                str(d / f"{kind}.pem"),
                "--tls-key",
                str(d / f"{kind}-key.pem"),
                "--tls-ca",
                str(d / "ca.pem"),
                "--tls-client-auth",
                "require",
                *(
                    ["--tls-client-ca", str(d / "client-ca.pem")]
                    if kind == "gateway"
                    else ["--tls-allowed-peers", GATEWAY_IDENTITY]
                ),
            ]
            env = {"SPECDEC_TRACE_FILE": str(self.trace_file), "SPECDEC_API_KEYS": KEY}
            self.services[kind] = start_service(
                kind,
                PORTS[kind],
                ["--host", self.net.address(kind), *args[kind], *tls],
                self.logs,
                env=env,
                metrics_port=0,
                prefix=self.net.prefix(kind),
            )
        answer = self.client(
            [
                {"op": "ready", "addresses": [self.address("gateway")], "tls": self.tls(), "timeout_s": 300},
                # health checks are open to any TLS client of the CA; the gateway's is one
                {
                    "op": "ready",
                    "addresses": [self.address(k) for k in ("verifier", "drafter")],
                    "tls": self.tls("gateway"),
                    "timeout_s": 300,
                },
            ]
        )
        if answer != ["ready", "ready"]:
            raise RuntimeError(f"services not ready: {answer}; logs in {self.logs}")

    def client(self, tasks: list[dict[str, Any]], timeout_s: float = 600) -> list[Any]:
        """Run tasks (tests/e2e/netns_client.py) on the client host."""
        for svc in self.services.values():
            if svc.proc.poll() is not None:
                raise RuntimeError(f"{svc.kind} exited with {svc.proc.returncode}; log: {svc.log_path}")
        proc = subprocess.run(
            [*self.net.prefix("client"), sys.executable, str(HERE / "netns_client.py")],
            input=json.dumps(tasks),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        if proc.returncode != 0:
            raise RuntimeError(f"client failed:\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def stop(self) -> None:
        stop_all(reversed(list(self.services.values())))
        self.net.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("multihost"))
    try:
        s.start()
        yield s
    finally:
        s.stop()


def gateway_task(stack: Stack, op: str, **kw: Any) -> dict[str, Any]:
    return {"op": op, "address": stack.address("gateway"), "tls": stack.tls(), "api_key": KEY, **kw}


def rest(stack: Stack, method: str, path: str, body: Any = None, api_key: str | None = KEY) -> dict[str, Any]:
    url = f"https://{stack.net.address('gateway')}:{REST_PORT}{path}"
    return {"op": "rest", "method": method, "url": url, "body": body, "tls": stack.tls(), "api_key": api_key}


def test_outputs_across_hosts_are_plain_vllms(stack: Stack, tiny_target: Path) -> None:
    (out,) = stack.client([gateway_task(stack, "generate", prompts=PROMPTS, max_tokens=24, gamma=4)])
    reference = vllm_reference(tiny_target, [{"prompt_token_ids": p, "max_tokens": 24} for p in PROMPTS])
    assert [o["token_ids"] for o in out] == reference
    assert all(o["drafted"] > 0 and not o["fallback"] for o in out)  # the drafter on its host took part


def test_clients_without_the_right_credentials_are_refused(stack: Stack) -> None:
    tls, rogue = stack.tls(), stack.tls("rogue")
    no_cert = {"ca": tls["ca"]}
    answers = stack.client(
        [
            gateway_task(stack, "probe", tls=no_cert),  # no client certificate
            gateway_task(stack, "probe", tls=rogue),  # a certificate from another CA
            gateway_task(stack, "probe", tls=None),  # plaintext
            gateway_task(stack, "probe", api_key=None),  # no API key
            gateway_task(stack, "probe", api_key="sk-wrong"),  # a wrong API key
            {"op": "probe", "address": stack.address("verifier"), "tls": None},  # the verifier, in plaintext
            {"op": "probe", "address": stack.address("drafter"), "tls": rogue},  # the drafter, rogue CA
            gateway_task(stack, "probe"),  # all right
        ]
    )
    codes = [a["code"] for a in answers]
    assert codes[:3] == ["UNAVAILABLE"] * 3, answers  # the TLS handshake fails: no call is made
    assert codes[3:5] == ["UNAUTHENTICATED"] * 2 and "API key" in answers[3]["details"], answers
    assert codes[5:7] == ["UNAVAILABLE"] * 2, answers
    assert codes[7] == "OK", answers


def test_only_the_gateway_identity_reaches_drafter_and_verifier(stack: Stack) -> None:
    """A certificate holder other than the gateway cannot call a verifier or a drafter directly
    (which would skip the gateway's API keys, rate limits and max_prompt_tokens): an end user's
    certificate is from a CA they do not trust, and the drafter host's own certificate is for
    server authentication only; both fail the handshake. The gateway's identity gets in."""
    calls = [
        {"op": "info", "service": service, "address": stack.address(service), "tls": stack.tls(who)}
        for service in ("verifier", "drafter")
        for who in ("client", "drafter", "verifier", "gateway")
    ]
    answers = stack.client(calls)
    codes = [a["code"] for a in answers]
    assert codes == ["UNAVAILABLE", "UNAVAILABLE", "UNAVAILABLE", "OK"] * 2, answers


def test_rest_bridge_serves_https_with_keys(stack: Stack) -> None:
    body = {"model": "tiny/target", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
    health, no_key, ok, metrics_no_key, metrics = stack.client(
        [
            rest(stack, "GET", "/health", api_key=None),
            rest(stack, "POST", "/v1/completions", body, api_key=None),
            rest(stack, "POST", "/v1/completions", body),
            rest(stack, "GET", "/metrics/", api_key=None),
            rest(stack, "GET", "/metrics/"),
        ]
    )
    assert health["status"] == 200  # health checks stay open
    assert no_key["status"] == 401 and no_key["body"]["error"]["type"] == "authentication_error"
    assert ok["status"] == 200 and ok["body"]["usage"]["completion_tokens"] == 4
    assert metrics_no_key["status"] == 401 and metrics["status"] == 200  # --metrics-auth
    assert "specdec:gateway_refused_total" in metrics["body"]


def test_certificates_rotate_without_a_restart(stack: Stack) -> None:
    """A new certificate written over the gateway's files is served to new connections (gRPC and
    REST) with no restart; generations go on."""
    host = stack.net.address("gateway")
    peers = [{"op": "peer", "host": host, "port": port, "tls": stack.tls()} for port in (PORTS["gateway"], REST_PORT)]
    before = stack.client(peers)
    fresh = stack.root / "rotated"
    write_certs(fresh, [stack.net.address(h) for h in ("verifier", "drafter", "gateway")], ca_dir=stack.pki)
    from cryptography import x509

    serial = x509.load_pem_x509_certificate((fresh / "gateway.pem").read_bytes()).serial_number
    assert serial not in before
    d = stack.cert_dir("gateway")
    for name in ("gateway.pem", "gateway-key.pem"):  # as a Secret update does: new files renamed into place
        shutil.copy(fresh / name, d / f".{name}.new")
        os.replace(d / f".{name}.new", d / name)
    deadline = time.monotonic() + 30  # the REST bridge checks its files every second
    while (now := stack.client(peers)) != [serial, serial] and time.monotonic() < deadline:
        time.sleep(1)
    assert now == [serial, serial]
    (out,) = stack.client([gateway_task(stack, "generate", prompts=PROMPTS[:1], max_tokens=8, gamma=4)])
    assert len(out[0]["token_ids"]) == 8


def test_the_key_never_shows_up(stack: Stack) -> None:
    """Requests that carry the key (gRPC and REST, allowed and refused) leave no trace of it in
    any log, span or metric. The test sends its own requests, so it holds in any order."""
    body = {"model": "tiny/target", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}

    def generate_spans() -> int:
        return stack.trace_file.read_text().count('"specdec.generate"') if stack.trace_file.exists() else 0

    before = generate_spans()
    out, ok, _refused, metrics = stack.client(
        [
            gateway_task(stack, "generate", prompts=PROMPTS[:1], max_tokens=6, gamma=4),
            rest(stack, "POST", "/v1/completions", body),
            rest(stack, "POST", "/v1/completions", body, api_key=KEY + "-wrong"),
            rest(stack, "GET", "/metrics/"),
        ]
    )
    assert len(out[0]["token_ids"]) == 6 and ok["status"] == 200
    # a generation's span ends as its response leaves: wait for the file to hold it (both calls')
    wait_for(lambda: generate_spans() >= before + 2, 60, "the gateway's specdec.generate spans in the trace file")
    texts = {"metrics": metrics["body"], "spans": stack.trace_file.read_text()}
    for svc in stack.services.values():
        texts[svc.kind] = svc.log_path.read_text(errors="replace")
    assert texts["gateway"]
    assert [name for name, text in texts.items() if KEY in text] == []
