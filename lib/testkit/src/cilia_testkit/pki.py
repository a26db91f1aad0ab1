"""Test certificates for the Kubernetes harnesses, written once: a cluster's CA, the API
server's serving pair, the admin client pair and the service-account key (:class:`ClusterCerts`),
a client certificate signed by that CA for any user and group (:func:`issue_client_cert`: a
kubelet's ``system:node:<name>``), and the kubeconfig that presents it (:func:`kubeconfig_json`).

Used by :mod:`cilia_testkit.kubeapi` (one server), :mod:`cilia_testkit.kubelet` (its node's
credentials) and :mod:`cilia_testkit.kind.pki` (the kind-style cluster). Keys are ECDSA P-256,
signatures SHA-256, files PEM (keys PKCS#8, mode 0600). ``cryptography`` is imported when a
certificate is made, so importing the harnesses stays cheap.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import pathlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

#: Days the generated certificates are valid.
CERT_DAYS = 7
#: How far back a certificate's validity starts (clock skew between host and node containers).
BACKDATE = datetime.timedelta(minutes=5)


def _new_key() -> ec.EllipticCurvePrivateKey:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key: ec.EllipticCurvePrivateKey, path: pathlib.Path) -> pathlib.Path:
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)
    return path


def _write_cert(cert: x509.Certificate, path: pathlib.Path) -> pathlib.Path:
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _subject(common_name: str, organization: str = "") -> x509.Name:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization)] if organization else []
    return x509.Name([*attrs, x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _sign_leaf(
    issuer: x509.Name,
    issuer_key: Any,
    subject: x509.Name,
    usage: x509.ObjectIdentifier,
    sans: list[x509.GeneralName] | None = None,
    days: int = CERT_DAYS,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A new key and its end-entity certificate (one extended key usage, optional SANs)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    key = _new_key()
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(issuer_key, hashes.SHA256()), key


def issue_client_cert(
    ca_file: pathlib.Path,
    ca_key_file: pathlib.Path,
    common_name: str,
    organization: str,
    cert_file: pathlib.Path,
    key_file: pathlib.Path,
    days: int = CERT_DAYS,
) -> tuple[pathlib.Path, pathlib.Path]:
    """Write a client certificate (``CN=common_name, O=organization``, extended key usage
    clientAuth, valid ``days`` days) signed by the CA in ``ca_file``/``ca_key_file``, and its
    key; returns ``(cert_file, key_file)``.

    Raises:
        OSError: a file cannot be read or written.
        ValueError: the CA files are not PEM.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID

    ca_cert = x509.load_pem_x509_certificate(ca_file.read_bytes())
    ca_key: Any = serialization.load_pem_private_key(ca_key_file.read_bytes(), None)
    cert, key = _sign_leaf(
        ca_cert.subject,
        ca_key,
        _subject(common_name, organization),
        ExtendedKeyUsageOID.CLIENT_AUTH,
        days=days,
    )
    _write_key(key, key_file)
    _write_cert(cert, cert_file)
    return cert_file, key_file


def kubeconfig_json(
    server: str,
    ca_file: pathlib.Path,
    cert_file: pathlib.Path,
    key_file: pathlib.Path,
    user: str,
    *,
    cluster: str,
    embed: bool,
) -> str:
    """A kubeconfig (JSON, which every YAML reader takes) for ``server``
    (``https://host:port``) presenting ``cert_file``/``key_file`` as ``user`` and trusting
    ``ca_file``; ``embed``: the files' contents inline (``*-data``, the same file works on the
    host and inside a node container), else their paths."""

    def ref(key: str, path: pathlib.Path) -> dict[str, str]:
        if embed:
            return {f"{key}-data": base64.b64encode(path.read_bytes()).decode()}
        return {key: str(path)}

    config: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": cluster,
                "cluster": {"server": server, **ref("certificate-authority", ca_file)},
            }
        ],
        "users": [
            {
                "name": user,
                "user": {**ref("client-certificate", cert_file), **ref("client-key", key_file)},
            }
        ],
        "contexts": [{"name": cluster, "context": {"cluster": cluster, "user": user}}],
        "current-context": cluster,
    }
    return json.dumps(config, indent=2)


class ClusterCerts:
    """The PKI of one server: a CA, the serving certificate (127.0.0.1, localhost,
    kubernetes.default.svc, plus ``extra_ips`` and ``extra_dns``), the admin client
    certificate (O=system:masters) and the service-account signing key; ECDSA P-256 keys,
    PEM files in ``directory`` (ca.crt/ca.key, apiserver.crt/.key, admin.crt/.key,
    sa.key/sa.pub). Also used by :mod:`cilia_testkit.kind` (the API server's node address
    and the ``kubernetes`` Service ClusterIP as extra SANs)."""

    def __init__(
        self,
        directory: pathlib.Path,
        extra_ips: tuple[str, ...] = (),
        extra_dns: tuple[str, ...] = (),
    ) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.x509.oid import ExtendedKeyUsageOID

        directory.mkdir(parents=True, exist_ok=True)
        now = datetime.datetime.now(datetime.UTC)
        ca_key = _new_key()
        ca_usage = dict.fromkeys(
            ("content_commitment", "key_encipherment", "data_encipherment", "key_agreement",
             "encipher_only", "decipher_only"),
            False,
        )  # fmt: skip
        ca_usage.update(digital_signature=True, key_cert_sign=True, crl_sign=True)
        ca_name = _subject("cilia-test-ca")
        ca = (
            x509.CertificateBuilder()
            .subject_name(ca_name)
            .issuer_name(ca_name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - BACKDATE)
            .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(**ca_usage), critical=True)
            .sign(ca_key, hashes.SHA256())
        )
        serving, serving_key = _sign_leaf(
            ca_name,
            ca_key,
            _subject("kube-apiserver"),
            ExtendedKeyUsageOID.SERVER_AUTH,
            [
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                x509.DNSName("localhost"),
                x509.DNSName("kubernetes"),
                x509.DNSName("kubernetes.default"),
                x509.DNSName("kubernetes.default.svc"),
                x509.DNSName("kubernetes.default.svc.cluster.local"),
                *(x509.IPAddress(ipaddress.ip_address(ip)) for ip in extra_ips),
                *(x509.DNSName(name) for name in extra_dns),
            ],
        )
        admin, admin_key = _sign_leaf(
            ca_name,
            ca_key,
            _subject("cilia-test-admin", "system:masters"),
            ExtendedKeyUsageOID.CLIENT_AUTH,
        )
        self.ca_file = _write_cert(ca, directory / "ca.crt")
        self.ca_key_file = _write_key(ca_key, directory / "ca.key")
        self.serving_cert = _write_cert(serving, directory / "apiserver.crt")
        self.serving_key = _write_key(serving_key, directory / "apiserver.key")
        self.admin_cert = _write_cert(admin, directory / "admin.crt")
        self.admin_key = _write_key(admin_key, directory / "admin.key")
        sa = _new_key()
        self.sa_key = _write_key(sa, directory / "sa.key")
        self.sa_pub = directory / "sa.pub"
        self.sa_pub.write_bytes(
            sa.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
