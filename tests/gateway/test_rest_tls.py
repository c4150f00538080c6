"""The REST bridge's TLS context (gateway.server.ReloadingSSLContext): what a reload replaces."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gateway.server import ReloadingSSLContext
from specdec import security
from specdec.config import GatewayConfig
from specdec_cli.certs import write_certs


def _handshake(server_context: Any, client_dir: Path, ca_dir: Path) -> bool:
    """A TLS handshake in memory between `server_context` (through wrap_bio, as asyncio makes each
    connection) and a client presenting client_dir's client certificate: True when it completes."""
    import ssl

    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.load_verify_locations(ca_dir / "ca.pem")
    client.load_cert_chain(client_dir / "client.pem", client_dir / "client-key.pem")
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    c = client.wrap_bio(c_in, c_out, server_hostname="localhost")
    s = server_context.wrap_bio(s_in, s_out, server_side=True)
    done = {"c": False, "s": False}
    for _ in range(20):
        for name, side in (("c", c), ("s", s)):
            if done[name]:
                continue
            try:
                side.do_handshake()
                done[name] = True
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLError:
                return False
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if all(done.values()):
            # TLS 1.3: the server checks the client's certificate after the client is done; one
            # read on the client side surfaces a refusal
            try:
                c.write(b"x")
                s_in.write(c_out.read())
                s.read(1)
            except ssl.SSLError:
                return False
            return True
    return False


def test_a_rest_reload_replaces_the_trust_store(tmp_path: Path) -> None:
    """A users' CA removed from the bundle (tls_client_ca) is no longer trusted after a reload (a
    new context, not load_verify_locations into the old one)."""
    old, new = tmp_path / "old", tmp_path / "new"
    write_certs(old, ["127.0.0.1"])
    write_certs(new, ["127.0.0.1"])
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes((old / "client-ca.pem").read_bytes() + (new / "client-ca.pem").read_bytes())
    cfg = GatewayConfig(
        tls_cert=str(new / "gateway.pem"),
        tls_key=str(new / "gateway-key.pem"),
        tls_ca=str(new / "ca.pem"),
        tls_client_ca=str(bundle),
        tls_client_auth="require",
    )
    context = ReloadingSSLContext(cfg)
    assert _handshake(context, old, new) and _handshake(context, new, new)  # both CAs trusted
    bundle.write_bytes((new / "client-ca.pem").read_bytes())  # the old CA is removed
    security.request_reload()  # as SIGHUP does (the file's mtime may not have moved)
    assert context.reload()
    assert not _handshake(context, old, new)  # the old CA's client is refused now
    assert _handshake(context, new, new)
