"""A real Kubernetes control plane for tests: etcd + kube-apiserver (+ kube-controller-manager).

The binaries are built from the Go module proxy by ``scripts/kube-tools.sh`` (``make setup``)
into ``${CILIA_CACHE_DIR:-~/.cache/cilia}/kube/<k8s-version>/bin`` (versions pinned in
``tools/kube/versions.env``); ``CILIA_KUBE_BIN`` overrides that directory. Test tooling only.

:class:`KubeAPI` is a context manager::

    with KubeAPI(tmp_dir) as kube:          # etcd + kube-apiserver, ready (/readyz answers ok)
        kube.server                         # "https://127.0.0.1:PORT"
        kube.kubeconfig                     # admin kubeconfig (client cert, group system:masters)
        kube.ca_file                        # the generated CA (PEM), also the client CA
        with kube.client() as api:          # an official ``kubernetes.client.ApiClient``
            kubernetes.client.CoreV1Api(api).list_namespace()
        kube.kubectl("get", "ns")           # CompletedProcess of kubectl with that kubeconfig
        kube.install_crds("deploy/helm/cilia/files/crds")  # apply CRDs for real, wait Established
        kube.requests("delete", "pods", ns)  # completed requests, from the audit log
        kube.controller_manager()           # optional: kube-controller-manager with
                                            # --allocate-node-cidrs --cluster-cidr=...

The server is as a cluster's: authorization RBAC, the default admission plugins (so a Pod
needs its namespace's ``default`` ServiceAccount: create it, or start the controller manager,
whose serviceaccount controller does), ``--allow-privileged`` (the agent runs privileged).
Nothing but loopback is bound. No scheduler or kubelet runs: a Pod's ``spec.nodeName`` and
``status`` are what the test writes (``pods/status``), and a deleted Pod bound to a node stays
Terminating until the test removes it with grace period 0, as a kubelet would. Service
``default/kubernetes`` has no endpoints (``--endpoint-reconciler-type=none``: the reconciler
refuses loopback addresses). Every request is in the audit log (:meth:`KubeAPI.requests`).

Ports: etcd binds port 0 (client and peer) and its "serving client traffic" log line gives
the bound address. kube-apiserver refuses ``--secure-port=0``, so it gets a free loopback port
from the kernel (bind port 0, close) and a start that loses that race (the port was taken in
between: "address already in use" in its log) is retried on a new port, :data:`START_ATTEMPTS`
times in all.

pytest fixture (the testkit plugin): ``kube_apiserver`` — ONE server per test session
(session scope), skipped with the build's own reason when a binary is missing (failing in CI,
``CILIA_REQUIRE_PRIVILEGED=1``). Tests share it: each uses names of its own (a namespace
named after the test, e.g. :func:`unique_name`) and deletes only objects of kinds it owns.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from typing import Any, BinaryIO

from cilia_testkit import ROOT
from cilia_testkit.pki import CERT_DAYS as CERT_DAYS  # re-exported: its old home
from cilia_testkit.pki import ClusterCerts
from cilia_testkit.procs import stop as stop_process

#: Overrides the directory of the built binaries (etcd, kube-apiserver, ...).
BIN_ENV = "CILIA_KUBE_BIN"
#: The versions file scripts/kube-tools.sh builds from.
VERSIONS_FILE = ROOT / "tools" / "kube" / "versions.env"
#: Seconds kube-apiserver may take until ``/readyz`` answers ``ok`` (≈5-10 s on 2 cores).
START_TIMEOUT = 90.0
#: Seconds a component may take to exit after SIGTERM before SIGKILL.
STOP_TIMEOUT = 10.0
#: Starts tried with fresh ports when a port was taken between choosing and binding it.
START_ATTEMPTS = 3
#: The Service ClusterIP range kube-apiserver allocates from (data only: nothing routes it).
SERVICE_CIDR = "10.96.0.0/16"
#: The pod CIDR kube-controller-manager hands node podCIDRs from (data only).
CLUSTER_CIDR = "10.244.0.0/16"

_ADDRESS_IN_USE = re.compile(r"address already in use|bind: address", re.IGNORECASE)


def spawn_logged(
    log_path: pathlib.Path, argv: list[str], cwd: pathlib.Path
) -> tuple[subprocess.Popen[bytes], BinaryIO]:
    """Start ``argv`` in its own session with stdout and stderr appended to ``log_path``
    (after a ``# <time> <argv>`` line) and stdin from /dev/null. Returns the process and
    the open log, which the caller closes after the process ends."""
    log = open(log_path, "ab")  # noqa: SIM115 - the caller closes it
    log.write(f"# {time.strftime('%Y-%m-%dT%H:%M:%S')} {' '.join(argv)}\n".encode())
    log.flush()
    proc = subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        cwd=cwd, start_new_session=True,
    )  # fmt: skip
    return proc, log


class KubeAPIError(RuntimeError):
    """A component did not start or not become ready; the message carries its log tail."""


def default_bin_dir() -> pathlib.Path:
    """Where ``scripts/kube-tools.sh`` puts the binaries: ``$CILIA_KUBE_BIN`` when set, else
    ``${CILIA_CACHE_DIR:-~/.cache/cilia}/kube/<K8S_VERSION from tools/kube/versions.env>/bin``."""
    if os.environ.get(BIN_ENV):
        return pathlib.Path(os.environ[BIN_ENV])
    version = "unknown"
    if VERSIONS_FILE.exists():
        for line in VERSIONS_FILE.read_text().splitlines():
            if line.startswith("K8S_VERSION="):
                version = line.split("=", 1)[1].strip()
    cache = pathlib.Path(os.environ.get("CILIA_CACHE_DIR") or pathlib.Path.home() / ".cache/cilia")
    return cache / "kube" / version / "bin"


def binary_missing(name: str, bin_dir: pathlib.Path | None = None) -> str | None:
    """Why ``name`` (etcd, kube-apiserver, kube-controller-manager, kubectl) cannot be run, or
    None. The reason is the build's own (``NAME.unavailable``: the command and its error)
    when scripts/kube-tools.sh failed, else how to build it."""
    bin_dir = bin_dir or default_bin_dir()
    path = bin_dir / name
    if os.access(path, os.X_OK):
        return None
    marker = bin_dir / f"{name}.unavailable"
    if marker.exists():
        return marker.read_text().strip()
    return f"{path} is missing: run scripts/kube-tools.sh (make setup builds it, minutes the first time)"


def unique_name(prefix: str = "t") -> str:
    """A DNS-1123 label unique in this session: ``<prefix>-<8 hex>`` (prefix cut to 50)."""
    clean = re.sub(r"[^a-z0-9-]", "-", prefix.lower()).strip("-")[:50] or "t"
    return f"{clean}-{uuid.uuid4().hex[:8]}"


def _free_ports(count: int) -> list[int]:
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _tail(path: pathlib.Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {path})"


class KubeAPI:
    """etcd + kube-apiserver on 127.0.0.1 with a generated PKI; see the module docstring.

    Args:
        workdir: directory for certificates, etcd data, logs and the kubeconfig; a new
            temporary directory (removed by :meth:`stop`) when None.
        bin_dir: the built binaries (:func:`default_bin_dir` when None).
        start_timeout: seconds until ``/readyz`` must answer ``ok`` (:data:`START_TIMEOUT`).
        apiserver_args: extra ``--flag=value`` arguments for kube-apiserver.

    Raises (from :meth:`start`):
        FileNotFoundError: a binary is missing (the message is :func:`binary_missing`'s).
        KubeAPIError: etcd or kube-apiserver exited or was not ready in time (log tail).
    """

    def __init__(
        self,
        workdir: pathlib.Path | None = None,
        *,
        bin_dir: pathlib.Path | None = None,
        start_timeout: float = START_TIMEOUT,
        apiserver_args: tuple[str, ...] = (),
    ) -> None:
        self.bin_dir = bin_dir or default_bin_dir()
        self._own_dir = workdir is None
        self.workdir = workdir or pathlib.Path(tempfile.mkdtemp(prefix="cilia-kubeapi-"))
        self.start_timeout = start_timeout
        self.apiserver_args = apiserver_args
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[Any] = []
        self.server = ""
        self.port = 0
        self.kubeconfig = self.workdir / "admin.kubeconfig"
        #: The API server's audit log (one JSON event per request, see :meth:`requests`).
        self.audit_log = self.workdir / "audit.log"
        self._certs: ClusterCerts | None = None

    # ----------------------------------------------------------------- attributes
    @property
    def ca_file(self) -> pathlib.Path:
        """The CA certificate (PEM) that signed the serving and client certificates."""
        assert self._certs is not None, "not started"
        return self._certs.ca_file

    @property
    def ca_key_file(self) -> pathlib.Path:
        """The CA's private key (PEM), for kube-controller-manager's
        ``--cluster-signing-key-file`` (certificates issued through CSRs)."""
        assert self._certs is not None, "not started"
        return self._certs.ca_key_file

    @property
    def client_cert_file(self) -> pathlib.Path:
        """The admin client certificate (PEM; CN cilia-test-admin, O system:masters)."""
        assert self._certs is not None, "not started"
        return self._certs.admin_cert

    @property
    def client_key_file(self) -> pathlib.Path:
        """The admin client key (PEM, PKCS#8)."""
        assert self._certs is not None, "not started"
        return self._certs.admin_key

    @property
    def service_account_key_file(self) -> pathlib.Path:
        """The service-account token signing key (PEM), for kube-controller-manager."""
        assert self._certs is not None, "not started"
        return self._certs.sa_key

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> KubeAPI:
        """Generate the PKI, start etcd and kube-apiserver, write :attr:`kubeconfig`, wait
        for ``/readyz``. Returns self. Raises as the class docstring says."""
        for name in ("etcd", "kube-apiserver"):
            reason = binary_missing(name, self.bin_dir)
            if reason:
                raise FileNotFoundError(reason)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._certs = ClusterCerts(self.workdir / "pki")
        try:
            etcd_url = self._start_etcd()
            for attempt in range(1, START_ATTEMPTS + 1):
                if self._start_apiserver(etcd_url, attempt):
                    break
            else:
                raise KubeAPIError(f"ports stayed taken in {START_ATTEMPTS} starts")
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        proc, log = spawn_logged(self.workdir / f"{name}.log", argv, self.workdir)
        self._logs.append(log)
        self._procs[name] = proc
        return proc

    def _stop_one(self, name: str) -> None:
        proc = self._procs.pop(name, None)
        if proc is not None:
            stop_process(proc, sig=signal.SIGTERM, timeout=STOP_TIMEOUT, group=True)

    def _start_etcd(self) -> str:
        """Start etcd on loopback ports it binds itself (port 0); its client URL, read from
        its "serving client traffic" log line."""
        data = self.workdir / "etcd-data"
        etcd = self._spawn(
            "etcd",
            [
                str(self.bin_dir / "etcd"),
                "--name=cilia-test",
                f"--data-dir={data}",
                "--listen-client-urls=http://127.0.0.1:0",
                "--advertise-client-urls=http://127.0.0.1:0",
                "--listen-peer-urls=http://127.0.0.1:0",
                "--initial-advertise-peer-urls=http://127.0.0.1:0",
                "--initial-cluster=cilia-test=http://127.0.0.1:0",
                "--listen-metrics-urls=",
                "--log-level=info",  # the bound client address is an info line
                # a test server: fsync'ed durability buys nothing, latency costs every test
                "--unsafe-no-fsync",
            ],
        )
        log = self.workdir / "etcd.log"
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            for line in log.read_text(errors="replace").splitlines():
                if "serving client traffic" not in line:
                    continue
                try:
                    address = json.loads(line).get("address", "")
                except ValueError:
                    continue
                if address and not address.endswith(":0"):
                    return f"http://{address}"
            if etcd.poll() is not None:
                raise KubeAPIError(f"etcd exited with {etcd.returncode}; {log}:\n{_tail(log)}")
            time.sleep(0.05)
        raise KubeAPIError(
            f"etcd reported no client address in {self.start_timeout:g}s:\n{_tail(log)}"
        )

    def _start_apiserver(self, etcd_url: str, attempt: int) -> bool:
        """One kube-apiserver start on a fresh port; False when the port was taken (retry),
        raises otherwise."""
        certs = self._certs
        assert certs is not None
        (api_port,) = _free_ports(1)
        self.port = api_port
        self.server = f"https://127.0.0.1:{api_port}"
        api = self._spawn(
            "kube-apiserver",
            [
                str(self.bin_dir / "kube-apiserver"),
                f"--etcd-servers={etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                # the endpoints of Service default/kubernetes refuse loopback addresses: no
                # reconciler (nothing reaches the server through that Service here)
                "--endpoint-reconciler-type=none",
                f"--secure-port={api_port}",
                f"--cert-dir={self.workdir / 'apiserver-certs'}",
                f"--tls-cert-file={certs.serving_cert}",
                f"--tls-private-key-file={certs.serving_key}",
                f"--client-ca-file={certs.ca_file}",
                f"--service-account-key-file={certs.sa_pub}",
                f"--service-account-signing-key-file={certs.sa_key}",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=RBAC",
                "--allow-privileged=true",
                "--profiling=false",
                # every request at Metadata level, synchronously: see requests()
                f"--audit-policy-file={self._audit_policy()}",
                f"--audit-log-path={self.audit_log}",
                "--audit-log-format=json",
                "--audit-log-mode=blocking",
                *self.apiserver_args,
            ],
        )
        self._write_kubeconfig()
        etcd = self._procs["etcd"]
        deadline = time.monotonic() + self.start_timeout
        last = ""
        while time.monotonic() < deadline:
            if etcd.poll() is not None:
                log = self.workdir / "etcd.log"
                raise KubeAPIError(f"etcd exited with {etcd.returncode}; {log}:\n{_tail(log)}")
            if api.poll() is not None:
                log = self.workdir / "kube-apiserver.log"
                text = _tail(log, 40)
                self._stop_one("kube-apiserver")
                if _ADDRESS_IN_USE.search(text) and attempt < START_ATTEMPTS:
                    return False
                raise KubeAPIError(f"kube-apiserver exited with {api.returncode}; {log}:\n{text}")
            last = self._readyz()
            if last == "ok":
                return True
            time.sleep(0.2)
        raise KubeAPIError(
            f"kube-apiserver not ready in {self.start_timeout:g}s (/readyz: {last});"
            f" kube-apiserver.log:\n{_tail(self.workdir / 'kube-apiserver.log')}\n"
            f"etcd.log:\n{_tail(self.workdir / 'etcd.log')}"
        )

    def _audit_policy(self) -> pathlib.Path:
        path = self.workdir / "audit-policy.json"
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "audit.k8s.io/v1",
                    "kind": "Policy",
                    "omitStages": ["RequestReceived"],
                    "rules": [{"level": "Metadata"}],
                }
            )
        )
        return path

    def requests(
        self, verb: str | None = None, resource: str | None = None, namespace: str | None = None
    ) -> list[dict[str, Any]]:
        """The requests the server has completed (its audit log, "ResponseComplete" events),
        oldest first, optionally only those with this ``verb`` (get, list, watch, create,
        update, patch, delete, deletecollection), ``resource`` (plural, e.g. "pods") and
        ``namespace``. Each is the audit event: ``verb``, ``requestURI``, ``objectRef``
        {resource, namespace, name, ...}, ``user``, ``responseStatus`` {code}. Tests share
        the session's server: filter by a namespace or name of the test's own."""
        out = []
        try:
            text = self.audit_log.read_text(errors="replace")
        except FileNotFoundError:
            return []
        for line in text.splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a line being written
            if event.get("stage") != "ResponseComplete":
                continue
            ref = event.get("objectRef") or {}
            if verb is not None and event.get("verb") != verb:
                continue
            if resource is not None and ref.get("resource") != resource:
                continue
            if namespace is not None and ref.get("namespace") != namespace:
                continue
            out.append(event)
        return out

    def ssl_context(self) -> ssl.SSLContext:
        """A client TLS context trusting :attr:`ca_file` and presenting the admin certificate."""
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        ctx.load_cert_chain(str(self.client_cert_file), str(self.client_key_file))
        return ctx

    def _readyz(self) -> str:
        try:
            with urllib.request.urlopen(
                f"{self.server}/readyz", context=self.ssl_context(), timeout=2
            ) as resp:
                return str(resp.read().decode().strip())
        except urllib.error.HTTPError as exc:
            return f"HTTP {exc.code}"
        except OSError as exc:
            return str(exc)

    def _write_kubeconfig(self) -> None:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "cilia-test",
                    "cluster": {"server": self.server, "certificate-authority": str(self.ca_file)},
                }
            ],
            "users": [
                {
                    "name": "cilia-test-admin",
                    "user": {
                        "client-certificate": str(self.client_cert_file),
                        "client-key": str(self.client_key_file),
                    },
                }
            ],
            "contexts": [
                {
                    "name": "cilia-test",
                    "context": {"cluster": "cilia-test", "user": "cilia-test-admin"},
                }
            ],
            "current-context": "cilia-test",
        }
        # JSON is YAML: every kubeconfig reader takes it
        self.kubeconfig.write_text(json.dumps(config, indent=2))

    def stop(self) -> None:
        """Stop (SIGTERM, then SIGKILL after :data:`STOP_TIMEOUT`) and reap every component,
        close the logs, remove the work directory when this object made it."""
        for name in ("kube-controller-manager", "kube-apiserver", "etcd"):
            self._stop_one(name)
        for log in self._logs:
            log.close()
        self._logs.clear()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> KubeAPI:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ----------------------------------------------------------------- clients
    def configuration(self) -> Any:
        """A ``kubernetes.client.Configuration`` for the admin user (client cert, CA)."""
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.server
        cfg.ssl_ca_cert = str(self.ca_file)
        cfg.cert_file = str(self.client_cert_file)
        cfg.key_file = str(self.client_key_file)
        return cfg

    def client(self) -> Any:
        """A new official ``kubernetes.client.ApiClient`` as the admin user (close it, or use
        it as a context manager)."""
        from kubernetes import client

        return client.ApiClient(self.configuration())

    def kubectl_path(self) -> str:
        """The built kubectl, else the one on PATH.

        Raises:
            FileNotFoundError: neither exists.
        """
        built = self.bin_dir / "kubectl"
        if os.access(built, os.X_OK):
            return str(built)
        found = shutil.which("kubectl")
        if found is None:
            raise FileNotFoundError(binary_missing("kubectl", self.bin_dir) or "no kubectl")
        return found

    def kubectl(
        self, *argv: str, input: str | None = None, check: bool = True, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl with :attr:`kubeconfig`; stdout/stderr captured as text.

        Raises:
            subprocess.CalledProcessError: non-zero exit with ``check`` (stderr in the message
                is the caller's to print: ``exc.stderr``).
            subprocess.TimeoutExpired: after ``timeout`` seconds.
        """
        return subprocess.run(
            [self.kubectl_path(), f"--kubeconfig={self.kubeconfig}", *argv],
            input=input, capture_output=True, text=True, check=check, timeout=timeout,
        )  # fmt: skip

    def stop_controller_manager(self) -> None:
        """Stop kube-controller-manager if it runs (SIGTERM, then SIGKILL; reaped)."""
        self._stop_one("kube-controller-manager")

    def install_crds(self, *paths: pathlib.Path | str, timeout: float = 60.0) -> list[str]:
        """Apply CustomResourceDefinition files or directories for real (server-side apply,
        taking over conflicting fields) and wait until each is Established; the applied
        objects as ``customresourcedefinition.apiextensions.k8s.io/<name>``.

        Raises:
            KubeAPIError: kubectl refused a file, or a CRD was not Established in ``timeout``
                seconds (the message has kubectl's stderr).
        """
        args = [f"--filename={p}" for p in paths]
        out = self.kubectl(
            "apply", "--server-side", "--force-conflicts", "-o", "name", *args,
            check=False, timeout=timeout,
        )  # fmt: skip
        if out.returncode != 0:
            raise KubeAPIError(f"kubectl apply {' '.join(args)}: {out.stderr}")
        names = [n for n in out.stdout.split() if n.startswith("customresourcedefinition")]
        if names:
            wait = self.kubectl(
                "wait", "--for=condition=Established", f"--timeout={timeout:g}s", *names,
                check=False, timeout=timeout + 10,
            )  # fmt: skip
            if wait.returncode != 0:
                raise KubeAPIError(f"CRDs not Established: {wait.stderr}")
        return names

    def controller_manager(
        self,
        cluster_cidr: str = CLUSTER_CIDR,
        node_cidr_mask_size: int = 24,
        extra: tuple[str, ...] = (),
    ) -> subprocess.Popen[bytes]:
        """Start kube-controller-manager (once; later calls return the running one) with
        ``--allocate-node-cidrs --cluster-cidr=<cluster_cidr>`` and the admin kubeconfig;
        no leader election, no serving port; ``extra``: more ``--flag=value``. On the shared
        session server it acts on every test's objects (DaemonSets get pods, pods on unknown
        nodes are collected, ...): stop it with :meth:`stop_controller_manager`. Its log is ``<workdir>/kube-controller-manager.log``.

        Raises:
            FileNotFoundError: not built (the message is :func:`binary_missing`'s).
            KubeAPIError: it exited within its first second.
        """
        running = self._procs.get("kube-controller-manager")
        if running is not None and running.poll() is None:
            return running
        reason = binary_missing("kube-controller-manager", self.bin_dir)
        if reason:
            raise FileNotFoundError(reason)
        proc = self._spawn(
            "kube-controller-manager",
            [
                str(self.bin_dir / "kube-controller-manager"),
                f"--kubeconfig={self.kubeconfig}",
                f"--authentication-kubeconfig={self.kubeconfig}",
                f"--authorization-kubeconfig={self.kubeconfig}",
                "--leader-elect=false",
                "--secure-port=0",
                "--allocate-node-cidrs=true",
                f"--cluster-cidr={cluster_cidr}",
                f"--node-cidr-mask-size={node_cidr_mask_size}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                f"--service-account-private-key-file={self.service_account_key_file}",
                f"--root-ca-file={self.ca_file}",
                "--use-service-account-credentials=false",
                *extra,
            ],
        )
        time.sleep(1.0)
        if proc.poll() is not None:
            log = self.workdir / "kube-controller-manager.log"
            raise KubeAPIError(
                f"kube-controller-manager exited with {proc.returncode}:\n{_tail(log)}"
            )
        return proc
