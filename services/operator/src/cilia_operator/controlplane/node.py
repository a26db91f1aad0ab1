"""NodeService: agents register their node (CiliumNode record)."""

from __future__ import annotations

import copy
import datetime
import ipaddress
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from cilia.controlplane.v1 import controlplane_pb2 as pb

from ..ipam import node as nodes
from ..ipam import nodegc
from ..ipam.controller import IPAMController
from ..ipam.pool import ObjectMeta
from ..kinds import NODE
from ..service import aliases
from ..store import AlreadyExists, Conflict, Contention, Expired, NotFound, Resource, Store
from .errors import streaming, unary
from .peers import peer_ip
from .streams import WATCH_MESSAGE_MAX_BYTES, pages

log = logging.getLogger(__name__)

VERSION_ANNOTATION = "cilia.io/agent-version"
HUBBLE_ANNOTATION = "cilia.io/hubble-address"


def node_message(record: Resource) -> pb.Node:
    """A CiliumNode record as ``cilia.controlplane.v1.Node``: its InternalIP addresses in
    record order, the node's own first (Kubernetes: the Node's InternalIP; standalone: the
    address the agent registered first), which peers use as next hop and tunnel endpoint."""
    meta = record.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    return pb.Node(
        name=meta.get("name", ""),
        addresses=[
            a.get("ip", "")
            for a in (record.get("spec") or {}).get("addresses") or []
            if a.get("type") == "InternalIP"
        ],
        hubble_address=annotations.get(HUBBLE_ANNOTATION, ""),
        version=annotations.get(VERSION_ANNOTATION, ""),
        pod_cidrs=sorted(
            {str(b) for blocks in nodes.allocated(record).values() for b in blocks}
            | {str(b) for b in nodes.pod_cidrs(record)}
        ),
    )


def _invalid(request: pb.RegisterRequest) -> str:
    try:
        ObjectMeta(name=request.node_name)
    except ValueError as exc:
        return f"node_name: {exc}"
    for i, addr in enumerate(request.addresses):
        try:
            ipaddress.ip_address(addr)
        except ValueError:
            return f"addresses[{i}]: {addr!r} is not an IP address"
    for i, net in enumerate(request.local_networks):
        try:
            ipaddress.ip_network(net.cidr, strict=False)
        except ValueError:
            return f"local_networks[{i}].cidr: {net.cidr!r} is not a CIDR"
    return ""


