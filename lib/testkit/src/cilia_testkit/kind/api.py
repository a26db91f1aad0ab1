"""The Kubernetes API side of a kind-style cluster (a mixin of
:class:`cilia_testkit.kind.KindCluster`): kubectl with the host kubeconfig, and the waits on
the API server and on Nodes (registered, Ready, the kubelet's Lease renewed)."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable
from typing import Any

from cilia_testkit.kind.node import Node, log_tail
from cilia_testkit.kubeapi import default_bin_dir

#: Seconds the API server may take to answer /readyz after its node starts.
API_READY_SECONDS = 120.0
#: Seconds until every node's kubelet has registered its Node.
NODE_REGISTER_SECONDS = 120.0
#: Seconds until the Nodes are Ready once a CNI is configured (or a kubelet is back).
NODE_READY_SECONDS = 120.0
#: Seconds one ``kubectl`` call may take.
KUBECTL_SECONDS = 60.0


class KindError(RuntimeError):
    """The cluster could not be created or changed as asked (the message says why, with log
    tails of the node services involved)."""


class ClusterAPI:
    """kubectl and the waits; the cluster provides the attributes declared here."""

    state_dir: pathlib.Path
    nodes: list[Node]

    @property
    def kubeconfig(self) -> pathlib.Path:
        """The admin kubeconfig for the host (the cluster's)."""
        raise NotImplementedError

    @property
    def api_server(self) -> str:
        """``host:port`` of the API server (the cluster's)."""
        raise NotImplementedError

    @property
    def control_plane(self) -> Node:
        """The control-plane node (the cluster's)."""
        raise NotImplementedError

    def _wait_api(self, timeout: float = API_READY_SECONDS) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            got = self.kubectl("get", "--raw=/readyz", check=False, timeout=10)
            if got.returncode == 0 and got.stdout.strip() == "ok":
                return
            last = (got.stdout + got.stderr).strip()[-300:]
            time.sleep(0.5)
        cp = self.control_plane.name
        raise KindError(
            f"API server {self.api_server} not ready in {timeout:g}s ({last});\n"
            f"kube-apiserver:\n{log_tail(self.state_dir, cp, 'kube-apiserver')}\n"
            f"etcd:\n{log_tail(self.state_dir, cp, 'etcd')}\n"
            f"entrypoint:\n{log_tail(self.state_dir, cp, 'entrypoint')}"
        )

    def kubectl(
        self,
        *argv: str,
        input: str | None = None,
        check: bool = True,
        timeout: float = KUBECTL_SECONDS,
    ) -> subprocess.CompletedProcess[str]:
        """kubectl with the host kubeconfig (the cached build, else the one on PATH).

        A call that gets no answer in ``timeout`` seconds (``--request-timeout``, and the
        process is killed 5 s later) fails with exit status 124.

        Raises:
            KindError: non-zero exit with ``check`` (kubectl's stderr).
        """
        binary = default_bin_dir() / "kubectl"
        path = str(binary) if os.access(binary, os.X_OK) else (shutil.which("kubectl") or "kubectl")
        cmd = [path, f"--kubeconfig={self.kubeconfig}", f"--request-timeout={timeout:g}s", *argv]
        try:
            got = subprocess.run(
                cmd, input=input, capture_output=True, text=True, timeout=timeout + 5, check=False
            )
        except subprocess.TimeoutExpired:
            # the API server's address does not answer (its node is stopped): a failed call
            got = subprocess.CompletedProcess(cmd, 124, "", f"no answer in {timeout:g}s")
        if check and got.returncode != 0:
            raise KindError(f"kubectl {' '.join(argv)}: {got.stderr.strip()}")
        return got

    def get(self, *argv: str) -> dict[str, Any]:
        """``kubectl get ARGV -o json`` parsed.

        Raises:
            KindError: kubectl failed.
        """
        out: dict[str, Any] = json.loads(self.kubectl("get", *argv, "-o", "json").stdout)
        return out

    def node_objects(self) -> dict[str, dict[str, Any]]:
        """The Node objects by name."""
        return {n["metadata"]["name"]: n for n in self.get("nodes")["items"]}

    def wait_registered(
        self, names: Iterable[str] | None = None, timeout: float = NODE_REGISTER_SECONDS
    ) -> None:
        """Wait until the Nodes ``names`` (default: all) exist.

        Raises:
            KindError: not in ``timeout`` seconds (kubelet log tails).
        """
        self._wait_nodes(names, timeout, lambda n: True, "registered")

    def wait_ready(
        self, names: Iterable[str] | None = None, timeout: float = NODE_READY_SECONDS
    ) -> None:
        """Wait until the Nodes ``names`` (default: all) are Ready.

        Raises:
            KindError: not in ``timeout`` seconds (kubelet log tails).
        """
        self._wait_nodes(names, timeout, _ready, "Ready")

    def _wait_nodes(
        self,
        names: Iterable[str] | None,
        timeout: float,
        ok: Callable[[dict[str, Any]], bool],
        what: str,
    ) -> None:
        want = set(names) if names is not None else {n.name for n in self.nodes}
        deadline = time.monotonic() + timeout
        pending = want
        while time.monotonic() < deadline:
            got = self.kubectl("get", "nodes", "-o", "json", check=False, timeout=15)
            if got.returncode == 0:
                objects = {n["metadata"]["name"]: n for n in json.loads(got.stdout)["items"]}
                pending = {n for n in want if n not in objects or not ok(objects[n])}
                if not pending:
                    return
            time.sleep(0.5)
        tails = "\n".join(f"{n} kubelet:\n{log_tail(self.state_dir, n, 'kubelet', 15)}"
                          for n in sorted(pending))  # fmt: skip
        raise KindError(f"nodes {sorted(pending)} not {what} in {timeout:g}s\n{tails}")

    def _lease_renewed(self, name: str) -> datetime.datetime | None:
        """``spec.renewTime`` of the node's Lease in kube-node-lease (the kubelet's
        heartbeat, renewed every 10 s), or None."""
        got = self.kubectl("get", "lease", "-n", "kube-node-lease", name, "-o",
                           "jsonpath={.spec.renewTime}", check=False, timeout=10)  # fmt: skip
        return parse_time(got.stdout) if got.returncode == 0 else None

    def _wait_heartbeat(
        self, name: str, since: datetime.datetime, timeout: float = NODE_READY_SECONDS
    ) -> None:
        """Until the kubelet has renewed its Lease at or after ``since`` (when its node
        container started; the API server and the containers share the machine's clock):
        it runs again and reaches the API server.

        Raises:
            KindError: not in ``timeout`` seconds (kubelet log tail).
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            renewed = self._lease_renewed(name)
            if renewed is not None and renewed >= since:
                return
            time.sleep(0.5)
        raise KindError(
            f"kubelet of {name} renewed no Lease in {timeout:g}s:\n"
            f"{log_tail(self.state_dir, name, 'kubelet')}"
        )


def _ready(node: dict[str, Any]) -> bool:
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def parse_time(text: str) -> datetime.datetime | None:
    """An RFC 3339 UTC time (``2026-12-07T20:41:02.123456Z``, any number of fraction digits:
    Docker's have 9), or None."""
    m = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?Z$", text.strip())
    if not m:
        return None
    micro = int((m.group(2) or "0")[:6].ljust(6, "0"))
    parsed = datetime.datetime.fromisoformat(m.group(1)).replace(tzinfo=datetime.UTC)
    return parsed.replace(microsecond=micro)
