"""The resource kinds the operator serves, with their names as kubectl spells them.

Source: upstream CRDs (reference: cilium-upstream.md §1): CiliumPodIPPool
(``cilium.io/v2alpha1``, plural ``ciliumpodippools``, short ``cpip``) and CiliumNode
(``cilium.io/v2``, plural ``ciliumnodes``, short ``cn``); both cluster-scoped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from .ipam import node, pool


class UnknownKind(ValueError):
    """A kind name (or apiVersion/kind pair) the operator does not serve."""


@dataclass(frozen=True)
class KindInfo:
    """One served kind.

    Attributes:
        kind: ``CiliumPodIPPool``; api_version: ``cilium.io/v2alpha1``;
        plural / singular / short_names: the names ``cilia-operator get`` accepts;
        validate: schema validation of a manifest (raises InvalidResource).
    """

    kind: str
    api_version: str
    plural: str
    singular: str
    short_names: tuple[str, ...]
    validate: Callable[[Mapping[str, Any]], BaseModel]

    @property
    def group(self) -> str:
        """API group (``cilium.io``)."""
        return self.api_version.partition("/")[0]

    def display(self, name: str) -> str:
        """kubectl-style ``ciliumpodippool.cilium.io/blue``."""
        return f"{self.singular}.{self.group}/{name}"


POOL = KindInfo(
    pool.KIND, pool.API_VERSION, "ciliumpodippools", "ciliumpodippool", ("cpip",),
    pool.validate_pool,
)  # fmt: skip
NODE = KindInfo(
    node.KIND, node.API_VERSION, "ciliumnodes", "ciliumnode", ("cn",), node.validate_node
)
KINDS = (POOL, NODE)


def resolve_kind(name: str) -> KindInfo:
    """Find a kind by plural, singular, short name or Kind (case-insensitive).

    Raises:
        UnknownKind: none matches; the message lists the accepted names.
    """
    wanted = name.lower()
    for info in KINDS:
        names = {info.kind.lower(), info.plural, info.singular, *info.short_names}
        if wanted in names or wanted == f"{info.plural}.{info.group}":
            return info
    accepted = ", ".join(f"{i.plural}|{'|'.join(i.short_names)}" for i in KINDS)
    raise UnknownKind(f"unknown kind {name!r}: use one of {accepted}")


def kind_of(api_version: str, kind: str) -> KindInfo:
    """Find the served kind for a manifest's ``apiVersion`` and ``kind``.

    Raises:
        UnknownKind: not served (the message names what is).
    """
    for info in KINDS:
        if info.kind == kind and info.api_version == api_version:
            return info
    served = ", ".join(f"{i.api_version} {i.kind}" for i in KINDS)
    raise UnknownKind(f"{api_version or '<none>'} {kind or '<none>'} is not served: use {served}")