class NodeServicer:
    """``cilia.controlplane.v1.NodeService``.

    Args:
        store: the Store; controller: told to reconcile registered nodes;
        default_pool: ``--ipam-default-ip-pool``; conflict_retries: write attempts;
        pods_from_api: Kubernetes mode (``RegisterResponse.pods_from_api``: agents take
        identity labels from the Pods of ``PodService``).
        chunk_size / max_bytes: ``--watch-list-chunk-size`` / ``--watch-max-message-bytes``
        (events and bytes of one ``WatchNodes`` message at most).
    """

    def __init__(
        self,
        store: Store,
        controller: IPAMController,
        default_pool: str,
        conflict_retries: int,
        *,
        pods_from_api: bool = False,
        record_alias_use: bool = False,
        nodes_from_api: bool = False,
        chunk_size: int = 1000,
        max_bytes: int = WATCH_MESSAGE_MAX_BYTES,
    ) -> None:
        self.chunk_size = chunk_size
        self.max_bytes = max_bytes
        # Kubernetes mode: the CiliumNode is owned by its Node and leads with its InternalIP
        self.nodes_from_api = nodes_from_api
        self.pods_from_api = pods_from_api
        # alias-use reports feed the ServiceCIDR migration (service.aliases); both modes
        self.record_alias_use = record_alias_use
        self.store = store
        self.controller = controller
        self.default_pool = default_pool
        self.conflict_retries = max(1, conflict_retries)

    @unary
    async def Register(  # noqa: N802 (gRPC method name)
        self, request: pb.RegisterRequest, context: Any
    ) -> pb.RegisterResponse:
        """Create or update the CiliumNode with the node's addresses (the agent sends its
        node address first) and local networks; in Kubernetes mode the Node's InternalIPs
        lead the addresses and the record gets the Node as ownerReference
        (:mod:`cilia_operator.ipam.nodegc`); with ``reports_alias_use`` (standalone), record
        the node's alias-VIP uses
        (:func:`cilia_operator.service.aliases.store_report`).

        Errors: INVALID_ARGUMENT (bad name/address/CIDR), ALREADY_EXISTS (an agent at
        another address holds the name: its allocation stream is open), UNAVAILABLE (store
        down), ABORTED (record changing too fast).
        """
        problem = _invalid(request)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        name = request.node_name
        peer, live = peer_ip(context), self.controller.live_peers(request.node_name)
        if peer and live and peer not in live:
            # another agent holds the name: taking over its record would re-route its pods
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS,
                f"node name {name!r} is in use by a connected agent at "
                f"{', '.join(sorted(live))}; an agent at {peer} cannot register as it "
                "(give every node its own --node-name)",
            )
        addresses = [{"type": "InternalIP", "ip": str(ipaddress.ip_address(a))}
                     for a in request.addresses]  # fmt: skip
        networks = [{"interface": n.interface,
                     "cidr": str(ipaddress.ip_network(n.cidr, strict=False))}
                    for n in request.local_networks]  # fmt: skip
        k8s_node = await self._k8s_node(name)
        for _ in range(self.conflict_retries):
            try:
                current = await self.store.get(NODE.kind, name)
            except NotFound:
                current = nodes.new_node(name)
            desired = copy.deepcopy(current)
            desired.setdefault("spec", {})["addresses"] = addresses
            desired = nodegc.adopted(desired, k8s_node)
            desired.setdefault("status", {})["localNetworks"] = networks
            for key, value in ((VERSION_ANNOTATION, request.version),
                               (HUBBLE_ANNOTATION, request.hubble_address)):  # fmt: skip
                if value:
                    desired["metadata"].setdefault("annotations", {})[key] = value
            try:
                if "resourceVersion" not in current["metadata"]:
                    await self.store.create(desired)
                    log.info(
                        "node registered", extra={"node": name, "addresses": request.addresses[:]}
                    )
                elif desired != current:
                    await self.store.update(desired)
                break
            except (Conflict, AlreadyExists):
                continue
        else:
            raise Contention(NODE.kind, "", name)
        if request.reports_alias_use and self.record_alias_use:
            await aliases.store_report(
                self.store, name,
                [(u.ip, u.used, u.idle_ms) for u in request.alias_uses],
                datetime.datetime.now(datetime.UTC), self.conflict_retries,
            )  # fmt: skip
        self.controller.enqueue(name)
        return pb.RegisterResponse(
            default_pool=self.default_pool,
            ipam_mode=self.controller.mode,
            pods_from_api=self.pods_from_api,
        )

    async def _k8s_node(self, name: str) -> Resource | None:
        """Kubernetes mode: the Node ``name`` (None when absent, or in standalone mode)."""
        if not self.nodes_from_api:
            return None
        try:
            return await self.store.get(nodegc.K8S_NODE_KIND, name)
        except NotFound:
            log.info("registering node has no Node object (yet)", extra={"node": name})
            return None

    @unary
    async def ReportAliasUse(  # noqa: N802 (gRPC method name)
        self, request: pb.ReportAliasUseRequest, context: Any
    ) -> pb.ReportAliasUseResponse:
        """Record the node's alias-VIP uses (standalone;
        :func:`cilia_operator.service.aliases.store_report`) and nothing else: the node's
        record is not touched and no IPAM reconcile is queued (a report comes every
        ``--alias-use-report-interval`` per node while aliases exist). With the Kubernetes
        store the record is a CiliaServiceAliasUse object (CRD), which ``servicecidr
        migrate --kubernetes`` reads to release aliases.

        Errors: INVALID_ARGUMENT (bad node name), UNAVAILABLE (store down), ABORTED (the
        record kept changing).
        """
        try:
            ObjectMeta(name=request.node_name)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"node_name: {exc}")
        if self.record_alias_use:
            await aliases.store_report(
                self.store, request.node_name,
                [(u.ip, u.used, u.idle_ms) for u in request.alias_uses],
                datetime.datetime.now(datetime.UTC), self.conflict_retries,
            )  # fmt: skip
        return pb.ReportAliasUseResponse()

    @streaming
    async def WatchNodes(  # noqa: N802 (gRPC method name)
        self, request: pb.WatchNodesRequest, context: Any
    ) -> AsyncIterator[pb.WatchNodesResponse]:
        """Stream every registered node (in messages within ``chunk_size`` events and
        ``max_bytes`` bytes, the last with ``synced`` true), then each change of a node's
        name/addresses/Hubble address/version/pod CIDRs, and deletions.

        A watch that falls behind the store's history relists and sends the difference
        (ending with ``synced`` true again). Errors: UNAVAILABLE.
        """
        sent: dict[str, pb.Node] = {}
        upsert, delete = pb.EVENT_TYPE_UPSERT, pb.EVENT_TYPE_DELETE
        while True:
            listed = await self.store.list(NODE.kind)
            current = {o["metadata"]["name"]: node_message(o) for o in listed.items}
            events = [
                pb.NodeEvent(type=delete, node=sent[n]) for n in sorted(set(sent) - set(current))
            ]
            events += [
                pb.NodeEvent(type=upsert, node=msg)
                for name, msg in current.items()
                if sent.get(name) != msg
            ]
            sent = current
            parts = pages(events, self.chunk_size, self.max_bytes)
            for i, part in enumerate(parts):
                yield pb.WatchNodesResponse(events=part, synced=i == len(parts) - 1)
            try:
                async for event in self.store.watch(NODE.kind, listed.resource_version):
                    msg = node_message(event.object)
                    if event.type == "DELETED":
                        sent.pop(msg.name, None)
                        yield pb.WatchNodesResponse(events=[pb.NodeEvent(type=delete, node=msg)])
                    elif sent.get(msg.name) != msg:
                        sent[msg.name] = msg
                        yield pb.WatchNodesResponse(events=[pb.NodeEvent(type=upsert, node=msg)])
            except Expired:
                log.info("node watch expired; relisting")
