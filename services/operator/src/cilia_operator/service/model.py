"""Schema rules and record helpers of ``v1 Service``, ``discovery.k8s.io/v1 EndpointSlice``
and ``networking.k8s.io/v1 ServiceCIDR``.

The rules restate Kubernetes' API validation (``pkg/apis/core/validation`` ValidateService,
``pkg/apis/discovery/validation``, ``pkg/apis/networking/validation`` ValidateServiceCIDR)
for what Cilia serves, which is IPv4 only:

- Service ``metadata.name``: a DNS-1035 label (starts with a letter, at most 63
  characters), as upstream requires of Services;
- ``spec.type``: ClusterIP (default), NodePort, LoadBalancer or ExternalName (the last is
  stored but never load-balanced: it has no ClusterIP);
- ``spec.ports``: at least one (except headless and ExternalName); each ``port`` 1-65535,
  ``protocol`` TCP (default) or UDP -- SCTP is valid Kubernetes but refused here because
  the eBPF load balancer does not translate it; ``name`` required once there are two
  ports, a DNS-1123 label, unique; (port, protocol) unique; ``targetPort`` an integer
  1-65535 or an IANA service name (at most 15 lower-case letters, digits and '-', one
  letter at least), default the port; ``nodePort`` only for NodePort/LoadBalancer (its
  range, ``--service-node-port-range``, is checked at allocation);
- ``spec.clusterIP``: "", ``None`` (headless) or an IPv4 address; ``spec.clusterIPs[0]``
  equals it when both are given;
- ``spec.sessionAffinity``: None (default) or ClientIP, its timeout
  (``sessionAffinityConfig.clientIP.timeoutSeconds``) 1-86400, default 10800;
- ``spec.externalTrafficPolicy`` (NodePort/LoadBalancer) and ``internalTrafficPolicy``:
  Cluster (default) or Local;
- ``spec.selector``: string -> string.

ServiceCIDR: ``spec.cidrs`` one or two CIDRs (one per family upstream; IPv4 only here),
each a network address, immutable. EndpointSlice: ``addressType`` IPv4, ``endpoints[]``
with 1..100 IPv4 ``addresses``, ``ports[]`` with port 1-65535 and TCP/UDP.
"""

from __future__ import annotations

import copy
import datetime
import ipaddress
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from ..addresses import special_ranges
from ..errors import FieldError, InvalidResource
from ..store import Resource

SERVICE_KIND = "Service"
SERVICE_API_VERSION = "v1"
SLICE_KIND = "EndpointSlice"
SLICE_API_VERSION = "discovery.k8s.io/v1"
CIDR_KIND = "ServiceCIDR"
CIDR_API_VERSION = "networking.k8s.io/v1"

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
"""Label of an EndpointSlice naming its Service (upstream ``discovery.LabelServiceName``)."""
MANAGED_BY_LABEL = "endpointslice.kubernetes.io/managed-by"
"""Label naming the controller that keeps an EndpointSlice (upstream ``LabelManagedBy``)."""
MANAGED_BY = "endpointslice-controller.cilia.io"
"""Cilia's value of :data:`MANAGED_BY_LABEL` (upstream's controller uses
``endpointslice-controller.k8s.io``; slices of other controllers are left alone)."""
MAX_ENDPOINTS_PER_SLICE = 100
"""Endpoints in one EndpointSlice at most (kube-controller-manager's
``--max-endpoints-per-slice`` default)."""
DEFAULT_CIDR_NAME = "kubernetes"
"""The ServiceCIDR kube-apiserver creates from ``--service-cluster-ip-range``."""
CIDR_FINALIZER = "networking.k8s.io/service-cidr-finalizer"
"""Finalizer upstream keeps on a ServiceCIDR while Services hold addresses in it."""
MIGRATION_MANAGED_BY = "servicecidr-migration.cilia.io"
"""The :data:`MANAGED_BY_LABEL` value of the EndpointSlices a Kubernetes-mode ServiceCIDR
migration writes while it re-creates a Service (``cilia-operator servicecidr migrate
--kubernetes``): copies of the Service's slices, without ownerReferences, so they outlive
the deleted Service. While such a slice names a Service, the operator's ServiceService keeps
serving a deleted Service of that name as it was (no DELETE to the agents) and adds the
slice's :data:`MIGRATING_FROM_ANNOTATION` address to the re-created Service's aliases."""
MIGRATING_FROM_ANNOTATION = "service.cilia.io/migrating-from"
"""Annotation of a migration slice (:data:`MIGRATION_MANAGED_BY`): the ClusterIP the Service
had before it was re-created (IPv4 text)."""


