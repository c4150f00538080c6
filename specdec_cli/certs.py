"""`specdec certs DIR`: a development PKI for a specdec deployment, one identity per role.

    DIR/ca.pem, ca-key.pem              the services' CA: SPECDEC_TLS_CA of the gateway, drafters
                                        and verifiers (what they verify each other with)
    DIR/gateway.pem, gateway-key.pem    the gateway: serves its clients (server authentication) and
                                        calls drafters and verifiers (client authentication), as
                                        spiffe://specdec/gateway
    DIR/drafter.pem, drafter-key.pem    a drafter: server authentication only, so a drafter host
                                        cannot call anything with it (spiffe://specdec/drafter)
    DIR/verifier.pem, verifier-key.pem  a verifier: server authentication only (spiffe://specdec/verifier)
    DIR/client-ca.pem, client-ca-key.pem  the end users' CA: the gateway's SPECDEC_TLS_CLIENT_CA.
                                        Drafters and verifiers do not trust it, so a user's
                                        certificate cannot even reach them.
    DIR/client.pem, client-key.pem      an end user's certificate (client authentication only, from
                                        the end users' CA; spiffe://specdec/client)

The server certificates name every host given (DNS names and IP addresses), plus localhost and
127.0.0.1; each role's also carries its role URI (above), the identity drafters and verifiers
check callers against (SPECDEC_TLS_ALLOWED_PEERS=spiffe://specdec/gateway). ECDSA P-256 keys,
SHA-256 signatures. The folder is made 0700 and every key is created 0600 (never readable by
others, not even for a moment). Give each host only its own role's files (and ca.pem). For
production, issue these from your own CA (cert-manager: deploy/k8s/components/cert-manager);
specdec only reads PEM files.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cryptography import x509

# role -> (URI it is known by, server authentication, client authentication)
ROLES = {
    "gateway": ("spiffe://specdec/gateway", True, True),
    "drafter": ("spiffe://specdec/drafter", True, False),
    "verifier": ("spiffe://specdec/verifier", True, False),
}
CLIENT_URI = "spiffe://specdec/client"
GATEWAY_IDENTITY = ROLES["gateway"][0]
FILES = (
    "ca.pem",
    "ca-key.pem",
    *(f"{r}{k}.pem" for r in ROLES for k in ("", "-key")),
    "client-ca.pem",
    "client-ca-key.pem",
    "client.pem",
    "client-key.pem",
)


def _san(hosts: Sequence[str], uri: str = "") -> list[x509.GeneralName]:
    from cryptography import x509

    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(uri)] if uri else []
    for host in dict.fromkeys([*hosts, "localhost", "127.0.0.1"]):  # ordered, no duplicates
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _write(path: Path, data: bytes, private: bool = False) -> None:
    """Write `path` whole (a new file renamed over it): 0600 from its creation when `private`
    (never readable by others, not even for a moment), else 0644, whatever the umask."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    try:
        os.fchmod(fd, 0o600 if private else 0o644)  # the umask cannot narrow or widen it
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_certs(
    out: Path, hosts: Sequence[str], days: int = 365, overwrite: bool = False, ca_dir: Path | None = None
) -> list[Path]:
    """Write the services' CA, a certificate per role for `hosts`, the end users' CA and a user's
    certificate into `out` (see the module docstring); returns the paths. Refuses
    (FileExistsError) to overwrite existing files unless asked. `ca_dir`: issue from the CAs
    already there (ca.pem / ca-key.pem and client-ca.pem / client-ca-key.pem, copied into
    `out`) instead of new ones: a rotation, or more hosts, under the same trust."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    if out.stat().st_mode & 0o077:  # a folder that was there already: only its owner may list it
        os.chmod(out, 0o700)
    paths = [out / f for f in FILES]
    existing = [p for p in paths if p.exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{existing[0]} exists; pass --force to replace the certificates in {out}")
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)  # tolerate small clock skew
    until = now + dt.timedelta(days=days)

    def key() -> ec.EllipticCurvePrivateKey:
        return ec.generate_private_key(ec.SECP256R1())

    def pem_key(k: ec.EllipticCurvePrivateKey) -> bytes:
        return k.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    def authority(name: str, common_name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        if ca_dir is not None:
            ca = x509.load_pem_x509_certificate((ca_dir / f"{name}.pem").read_bytes())
            k = serialization.load_pem_private_key((ca_dir / f"{name}-key.pem").read_bytes(), password=None)
            return ca, k  # type: ignore[return-value]  # ours are always ECDSA keys
        k = key()
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        ca = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(k.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(until)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(k.public_key()), critical=False)
            .sign(k, hashes.SHA256())
        )
        return ca, k

    def leaf(
        ca: x509.Certificate,
        ca_key: ec.EllipticCurvePrivateKey,
        common_name: str,
        usages: list[x509.ObjectIdentifier],
        san: list[x509.GeneralName] | None,
    ) -> tuple[bytes, bytes]:
        k = key()
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(ca.subject)
            .public_key(k.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(until)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        )
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        return cert.public_bytes(serialization.Encoding.PEM), pem_key(k)

    ca, ca_key = authority("ca", "specdec services CA")
    client_ca, client_ca_key = authority("client-ca", "specdec clients CA")
    contents = [ca.public_bytes(serialization.Encoding.PEM), pem_key(ca_key)]
    for role, (uri, server_auth, client_auth) in ROLES.items():
        usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server_auth else []) + (
            [ExtendedKeyUsageOID.CLIENT_AUTH] if client_auth else []
        )
        contents += leaf(ca, ca_key, f"specdec {role}", usages, _san(hosts, uri))
    contents += [client_ca.public_bytes(serialization.Encoding.PEM), pem_key(client_ca_key)]
    contents += leaf(
        client_ca,
        client_ca_key,
        "specdec client",
        [ExtendedKeyUsageOID.CLIENT_AUTH],
        [x509.UniformResourceIdentifier(CLIENT_URI)],
    )
    for path, data in zip(paths, contents, strict=True):
        _write(path, data, private=path.name.endswith("-key.pem"))
    return paths
