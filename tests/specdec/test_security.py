"""specdec.security and specdec_cli.certs: keys, limits, certificate files, options. No timers."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from cryptography import x509

from specdec import security
from specdec.config import GatewayConfig
from specdec_cli.certs import write_certs


def test_keys_are_kept_as_hashes_and_identified() -> None:
    store = security.KeyStore(["sk-one", "sk-two", ""])
    assert store.enabled and "sk-one" not in repr(vars(store))
    kid = store.identify("Bearer sk-two")
    assert kid == security.key_id(security.key_hash("sk-two")) and "sk-two" not in kid
    assert store.identify("bearer   sk-one ") is not None  # scheme case and spaces, as RFC 6750 allows
    for bad in (None, "", "sk-one", "Basic sk-one", "Bearer ", "Bearer sk-three"):
        assert store.identify(bad) is None
    assert not security.KeyStore([]).enabled


def test_keys_from_settings_and_file(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("# ops\nsk-file  # rotated 2026-11\n\n")
    store = security.KeyStore.from_config(SimpleNamespace(api_keys="sk-a, sk-b", api_key_file=str(f)))
    assert all(store.identify(f"Bearer {k}") for k in ("sk-a", "sk-b", "sk-file"))


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_token_bucket_refuses_past_the_burst_and_refills() -> None:
    clock = Clock()
    rl = security.RateLimiter(rps=2, burst=3, clock=clock)
    assert [rl.acquire("k").ok for _ in range(4)] == [True, True, True, False]
    refused = rl.acquire("k")
    assert "rate_limit_rps" in refused.reason and refused.retry_after_s == pytest.approx(0.5)
    assert rl.retry_after_header(refused) == "1"
    assert rl.acquire("other").ok  # per key
    clock.t += 0.5  # one token back
    assert rl.acquire("k").ok and not rl.acquire("k").ok


def test_concurrent_streams_per_key() -> None:
    rl = security.RateLimiter(max_streams=2, clock=Clock())
    assert rl.acquire("k").ok and rl.acquire("k").ok
    refused = rl.acquire("k")
    assert not refused.ok and "max_streams_per_key (2)" in refused.reason
    rl.release("k")
    assert rl.acquire("k").ok


def test_cert_files_change_on_write_and_on_reload(tmp_path: Path) -> None:
    f = tmp_path / "cert.pem"
    f.write_bytes(b"one")
    files = security.CertFiles(str(f), "")
    assert files.changed() and files.read() == [b"one", None]
    assert not files.changed()
    f.write_bytes(b"two, longer")
    assert files.changed() and files.read()[0] == b"two, longer"
    security.request_reload()  # SIGHUP: re-read even though nothing changed on disk
    assert files.changed()
    files.read()
    assert not files.changed()


def test_both_sides_agree_on_keepalive() -> None:
    cfg = GatewayConfig()
    client = dict(security.grpc_options(cfg, server=False))
    server = dict(security.grpc_options(cfg, server=True))
    # a server accepts pings at least as often as a client sends them: no GOAWAY too_many_pings
    assert server["grpc.http2.min_recv_ping_interval_without_data_ms"] <= client["grpc.keepalive_time_ms"]
    assert client["grpc.max_send_message_length"] == server["grpc.max_receive_message_length"]
    # a restarted peer is tried again within seconds (gRPC's default backoff reaches 120 s)
    assert client["grpc.max_reconnect_backoff_ms"] <= 5000 and "grpc.max_reconnect_backoff_ms" not in server


@pytest.mark.parametrize(
    "host, loopback",
    [
        ("127.0.0.1", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("unix:/tmp/x", True),
        ("0.0.0.0", False),
        ("10.0.0.5", False),
        ("gateway.svc", False),
    ],
)
def test_loopback(host: str, loopback: bool) -> None:
    assert security.is_loopback(host) is loopback


def test_tls_settings_that_cannot_work_are_named(tmp_path: Path) -> None:
    base = dict(tls_cert="", tls_key="", tls_ca="", tls_client_auth="none", tls_client_ca="", tls_allowed_peers="")
    security.check_tls_settings(SimpleNamespace(**base))
    for bad, name in [
        ({"tls_cert": "x.pem"}, "tls_key"),
        ({"tls_client_auth": "require"}, "tls_client_auth"),
        ({"tls_allowed_peers": "spiffe://specdec/gateway"}, "tls_allowed_peers"),
        ({"tls_client_auth": "maybe"}, "tls_client_auth"),
        ({"tls_cert": str(tmp_path / "no.pem"), "tls_key": str(tmp_path / "no.pem")}, "tls_cert"),
    ]:
        with pytest.raises(ValueError, match=name):
            security.check_tls_settings(SimpleNamespace(**{**base, **bad}))


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _usages(cert: x509.Certificate) -> set[str]:
    return {u._name for u in cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value}


def test_certs_give_each_role_its_own_identity(tmp_path: Path) -> None:
    paths = write_certs(tmp_path, ["10.1.2.3", "verifier.internal"])
    ca, client_ca = _cert(tmp_path / "ca.pem"), _cert(tmp_path / "client-ca.pem")
    for role in ("gateway", "drafter", "verifier"):
        leaf = _cert(tmp_path / f"{role}.pem")
        leaf.verify_directly_issued_by(ca)
        san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} == {"10.1.2.3", "127.0.0.1"}
        assert set(san.get_values_for_type(x509.DNSName)) == {"verifier.internal", "localhost"}
        assert san.get_values_for_type(x509.UniformResourceIdentifier) == [f"spiffe://specdec/{role}"]
        # drafters and verifiers: server authentication only (their hosts cannot call anything with them)
        assert _usages(leaf) == ({"serverAuth", "clientAuth"} if role == "gateway" else {"serverAuth"})
    user = _cert(tmp_path / "client.pem")
    user.verify_directly_issued_by(client_ca)  # the end users' CA, which drafters and verifiers do not trust
    with pytest.raises(ValueError):
        user.verify_directly_issued_by(ca)
    assert _usages(user) == {"clientAuth"}
    assert security.certificate_identities((tmp_path / "client.pem").read_bytes()) == {"spiffe://specdec/client"}
    # keys: 0600 from creation, in a 0700 folder, whatever the umask
    assert all(os.stat(p).st_mode & 0o777 == 0o600 for p in paths if p.name.endswith("-key.pem"))
    assert os.stat(tmp_path).st_mode & 0o777 == 0o700
    with pytest.raises(FileExistsError):
        write_certs(tmp_path, ["10.1.2.3"])
    rotated = write_certs(tmp_path / "next", ["10.1.2.3"], ca_dir=tmp_path)  # same CAs, new leaves
    _cert(rotated[2]).verify_directly_issued_by(ca)
    _cert(tmp_path / "next" / "client.pem").verify_directly_issued_by(client_ca)
    # and gRPC takes them
    security.server_credentials(
        SimpleNamespace(
            tls_cert=str(tmp_path / "verifier.pem"),
            tls_key=str(tmp_path / "verifier-key.pem"),
            tls_client_ca="",
            tls_ca=str(tmp_path / "ca.pem"),
            tls_client_auth="require",
        )
    )
    assert isinstance(security.channel_credentials(str(tmp_path / "ca.pem")), grpc.ChannelCredentials)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki") / "pki"
    write_certs(d, ["localhost"])
    return d


async def _call_as(pki: Path, allowed: str, who: str) -> str:
    """A verifier-like server (the verifier's certificate, client certificates required from the
    services' CA, `allowed` peers) called by `who` (a role's or the end user's certificate):
    the status code name of a health check and of a service method, "handshake" when no TLS
    connection could be made."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    cfg = SimpleNamespace(
        tls_cert=str(pki / "verifier.pem"),
        tls_key=str(pki / "verifier-key.pem"),
        tls_ca=str(pki / "ca.pem"),
        tls_client_ca="",
        tls_client_auth="require",
        tls_allowed_peers=allowed,
    )
    security.check_tls_settings(cfg)
    server = grpc.aio.server(interceptors=security.server_interceptors("verifier", cfg))
    h = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(h, server)

    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("test.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)})]
    )
    port = server.add_secure_port("127.0.0.1:0", security.server_credentials(cfg))
    await server.start()
    creds = security.channel_credentials(str(pki / "ca.pem"), str(pki / f"{who}.pem"), str(pki / f"{who}-key.pem"))
    try:
        async with grpc.aio.secure_channel(f"localhost:{port}", creds) as ch:
            codes = []
            for call in (
                lambda: health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10),
                lambda: ch.unary_unary("/test.Echo/Echo")(b"hi", timeout=10),
            ):
                try:
                    await call()
                    codes.append("OK")
                except grpc.aio.AioRpcError as err:
                    codes.append("handshake" if err.code() == grpc.StatusCode.UNAVAILABLE else err.code().name)
            return ",".join(codes)
    finally:
        await server.stop(None)


