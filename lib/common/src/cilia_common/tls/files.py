"""TLS files and grpcio credentials: the server's and client's file sets
(:class:`ServerTLS`, :class:`ClientTLS`), reading and checking them (:func:`read_ca_bundle`,
:func:`read_key_pair`, :class:`TLSFileError`), the change stamp rotation compares
(:func:`file_stamp`), and grpcio's credentials built from them: :func:`server_credentials`
with its per-handshake :class:`CertificateReloader`, :func:`channel_credentials`,
:func:`channel_options`."""

from __future__ import annotations

import logging
import os
import pathlib
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

log = logging.getLogger(__name__)


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


def read_file(path: str) -> bytes:
    """The bytes of a TLS file.

    Raises:
        TLSFileError: it is missing or unreadable (the OS error's text).
    """
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
        data = read_file(path)
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
    cert_pem, key_pem = read_file(cert_file), read_file(key_file)
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
