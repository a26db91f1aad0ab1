"""The resource types the mock serves (group, version, plural, kind, scope).

Source: Kubernetes API conventions (core/v1, apps/v1, coordination.k8s.io/v1,
events.k8s.io) and the upstream Cilium CRDs (cilium.io v2 / v2alpha1: CiliumNetworkPolicy,
CiliumNode, CiliumIdentity, CiliumEndpoint in v2; CiliumPodIPPool in v2alpha1).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ResourceType:
    """One served resource.

    Attributes:
        group: API group, ``""`` for the core group (served under ``/api/v1``).
        version: ``v1``, ``v2alpha1``...
        plural: URL name (``pods``); singular: ``pod``; kind: ``Pod``.
        namespaced: whether objects live in a namespace.
        short_names: as in discovery (``po``).
        status_subresource: whether ``.../status`` is served. When True a PUT/PATCH of the
            main resource keeps the stored ``status`` and a write to ``/status`` changes
            only ``status`` (as the real API server does).
    """

    group: str
    version: str
    plural: str
    singular: str
    kind: str
    namespaced: bool
    short_names: tuple[str, ...] = field(default=())
    status_subresource: bool = False

    @property
    def api_version(self) -> str:
        """``v1`` for core, else ``group/version``."""
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def group_version(self) -> str:
        """Same as :attr:`api_version` (discovery's ``groupVersion``)."""
        return self.api_version


def _t(
    group: str,
    version: str,
    plural: str,
    kind: str,
    namespaced: bool,
    short: tuple[str, ...] = (),
    status: bool = False,
) -> ResourceType:
    return ResourceType(group, version, plural, kind.lower(), kind, namespaced, short, status)


DEFAULT_TYPES: tuple[ResourceType, ...] = (
    _t("", "v1", "namespaces", "Namespace", False, ("ns",), status=True),
    _t("", "v1", "nodes", "Node", False, ("no",), status=True),
    _t("", "v1", "pods", "Pod", True, ("po",), status=True),
    _t("", "v1", "events", "Event", True, ("ev",)),
    _t("", "v1", "configmaps", "ConfigMap", True, ("cm",)),
    _t("", "v1", "secrets", "Secret", True),
    _t("", "v1", "services", "Service", True, ("svc",), status=True),
    _t("", "v1", "serviceaccounts", "ServiceAccount", True, ("sa",)),
    _t("apps", "v1", "daemonsets", "DaemonSet", True, ("ds",), status=True),
    _t("apps", "v1", "deployments", "Deployment", True, ("deploy",), status=True),
    _t("coordination.k8s.io", "v1", "leases", "Lease", True),
    _t("events.k8s.io", "v1", "events", "Event", True, ("ev",)),
    _t("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", True, ("netpol",)),
    _t(
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        False,
        ("crd", "crds"),
        status=True,
    ),
    _t("cilium.io", "v2", "ciliumnodes", "CiliumNode", False, ("cn",), status=True),
    _t("cilium.io", "v2", "ciliumidentities", "CiliumIdentity", False, ("ciliumid",)),
    _t("cilium.io", "v2", "ciliumendpoints", "CiliumEndpoint", True, ("cep", "ciliumep")),
    _t("cilium.io", "v2", "ciliumnetworkpolicies", "CiliumNetworkPolicy", True, ("cnp",), True),
    _t(
        "cilium.io",
        "v2",
        "ciliumclusterwidenetworkpolicies",
        "CiliumClusterwideNetworkPolicy",
        False,
        ("ccnp",),
    ),
    _t("cilium.io", "v2alpha1", "ciliumpodippools", "CiliumPodIPPool", False, ("cpip",)),
    # Cilia's own bookkeeping CRDs (the operator's Store kinds)
    _t("cilia.io", "v1alpha1", "ciliaipamblocks", "CiliaIPAMBlock", False),
    _t("cilia.io", "v1alpha1", "ciliaidentitykeys", "CiliaIdentityKey", False),
)
"""Served from the start. As upstream's CRDs, CiliumNode and CiliumNetworkPolicy have a
``status`` subresource (a create/PUT of the object ignores ``status``; ``/status`` writes
only it); the other cilium.io / cilia.io kinds do not (a PUT replaces the whole object)."""


def types_from_crd(crd: dict[str, object]) -> list[ResourceType]:
    """The resource types a ``CustomResourceDefinition`` object declares (one per version).

    Raises:
        ValueError: ``spec.group``, ``spec.names.plural``/``kind`` or versions missing.
    """
    spec = crd.get("spec")
    if not isinstance(spec, dict):
        raise ValueError("spec: required")
    names = spec.get("names") or {}
    group, plural, kind = spec.get("group"), names.get("plural"), names.get("kind")
    if not (isinstance(group, str) and isinstance(plural, str) and isinstance(kind, str)):
        raise ValueError("spec.group, spec.names.plural and spec.names.kind are required")
    versions = spec.get("versions") or []
    if not versions:
        raise ValueError("spec.versions: at least one version is required")
    out = []
    for ver in versions:
        subresources = ver.get("subresources") or {}
        out.append(
            ResourceType(
                group=group,
                version=str(ver.get("name")),
                plural=plural,
                singular=str(names.get("singular") or kind.lower()),
                kind=kind,
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                short_names=tuple(names.get("shortNames") or ()),
                status_subresource="status" in subresources,
            )
        )
    return out
