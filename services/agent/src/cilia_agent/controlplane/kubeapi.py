"""The agent's read-only access to the Kubernetes API server (operator discovery only).

The agent takes nothing else from the API server (pods, identities, policies and node CIDRs
come from the operator over gRPC); it lists the EndpointSlices of the operator's Service to
find the operator without a ClusterIP (``--operator k8s:NAMESPACE/SERVICE``,
:mod:`cilia_agent.controlplane.discovery`).

Where the API server is (upstream ``cilium-agent`` flags and order):

1. ``--k8s-kubeconfig-path``: a kubeconfig file; its current context's cluster ``server``,
   CA (``certificate-authority`` or ``-data``, or ``insecure-skip-tls-verify``) and user
   (``token``, ``tokenFile``, or ``client-certificate``/``client-key`` with their ``-data``
   forms);
2. else in-cluster: env ``KUBERNETES_SERVICE_HOST`` and ``KUBERNETES_SERVICE_PORT`` (the
   chart sets them to ``k8sServiceHost``/``k8sServicePort``, so no ClusterIP is needed) with
   the pod's service-account token and CA (:data:`SERVICE_ACCOUNT_DIR`);
3. ``--k8s-api-server`` (a URL, or ``host:port`` meaning https) replaces the server of
   either; with neither a kubeconfig nor the env, it is used with the service-account files
   when they exist, else without credentials.

The token file is re-read for every request: projected service-account tokens are rotated
by the kubelet while the agent runs.

Library: ``urllib3`` (the official client's own transport) in a worker thread, one pooled
connection, its ``Retry`` for connection errors and 429/5xx. The official ``kubernetes``
client was measured on top of the agent's imports: +11 MB RSS and 250-700 ms of import
(every API model is imported) for one LIST call; ``aiohttp`` +6 MB; ``urllib3`` +1.4 MB and
~60 ms, imported only when ``--operator k8s:`` is used.
"""

from __future__ import annotations

import base64
import json
import os
import pathlib
import ssl
import tempfile
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SERVICE_ACCOUNT_DIR = pathlib.Path("/var/run/secrets/kubernetes.io/serviceaccount")
"""Where the kubelet mounts a pod's service-account ``token`` and ``ca.crt``."""

HOST_ENV, PORT_ENV = "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"


class KubeConfigError(ValueError):
    """No usable API server configuration; the message names the flag, file or variable."""


class KubeAPIError(OSError):
    """A request to the API server failed (unreachable, refused, or an HTTP error status).

    Attributes:
        status: the HTTP status (0 when no response came).
    """

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class KubeAccess:
    """How to reach the API server.

    Attributes:
        server: ``https://HOST:PORT`` (IPv6 hosts bracketed).
        ca_file: PEM CA bundle the server's certificate must chain to ("" = system CAs).
        insecure: skip server certificate verification (kubeconfig
            ``insecure-skip-tls-verify``).
        token_file: bearer token file, re-read per request ("" = none).
        token: a literal bearer token (kubeconfig ``token``).
        cert_file, key_file: client certificate and key (PEM) ("" = none).
        source: where this came from, for messages (``"in-cluster"``, a kubeconfig path).
    """

    server: str
    ca_file: str = ""
    insecure: bool = False
    token_file: str = ""
    token: str = ""
    cert_file: str = ""
    key_file: str = ""
    source: str = ""

    def bearer(self) -> str:
        """The token to send ("" = none); the file is read now.

        Raises:
            KubeAPIError: the token file cannot be read.
        """
        if self.token_file:
            try:
                return pathlib.Path(self.token_file).read_text().strip()
            except OSError as exc:
                raise KubeAPIError(f"service-account token {self.token_file}: {exc}") from exc
        return self.token


def server_url(value: str) -> str:
    """``--k8s-api-server`` as a URL: ``https://h:p`` and ``http://h:p`` as given (no
    trailing slash), ``h:p`` → ``https://h:p``.

    Raises:
        KubeConfigError: not ``[scheme://]host[:port]``.
    """
    text = value.strip().rstrip("/")
    if "://" not in text:
        text = "https://" + text
    parsed = urllib.parse.urlsplit(text)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise KubeConfigError(f"--k8s-api-server: {value!r} is not [https://]HOST[:PORT]")
    return text


def in_cluster(
    env: Mapping[str, str], sa_dir: pathlib.Path = SERVICE_ACCOUNT_DIR
) -> KubeAccess | None:
    """The in-cluster configuration from ``env`` (None when ``KUBERNETES_SERVICE_HOST`` is
    unset): ``https://HOST:PORT`` (port default 443), the token and CA under ``sa_dir``."""
    host = env.get(HOST_ENV, "").strip()
    if not host:
        return None
    port = env.get(PORT_ENV, "").strip() or "443"
    if not port.isdigit():
        raise KubeConfigError(f"{PORT_ENV}: {port!r} is not a port number")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    token, ca = sa_dir / "token", sa_dir / "ca.crt"
    return KubeAccess(
        server=f"https://{host}:{port}",
        ca_file=str(ca) if ca.exists() else "",
        token_file=str(token) if token.exists() else "",
        source=f"in-cluster ({HOST_ENV}={env.get(HOST_ENV)}, {PORT_ENV}={port})",
    )


def _data_file(data: str, suffix: str) -> str:
    """A ``*-data`` kubeconfig value (base64 PEM) written to a private temporary file."""
    fd, path = tempfile.mkstemp(prefix="cilia-kubeconfig-", suffix=suffix)
    with os.fdopen(fd, "wb") as out:
        out.write(base64.b64decode(data))
    return path


