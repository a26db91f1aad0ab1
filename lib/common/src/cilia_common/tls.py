"""Mutual TLS for Cilia's gRPC links: files, credentials, rotation, peer identity, issuing.

Server side: :func:`server_credentials` builds grpcio's *dynamic* SSL server credentials from
:class:`ServerTLS` (certificate, key, client CA bundle; clients must present a certificate the
bundle verifies). Its fetcher, :class:`CertificateReloader`, runs on each new TLS handshake,
stats the files and re-reads them when one changed (mtime, size or inode: what an atomic
rename by cert-manager/kubelet's projected-Secret update or ``cp`` produces), so a renewed
certificate is served without a restart. A half-written pair (the certificate does not match
the key, a file is unreadable) is not taken: the previous pair stays in use and the error is
logged; the next handshake tries again.

Client side: :func:`channel_credentials` reads :class:`ClientTLS` (CA bundle, client
certificate and key) at the moment it is called; :class:`RotatingChannel` is a
``grpc.aio.Channel`` that calls it again for new calls once a file changed, so a long-lived
client (the agent) dials with renewed files without a restart. grpcio's channel credentials
are fixed per channel, hence one channel per generation of files.

Identity: :func:`peer_identity` reads the verified peer certificate of an RPC from the gRPC
auth context (``x509_pem_cert``) into a :class:`PeerIdentity` (common name, organizations,
SANs). The names Cilia authorises by follow Kubernetes' client certificates: an agent is
``CN=system:node:<node>, O=system:nodes`` (the kubelet's identity that Kubernetes' Node
authorizer uses), an administrator is in ``O=system:masters`` (the group the API server
treats as cluster-admin); see :data:`NODE_GROUP`, :data:`ADMIN_GROUP`.

Issuing: :func:`generate_bundle` writes a CA, a server certificate and client certificates
(ECDSA P-256, SHA-256) for standalone installations and tests.

Source: flag and file conventions of upstream Hubble (``--hubble-tls-cert-file``,
``--hubble-tls-key-file``, ``--hubble-tls-client-ca-files``; relay's
``--tls-hubble-server-ca-files``, ``--tls-hubble-client-cert-file``,
``--tls-hubble-client-key-file``) and grpcio's ``dynamic_ssl_server_credentials``.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import ipaddress
import logging
import os
import pathlib
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = [
    "ADMIN_GROUP",
    "HUBBLE_RELAY_SERVER_NAME",
    "NODE_GROUP",
    "NODE_PREFIX",
    "CertificateReloader",
    "ClientTLS",
    "GeneratedBundle",
    "PeerIdentity",
    "RotatingChannel",
    "ServerTLS",
    "TLSFileError",
    "certificate_identity",
    "channel_credentials",
    "channel_options",
    "generate_bundle",
    "hubble_server_name",
    "is_loopback",
    "node_subject",
    "peer_identity",
    "read_ca_bundle",
    "read_key_pair",
    "server_credentials",
]

log = logging.getLogger(__name__)

NODE_PREFIX = "system:node:"
"""Common-name prefix of an agent certificate: ``system:node:<node-name>``."""
NODE_GROUP = "system:nodes"
"""Organization (group) of every agent certificate."""
ADMIN_GROUP = "system:masters"
"""Organization (group) of an administrator certificate: may write resources."""


class TLSFileError(RuntimeError):
    """A TLS file is missing, unreadable or malformed, or a certificate does not match its key.

    Attributes:
        path: the file at fault ("" when the pair as a whole is).
    """

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        super().__init__(f"{path}: {reason}" if path else reason)


@dataclass(frozen=True)
class ServerTLS:
    """Files of a mutual-TLS server.

    Attributes:
        cert_file: PEM certificate chain served (leaf first).
        key_file: PEM private key of the leaf.
        client_ca_files: PEM CA bundles a client certificate must chain to; empty: clients
            are not asked for a certificate (server-only TLS, as Hubble allows).
    """

    cert_file: str
    key_file: str
    client_ca_files: tuple[str, ...]


@dataclass(frozen=True)
class ClientTLS:
    """Files of a mutual-TLS client.

    Attributes:
        ca_files: PEM CA bundles the server certificate must chain to.
        cert_file: PEM client certificate chain presented ("" = none: server-only TLS).
        key_file: PEM private key of the client certificate ("" with no certificate).
        server_name: name checked against the server certificate's SANs ("" = the host of
            the address dialled).
    """

    ca_files: tuple[str, ...]
    cert_file: str
    key_file: str
    server_name: str = ""

    def paths(self) -> tuple[str, ...]:
        """Every file this client reads."""
        return tuple(p for p in (*self.ca_files, self.cert_file, self.key_file) if p)


def _read(path: str) -> bytes:
    try:
        return pathlib.Path(path).read_bytes()
    except OSError as exc:
        raise TLSFileError(path, exc.strerror or str(exc)) from None


def read_ca_bundle(files: Iterable[str]) -> bytes:
    """The PEM certificates of ``files`` concatenated (each checked to hold at least one).

    Raises:
        TLSFileError: a file is unreadable or holds no PEM certificate.
    """
    out = []
    for path in files:
        data = _read(path)
        try:
            x509.load_pem_x509_certificates(data)
        except ValueError as exc:
            raise TLSFileError(path, f"not a PEM certificate bundle: {exc}") from None
        out.append(data if data.endswith(b"\n") else data + b"\n")
    if not out:
        raise TLSFileError("", "no CA file given")
    return b"".join(out)


def read_key_pair(cert_file: str, key_file: str) -> tuple[bytes, bytes]:
    """``(certificate chain PEM, private key PEM)``, checked to belong together.

    Raises:
        TLSFileError: a file is unreadable or malformed, or the key is not the
            certificate's (e.g. read between the two renames of a rotation).
    """
    cert_pem, key_pem = _read(cert_file), _read(key_file)
    try:
        leaf = x509.load_pem_x509_certificates(cert_pem)[0]
    except ValueError as exc:
        raise TLSFileError(cert_file, f"not a PEM certificate: {exc}") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise TLSFileError(key_file, f"not an unencrypted PEM private key: {exc}") from None
    fmt = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if leaf.public_key().public_bytes(*fmt) != key.public_key().public_bytes(*fmt):
        raise TLSFileError("", f"{key_file} is not the private key of {cert_file}")
    return cert_pem, key_pem


def file_stamp(paths: Iterable[str]) -> tuple[tuple[int, int, int], ...]:
    """(mtime_ns, size, inode) of each path; (-1, -1, -1) for one that cannot be stat'ed."""
    out = []
    for path in paths:
        try:
            st = os.stat(path)
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            out.append((-1, -1, -1))
    return tuple(out)


