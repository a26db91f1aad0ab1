"""TLS for the relay's HTTP/2 server: an ``ssl.SSLContext`` with ALPN ``h2`` whose
certificate files are re-read at a handshake after they changed."""

from __future__ import annotations

import logging
import ssl

from cilia_common.tls import ServerTLS, TLSFileError, file_stamp, read_ca_bundle, read_key_pair

log = logging.getLogger(__name__)


def _context(tls: ServerTLS) -> ssl.SSLContext:
    cert_pem, key_pem = read_key_pair(tls.cert_file, tls.key_file)  # checked to match
    del cert_pem, key_pem
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["h2"])
    try:
        ctx.load_cert_chain(tls.cert_file, tls.key_file)
    except (OSError, ssl.SSLError) as exc:
        raise TLSFileError(tls.cert_file, str(exc)) from None
    if tls.client_ca_files:
        ctx.load_verify_locations(cadata=read_ca_bundle(tls.client_ca_files).decode())
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


class ReloadingSSLContext:
    """A server ``ssl.SSLContext`` whose files are re-read at a handshake after they changed
    (mtime, size or inode), like :class:`cilia_common.tls.CertificateReloader` for grpcio:
    a pair that does not load is not taken (the previous one stays; logged).

    Attributes:
        context: the context to listen with (its SNI callback swaps in the new one).
        reloads: how many times changed files were taken.
    """

    def __init__(self, tls: ServerTLS) -> None:
        self.tls = tls
        self._paths = (tls.cert_file, tls.key_file, *tls.client_ca_files)
        self._stamp = file_stamp(self._paths)
        self.context = _context(tls)
        self._current = self.context
        self.reloads = 0
        self.context.sni_callback = self._on_hello

    def _on_hello(
        self, sslobj: ssl.SSLObject, server_name: str | None, ctx: ssl.SSLContext
    ) -> None:
        stamp = file_stamp(self._paths)
        if stamp != self._stamp:
            try:
                fresh = _context(self.tls)
            except (TLSFileError, ssl.SSLError) as exc:
                log.warning("TLS files changed but cannot be used", extra={"error": str(exc)})
            else:
                self._stamp, self._current = stamp, fresh
                self.reloads += 1
                log.info("TLS certificate reloaded", extra={"cert_file": self.tls.cert_file})
        if self._current is not self.context:
            sslobj.context = self._current


def server_ssl_context(tls: ServerTLS) -> ReloadingSSLContext:
    """TLS for :class:`GrpcH2Server`: ALPN ``h2``, TLS >= 1.2, the certificate pair of
    ``tls``, client certificates required and verified against ``tls.client_ca_files`` when
    given; renewed files are taken at the next handshake.

    Raises:
        TLSFileError: a file is unusable at start-up.
    """
    return ReloadingSSLContext(tls)
