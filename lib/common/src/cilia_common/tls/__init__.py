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

The package, a module a job: :mod:`.files` (file sets, reading, grpcio credentials and
server-side reload), :mod:`.rotating` (the client channel that follows renewed files),
:mod:`.identity` (peer identity and the names authorised by), :mod:`.issue` (certificates for
standalone installs and tests). Every name is importable from ``cilia_common.tls``.
"""

from .files import (
    CertificateReloader,
    ClientTLS,
    ServerTLS,
    TLSFileError,
    channel_credentials,
    channel_options,
    file_stamp,
    read_ca_bundle,
    read_key_pair,
    server_credentials,
)
from .identity import (
    ADMIN_GROUP,
    NODE_GROUP,
    NODE_PREFIX,
    PeerIdentity,
    certificate_identity,
    is_loopback,
    node_subject,
    peer_identity,
)
from .issue import HUBBLE_RELAY_SERVER_NAME, GeneratedBundle, generate_bundle, hubble_server_name
from .rotating import RotatingChannel

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
    "file_stamp",
    "generate_bundle",
    "hubble_server_name",
    "is_loopback",
    "node_subject",
    "peer_identity",
    "read_ca_bundle",
    "read_key_pair",
    "server_credentials",
]
