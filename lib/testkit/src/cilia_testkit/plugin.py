"""The pytest plugin (entry point ``pytest11``): fixtures every suite can use.

- ``netns_registry`` (session): a :class:`~cilia_testkit.netns.NetnsRegistry` whose prefix
  is the ini option ``testkit_netns_prefix`` (default ``cilia-test-``); stale namespaces of
  an earlier, killed run are removed first, and everything it made at the end.
- ``cluster`` (module): a factory ``cluster(nodes=3, routing="native", **kw)`` returning a
  started :class:`~cilia_testkit.cluster.Cluster`; every cluster it made and did not stop
  yet is stopped at the end of the module (stop one earlier with ``c.stop()``). Skips with
  the reason when not root or a tool is missing.
- ``kube_apiserver`` (session): ONE real etcd + kube-apiserver
  (:class:`~cilia_testkit.kubeapi.KubeAPI`) for the whole test session; tests share it and
  use names of their own (see :mod:`cilia_testkit.kubeapi`). Skips with the build's reason
  when scripts/kube-tools.sh could not build a binary (fails in CI).
- ``kind_cluster`` (module): a factory ``kind_cluster(nodes=3, cni=None, **kw)`` returning a
  started :class:`~cilia_testkit.kind.KindCluster` (a real multi-node Kubernetes cluster of
  node containers, named ``kt-<8 hex>``); every cluster it made is removed at the end of the
  module (also when the test fails; SIGTERM unwinds the session through it). Skips with the
  reason when the Docker engine or a built tool is missing (fails in CI).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from cilia_testkit import VENV_BIN, skips
from cilia_testkit.cluster import Cluster, RoutingMode
from cilia_testkit.kubeapi import KubeAPI, KubeAPIError, binary_missing
from cilia_testkit.netns import NetnsRegistry
from cilia_testkit.stack import StackError

#: Host tools a :class:`Cluster` needs.
CLUSTER_TOOLS = ("ip", "iptables", "nsenter", "redis-server")


def pytest_addoption(parser: pytest.Parser) -> None:
    """Register the ``testkit_netns_prefix`` ini option."""
    parser.addini(
        "testkit_netns_prefix",
        "prefix of the network namespaces the netns_registry fixture creates",
        default="cilia-test-",
    )


@pytest.fixture(scope="session")
def netns_registry(pytestconfig: pytest.Config) -> Iterator[NetnsRegistry]:
    """Network namespaces of this test session (see the module docstring)."""
    registry = NetnsRegistry(str(pytestconfig.getini("testkit_netns_prefix")))
    registry.remove_stale()
    try:
        yield registry
    finally:
        registry.cleanup()


def cluster_unsupported() -> str:
    """Why a :class:`Cluster` cannot run here ("" when it can)."""
    if os.geteuid() != 0:
        return "a cluster needs root: network namespaces, veth, bridge, iptables, eBPF"
    for tool in CLUSTER_TOOLS:
        if shutil.which(tool) is None:
            return f"a cluster needs {tool!r} on PATH (scripts/setup.sh installs it)"
    for binary in ("cilia-operator", "cilia-agent", "cilia-cni", "cilia-relay"):
        if not (VENV_BIN / binary).exists():
            return f"{VENV_BIN / binary} missing: run scripts/setup.sh (make setup)"
    return ""


@pytest.fixture(scope="module")
def cluster() -> Iterator[Callable[..., Cluster]]:
    """Factory of started clusters (see the module docstring); fails the test with the
    components' log tails when one does not start."""
    made: list[Cluster] = []

    def make(nodes: int = 3, routing: RoutingMode = "native", **kw: Any) -> Cluster:
        reason = cluster_unsupported()
        if reason:
            pytest.skip(reason)
        c = Cluster(nodes, routing=routing, **kw)
        made.append(c)
        try:
            c.start()
        except StackError as exc:
            pytest.fail(f"the {nodes}-node {routing} cluster did not start:\n{exc}")
        return c

    try:
        yield make
    finally:
        for c in reversed(made):
            c.stop()


@pytest.fixture(scope="module")
def kind_cluster() -> Iterator[Callable[..., Any]]:
    """Factory of kind-style clusters (see the module docstring)."""
    import signal
    import threading
    import uuid

    from cilia_testkit import kind

    made: list[kind.KindCluster] = []
    old = None
    if threading.current_thread() is threading.main_thread():
        # pytest dies on SIGTERM without running teardowns: stop the session as Ctrl-C does
        # (pytest then tears down every fixture), so the clusters below are removed
        def _unwind(signum: int, frame: object) -> None:
            raise KeyboardInterrupt(f"signal {signum}")

        old = signal.signal(signal.SIGTERM, _unwind)

    def make(nodes: int = 3, **kw: Any) -> kind.KindCluster:
        skips.require(kind.missing())
        c = kind.KindCluster(f"kt-{uuid.uuid4().hex[:8]}", nodes, **kw)
        made.append(c)
        return c.up()

    try:
        yield make
    finally:
        for c in made:
            c.down()
        if old is not None:
            signal.signal(signal.SIGTERM, old)


@pytest.fixture(scope="session")
def kube_apiserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeAPI]:
    """The session's real kube-apiserver (see the module docstring); stopped at the end."""
    skips.require(binary_missing("etcd") or binary_missing("kube-apiserver"))
    api = KubeAPI(tmp_path_factory.mktemp("kubeapi"))
    try:
        api.start()
    except KubeAPIError as exc:
        pytest.fail(f"the test kube-apiserver did not start: {exc}", pytrace=False)
    try:
        yield api
    finally:
        api.stop()