@pytest.mark.parametrize(
    "who, allowed, expected",
    [
        ("gateway", "spiffe://specdec/gateway", "OK,OK"),  # the gateway's identity: served
        ("gateway", "spiffe://specdec/other", "OK,PERMISSION_DENIED"),  # a certificate of the CA, not allowed
        ("gateway", "", "OK,OK"),  # no list: any certificate of the CA
        ("client", "spiffe://specdec/gateway", "handshake,handshake"),  # an end user's: another CA
        ("drafter", "spiffe://specdec/gateway", "handshake,handshake"),  # a drafter host's: server-only
    ],
)
def test_only_allowed_peers_call_a_service(pki: Path, who: str, allowed: str, expected: str) -> None:
    import asyncio

    assert asyncio.run(_call_as(pki, allowed, who)) == expected


def test_key_files_are_private_from_their_creation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a permissive umask and no chmod taking effect afterwards, the keys are still 0600 and
    the folder 0700: the modes are set when the files are created, not fixed up later."""
    chmods: list[tuple[str, int]] = []
    old_umask = os.umask(0)
    try:
        monkeypatch.setattr(os, "chmod", lambda path, mode, *a, **k: chmods.append((str(path), mode)))
        out = tmp_path / "certs"
        paths = write_certs(out, ["10.1.2.3"])
    finally:
        os.umask(old_umask)
    keys = [p for p in paths if p.name.endswith("-key.pem")]
    assert keys and all(os.stat(p).st_mode & 0o777 == 0o600 for p in keys), [oct(os.stat(p).st_mode) for p in keys]
    assert os.stat(out).st_mode & 0o777 == 0o700
    assert not any(p.name.startswith(".") for p in out.iterdir())  # no temporary file left behind


def test_an_existing_certs_folder_is_made_private(tmp_path: Path) -> None:
    out = tmp_path / "certs"
    out.mkdir(mode=0o755)
    os.chmod(out, 0o755)
    write_certs(out, ["10.1.2.3"])
    assert os.stat(out).st_mode & 0o777 == 0o700


def test_with_keys_no_one_key_takes_every_slot_by_default() -> None:
    """max_inflight_share_per_key (0.5): with API keys, one key holds at most half of max_inflight
    at once while another key is still admitted; max_streams_per_key caps it further; without
    keys (one anonymous client) there is no share."""
    limiter = security.RateLimiter.from_config(GatewayConfig(max_inflight=256), keys_enabled=True)
    assert limiter.max_streams == 128
    assert all(limiter.acquire("key-a").ok for _ in range(128))
    refused = limiter.acquire("key-a")
    assert not refused.ok and "max_inflight_share_per_key (0.5 of max_inflight) (128)" in refused.reason
    assert limiter.acquire("key-b").ok
    assert (
        security.RateLimiter.from_config(GatewayConfig(max_inflight=256, max_streams_per_key=8), True).max_streams == 8
    )
    assert security.RateLimiter.from_config(GatewayConfig(max_inflight=256), keys_enabled=False).max_streams == 0
    assert security.RateLimiter.from_config(GatewayConfig(max_inflight_share_per_key=1.0), True).max_streams == 0