MIGRATING_TO_ANNOTATION = "service.cilia.io/migrating-to"
"""Annotation a Kubernetes-mode migration writes on a Service just before deleting it (its
new ClusterIP): the DELETE event then carries it, on the same watch as the Service's
re-creation, so the operator holds the deletion even when its EndpointSlice watch lags."""


def migrating_service(obj: Mapping[str, Any]) -> bool:
    """Whether Service ``obj`` carries :data:`MIGRATING_TO_ANNOTATION`."""
    return bool((_meta(obj).get("annotations") or {}).get(MIGRATING_TO_ANNOTATION))


def migration_slice(obj: Mapping[str, Any]) -> bool:
    """Whether EndpointSlice ``obj`` is a migration copy (:data:`MIGRATION_MANAGED_BY`)."""
    return labels_of(obj).get(MANAGED_BY_LABEL) == MIGRATION_MANAGED_BY


def migrating_from(obj: Mapping[str, Any]) -> ipaddress.IPv4Address | None:
    """The :data:`MIGRATING_FROM_ANNOTATION` address of a migration slice; None when absent
    or not IPv4."""
    raw = (_meta(obj).get("annotations") or {}).get(MIGRATING_FROM_ANNOTATION)
    try:
        return ipaddress.IPv4Address(str(raw)) if raw else None
    except ValueError:
        return None


ALIAS_ANNOTATION = "service.cilia.io/alias-ips"
"""Annotation of a Service holding its alias VIPs: a JSON object ``{"<former ClusterIP>":
"<RFC 3339 time it became an alias>"}``. Written by the ServiceCIDR migration; the agents
serve each alias like the ClusterIP (``Service.alias_ips``) until it is released. Cilia's
own: Kubernetes has no alias of a ClusterIP."""
MIGRATED_FROM_ANNOTATION = "service.cilia.io/migrated-from"
"""Annotation of the ServiceCIDR a migration created: the comma-separated ranges it replaces.
Once the default ServiceCIDR ``kubernetes`` is released, ``--service-cluster-ip-range``
ranges listed here are no longer offered (nor the record re-created at start) until the
flag is changed to the new range."""
DEFAULT_AFFINITY_TIMEOUT = 10800
"""``sessionAffinityConfig.clientIP.timeoutSeconds`` default (3 hours, Kubernetes')."""
MAX_AFFINITY_TIMEOUT = 86400

SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer", "ExternalName")

#: DNS-1123 subdomain (``spec.externalName``), as Kubernetes validates it.
_DNS1123_SUBDOMAIN = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
)


def _special(net: ipaddress.IPv4Network) -> str:
    """The special-purpose ranges (:mod:`cilia_operator.addresses`: the socket load balancer
    would answer for them for every process on the node) ``net`` overlaps, as text ("" when
    none)."""
    return ", ".join(f"{name} {r}" for name, r in special_ranges(net))


PROTOCOLS = ("TCP", "UDP")

