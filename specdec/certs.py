"""`specdec certs DIR`: a development CA and the certificates a specdec deployment needs.

    DIR/ca.pem, ca-key.pem          the CA (SPECDEC_TLS_CA of every service and client)
    DIR/server.pem, server-key.pem  the services' certificate (SPECDEC_TLS_CERT / _KEY of the
                                    gateway, drafter and verifier): valid for every host named
                                    (DNS names and IP addresses), plus localhost and 127.0.0.1,
                                    for server and client authentication (the gateway presents it
                                    to the drafter and the verifier under mTLS)
    DIR/client.pem, client-key.pem  a client certificate (client authentication only), for
                                    callers of a gateway that requires client certificates

ECDSA P-256 keys, SHA-256 signatures. Keys are written 0600. For production, issue these from
your own CA (cert-manager, Vault); specdec only reads PEM files.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

FILES = ("ca.pem", "ca-key.pem", "server.pem", "server-key.pem", "client.pem", "client-key.pem")


def _san(hosts: Sequence[str]) -> list:
    from cryptography import x509

    names: list = []
    for host in dict.fromkeys([*hosts, "localhost", "127.0.0.1"]):  # ordered, no duplicates
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.write_bytes(data)
    if private:
        os.chmod(path, 0o600)


def write_certs(out: Path, hosts: Sequence[str], days: int = 365, overwrite: bool = False,
                ca_dir: Path | None = None) -> list[Path]:
    """Write a CA, the services' certificate for `hosts` and a client certificate into `out`;
    returns the paths. Refuses (FileExistsError) to overwrite existing files unless asked.
    `ca_dir`: issue from the CA already there (its ca.pem and ca-key.pem, copied into `out`)
    instead of a new one: a rotation, or more hosts, under the same trust."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f for f in FILES]
    existing = [p for p in paths if p.exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{existing[0]} exists; pass --force to replace the certificates in {out}")
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)  # tolerate small clock skew
    until = now + dt.timedelta(days=days)

    def key() -> ec.EllipticCurvePrivateKey:
        return ec.generate_private_key(ec.SECP256R1())

    def pem_key(k: ec.EllipticCurvePrivateKey) -> bytes:
        return k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                               serialization.NoEncryption())

    if ca_dir is not None:
        ca = x509.load_pem_x509_certificate((ca_dir / "ca.pem").read_bytes())
        ca_key = serialization.load_pem_private_key((ca_dir / "ca-key.pem").read_bytes(), password=None)
        ca_name = ca.subject
    else:
        ca_key = key()
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "specdec development CA")])
        ca = (
            x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(until)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256())
        )

    def leaf(common_name: str, usages: list, san: list | None) -> tuple[bytes, bytes]:
        k = key()
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(ca_name).public_key(k.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(until)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        )
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        return cert.public_bytes(serialization.Encoding.PEM), pem_key(k)

    server, server_key = leaf("specdec service", [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
                              _san(hosts))
    client, client_key = leaf("specdec client", [ExtendedKeyUsageOID.CLIENT_AUTH], None)
    contents = [ca.public_bytes(serialization.Encoding.PEM), pem_key(ca_key), server, server_key, client, client_key]
    for path, data in zip(paths, contents):
        _write(path, data, private=path.name.endswith("-key.pem"))
    return paths
