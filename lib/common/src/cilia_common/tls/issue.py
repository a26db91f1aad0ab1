"""Issuing certificates for standalone installations and tests: :func:`generate_bundle`
writes a CA, the operator's server pair, one client pair per node and an admin pair, and with
``hubble_cluster`` Hubble's per-node, relay client and relay server pairs (ECDSA P-256,
SHA-256), all PEM in one directory (:class:`GeneratedBundle`)."""

from __future__ import annotations

import datetime
import ipaddress
import os
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .files import TLSFileError, read_key_pair
from .identity import ADMIN_GROUP, node_subject


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