_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_IANA_SVC_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def _meta(doc: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = doc.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def _spec(doc: Mapping[str, Any]) -> Mapping[str, Any]:
    spec = doc.get("spec")
    return spec if isinstance(spec, Mapping) else {}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _port_number(value: Any, path: str, errors: list[FieldError]) -> None:
    if not _is_int(value):
        errors.append(FieldError(path, f"{value!r} is not an integer (1-65535)"))
    elif not 1 <= value <= 65535:
        errors.append(FieldError(path, f"{value} is out of range: must be 1-65535"))


def target_port_error(value: Any) -> str:
    """Why ``value`` is not a valid ``targetPort`` ("" when it is): an integer 1-65535 or an
    IANA service name (upstream ``IsValidPortName``)."""
    if _is_int(value):
        return "" if 1 <= value <= 65535 else f"{value} is out of range: must be 1-65535"
    if isinstance(value, str):
        if value.isdigit():
            return f"{value!r}: give the number unquoted, or a port name"
        if (
            len(value) <= 15
            and _IANA_SVC_NAME.match(value)
            and "--" not in value
            and any(c.isalpha() for c in value)
        ):
            return ""
        return (
            f"{value!r} is not a port name (at most 15 lower-case letters, digits and '-', "
            "with a letter, no '--')"
        )
    return f"{value!r} is not an integer or a port name"


def _protocol(value: Any, path: str, errors: list[FieldError]) -> str:
    protocol = "TCP" if value in (None, "") else value
    if protocol == "SCTP":
        errors.append(FieldError(path, "SCTP is not supported (Cilia load-balances TCP and UDP)"))
    elif protocol not in PROTOCOLS:
        errors.append(FieldError(path, f"{protocol!r}: must be TCP or UDP"))
    return str(protocol)


def validate_service(doc: Mapping[str, Any]) -> Mapping[str, Any]:
    """Validate a ``v1 Service`` manifest (rules in the module docstring).

    Returns:
        the document (unchanged; defaults are set when it is applied).

    Raises:
        InvalidResource: every problem, with its field path.
    """
    errors: list[FieldError] = []
    name = _meta(doc).get("name")
    if not isinstance(name, str) or not name:
        errors.append(FieldError("metadata.name", "required"))
    elif len(name) > 63 or not _DNS1035.match(name):
        errors.append(FieldError("metadata.name", f"{name!r} is not a DNS-1035 label (a "
                                 "lower-case letter first, then letters, digits and '-', at "
                                 "most 63 characters)"))  # fmt: skip
    raw_spec = doc.get("spec")
    if not isinstance(raw_spec, Mapping):
        raise InvalidResource([*errors, FieldError("spec", "required (a mapping)")])
    spec = raw_spec
    kind = spec.get("type") or "ClusterIP"
    if kind not in SERVICE_TYPES:
        errors.append(
            FieldError("spec.type", f"{kind!r}: must be one of {', '.join(SERVICE_TYPES)}")
        )
    external = spec.get("externalName")
    if kind == "ExternalName" and not external:
        errors.append(FieldError("spec.externalName", "required for type ExternalName"))
    elif kind == "ExternalName" and (
        not isinstance(external, str) or len(external) > 253
        or not _DNS1123_SUBDOMAIN.match(external.rstrip("."))
    ):  # fmt: skip
        errors.append(FieldError("spec.externalName", f"{external!r} is not a DNS-1123 "
                                 "subdomain (lower-case labels of letters, digits and '-', "
                                 "separated by '.')"))  # fmt: skip
    cluster_ip = spec.get("clusterIP") or ""
    headless = cluster_ip == "None"
    if kind == "ExternalName" and cluster_ip and not headless:
        errors.append(FieldError("spec.clusterIP", "must not be set for type ExternalName (it "
                                 "gets no address; clients resolve spec.externalName)"))  # fmt: skip
    elif cluster_ip and not headless:
        try:
            address = ipaddress.IPv4Address(str(cluster_ip))
        except ValueError:
            errors.append(FieldError("spec.clusterIP", f"{cluster_ip!r} is not an IPv4 address "
                                     "(or 'None' for a headless Service)"))  # fmt: skip
        else:
            special = _special(ipaddress.IPv4Network(address))
            if special:
                errors.append(FieldError("spec.clusterIP", f"{address} is in a special-purpose "
                                         f"range ({special})"))  # fmt: skip
    cluster_ips = spec.get("clusterIPs")
    if cluster_ips is not None:
        if not isinstance(cluster_ips, list) or len(cluster_ips) > 1:
            errors.append(FieldError("spec.clusterIPs", "at most one address (IPv4 only)"))
        elif cluster_ips and cluster_ip and cluster_ips[0] != cluster_ip:
            errors.append(FieldError("spec.clusterIPs[0]", f"{cluster_ips[0]!r} must equal "
                                     f"spec.clusterIP {cluster_ip!r}"))  # fmt: skip
    if headless and kind in ("NodePort", "LoadBalancer"):
        errors.append(FieldError("spec.clusterIP", f"'None' is not allowed for type {kind}"))
    selector = spec.get("selector")
    if selector is not None and (
        not isinstance(selector, Mapping)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in selector.items())
    ):
        errors.append(FieldError("spec.selector", "must map label names to string values"))
    affinity = spec.get("sessionAffinity") or "None"
    if affinity not in ("None", "ClientIP"):
        errors.append(FieldError("spec.sessionAffinity", f"{affinity!r}: must be None or ClientIP"))
    timeout = ((spec.get("sessionAffinityConfig") or {}).get("clientIP") or {}).get(
        "timeoutSeconds"
    )
    if timeout is not None:
        path = "spec.sessionAffinityConfig.clientIP.timeoutSeconds"
        if affinity != "ClientIP":
            errors.append(FieldError(path, "only with sessionAffinity ClientIP"))
        elif not _is_int(timeout) or not 1 <= timeout <= MAX_AFFINITY_TIMEOUT:
            errors.append(FieldError(path, f"{timeout!r}: must be 1-{MAX_AFFINITY_TIMEOUT}"))
    for field in ("externalTrafficPolicy", "internalTrafficPolicy"):
        policy = spec.get(field)
        if policy is None or policy == "":
            continue
        if policy not in ("Cluster", "Local"):
            errors.append(FieldError(f"spec.{field}", f"{policy!r}: must be Cluster or Local"))
        elif field == "externalTrafficPolicy" and kind not in ("NodePort", "LoadBalancer"):
            errors.append(FieldError(f"spec.{field}", f"only for type NodePort or LoadBalancer, "
                                     f"not {kind}"))  # fmt: skip
    errors += _port_errors(spec, kind, headless)
    if errors:
        raise InvalidResource(errors)
    return doc


