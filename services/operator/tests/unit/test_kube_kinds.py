"""The Kubernetes store's kind table agrees with the CRDs the project ships."""

from __future__ import annotations

import pathlib

import pytest
import yaml

from cilia_kubemock.resources import types_from_crd
from cilia_operator.store.kubernetes import KINDS

CRDS = sorted(
    (pathlib.Path(__file__).parents[4] / "deploy" / "helm" / "cilia" / "files" / "crds").glob(
        "*.yaml"
    )
)


@pytest.mark.parametrize("path", CRDS, ids=[p.stem for p in CRDS])
def test_every_shipped_crd_matches_the_store_kind_table(path: pathlib.Path) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        for served in types_from_crd(doc):
            info = KINDS.get(served.kind)
            assert info is not None, f"{path.name}: kind {served.kind} missing from KINDS"
            if served.version != info.version:
                continue  # another served version of the same CRD
            assert (info.group, info.plural, info.namespaced, info.status_subresource) == (
                served.group, served.plural, served.namespaced, served.status_subresource,
            ), path.name  # fmt: skip


def test_the_crds_are_found() -> None:
    assert len(CRDS) >= 3
