"""The Kubernetes store's kind table agrees with the CRDs the project ships."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import yaml

from cilia_operator.store.kubernetes import KINDS, KubeKind

CRDS = sorted(
    (pathlib.Path(__file__).parents[4] / "deploy" / "helm" / "cilia" / "files" / "crds").glob(
        "*.yaml"
    )
)


def served_kinds(crd: dict[str, Any]) -> list[tuple[str, KubeKind]]:
    """``(kind, KubeKind)`` for each version a CustomResourceDefinition serves, read from
    the CRD itself (``spec.group``, ``spec.names``, ``spec.scope``, ``spec.versions[].name``
    and ``.subresources.status``; scope defaults to Namespaced as the API server's does)."""
    spec = crd["spec"]
    namespaced = spec.get("scope", "Namespaced") == "Namespaced"
    return [
        (
            spec["names"]["kind"],
            KubeKind(
                spec["group"],
                version["name"],
                spec["names"]["plural"],
                namespaced,
                status_subresource="status" in (version.get("subresources") or {}),
            ),
        )
        for version in spec["versions"]
    ]


@pytest.mark.parametrize("path", CRDS, ids=[p.stem for p in CRDS])
def test_every_shipped_crd_matches_the_store_kind_table(path: pathlib.Path) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        for kind, served in served_kinds(doc):
            info = KINDS.get(kind)
            assert info is not None, f"{path.name}: kind {kind} missing from KINDS"
            if served.version != info.version:
                continue  # another served version of the same CRD
            assert (info.group, info.plural, info.namespaced, info.status_subresource) == (
                served.group, served.plural, served.namespaced, served.status_subresource,
            ), path.name  # fmt: skip


def test_the_crds_are_found() -> None:
    assert len(CRDS) >= 3