def _port_errors(spec: Mapping[str, Any], kind: Any, headless: bool) -> list[FieldError]:
    errors: list[FieldError] = []
    ports = spec.get("ports")
    if ports is None:
        ports = []
    if not isinstance(ports, list):
        return [FieldError("spec.ports", "must be a list")]
    if not ports and not headless and kind != "ExternalName":
        errors.append(FieldError("spec.ports", "required: at least one port"))
    names: dict[str, int] = {}
    seen: dict[tuple[Any, str], int] = {}
    for i, port in enumerate(ports):
        path = f"spec.ports[{i}]"
        if not isinstance(port, Mapping):
            errors.append(FieldError(path, "must be a mapping"))
            continue
        _port_number(port.get("port"), f"{path}.port", errors)
        protocol = _protocol(port.get("protocol"), f"{path}.protocol", errors)
        name = port.get("name") or ""
        if not name and len(ports) > 1:
            errors.append(FieldError(f"{path}.name", "required when the Service has several ports"))
        elif name and (not isinstance(name, str) or len(name) > 63
                       or not _DNS1123_LABEL.match(name)):  # fmt: skip
            errors.append(FieldError(f"{path}.name", f"{name!r} is not a DNS-1123 label"))
        elif name in names:
            errors.append(
                FieldError(f"{path}.name", f"duplicate: same as spec.ports[{names[name]}]")
            )
        if name:
            names[str(name)] = i
        key = (port.get("port"), protocol)
        if key in seen:
            errors.append(FieldError(path, f"duplicate port {key[0]}/{protocol}: same as "
                                     f"spec.ports[{seen[key]}]"))  # fmt: skip
        seen.setdefault(key, i)
        target = port.get("targetPort")
        if target is not None and target != 0:
            why = target_port_error(target)
            if why:
                errors.append(FieldError(f"{path}.targetPort", why))
        node_port = port.get("nodePort")
        if node_port not in (None, 0):
            if kind not in ("NodePort", "LoadBalancer"):
                errors.append(FieldError(f"{path}.nodePort", f"only for type NodePort or "
                                         f"LoadBalancer, not {kind}"))  # fmt: skip
            else:
                _port_number(node_port, f"{path}.nodePort", errors)
    return errors