class CertificateReloader:
    """The certificate-configuration fetcher of :func:`server_credentials`.

    grpcio calls it (from its own threads) before each new handshake; it returns None while
    the files are unchanged, else a new ``grpc.ssl_server_certificate_configuration``.

    Attributes:
        serial: serial number of the certificate currently served.
        reloads: how many times a changed pair was taken.
    """

    def __init__(self, tls: ServerTLS) -> None:
        self.tls = tls
        self._lock = threading.Lock()
        self._stamp = file_stamp(self._paths())
        self.serial = 0
        self.reloads = 0
        self.initial = self._configuration()

    def _paths(self) -> tuple[str, ...]:
        return (self.tls.cert_file, self.tls.key_file, *self.tls.client_ca_files)

    def _configuration(self) -> Any:
        cert_pem, key_pem = read_key_pair(self.tls.cert_file, self.tls.key_file)
        roots = read_ca_bundle(self.tls.client_ca_files) if self.tls.client_ca_files else None
        self.serial = x509.load_pem_x509_certificates(cert_pem)[0].serial_number
        return grpc.ssl_server_certificate_configuration(
            [(key_pem, cert_pem)], root_certificates=roots
        )

    def __call__(self) -> Any:
        """None (keep the current pair) or the configuration of the changed files."""
        with self._lock:
            stamp = file_stamp(self._paths())
            if stamp == self._stamp:
                return None
            try:
                config = self._configuration()
            except TLSFileError as exc:
                # keep serving the previous pair; retried at the next handshake
                log.warning("TLS files changed but cannot be used", extra={"error": str(exc)})
                return None
            self._stamp = stamp
            self.reloads += 1
            log.info(
                "TLS certificate reloaded",
                extra={"cert_file": self.tls.cert_file, "serial": f"{self.serial:x}"},
            )
            return config


