"""Who a TLS peer is: the names Cilia authorises by (:data:`NODE_PREFIX`,
:data:`NODE_GROUP`, :data:`ADMIN_GROUP`, as Kubernetes' client certificates name a kubelet and
an administrator), the verified peer certificate of an RPC read into a :class:`PeerIdentity`
(:func:`peer_identity`), a certificate file's identity, and whether a listen address is
local-only (:func:`is_loopback`)."""

from __future__ import annotations

import functools
import ipaddress
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID

from .files import TLSFileError, read_file

NODE_PREFIX = "system:node:"
"""Common-name prefix of an agent certificate: ``system:node:<node-name>``."""
NODE_GROUP = "system:nodes"
"""Organization (group) of every agent certificate."""
ADMIN_GROUP = "system:masters"
"""Organization (group) of an administrator certificate: may write resources."""


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
    data = read_file(cert_file)
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