def validate_service_cidr(doc: Mapping[str, Any]) -> Mapping[str, Any]:
    """Validate a ``networking.k8s.io/v1 ServiceCIDR`` manifest: ``spec.cidrs`` one IPv4
    network (upstream allows one per family; Cilia is IPv4 only), prefix at most /30 wide
    enough to hold a Service and no host bits set.

    Raises:
        InvalidResource: with field paths.
    """
    errors: list[FieldError] = []
    if not _meta(doc).get("name"):
        errors.append(FieldError("metadata.name", "required"))
    cidrs = _spec(doc).get("cidrs")
    if not isinstance(cidrs, list) or not cidrs:
        errors.append(FieldError("spec.cidrs", "required: one IPv4 CIDR"))
        cidrs = []
    elif len(cidrs) > 1:
        errors.append(FieldError("spec.cidrs", "one IPv4 CIDR (Cilia serves IPv4 only)"))
    for i, cidr in enumerate(cidrs):
        try:
            net = ipaddress.IPv4Network(str(cidr), strict=True)
        except ValueError as exc:
            errors.append(FieldError(f"spec.cidrs[{i}]", f"{cidr!r} is not an IPv4 CIDR: {exc}"))
            continue
        if net.prefixlen > 30:
            errors.append(FieldError(f"spec.cidrs[{i}]", f"{net}: too small (at most /30, so "
                                     "it holds an address besides network and broadcast)"))  # fmt: skip
        special = _special(net)
        if special:
            errors.append(FieldError(f"spec.cidrs[{i}]", f"{net} overlaps a special-purpose "
                                     f"range ({special})"))  # fmt: skip
    if errors:
        raise InvalidResource(errors)
    return doc


