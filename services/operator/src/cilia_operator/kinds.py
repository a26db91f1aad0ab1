"""The resource kinds the operator serves, with their names as kubectl spells them.

Source: upstream CRDs (reference: cilium-upstream.md §1, §4, §5, §8):

==========================  ======================  ==========================  ==========
kind                        apiVersion              plural | short names        scope
==========================  ======================  ==========================  ==========
CiliumPodIPPool             cilium.io/v2alpha1      ciliumpodippools | cpip     cluster
CiliumNode                  cilium.io/v2            ciliumnodes | cn            cluster
CiliumNetworkPolicy         cilium.io/v2            ciliumnetworkpolicies |     namespaced
                                                    cnp, ciliumnp
CiliumClusterwide-         cilium.io/v2            ciliumclusterwide-          cluster
NetworkPolicy                                       networkpolicies | ccnp
NetworkPolicy               networking.k8s.io/v1    networkpolicies | netpol    namespaced
CiliumIdentity              cilium.io/v2            ciliumidentities | ciliumid cluster
CiliumEndpoint              cilium.io/v2            ciliumendpoints | cep,      namespaced
                                                    ciliumep
Namespace                   v1                      namespaces | ns             cluster
CiliaIPAMBlock              cilia.io/v1alpha1       ciliaipamblocks | cipb      cluster
Service                     v1                      services | svc              namespaced
EndpointSlice               discovery.k8s.io/v1     endpointslices              namespaced
ServiceCIDR                 networking.k8s.io/v1    servicecidrs                cluster
CiliaServiceCIDRMigration   cilia.io/v1alpha1       ciliaservicecidrmigrations  cluster
                                                    | cscm
==========================  ======================  ==========================  ==========

Services, EndpointSlices and ServiceCIDRs are Kubernetes' own kinds (see
:mod:`cilia_operator.service`): in standalone mode the operator allocates ClusterIPs and
keeps EndpointSlices as kube-apiserver and kube-controller-manager would; with
``--store kubernetes`` they are the API server's objects.

CiliaServiceCIDRMigration is the record ``cilia-operator servicecidr migrate`` applies; the
operator's Service controller carries it out and writes its ``status`` (see
:mod:`cilia_operator.service.migration`).

Namespaces carry the labels/annotations ResolvePool reads (pool annotations,
namespaceSelector). CiliaIPAMBlock records are the allocator's per-block claims
(see :mod:`cilia_operator.ipam.claims`).

CiliumIdentity and CiliumEndpoint are written by the operator and the agents only:
``apply`` refuses them; ``get`` and ``delete`` work.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import FieldError, InvalidResource
from .ipam import claims, node, pool, resolve
from .policy import validation as policy
from .service import migration as service_migration
from .service import model as service


class UnknownKind(ValueError):
    """A kind name (or apiVersion/kind pair) the operator does not serve."""


@dataclass(frozen=True)
class KindInfo:
    """One served kind.

    Attributes:
        kind: ``CiliumPodIPPool``; api_version: ``cilium.io/v2alpha1``;
        plural / singular / short_names: the names ``cilia-operator get`` accepts;
        validate: schema validation of a manifest (raises InvalidResource); returns a
            model or the normalised manifest;
        namespaced: whether records are keyed by namespace (default ``default``);
        appliable: whether ``apply`` may write it (False: written by the control plane).
    """

    kind: str
    api_version: str
    plural: str
    singular: str
    short_names: tuple[str, ...]
    validate: Callable[[Mapping[str, Any]], Any]
    namespaced: bool = False
    appliable: bool = True

    @property
    def group(self) -> str:
        """API group (``cilium.io``)."""
        return self.api_version.partition("/")[0]

    def display(self, name: str) -> str:
        """kubectl-style ``ciliumpodippool.cilium.io/blue`` (core kinds: ``namespace/x``)."""
        if "/" not in self.api_version:
            return f"{self.singular}/{name}"
        return f"{self.singular}.{self.group}/{name}"


POOL = KindInfo(
    pool.KIND, pool.API_VERSION, "ciliumpodippools", "ciliumpodippool", ("cpip",),
    pool.validate_pool,
)  # fmt: skip
NODE = KindInfo(
    node.KIND, node.API_VERSION, "ciliumnodes", "ciliumnode", ("cn",), node.validate_node
)


def _managed_by(who: str) -> Callable[[Mapping[str, Any]], Any]:
    def refuse(doc: Mapping[str, Any]) -> Any:
        raise InvalidResource(
            [
                FieldError(
                    "kind",
                    f"{doc.get('kind')} records are written by {who}; "
                    "they cannot be applied (get and delete work)",
                )
            ]
        )

    return refuse


CNP = KindInfo(
    policy.CNP_KIND, policy.CNP_API_VERSION, "ciliumnetworkpolicies", "ciliumnetworkpolicy",
    ("cnp", "ciliumnp"), policy.validate_cnp, namespaced=True,
)  # fmt: skip
CCNP = KindInfo(
    policy.CCNP_KIND, policy.CNP_API_VERSION, "ciliumclusterwidenetworkpolicies",
    "ciliumclusterwidenetworkpolicy", ("ccnp",), policy.validate_ccnp,
)  # fmt: skip
NETWORK_POLICY = KindInfo(
    policy.NP_KIND, policy.NP_API_VERSION, "networkpolicies", "networkpolicy", ("netpol",),
    policy.validate_np, namespaced=True,
)  # fmt: skip
IDENTITY = KindInfo(
    "CiliumIdentity", "cilium.io/v2", "ciliumidentities", "ciliumidentity", ("ciliumid",),
    _managed_by("the operator (IdentityService.Allocate)"), appliable=False,
)  # fmt: skip
ENDPOINT = KindInfo(
    "CiliumEndpoint", "cilium.io/v2", "ciliumendpoints", "ciliumendpoint", ("cep", "ciliumep"),
    _managed_by("the agents (EndpointService.UpsertEndpoint)"), namespaced=True, appliable=False,
)  # fmt: skip
NAMESPACE = KindInfo(
    resolve.NAMESPACE_KIND, resolve.NAMESPACE_API_VERSION, "namespaces", "namespace", ("ns",),
    resolve.validate_namespace,
)  # fmt: skip
IPAM_BLOCK = KindInfo(
    claims.KIND, claims.API_VERSION, "ciliaipamblocks", "ciliaipamblock", ("cipb",),
    _managed_by("the operator's IPAM allocator"), appliable=False,
)  # fmt: skip
SERVICE = KindInfo(
    service.SERVICE_KIND, service.SERVICE_API_VERSION, "services", "service", ("svc",),
    service.validate_service, namespaced=True,
)  # fmt: skip
ENDPOINT_SLICE = KindInfo(
    service.SLICE_KIND, service.SLICE_API_VERSION, "endpointslices", "endpointslice", (),
    service.validate_endpoint_slice, namespaced=True,
)  # fmt: skip
SERVICE_CIDR = KindInfo(
    service.CIDR_KIND, service.CIDR_API_VERSION, "servicecidrs", "servicecidr", (),
    service.validate_service_cidr,
)  # fmt: skip
SERVICE_CIDR_MIGRATION = KindInfo(
    service_migration.KIND, service_migration.API_VERSION, "ciliaservicecidrmigrations",
    "ciliaservicecidrmigration", ("cscm",), service_migration.validate_migration,
)  # fmt: skip
KINDS = (
    POOL, NODE, CNP, CCNP, NETWORK_POLICY, IDENTITY, ENDPOINT, NAMESPACE, IPAM_BLOCK,
    SERVICE, ENDPOINT_SLICE, SERVICE_CIDR, SERVICE_CIDR_MIGRATION,
)  # fmt: skip


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
    accepted = ", ".join("|".join((i.plural, *i.short_names)) for i in KINDS)
    raise UnknownKind(f"unknown kind {name!r}: use one of {accepted}")


def kind_of(api_version: str, kind: str) -> KindInfo:
    """Find the served kind for a manifest's ``apiVersion`` and ``kind``.

    Raises:
        UnknownKind: not served (the message names what is).
    """
    for info in KINDS:
        if info.kind == kind and info.api_version == api_version:
            return info
    served = ", ".join(f"{i.api_version} {i.kind}" for i in KINDS if i.appliable)
    raise UnknownKind(f"{api_version or '<none>'} {kind or '<none>'} is not served: use {served}")
