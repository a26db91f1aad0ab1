"""CiliumEndpoint (``cilium.io/v2``, namespaced, short names ``cep``/``ciliumep``).

Source: upstream ``pkg/k8s/apis/cilium.io/v2`` EndpointStatus (reference:
cilium-upstream.md §8). Fields written by ``EndpointService.UpsertEndpoint``::

    metadata.{name, namespace}                 the pod
    status.id                                  endpoint id (agent-local)
    status.identity.{id, labels[]}             numeric identity and its sorted labels
    status.networking.addressing[{ipv4}]       the pod address
    status.networking.node                     the node's InternalIP (upstream meaning)
    status.networking.node-name                the node's name (Cilia extension: the
                                               record's owner; ipcache joins on it)
    status.external-identifiers.{container-id, k8s-namespace, k8s-pod-name, pod-name}
    status.state                               "ready"
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any

from ..store import Resource

API_VERSION = "cilium.io/v2"
KIND = "CiliumEndpoint"
DEFAULT_NAMESPACE = "default"

_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
)


class InvalidEndpoint(ValueError):
    """An endpoint record is malformed; the message names the field."""


def check_namespace(value: str, field: str = "namespace") -> str:
    """Validate a namespace (DNS-1123 label, at most 63 characters).

    Raises:
        InvalidEndpoint: it is not one.
    """
    if len(value) > 63 or not _DNS1123_LABEL.match(value):
        raise InvalidEndpoint(f"{field}: {value!r} is not a valid namespace (lower-case "
                              "letters, digits and '-', at most 63 characters)")  # fmt: skip
    return value


def check_name(value: str, field: str = "name") -> str:
    """Validate an object name (DNS-1123 subdomain, at most 253 characters).

    Raises:
        InvalidEndpoint: it is not one.
    """
    if len(value) > 253 or not _DNS1123_SUBDOMAIN.match(value):
        raise InvalidEndpoint(f"{field}: {value!r} is not a valid name (lower-case letters, "
                              "digits, '-' and '.', at most 253 characters)")  # fmt: skip
    return value


@dataclass(frozen=True)
class Endpoint:
    """What ipcache needs of one endpoint record."""

    namespace: str
    name: str
    node_name: str
    ipv4: str
    identity: int

    @property
    def owner(self) -> str:
        """``namespace/name``."""
        return f"{self.namespace}/{self.name}"


def endpoint_record(
    *,
    namespace: str,
    name: str,
    node_name: str,
    node_ip: str,
    ipv4: str,
    identity: int,
    labels: list[str],
    endpoint_id: int,
    container_id: str,
) -> Resource:
    """Validate the fields and build the CiliumEndpoint record.

    Args:
        namespace: "" means ``default``; node_ip: the node's InternalIP ("" when unknown).

    Raises:
        InvalidEndpoint: bad namespace/name/node name, IPv4 address, or identity 0.
    """
    namespace = check_namespace(namespace or DEFAULT_NAMESPACE)
    check_name(name)
    check_name(node_name, "node_name")
    try:
        address = str(ipaddress.IPv4Address(ipv4))
    except ValueError:
        raise InvalidEndpoint(f"ipv4: {ipv4!r} is not an IPv4 address") from None
    if identity <= 0:
        raise InvalidEndpoint("identity: must be > 0 (allocate one first)")
    networking: dict[str, Any] = {"addressing": [{"ipv4": address}], "node-name": node_name}
    if node_ip:
        networking["node"] = node_ip
    external: dict[str, str] = {
        "k8s-namespace": namespace,
        "k8s-pod-name": name,
        "pod-name": f"{namespace}/{name}",
    }
    if container_id:
        external["container-id"] = container_id
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name, "namespace": namespace},
        "status": {
            "id": endpoint_id,
            "identity": {"id": identity, "labels": sorted(labels)},
            "networking": networking,
            "external-identifiers": external,
            "state": "ready",
        },
    }


def owner_of(record: Resource) -> str:
    """``namespace/name`` of a record (namespace defaulted): its key in the ipcache."""
    meta = record.get("metadata") or {}
    return f"{meta.get('namespace') or DEFAULT_NAMESPACE}/{meta.get('name')}"


def node_name_of(record: Resource) -> str:
    """``status.networking.node-name`` ("" when absent)."""
    networking = (record.get("status") or {}).get("networking") or {}
    return str(networking.get("node-name") or "")


def container_id_of(record: Resource) -> str:
    """``status.external-identifiers.container-id`` ("" when absent)."""
    external = (record.get("status") or {}).get("external-identifiers") or {}
    return str(external.get("container-id") or "")


def parse_endpoint(record: Resource) -> Endpoint | None:
    """The ipcache view of a record; None when it has no IPv4 address or identity."""
    meta = record.get("metadata") or {}
    status = record.get("status") or {}
    networking = status.get("networking") or {}
    addressing = networking.get("addressing") or []
    ipv4 = next((str(a["ipv4"]) for a in addressing if isinstance(a, dict) and a.get("ipv4")), "")
    identity = (status.get("identity") or {}).get("id")
    if not ipv4 or not isinstance(identity, int) or identity <= 0:
        return None
    try:
        ipaddress.IPv4Address(ipv4)
    except ValueError:
        return None
    return Endpoint(
        namespace=str(meta.get("namespace") or DEFAULT_NAMESPACE),
        name=str(meta.get("name") or ""),
        node_name=node_name_of(record),
        ipv4=ipv4,
        identity=identity,
    )