def validate_endpoint_slice(doc: Mapping[str, Any]) -> Mapping[str, Any]:
    """Validate a ``discovery.k8s.io/v1 EndpointSlice`` manifest (for selector-less
    Services): ``addressType`` IPv4, endpoints with 1-100 IPv4 addresses and boolean
    conditions, ports 1-65535 TCP/UDP, unique port names; the
    ``kubernetes.io/service-name`` label ties it to its Service.

    Raises:
        InvalidResource: with field paths.
    """
    errors: list[FieldError] = []
    if not _meta(doc).get("name"):
        errors.append(FieldError("metadata.name", "required"))
    address_type = doc.get("addressType")
    if address_type != "IPv4":
        errors.append(FieldError("addressType", f"{address_type!r}: must be IPv4 (Cilia serves "
                                 "IPv4 only)"))  # fmt: skip
    endpoints = doc.get("endpoints") or []
    if not isinstance(endpoints, list):
        errors.append(FieldError("endpoints", "must be a list"))
        endpoints = []
    if len(endpoints) > 1000:
        errors.append(FieldError("endpoints", "at most 1000 endpoints"))
    for i, ep in enumerate(endpoints):
        path = f"endpoints[{i}]"
        if not isinstance(ep, Mapping):
            errors.append(FieldError(path, "must be a mapping"))
            continue
        addresses = ep.get("addresses")
        if not isinstance(addresses, list) or not 1 <= len(addresses) <= 100:
            errors.append(FieldError(f"{path}.addresses", "1 to 100 addresses"))
            addresses = []
        for j, address in enumerate(addresses):
            try:
                ipaddress.IPv4Address(str(address))
            except ValueError:
                errors.append(FieldError(f"{path}.addresses[{j}]",
                                         f"{address!r} is not an IPv4 address"))  # fmt: skip
        conditions = ep.get("conditions") or {}
        if not isinstance(conditions, Mapping):
            errors.append(FieldError(f"{path}.conditions", "must be a mapping"))
            continue
        for key, value in conditions.items():
            if key not in ("ready", "serving", "terminating"):
                errors.append(FieldError(f"{path}.conditions.{key}", "unknown field"))
            elif value is not None and not isinstance(value, bool):
                errors.append(FieldError(f"{path}.conditions.{key}", "must be true or false"))
    ports = doc.get("ports") or []
    if not isinstance(ports, list):
        errors.append(FieldError("ports", "must be a list"))
        ports = []
    names: set[str] = set()
    for i, port in enumerate(ports):
        path = f"ports[{i}]"
        if not isinstance(port, Mapping):
            errors.append(FieldError(path, "must be a mapping"))
            continue
        _port_number(port.get("port"), f"{path}.port", errors)
        _protocol(port.get("protocol"), f"{path}.protocol", errors)
        name = str(port.get("name") or "")
        if name in names:
            errors.append(FieldError(f"{path}.name", f"duplicate {name!r}"))
        names.add(name)
    if errors:
        raise InvalidResource(errors)
    return doc


# ---------------------------------------------------------------------------- record helpers


def key_of(obj: Mapping[str, Any]) -> tuple[str, str]:
    """``(namespace, name)`` of a namespaced record (namespace defaulted to ``default``)."""
    meta = _meta(obj)
    return str(meta.get("namespace") or "default"), str(meta.get("name") or "")


def labels_of(obj: Mapping[str, Any]) -> dict[str, str]:
    """``metadata.labels`` as strings."""
    labels = _meta(obj).get("labels")
    if not isinstance(labels, Mapping):
        return {}
    return {str(k): str(v) for k, v in labels.items()}


def slice_service(obj: Mapping[str, Any]) -> tuple[str, str] | None:
    """``(namespace, service name)`` an EndpointSlice belongs to (its
    ``kubernetes.io/service-name`` label), None without one."""
    name = labels_of(obj).get(SERVICE_NAME_LABEL)
    if not name:
        return None
    return key_of(obj)[0], name


def service_ips(obj: Mapping[str, Any]) -> list[ipaddress.IPv4Address]:
    """The IPv4 ClusterIPs of a Service record (``spec.clusterIPs``, else ``clusterIP``;
    empty for headless/ExternalName or when not yet allocated)."""
    spec = _spec(obj)
    raw = spec.get("clusterIPs") or ([spec["clusterIP"]] if spec.get("clusterIP") else [])
    out = []
    for value in raw:
        try:
            out.append(ipaddress.IPv4Address(str(value)))
        except ValueError:
            continue
    return out


def alias_ips(obj: Mapping[str, Any]) -> dict[ipaddress.IPv4Address, str]:
    """The alias VIPs of a Service record (:data:`ALIAS_ANNOTATION`): ``{ip: since}``
    (``since``: RFC 3339 text, "" when not given). A malformed annotation reads as none."""
    raw = (_meta(obj).get("annotations") or {}).get(ALIAS_ANNOTATION)
    if not raw:
        return {}
    try:
        parsed = json.loads(str(raw))
    except ValueError:
        return {}
    if isinstance(parsed, list):  # a hand-written list of addresses is accepted too
        parsed = {str(ip): "" for ip in parsed}
    if not isinstance(parsed, Mapping):
        return {}
    out = {}
    for ip, since in parsed.items():
        try:
            out[ipaddress.IPv4Address(str(ip))] = str(since or "")
        except ValueError:
            continue
    return out