def from_kubeconfig(path: str) -> KubeAccess:
    """The current context of the kubeconfig at ``path`` (see the module docstring).

    Raises:
        KubeConfigError: unreadable, not YAML, or no usable context/cluster/server.
    """
    import yaml

    where = f"--k8s-kubeconfig-path {path}"
    try:
        doc = yaml.safe_load(pathlib.Path(path).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise KubeConfigError(f"{where}: unreadable kubeconfig: {exc}") from exc
    if not isinstance(doc, dict):
        raise KubeConfigError(f"{where}: not a kubeconfig (no mapping)")

    def named(section: str, name: str, key: str) -> dict[str, Any]:
        for item in doc.get(section) or []:
            if isinstance(item, dict) and item.get("name") == name:
                value = item.get(key)
                return value if isinstance(value, dict) else {}
        raise KubeConfigError(f"{where}: no {key} named {name!r}")

    context = named("contexts", str(doc.get("current-context") or ""), "context")
    cluster = named("clusters", str(context.get("cluster") or ""), "cluster")
    user: dict[str, Any] = {}
    if context.get("user"):
        user = named("users", str(context["user"]), "user")
    server = str(cluster.get("server") or "")
    if not server:
        raise KubeConfigError(f"{where}: the current context's cluster has no server")
    base = pathlib.Path(path).parent

    def file_of(key: str, suffix: str, block: dict[str, Any]) -> str:
        if block.get(f"{key}-data"):
            return _data_file(str(block[f"{key}-data"]), suffix)
        value = str(block.get(key) or "")
        return str(base / value) if value else ""

    return KubeAccess(
        server=server.rstrip("/"),
        ca_file=file_of("certificate-authority", ".crt", cluster),
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
        token=str(user.get("token") or ""),
        token_file=str(base / user["tokenFile"]) if user.get("tokenFile") else "",
        cert_file=file_of("client-certificate", ".crt", user),
        key_file=file_of("client-key", ".key", user),
        source=path,
    )


def resolve_access(
    kubeconfig: str,
    api_server: str,
    env: Mapping[str, str] | None = None,
    sa_dir: pathlib.Path = SERVICE_ACCOUNT_DIR,
) -> KubeAccess:
    """The :class:`KubeAccess` of ``--k8s-kubeconfig-path``, ``--k8s-api-server`` and the
    environment, in the order of the module docstring.

    Raises:
        KubeConfigError: nothing says where the API server is, or a source is unusable.
    """
    env = os.environ if env is None else env
    access = from_kubeconfig(kubeconfig) if kubeconfig else in_cluster(env, sa_dir)
    if api_server:
        url = server_url(api_server)
        if access is None:
            found = in_cluster({HOST_ENV: "unused"}, sa_dir)
            assert found is not None
            access = KubeAccess(url, found.ca_file, token_file=found.token_file,
                                source="--k8s-api-server")  # fmt: skip
        else:
            access = KubeAccess(
                url, access.ca_file, access.insecure, access.token_file, access.token,
                access.cert_file, access.key_file, f"{access.source}, --k8s-api-server",
            )  # fmt: skip
    if access is None:
        raise KubeConfigError(
            f"the API server is unknown: set {HOST_ENV}/{PORT_ENV} (the chart's "
            "k8sServiceHost/k8sServicePort), --k8s-api-server or --k8s-kubeconfig-path"
        )
    return access


class KubeClient:
    """GETs of JSON from the API server (blocking; run it in a thread).

    Args:
        access: where and how (:func:`resolve_access`).
        timeout: seconds per request (connect and read each).
        retries: urllib3 retries of one request (connection errors, 429, 5xx).
    """

    def __init__(self, access: KubeAccess, *, timeout: float, retries: int = 2) -> None:
        import urllib3

        self.access = access
        self._timeout = urllib3.Timeout(connect=timeout, read=timeout)
        retry = urllib3.Retry(
            total=retries, backoff_factor=0.2, status_forcelist=(429, 500, 502, 503, 504),
            raise_on_status=False, respect_retry_after_header=True,
        )  # fmt: skip
        kwargs: dict[str, Any] = {"retries": retry, "maxsize": 1}
        if access.server.startswith("https://"):
            ctx = ssl.create_default_context(cafile=access.ca_file or None)
            if access.insecure:
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            if access.cert_file:
                ctx.load_cert_chain(access.cert_file, access.key_file or None)
            kwargs["ssl_context"] = ctx
        self._pool = urllib3.PoolManager(**kwargs)

    def get(self, path: str, query: Mapping[str, str] | None = None) -> dict[str, Any]:
        """GET ``path`` (``/apis/...``) with ``query``; the decoded JSON object.

        Raises:
            KubeAPIError: no answer, an HTTP status >= 400 (the server's message), or not
                JSON.
        """
        import urllib3

        url = self.access.server + path
        if query:
            url += "?" + urllib.parse.urlencode(query)
        headers = {"Accept": "application/json", "User-Agent": "cilia-agent"}
        token = self.access.bearer()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        try:
            resp = self._pool.request("GET", url, headers=headers, timeout=self._timeout)
        except urllib3.exceptions.HTTPError as exc:
            raise KubeAPIError(f"GET {url}: {exc}") from exc
        if resp.status >= 400:
            try:
                message = json.loads(resp.data).get("message", "")
            except ValueError:
                message = resp.data[:200].decode(errors="replace")
            raise KubeAPIError(f"GET {url}: HTTP {resp.status}: {message}", resp.status)
        try:
            body = json.loads(resp.data)
        except ValueError as exc:
            raise KubeAPIError(f"GET {url}: not JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise KubeAPIError(f"GET {url}: not a JSON object")
        return body

    def close(self) -> None:
        """Close the pooled connection."""
        self._pool.clear()