def server_credentials(tls: ServerTLS) -> tuple[grpc.ServerCredentials, CertificateReloader]:
    """TLS server credentials that pick up renewed files at the next handshake; mutual
    (a client certificate chaining to ``tls.client_ca_files`` required) when CA files are
    given.

    Returns:
        ``(credentials, reloader)``: pass the credentials to ``add_secure_port``; the
        reloader tells the serial served and counts reloads.

    Raises:
        TLSFileError: a file is unusable at start-up.
    """
    reloader = CertificateReloader(tls)
    credentials = grpc.dynamic_ssl_server_credentials(
        reloader.initial, reloader, require_client_authentication=bool(tls.client_ca_files)
    )
    return credentials, reloader


def channel_credentials(tls: ClientTLS) -> grpc.ChannelCredentials:
    """Client credentials from the files as they are now.

    Raises:
        TLSFileError: a file is unusable.
    """
    roots = read_ca_bundle(tls.ca_files)
    if not tls.cert_file and not tls.key_file:
        return grpc.ssl_channel_credentials(root_certificates=roots)
    cert_pem, key_pem = read_key_pair(tls.cert_file, tls.key_file)
    return grpc.ssl_channel_credentials(
        root_certificates=roots, private_key=key_pem, certificate_chain=cert_pem
    )


def channel_options(tls: ClientTLS | None) -> list[tuple[str, Any]]:
    """Channel options a TLS client needs (the server-name override when one is set)."""
    if tls is None or not tls.server_name:
        return []
    return [("grpc.ssl_target_name_override", tls.server_name)]