def with_aliases(obj: Mapping[str, Any], aliases: Mapping[ipaddress.IPv4Address, str]) -> Resource:
    """A copy of Service ``obj`` whose :data:`ALIAS_ANNOTATION` is ``aliases`` (removed when
    empty)."""
    out = copy.deepcopy(dict(obj))
    annotations = out.setdefault("metadata", {}).setdefault("annotations", {})
    if aliases:
        annotations[ALIAS_ANNOTATION] = json.dumps(
            {str(ip): aliases[ip] for ip in sorted(aliases)}, sort_keys=True
        )
    else:
        annotations.pop(ALIAS_ANNOTATION, None)
        if not annotations:
            del out["metadata"]["annotations"]
    return out


def migrated_from(cidrs: Iterable[Mapping[str, Any]]) -> set[ipaddress.IPv4Network]:
    """The ranges stored ServiceCIDRs say they replace (:data:`MIGRATED_FROM_ANNOTATION`)."""
    out = set()
    for obj in cidrs:
        raw = str((_meta(obj).get("annotations") or {}).get(MIGRATED_FROM_ANNOTATION) or "")
        for part in raw.split(","):
            try:
                out.add(ipaddress.IPv4Network(part.strip()))
            except ValueError:
                continue
    return out


def rfc3339(when: datetime.datetime) -> str:
    """``when`` (aware) as RFC 3339 UTC text in milliseconds, e.g.
    ``2026-12-02T01:00:00.250Z``."""
    return when.astimezone(datetime.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_time(text: str) -> datetime.datetime | None:
    """Inverse of :func:`rfc3339` (any ISO 8601 with a zone); None when not a time."""
    try:
        parsed = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=datetime.UTC)


def cidr_networks(obj: Mapping[str, Any]) -> list[ipaddress.IPv4Network]:
    """``spec.cidrs`` of a ServiceCIDR record as IPv4 networks (others skipped)."""
    out = []
    for value in _spec(obj).get("cidrs") or []:
        try:
            out.append(ipaddress.IPv4Network(str(value)))
        except ValueError:
            continue
    return out


def cidr_terminating(obj: Mapping[str, Any]) -> bool:
    """Whether a ServiceCIDR is being deleted (``metadata.deletionTimestamp`` set)."""
    return bool(_meta(obj).get("deletionTimestamp"))


def default_cidr(cidrs: list[ipaddress.IPv4Network]) -> Resource:
    """The default ServiceCIDR ``kubernetes`` for ``--service-cluster-ip-range`` (as
    kube-apiserver creates it at start)."""
    return {
        "apiVersion": CIDR_API_VERSION,
        "kind": CIDR_KIND,
        "metadata": {"name": DEFAULT_CIDR_NAME},
        "spec": {"cidrs": [str(c) for c in cidrs]},
    }


def terminating(obj: Resource) -> Resource:
    """A copy of ServiceCIDR ``obj`` marked as being deleted, as the API server marks an
    object with a finalizer: ``metadata.deletionTimestamp`` (RFC 3339, UTC), the finalizer
    :data:`CIDR_FINALIZER`, and ``status.conditions`` Ready=False reason Terminating."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    out = copy.deepcopy(dict(obj))
    meta = out.setdefault("metadata", {})
    meta["deletionTimestamp"] = now
    meta["finalizers"] = sorted({*(meta.get("finalizers") or []), CIDR_FINALIZER})
    out["status"] = {
        "conditions": [
            {
                "type": "Ready",
                "status": "False",
                "reason": "Terminating",
                "message": "being deleted: kept while Services hold addresses in it",
                "lastTransitionTime": now,
            }
        ]
    }
    return out
