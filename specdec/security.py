"""Transport security, API keys and limits: the one place every service takes them from.

Terms:
    TLS files       `tls_cert` / `tls_key` (PEM: this service's certificate chain and key) and
                    `tls_ca` (PEM: the CA bundle peers' certificates must chain to). A server
                    with cert + key serves TLS; a client with a CA verifies its server with it and,
                    with cert + key too, presents them as its client certificate (mTLS).
    client auth     `tls_client_auth = require`: a server accepts only clients whose certificate
                    chains to `tls_client_ca` (default `tls_ca`). A gateway's clients (end users)
                    have certificates from a CA of their own, so they cannot even complete a
                    handshake with a drafter or a verifier, which trust only the services' CA.
    identity        a peer's identity is what its certificate names in its subjectAltName: URIs
                    (`spiffe://specdec/gateway`, the role URIs `specdec certs` issues), DNS names,
                    IPs. `tls_allowed_peers` lists the identities a server serves (drafters and
                    verifiers: the gateways'); a call from any other certificate ends with
                    PERMISSION_DENIED before the handler runs. Health checks stay open.
    reload          certificates are read again when their files change (checked at every new
                    TLS handshake, a stat per file) or after SIGHUP (`request_reload`), so a
                    rotation (cert-manager rewriting a Secret) needs no restart. Connections
                    already open keep the certificate they were made with.
    API key         a bearer token (gRPC metadata `authorization: Bearer K`, REST header
                    `Authorization: Bearer K`). Only SHA-256 hashes of the configured keys are
                    kept; a presented key is hashed and compared with every stored hash in
                    constant time. A key is known in logs and metrics only by its `key id`, the
                    first 8 hex digits of its hash.
    rate limit      per key id: a token bucket of `rate_limit_rps` requests per second with
                    `rate_limit_burst` capacity, and at most `max_streams_per_key` generations in
                    flight; a refusal carries the seconds after which a retry can succeed.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import grpc

if TYPE_CHECKING:
    from specdec.config import GatewayConfig, TransportConfig

# A call's context in code that serves every service alike (interceptors, admission, aborts):
# the messages' types depend on the service, and that code reads none of them.
AnyContext: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"  # a string: not subscriptable at run time

log = logging.getLogger("specdec.security")

# ---------------------------------------------------------------------------- reload

_reload_generation = 0  # bumped by SIGHUP: every certificate set is read again at its next use


def request_reload() -> None:
    """Have every service certificate re-read at its next handshake (the SIGHUP handler)."""
    global _reload_generation
    _reload_generation += 1
    log.info("certificate reload requested")


class CertFiles:
    """A set of PEM files read together, re-read when any of them changes or on request.

    `changed()` is cheap (a stat per file); `read()` returns their bytes (None for an unset path)
    and records the state it read, so the next `changed()` compares against it.
    """

    def __init__(self, *paths: str) -> None:
        self.paths = [p or "" for p in paths]
        self._seen: tuple[Any, ...] | None = None
        self._generation = -1
        self._lock = threading.Lock()

    def _signature(self) -> tuple[Any, ...]:
        sig = []
        for p in self.paths:
            try:
                st = os.stat(p) if p else None
            except OSError:
                st = None
            sig.append((st.st_mtime_ns, st.st_size, st.st_ino) if st else None)
        return tuple(sig)

    def changed(self) -> bool:
        return self._generation != _reload_generation or self._signature() != self._seen

    def read(self) -> list[bytes | None]:
        with self._lock:
            self._generation = _reload_generation
            self._seen = self._signature()
            return [Path(p).read_bytes() if p else None for p in self.paths]


# ---------------------------------------------------------------------------- TLS


def tls_enabled(cfg: TransportConfig) -> bool:
    """A service serves TLS when it has a certificate and its key."""
    return bool(cfg.tls_cert and cfg.tls_key)


def check_tls_settings(cfg: TransportConfig) -> None:
    """Settings that cannot work stop the start-up with a message naming them."""
    if bool(cfg.tls_cert) != bool(cfg.tls_key):
        raise ValueError("tls_cert and tls_key: set both (SPECDEC_TLS_CERT, SPECDEC_TLS_KEY) or neither")
    if cfg.tls_client_auth not in ("none", "require"):
        raise ValueError(f"tls_client_auth: {cfg.tls_client_auth!r} is not none or require")
    if cfg.tls_client_auth == "require" and not (tls_enabled(cfg) and (cfg.tls_client_ca or cfg.tls_ca)):
        raise ValueError(
            "tls_client_auth=require needs tls_cert, tls_key and tls_client_ca or tls_ca (the CA clients must chain to)"
        )
    if cfg.tls_allowed_peers and cfg.tls_client_auth != "require":
        raise ValueError("tls_allowed_peers needs tls_client_auth=require (identities come from client certificates)")
    for name in ("tls_cert", "tls_key", "tls_ca", "tls_client_ca"):
        path = getattr(cfg, name)
        if path and not Path(path).is_file():
            raise ValueError(f"{name}: {path} is not a readable file")


def server_credentials(cfg: TransportConfig) -> grpc.ServerCredentials:
    """TLS credentials for a gRPC server that re-read the files when they change (or on SIGHUP)."""
    files = CertFiles(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca or cfg.tls_ca)
    require = cfg.tls_client_auth == "require"

    def configuration() -> Any:
        cert, key, ca = files.read()
        assert cert is not None and key is not None, "served with TLS only when tls_cert and tls_key are set"
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch() -> Any:  # gRPC calls this at every new handshake: None keeps the current certificates
        if not files.changed():
            return None
        try:
            config = configuration()
        except OSError as err:  # a rotation caught half-written: keep serving the old ones
            log.warning("certificate reload failed (%s); keeping the current certificates", err)
            return None
        log.info("certificates reloaded from %s", cfg.tls_cert)
        return config

    return grpc.dynamic_ssl_server_credentials(configuration(), fetch, require_client_authentication=require)


def channel_credentials(ca: str = "", cert: str = "", key: str = "") -> grpc.ChannelCredentials:
    """TLS credentials of a client: verify the server with `ca` (empty: the system's roots) and,
    with `cert` and `key`, present them (mTLS)."""
    root, chain, private = CertFiles(ca, cert, key).read()
    return grpc.ssl_channel_credentials(
        root_certificates=root, private_key=private if chain else None, certificate_chain=chain if private else None
    )


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (localhost, 127.0.0.0/8, ::1, unix sockets)."""
    if host.startswith("unix:") or host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def grpc_options(cfg: TransportConfig, server: bool) -> list[tuple[str, Any]]:
    """Message-size, keepalive (and, for clients, reconnect) options of a server or a client of
    this service's settings.

    Both sides take the keepalive from the same settings: clients ping every
    `keepalive_time_s` (also without calls in flight) and give up on a peer that does not
    answer within `keepalive_timeout_s`; servers accept pings that often, so no side ever
    sends GOAWAY too_many_pings."""
    size = int(cfg.max_message_mb * (1 << 20))
    ping_ms = int(cfg.keepalive_time_s * 1000)
    opts: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", size),
        ("grpc.max_send_message_length", size),
        ("grpc.keepalive_time_ms", ping_ms),
        ("grpc.keepalive_timeout_ms", int(cfg.keepalive_timeout_s * 1000)),
        # gRPC >= 1.6x times a ping's answer with this one (keepalive_timeout_ms alone no longer
        # ends a connection whose peer is alive but silent, e.g. SIGSTOPped)
        ("grpc.http2.ping_timeout_ms", int(cfg.keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    if server:
        # accept a client's pings at half its interval (timer jitter must never look like abuse)
        opts += [
            ("grpc.http2.min_recv_ping_interval_without_data_ms", ping_ms // 2),
            ("grpc.http2.min_ping_interval_without_data_ms", ping_ms // 2),
            ("grpc.so_reuseport", 0),
        ]
    else:
        # a peer back from a restart (a pod rescheduled, a verifier reloaded) is reached within
        # 5 s, not after gRPC's default backoff, which grows to 120 s across the failed attempts
        opts.append(("grpc.max_reconnect_backoff_ms", 5000))
    return opts


def add_port(server: grpc.aio.Server, name: str, address: str, cfg: TransportConfig) -> int:
    """Bind `address` with TLS when the service has certificates, else in plaintext; plaintext on
    an address other machines can reach is logged as a warning at start-up. Returns the port
    bound, 0 when it could not be bound (`serving.bind_error` says why)."""
    host = address.rsplit(":", 1)[0] if not address.startswith("unix:") else address
    try:
        if tls_enabled(cfg):
            bound = server.add_secure_port(address, server_credentials(cfg))
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError:  # grpcio raises "Failed to bind" (older releases returned 0); the caller asks the OS why
        return 0
    if tls_enabled(cfg):
        log.info("%s: TLS on %s (client certificates: %s)", name, address, cfg.tls_client_auth)
    else:
        if not is_loopback(host):
            log.warning(
                "%s: serving PLAINTEXT gRPC on %s, which other hosts can reach: anyone on the network "
                "can read and send requests. Set SPECDEC_TLS_CERT / SPECDEC_TLS_KEY (and SPECDEC_TLS_CA "
                "with SPECDEC_TLS_CLIENT_AUTH=require), see `specdec certs`.",
                name,
                address,
            )
    return bound


def client_channel(address: str, cfg: TransportConfig, server_name: str = "") -> grpc.aio.Channel:
    """An asyncio channel from one service to another (the gateway to its drafter and verifier):
    TLS when the service has a CA (its own certificate as the client's, for mTLS).
    `server_name`: the name the server's certificate must carry when `address` is an IP that
    name resolved to (a pod behind a headless Service)."""
    opts = grpc_options(cfg, server=False)
    if server_name:
        opts.append(("grpc.ssl_target_name_override", server_name))
    if cfg.tls_ca:
        return grpc.aio.secure_channel(
            address, channel_credentials(cfg.tls_ca, cfg.tls_cert, cfg.tls_key), options=opts
        )
    return grpc.aio.insecure_channel(address, options=opts)


# ---------------------------------------------------------------------------- identities

HEALTH_METHODS = "/grpc.health.v1.Health/"  # open to every TLS client: probes carry no role identity


def certificate_identities(pem: bytes) -> set[str]:
    """The identities a PEM certificate names: its subjectAltName URIs, DNS names and IPs."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(pem)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return (
        {str(v) for v in san.get_values_for_type(x509.UniformResourceIdentifier)}
        | {str(v) for v in san.get_values_for_type(x509.DNSName)}
        | {str(v) for v in san.get_values_for_type(x509.IPAddress)}
    )


def allowed_peers(cfg: TransportConfig) -> list[str]:
    return [p.strip() for p in (cfg.tls_allowed_peers or "").split(",") if p.strip()]


class PeerIdentityCheck(grpc.aio.ServerInterceptor):
    """Serve only peers whose client certificate names one of `allowed` (see `identity` in the
    module docstring); every other call (health checks aside) ends with PERMISSION_DENIED before
    its handler runs. The check reads the certificate gRPC verified in the handshake."""

    def __init__(self, allowed: Iterable[str]) -> None:
        self.allowed = set(allowed)
        self._seen: dict[bytes, set[str]] = {}  # certificate -> identities (parsed once per certificate)

    def _refusal(self, context: AnyContext) -> str | None:
        """Why this call's peer is refused (None: it is allowed)."""
        pem = next(iter(context.auth_context().get("x509_pem_cert") or []), None)
        if pem is None:
            return "no client certificate"
        if pem not in self._seen:
            if len(self._seen) > 1024:
                self._seen.clear()
            self._seen[pem] = certificate_identities(pem)
        names = self._seen[pem]
        if names & self.allowed:
            return None
        return f"the client certificate ({', '.join(sorted(names)) or 'no subjectAltName'}) is not one of tls_allowed_peers"

    async def intercept_service(self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(HEALTH_METHODS):
            return handler
        return _guarded(handler, self._refusal, details.method)


def _guarded(handler: grpc.RpcMethodHandler[Any, Any], refusal: Callable[[Any], str | None], method: str) -> Any:
    """`handler` with `refusal(context)` checked first: PERMISSION_DENIED when it says why."""
    import inspect

    kind = next(k for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream") if getattr(handler, k))
    behavior = getattr(handler, kind)

    async def deny(context: AnyContext) -> None:
        why = refusal(context)
        if why is not None:
            log.warning("refused %s from %s: %s", method, context.peer(), why)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"peer not allowed: {why}")

    if inspect.isasyncgenfunction(behavior):

        async def guarded_gen(request: Any, context: AnyContext) -> Any:
            await deny(context)
            async for item in behavior(request, context):
                yield item

        wrapped: Any = guarded_gen
    else:

        async def guarded(request: Any, context: AnyContext) -> Any:
            await deny(context)
            return await behavior(request, context)

        wrapped = guarded
    make = getattr(grpc, f"{kind}_rpc_method_handler")
    return make(
        wrapped, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )


def server_interceptors(name: str, cfg: TransportConfig) -> list[grpc.aio.ServerInterceptor]:
    """The identity check when `tls_allowed_peers` is set; a warning when client certificates are
    required but any certificate from the CA may call."""
    peers = allowed_peers(cfg)
    if peers:
        log.info("%s: serving only the peers %s", name, ", ".join(peers))
        return [PeerIdentityCheck(peers)]
    if cfg.tls_client_auth == "require" and name in ("drafter", "verifier"):
        log.warning(
            "%s: any client certificate from the CA may call this service (it skips the gateway's API "
            "keys and limits): set SPECDEC_TLS_ALLOWED_PEERS to the gateways' identity, e.g. "
            "spiffe://specdec/gateway",
            name,
        )
    return []


# ---------------------------------------------------------------------------- API keys


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_id(hashed: str) -> str:
    """How logs and metrics name a key: never the key, the first 8 hex digits of its hash."""
    return "key-" + hashed[:8]


class KeyStore:
    """The gateway's API keys, kept as SHA-256 hashes only.

    Keys come from `api_keys` (comma-separated; env SPECDEC_API_KEYS) and `api_key_file` (one
    per line, # comments). No keys configured: authentication is off.
    """

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._hashes = sorted({key_hash(k) for k in keys if k})

    @classmethod
    def from_config(cls, cfg: GatewayConfig) -> KeyStore:
        keys = [k.strip() for k in (cfg.api_keys or "").split(",")]
        if cfg.api_key_file:
            for line in Path(cfg.api_key_file).read_text().splitlines():
                line = line.split("#", 1)[0].strip()
                if line:
                    keys.append(line)
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self._hashes)

    def identify(self, authorization: str | None) -> str | None:
        """The key id of an `authorization` value `Bearer K` whose K is a configured key, else None.
        Every stored hash is compared (constant time each), so timing tells nothing of which matched."""
        if not authorization:
            return None
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        presented = key_hash(token.strip())
        found = None
        for stored in self._hashes:
            if hmac.compare_digest(presented, stored):
                found = stored
        return key_id(found) if found else None


# ---------------------------------------------------------------------------- rate limits


@dataclass
class Admission:
    """A rate limiter's answer: admitted, or not with the reason and when to retry."""

    ok: bool
    reason: str = ""
    retry_after_s: float = 0.0


@dataclass
class _Bucket:
    tokens: float
    stamp: float
    streams: int = 0


@dataclass
class RateLimiter:
    """Per key id: a token bucket (`rps` tokens per second, `burst` capacity; 0 rps: unlimited)
    and at most `max_streams` generations in flight (0: unlimited). `clock` is injectable so
    tests need no timers."""

    rps: float = 0.0
    burst: int = 0
    max_streams: int = 0
    clock: Callable[[], float] = time.monotonic
    streams_setting: str = "max_streams_per_key"  # the setting `max_streams` comes from, for the refusal
    _buckets: dict[str, _Bucket] = field(default_factory=dict)

    def acquire(self, key: str) -> Admission:
        """Take one request for `key`; on success the caller must `release(key)` when it ends."""
        now = self.clock()
        capacity = max(1.0, float(self.burst or self.rps))
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = _Bucket(capacity, now)
        if self.max_streams and b.streams >= self.max_streams:
            return Admission(
                False,
                f"{self.streams_setting} ({self.max_streams}) generations are already in flight for this API key",
                1.0,
            )
        if self.rps > 0:
            b.tokens = min(capacity, b.tokens + (now - b.stamp) * self.rps)
            b.stamp = now
            if b.tokens < 1.0:
                return Admission(
                    False,
                    f"rate_limit_rps ({self.rps:g} requests/s, burst {capacity:g}) exceeded for this API key",
                    (1.0 - b.tokens) / self.rps,
                )
            b.tokens -= 1.0
        b.streams += 1
        return Admission(True)

    def release(self, key: str) -> None:
        b = self._buckets.get(key)
        if b is not None and b.streams > 0:
            b.streams -= 1

    @classmethod
    def from_config(cls, cfg: GatewayConfig, keys_enabled: bool) -> RateLimiter:
        """The gateway's limiter: `max_streams` is max_streams_per_key (0: none) and, with API keys,
        at most max_inflight_share_per_key of max_inflight (rounded up, at least 1)."""
        streams, setting = cfg.max_streams_per_key, "max_streams_per_key"
        share = cfg.max_inflight_share_per_key
        if keys_enabled and cfg.max_inflight and 0 < share < 1:
            cap = max(1, math.ceil(share * cfg.max_inflight))
            if not streams or cap < streams:
                streams, setting = cap, f"max_inflight_share_per_key ({share:g} of max_inflight)"
        return cls(cfg.rate_limit_rps, cfg.rate_limit_burst, streams, streams_setting=setting)

    def retry_after_header(self, admission: Admission) -> str:
        """Retry-After's value: whole seconds, at least 1."""
        return str(max(1, math.ceil(admission.retry_after_s)))
