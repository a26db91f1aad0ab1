"""IPAMService: node demand in, per-node allocations streamed out."""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from cilia.controlplane.v1 import controlplane_pb2 as pb

from ..ipam import node as nodes
from ..ipam.controller import IPAMController
from ..kinds import NODE
from ..store import Conflict, Contention, NotFound, Resource, Store, resource_version
from .errors import streaming, unary

log = logging.getLogger(__name__)


def allocation_message(record: Resource) -> pb.NodeAllocation:
    """A CiliumNode record as ``NodeAllocation`` (allocated pools, error, resourceVersion)."""
    return pb.NodeAllocation(
        node_name=record["metadata"]["name"],
        pools=[
            pb.PoolCIDRs(pool=pool, cidrs=[str(b) for b in blocks])
            for pool, blocks in sorted(nodes.allocated(record).items())
        ],
        error=nodes.operator_error(record),
        resource_version=resource_version(record),
    )


class IPAMServicer:
    """``cilia.controlplane.v1.IPAMService``.

    Args:
        store: the Store; controller: reconciles nodes and feeds allocation streams;
        conflict_retries: write attempts per request.
    """

    def __init__(self, store: Store, controller: IPAMController, conflict_retries: int) -> None:
        self.store = store
        self.controller = controller
        self.conflict_retries = max(1, conflict_retries)

    @unary
    async def UpdateDemand(  # noqa: N802 (gRPC method name)
        self, request: pb.UpdateDemandRequest, context: Any
    ) -> pb.UpdateDemandResponse:
        """Write ``spec.ipam.pools.requested`` and drop released CIDRs from ``allocated``.

        Errors: NOT_FOUND (node not registered), INVALID_ARGUMENT (bad pool/CIDR),
        UNAVAILABLE, ABORTED.
        """
        demands: dict[str, int] = {}
        for i, demand in enumerate(request.demands):
            if not demand.pool:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"demands[{i}].pool: empty")
            demands[demand.pool] = demand.needed_ipv4
        released: list[tuple[str, ipaddress.IPv4Network]] = []
        for i, entry in enumerate(request.released):
            for j, cidr in enumerate(entry.cidrs):
                try:
                    released.append((entry.pool, ipaddress.IPv4Network(cidr)))
                except ValueError as exc:
                    await context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT, f"released[{i}].cidrs[{j}]: {exc}"
                    )
        name = request.node_name
        for _ in range(self.conflict_retries):
            try:
                record = await self.store.get(NODE.kind, name)
            except NotFound:
                await context.abort(
                    grpc.StatusCode.NOT_FOUND, f"node {name!r} is not registered: call Register"
                )
            updated = nodes.with_demand(record, demands, released)
            if updated == record:
                break
            try:
                await self.store.update(updated)
            except Conflict:
                continue
            if released:
                log.info("node released CIDRs", extra={"node": name,
                         "cidrs": [f"{p}:{b}" for p, b in released]})  # fmt: skip
            break
        else:
            raise Contention(NODE.kind, "", name)
        self.controller.enqueue(name)
        return pb.UpdateDemandResponse()

    @streaming
    async def WatchAllocations(  # noqa: N802 (gRPC method name)
        self, request: pb.WatchAllocationsRequest, context: Any
    ) -> AsyncIterator[pb.WatchAllocationsResponse]:
        """Stream the node's allocation now and after every change of its record.

        Errors: NOT_FOUND (node not registered, or deleted while watching), UNAVAILABLE.
        """
        name = request.node_name
        sub = self.controller.subscribe(name)
        try:
            current = await self.store.get(NODE.kind, name)
            sent = ""
            while True:
                latest = sub.latest
                if sub.deleted:
                    await context.abort(grpc.StatusCode.NOT_FOUND, f"node {name!r} was deleted")
                if latest is not None and int(resource_version(latest)) > int(
                    resource_version(current)
                ):
                    current = latest
                if resource_version(current) != sent:
                    sent = resource_version(current)
                    yield pb.WatchAllocationsResponse(allocation=allocation_message(current))
                sub.changed.clear()
                if sub.latest is latest and not sub.deleted:
                    await sub.changed.wait()
        finally:
            self.controller.unsubscribe(sub)
