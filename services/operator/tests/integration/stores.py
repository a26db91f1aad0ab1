"""Store backends for the shared suite: a real redis-server and a real kube-apiserver.

Fixture factories (test modules do ``from stores import make_store``):

- ``make_store`` — params ``redis`` and ``kubernetes``: the session's REAL kube-apiserver
  (the testkit's ``kube_apiserver``: etcd + kube-apiserver), serving TEST_KINDS as CRDs; the
  test kinds are emptied before each test (only this suite uses them).
- ``kube_cilia`` — the real server with Cilia's CRDs installed and the operator's kinds
  emptied (for tests that start an operator or a controller on it).

resourceVersions are opaque (the real server's are etcd revisions shared by the whole
session): tests compare them for equality with versions their own writes returned.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from cilia_operator.store import Store
from cilia_operator.store.kubernetes import KubeKind, KubernetesStore
from cilia_operator.store.redis import RedisStore
from cilia_testkit.kubeapi import KubeAPI

# Test-only kinds of the shared suite, served by the real server as CRDs.
TEST_KINDS = {
    "Thing": KubeKind("test.cilia.io", "v1", "things", False),
    "Other": KubeKind("test.cilia.io", "v1", "others", False),
    "Scoped": KubeKind("test.cilia.io", "v1", "scopeds", True),
    "Statusful": KubeKind("test.cilia.io", "v1", "statusfuls", False, status_subresource=True),
}

StoreFactory = Callable[..., Store]


def _test_kind_crds() -> list[dict[str, Any]]:
    """TEST_KINDS as CustomResourceDefinitions (open schema, status subresource as declared)."""
    crds = []
    for kind, info in TEST_KINDS.items():
        version: dict[str, Any] = {
            "name": info.version,
            "served": True,
            "storage": True,
            "schema": {
                "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
            },
        }
        if info.status_subresource:
            version["subresources"] = {"status": {}}
        crds.append(
            {
                "apiVersion": "apiextensions.k8s.io/v1",
                "kind": "CustomResourceDefinition",
                "metadata": {"name": f"{info.plural}.{info.group}"},
                "spec": {
                    "group": info.group,
                    "names": {"kind": kind, "plural": info.plural, "singular": kind.lower()},
                    "scope": "Namespaced" if info.namespaced else "Cluster",
                    "versions": [version],
                },
            }
        )
    return crds


#: Namespaces the suite's namespaced objects live in (created once on the real server).
TEST_NAMESPACES = ("a", "b")
_prepared: set[str] = set()


def prepare_kube(kube: KubeAPI, tmp: pathlib.Path) -> None:
    """Serve TEST_KINDS (CRDs, Established) and create TEST_NAMESPACES, once per server;
    then delete every object of the test kinds (an empty store for the next test)."""
    if kube.server not in _prepared:
        path = tmp / "test-kinds.json"
        path.write_text(
            json.dumps({"apiVersion": "v1", "kind": "List", "items": _test_kind_crds()})
        )
        kube.install_crds(path)
        for ns in TEST_NAMESPACES:
            got = kube.kubectl("create", "namespace", ns, check=False)
            assert got.returncode == 0 or "AlreadyExists" in got.stderr, got.stderr
        _prepared.add(kube.server)
    kinds = ",".join(f"{i.plural}.{i.group}" for i in TEST_KINDS.values())
    kube.kubectl("delete", kinds, "--all", "--all-namespaces", "--wait=true")


def real_kube_store(kube: KubeAPI, **kwargs: Any) -> KubernetesStore:
    """A KubernetesStore on the real server through its admin kubeconfig; 1 s watch
    requests, so every watch test also exercises the reconnect from the last seen version."""
    kwargs.setdefault("watch_timeout", 1)
    return KubernetesStore(kubeconfig=str(kube.kubeconfig), kinds=TEST_KINDS, **kwargs)


@pytest.fixture(params=["redis", "kubernetes"])
def make_store(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[StoreFactory]:
    """``make_store()`` -> a fresh, empty Store on the parametrized backend: Redis or the
    session's real kube-apiserver.

    Stores are not closed by the fixture (the test closes them on its own event loop).
    """
    if request.param == "redis":
        url = request.getfixturevalue("redis_server")
        redis.Redis.from_url(url).flushall()

        def make_redis() -> Store:
            return RedisStore(url, event_history=10000, watch_block_timeout=0.5)

        yield make_redis
    else:
        kube: KubeAPI = request.getfixturevalue("kube_apiserver")
        prepare_kube(kube, tmp_path_factory.mktemp("kinds"))

        def make_kube() -> Store:
            return real_kube_store(kube)

        yield make_kube


#: Every custom kind the operator's Kubernetes store writes (deploy/helm/cilia/files/crds), as
#: kubectl names them; emptied by ``kube_cilia`` before each test.
OPERATOR_KINDS = (
    "ciliumpodippools.cilium.io",
    "ciliumnodes.cilium.io",
    "ciliumidentities.cilium.io",
    "ciliumendpoints.cilium.io",
    "ciliumendpointslices.cilium.io",
    "ciliumclusterwidenetworkpolicies.cilium.io",
    "ciliumnodeconfigs.cilium.io",
    "ciliumnetworkpolicies.cilium.io",
    "ciliaidentitykeys.cilia.io",
    "ciliaipamblocks.cilia.io",
)
CRD_DIR = (
    pathlib.Path(__file__).resolve().parents[4] / "deploy" / "helm" / "cilia" / "files" / "crds"
)
_crds_on: set[str] = set()


def empty_operator_kinds(kube: KubeAPI) -> None:
    """Delete every object of OPERATOR_KINDS on ``kube`` (all namespaces)."""
    kube.kubectl("delete", ",".join(OPERATOR_KINDS), "--all", "--all-namespaces")


@pytest.fixture
def kube_cilia(kube_apiserver: KubeAPI) -> KubeAPI:
    """The session's real kube-apiserver (testkit ``kube_apiserver``) serving Cilia's CRDs
    (deploy/helm/cilia/files/crds, installed once) with every object of OPERATOR_KINDS deleted:
    an operator started on it finds an empty cluster. Tests use namespaces of their own for
    namespaced built-in kinds (Leases). Import it: ``from stores import kube_cilia``."""
    if kube_apiserver.server not in _crds_on:
        kube_apiserver.install_crds(CRD_DIR)
        _crds_on.add(kube_apiserver.server)
    empty_operator_kinds(kube_apiserver)
    return kube_apiserver