class RotatingChannel(grpc.aio.Channel):  # type: ignore[misc]  # grpc has no stubs
    """A ``grpc.aio.Channel`` whose calls go to a secure channel built from ``tls``'s
    files as they were when the call started: when a file changed (mtime, size, inode) and
    the new files are usable, new calls go to a new channel built from them. Calls already
    running keep their channel; superseded channels are closed by :meth:`close`
    (rotations are rare, so they are few).

    Multi-callables (what stubs hold) resolve the channel at each call, so a stub made once
    follows rotations.

    Raises (constructor):
        TLSFileError: the files are unusable at start.
    """

    def __init__(
        self, target: str, tls: ClientTLS, options: Sequence[tuple[str, Any]] = ()
    ) -> None:
        self._target = target
        self._tls = tls
        self._options = [*options, *channel_options(tls)]
        self._stamp = file_stamp(tls.paths())
        self._current = self._dial()
        self._retired: list[grpc.aio.Channel] = []
        self.generation = 0

    def _dial(self) -> grpc.aio.Channel:
        return grpc.aio.secure_channel(
            self._target, channel_credentials(self._tls), options=self._options
        )

    def current(self) -> grpc.aio.Channel:
        """The channel for a new call (a new one when the files changed and are usable)."""
        stamp = file_stamp(self._tls.paths())
        if stamp != self._stamp:
            try:
                fresh = self._dial()
            except TLSFileError as exc:
                log.warning(
                    "TLS client files changed but cannot be used", extra={"error": str(exc)}
                )
            else:
                self._retired.append(self._current)
                self._current, self._stamp = fresh, stamp
                self.generation += 1
                log.info("TLS client files reloaded", extra={"target": self._target})
        return self._current

    def _lazy(self, kind: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return _LazyCallable(self, kind, method, args, kwargs)

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._lazy("unary_unary", method, args, kwargs)

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._lazy("unary_stream", method, args, kwargs)

    def stream_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._lazy("stream_unary", method, args, kwargs)

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._lazy("stream_stream", method, args, kwargs)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self.current().get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self._current.wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self.current().channel_ready()

    async def close(self, grace: float | None = None) -> None:
        """Close the current channel and every superseded one."""
        channels, self._retired = [self._current, *self._retired], []
        await asyncio.gather(*(c.close(grace) for c in channels))

    async def __aenter__(self) -> RotatingChannel:
        return self

    async def __aexit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        await self.close(None)


@dataclass
class _LazyCallable:
    """A multi-callable that binds to :meth:`RotatingChannel.current` at each call."""

    owner: RotatingChannel
    kind: str
    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        channel = self.owner.current()
        return getattr(channel, self.kind)(self.method, *self.args, **self.kwargs)(*args, **kwargs)


@dataclass(frozen=True)
class PeerIdentity:
    """The verified client certificate of an RPC.

    Attributes:
        common_name: subject CN ("" when absent).
        organizations: subject O values (groups).
        dns_names, uris: SAN entries.
        serial: certificate serial number.
    """

    common_name: str
    organizations: tuple[str, ...]
    dns_names: tuple[str, ...] = ()
    uris: tuple[str, ...] = ()
    serial: int = 0

    @property
    def node(self) -> str:
        """The node an agent certificate is for (``CN=system:node:<node>`` in
        ``O=system:nodes``), or "" when this is not an agent certificate."""
        if NODE_GROUP in self.organizations and self.common_name.startswith(NODE_PREFIX):
            return self.common_name[len(NODE_PREFIX) :]
        return ""

    @property
    def is_admin(self) -> bool:
        """Whether the certificate is in the administrators' group (``O=system:masters``)."""
        return ADMIN_GROUP in self.organizations

    def describe(self) -> str:
        """``CN=..., O=...`` for messages."""
        orgs = ",".join(self.organizations)
        return f"CN={self.common_name!r}" + (f", O={orgs!r}" if orgs else "")


@functools.lru_cache(maxsize=256)
def _identity_of(pem: bytes) -> PeerIdentity:
    cert = x509.load_pem_x509_certificate(pem)

    def attrs(oid: x509.ObjectIdentifier) -> tuple[str, ...]:
        return tuple(str(a.value) for a in cert.subject.get_attributes_for_oid(oid))

    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        dns = tuple(san.get_values_for_type(x509.DNSName))
        uris = tuple(san.get_values_for_type(x509.UniformResourceIdentifier))
    except x509.ExtensionNotFound:
        dns, uris = (), ()
    cns = attrs(NameOID.COMMON_NAME)
    return PeerIdentity(
        common_name=cns[0] if cns else "",
        organizations=attrs(NameOID.ORGANIZATION_NAME),
        dns_names=dns,
        uris=uris,
        serial=cert.serial_number,
    )


def peer_identity(context: Any) -> PeerIdentity | None:
    """The identity of the RPC's client certificate, from ``context.auth_context()``
    (``x509_pem_cert``, which grpc sets only once the chain verified), or None when the
    connection is not TLS or the client sent no certificate.

    Args:
        context: a ``grpc.ServicerContext`` or ``grpc.aio.ServicerContext``.
    """
    auth = context.auth_context() or {}
    pems = auth.get("x509_pem_cert") or []
    if not pems:
        return None
    return _identity_of(bytes(pems[0]))


def certificate_identity(cert_file: str) -> PeerIdentity:
    """The identity a client presents with ``cert_file`` (its leaf certificate), as
    :func:`peer_identity` would read it on the server.

    Raises:
        TLSFileError: the file is unreadable or not a PEM certificate.
    """
    data = _read(cert_file)
    try:
        leaf = x509.load_pem_x509_certificates(data)[0]
    except ValueError as exc:
        raise TLSFileError(cert_file, f"not a PEM certificate: {exc}") from None
    return _identity_of(leaf.public_bytes(serialization.Encoding.PEM))


def is_loopback(address: str) -> bool:
    """Whether a listen address ``HOST:PORT`` / ``unix:PATH`` is reachable from this host
    only (a unix socket, ``localhost``, 127.0.0.0/8, ::1)."""
    if address.startswith("unix:"):
        return True
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def node_subject(node: str) -> tuple[str, tuple[str, ...]]:
    """``(common name, organizations)`` of the agent certificate of ``node``."""
    return f"{NODE_PREFIX}{node}", (NODE_GROUP,)


@dataclass(frozen=True)
class GeneratedBundle:
    """Paths written by :func:`generate_bundle` (all PEM in one directory).

    Attributes:
        ca_cert, ca_key: the CA (``ca.crt``, ``ca.key``).
        server_cert, server_key: the operator's server pair (``server.crt``, ``server.key``).
        clients: client name -> (cert, key) paths (``<name>.crt``, ``<name>.key``): one per
            node (``node-<node>``) and ``admin``.
        hubble: with ``hubble_cluster``: ``hubble-<node>`` (each agent's Hubble server, also
            a client certificate), ``hubble-server`` (one for every node:
            ``*.<cluster>.hubble-grpc.cilium.io``, what a DaemonSet mounts),
            ``hubble-relay-client`` and ``hubble-relay-server`` -> (cert, key) paths.
    """

    ca_cert: str
    ca_key: str
    server_cert: str
    server_key: str
    clients: dict[str, tuple[str, str]]
    hubble: dict[str, tuple[str, str]] = field(default_factory=dict)


def hubble_server_name(node: str, cluster: str = "default") -> str:
    """The TLS name of a node's Hubble server, ``<node>.<cluster>.hubble-grpc.cilium.io``
    (upstream's format: the Peer service announces it, the relay checks it)."""
    return f"{node}.{cluster}.hubble-grpc.cilium.io"


HUBBLE_RELAY_SERVER_NAME = "*.hubble-relay.cilium.io"
"""Name on the relay's server certificate (upstream's)."""


def _name(common_name: str, organizations: Sequence[str] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations]
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attrs)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _issue(
    subject: x509.Name,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Certificate | None,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    days: float,
    ca: bool = False,
    server_hosts: Sequence[str] = (),
    client: bool = False,
    not_before: datetime.datetime | None = None,
) -> x509.Certificate:
    now = not_before or datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer.subject if issuer is not None else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), True
        )
    else:
        usages = [ExtendedKeyUsageOID.SERVER_AUTH] if server_hosts else []
        usages += [ExtendedKeyUsageOID.CLIENT_AUTH] if client else []
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        builder = builder.add_extension(
            x509.KeyUsage(True, False, False, False, False, False, False, False, False), True
        )
    if server_hosts:
        sans: list[x509.GeneralName] = []
        for host in server_hosts:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                sans.append(x509.DNSName(host))
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: pathlib.Path, data: bytes, mode: int) -> None:
    """Write ``data`` atomically (temporary file + rename) with ``mode``."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def generate_bundle(
    directory: str | os.PathLike[str],
    *,
    server_hosts: Sequence[str],
    nodes: Sequence[str] = (),
    admins: Sequence[str] = ("admin",),
    days: float = 365.0,
    ca_name: str = "cilia-ca",
    server_name: str = "cilia-operator",
    reuse_ca: bool = True,
    not_before: datetime.datetime | None = None,
    hubble_cluster: str | None = None,
) -> GeneratedBundle:
    """Write a CA and the certificates of a Cilia control plane into ``directory``.

    Files (PEM; keys mode 0600, certificates 0644): ``ca.crt``/``ca.key`` (kept and reused
    when both exist and ``reuse_ca``), ``server.crt``/``server.key`` (CN ``server_name``,
    SANs ``server_hosts`` and ``server_name``: IPs as IP SANs, the rest as DNS names),
    ``node-<node>.crt/.key`` per node (``CN=system:node:<node>, O=system:nodes``) and
    ``<admin>.crt/.key`` per admin (``CN=<admin>, O=system:masters``). Every certificate is
    valid for ``days`` from ``not_before`` (default: five minutes ago, for clock skew).
    With ``hubble_cluster`` (a cluster name), also Hubble's: ``hubble-<node>.crt/.key`` per
    node (SAN :func:`hubble_server_name`, server and client use), ``hubble-server.crt/.key``
    (SAN ``*.<cluster>.hubble-grpc.cilium.io``: one pair for every node),
    ``hubble-relay-client.crt/.key`` and ``hubble-relay-server.crt/.key`` (SANs
    :data:`HUBBLE_RELAY_SERVER_NAME` and ``server_hosts``), and ``hubble-ui-client.crt/.key``
    (``CN=hubble-ui``, client use: what cilia-hubble-ui presents to the relay, Secret
    ``hubble-ui-client-certs`` in the manifests).

    Raises:
        ValueError: no server host, or ``days`` <= 0.
        NotADirectoryError: ``directory`` exists and is a file (nothing written).
        OSError: the directory cannot be written.
        TLSFileError: an existing CA pair is unusable.
    """
    if days <= 0:
        raise ValueError(f"days: {days} must be > 0")
    out = pathlib.Path(directory)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    ca_cert_path, ca_key_path = out / "ca.crt", out / "ca.key"
    ca_key: Any
    if reuse_ca and ca_cert_path.exists() and ca_key_path.exists():
        cert_pem, key_pem = read_key_pair(str(ca_cert_path), str(ca_key_path))
        ca_cert = x509.load_pem_x509_certificates(cert_pem)[0]
        ca_key = serialization.load_pem_private_key(key_pem, password=None)
        if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
            raise TLSFileError(str(ca_key_path), "the CA key must be an ECDSA key")
    else:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_cert = _issue(
            _name(ca_name), ca_key, None, ca_key, days=days * 10, ca=True, not_before=not_before
        )
        _write(ca_key_path, _key_pem(ca_key), 0o600)
        _write(ca_cert_path, ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)

    def leaf(stem: str, subject: x509.Name, hosts: Sequence[str], client: bool) -> tuple[str, str]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _issue(
            subject, key, ca_cert, ca_key, days=days, server_hosts=hosts, client=client,
            not_before=not_before,
        )  # fmt: skip
        cert_path, key_path = out / f"{stem}.crt", out / f"{stem}.key"
        _write(key_path, _key_pem(key), 0o600)
        _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
        return str(cert_path), str(key_path)

    hosts = [h for h in server_hosts if h]
    if not hosts:
        raise ValueError("server_hosts: at least one address or name is needed")
    server = leaf("server", _name(server_name), [*hosts, server_name], client=False)
    clients: dict[str, tuple[str, str]] = {}
    for node in nodes:
        cn, orgs = node_subject(node)
        clients[f"node-{node}"] = leaf(f"node-{node}", _name(cn, orgs), (), client=True)
    for admin in admins:
        clients[admin] = leaf(admin, _name(admin, (ADMIN_GROUP,)), (), client=True)
    hubble: dict[str, tuple[str, str]] = {}
    if hubble_cluster is not None:
        wildcard = hubble_server_name("*", hubble_cluster)
        hubble["hubble-server"] = leaf("hubble-server", _name(wildcard), [wildcard], client=True)
        for node in nodes:
            name = hubble_server_name(node, hubble_cluster)
            hubble[f"hubble-{node}"] = leaf(f"hubble-{node}", _name(name), [name], client=True)
        hubble["hubble-relay-client"] = leaf(
            "hubble-relay-client", _name("hubble-relay-client"), (), client=True
        )
        hubble["hubble-ui-client"] = leaf("hubble-ui-client", _name("hubble-ui"), (), client=True)
        relay_hosts = [HUBBLE_RELAY_SERVER_NAME, *hosts]
        hubble["hubble-relay-server"] = leaf(
            "hubble-relay-server", _name(HUBBLE_RELAY_SERVER_NAME), relay_hosts, client=False
        )
    return GeneratedBundle(str(ca_cert_path), str(ca_key_path), *server, clients, hubble)
