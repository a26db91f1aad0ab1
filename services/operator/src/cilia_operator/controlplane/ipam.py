"""IPAMService: node demand in, per-node allocations streamed out."""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

import grpc

from cilia.controlplane.v1 import controlplane_pb2 as pb

from ..ipam import claims
from ..ipam import node as nodes
from ..ipam.controller import CLUSTER_POOL, IPAMController
from ..ipam.pool import PoolSpec, pool_specs
from ..ipam.resolve import NoPoolMatch, resolve_pool
from ..kinds import NAMESPACE, NODE, POOL
from ..store import Conflict, Contention, NotFound, Resource, Store, resource_version
from .errors import streaming, unary
from .peers import peer_ip

log = logging.getLogger(__name__)


def allocation_message(
    record: Resource, pools: Mapping[str, PoolSpec] | None = None
) -> pb.NodeAllocation:
    """A CiliumNode record as ``NodeAllocation``: allocated pools (with the pool's
    allowFirstIP/allowLastIP), podCIDRs (cluster-pool), draining blocks, error,
    resourceVersion.

    A block is draining when it lies in a draining CIDR of its pool, outside the pool's
    CIDRs, or its pool is unknown (``pools`` None: nothing is reported draining); a
    podCIDR outside ``--cluster-pool-ipv4-cidr`` (``pools`` holds the controller's
    cluster-pool entry) is draining under pool ``cluster-pool``.
    """
    allocated = sorted(nodes.allocated(record).items())
    draining = []
    if pools is not None:
        for pool, blocks in allocated:
            spec = pools.get(pool)
            gone = [
                str(b)
                for b in blocks
                if spec is None or spec.draining_cidr(b) is not None or not spec.contains(b)
            ]
            if gone:
                draining.append(pb.PoolCIDRs(pool=pool, cidrs=gone))
        cluster = pools.get(CLUSTER_POOL)
        if cluster is not None:
            gone = [str(b) for b in nodes.pod_cidrs(record) if not cluster.contains(b)]
            if gone:
                draining.append(pb.PoolCIDRs(pool="cluster-pool", cidrs=gone))

    def entry(pool: str, blocks: list[ipaddress.IPv4Network]) -> pb.PoolCIDRs:
        spec = pools.get(pool) if pools is not None else None
        return pb.PoolCIDRs(
            pool=pool,
            cidrs=[str(b) for b in blocks],
            allow_first_ip=spec.allow_first_ip if spec else False,
            allow_last_ip=spec.allow_last_ip if spec else False,
        )

    return pb.NodeAllocation(
        node_name=record["metadata"]["name"],
        pools=[entry(pool, blocks) for pool, blocks in allocated],
        error=nodes.operator_error(record),
        resource_version=resource_version(record),
        pod_cidrs=[str(b) for b in nodes.pod_cidrs(record)],
        draining=draining,
    )


class IPAMServicer:
    """``cilia.controlplane.v1.IPAMService``.

    Args:
        store: the Store; controller: reconciles nodes and feeds allocation streams;
        conflict_retries: write attempts per request; service_cidrs: the operator's
        ``--service-cluster-ip-range``, reported by GetStatus.
    """

    def __init__(
        self,
        store: Store,
        controller: IPAMController,
        conflict_retries: int,
        default_pool: str = "default",
        service_cidrs: tuple[ipaddress.IPv4Network, ...] = (),
    ) -> None:
        self.store = store
        self.controller = controller
        self.conflict_retries = max(1, conflict_retries)
        self.default_pool = default_pool
        self.service_cidrs = service_cidrs

    async def _pools(self) -> Mapping[str, PoolSpec]:
        """Pool specs (with draining CIDRs): the running controller's view (kept current by
        its pool watch), else as the store holds them now."""
        if self.controller.running:
            return self.controller.allocator.pools
        return pool_specs((await self.store.list(POOL.kind)).items)

    @unary
    async def UpdateDemand(  # noqa: N802 (gRPC method name)
        self, request: pb.UpdateDemandRequest, context: Any
    ) -> pb.UpdateDemandResponse:
        """Write ``spec.ipam.pools.requested`` and drop released CIDRs from ``allocated``
        (their block claims are deleted first, then the record written, so no reconcile in
        between can take them for blocks still being written and put them back); returns the resourceVersion of that write (of
        the unchanged record when nothing changed).

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
            written = resource_version(record)
            if updated == record:
                break
            # hand-backs in this order: first the claims of the released blocks the record
            # lists, then the record without them. The other order left a moment where a
            # reconcile saw them claimed but unlisted, kept them as the node's (reserved)
            # and wrote them back. A block released but not listed (a repeated release, or
            # one claimed for the node by a reconcile still writing) keeps its claim.
            listed = nodes.allocated(record)
            for pool, block in released:
                if block in listed.get(pool, []):
                    await claims.unclaim(self.store, block, name)
            try:
                written = resource_version(await self.store.update(updated))
            except Conflict:
                continue
            if released:
                log.info("node released CIDRs", extra={"node": name,
                         "cidrs": [f"{p}:{b}" for p, b in released]})  # fmt: skip
            break
        else:
            raise Contention(NODE.kind, "", name)
        self.controller.enqueue(name)
        return pb.UpdateDemandResponse(resource_version=written)

    @unary
    async def ResolvePool(  # noqa: N802 (gRPC method name)
        self, request: pb.ResolvePoolRequest, context: Any
    ) -> pb.ResolvePoolResponse:
        """The pool a pod allocates from, with upstream precedence (see
        :func:`cilia_operator.ipam.resolve.resolve_pool`). cluster-pool and kubernetes
        modes: the default pool name (every pod uses the node's podCIDRs).

        Errors: FAILED_PRECONDITION (several selectors match; the named pool does not
        exist or nothing matches while require-pool-match is "true"), UNAVAILABLE.
        """
        if self.controller.mode in ("cluster-pool", "kubernetes"):
            return pb.ResolvePoolResponse(
                pool=self.default_pool,
                reason=f"ipam mode {self.controller.mode}: the node's podCIDRs",
            )
        try:
            ns = await self.store.get(NAMESPACE.kind, request.pod_namespace)
        except NotFound:
            ns = None
        try:
            got = resolve_pool(
                namespace=request.pod_namespace,
                name=request.pod_name,
                pod_labels=dict(request.pod_labels),
                pod_annotations=dict(request.pod_annotations),
                namespace_obj=ns,
                pools=(await self.store.list(POOL.kind)).items,
                default_pool=self.default_pool,
            )
        except NoPoolMatch as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return pb.ResolvePoolResponse(pool=got.pool, reason=got.reason)

    @unary
    async def GetStatus(  # noqa: N802 (gRPC method name)
        self, request: pb.IPAMServiceGetStatusRequest, context: Any
    ) -> pb.IPAMServiceGetStatusResponse:
        """Pools (CIDRs, draining CIDRs, blocks total/allocated), every node's allocation,
        demand, podCIDRs, error and local networks, migration progress, leadership and
        the service CIDRs pools must not overlap.

        Errors: UNAVAILABLE.
        """
        pools = pool_specs((await self.store.list(POOL.kind)).items)
        records = (await self.store.list(NODE.kind)).items
        held: dict[str, int] = {}
        out_nodes = []
        for record in records:
            allocated = nodes.allocated(record)
            for pool, blocks in allocated.items():
                held[pool] = held.get(pool, 0) + len(blocks)
            out_nodes.append(
                pb.NodeIPAMStatus(
                    node_name=nodes.node_name(record),
                    allocated=[
                        pb.PoolCIDRs(pool=p, cidrs=[str(b) for b in bs])
                        for p, bs in sorted(allocated.items())
                    ],
                    requested=[
                        pb.PoolDemand(pool=p, needed_ipv4=n)
                        for p, n in sorted(nodes.requested(record).items())
                    ],
                    pod_cidrs=[str(b) for b in nodes.pod_cidrs(record)],
                    error=nodes.operator_error(record),
                    local_networks=[
                        pb.LocalNetwork(interface=i, cidr=str(c))
                        for i, c in nodes.local_networks(record)
                    ],
                )
            )
        out_pools = [
            pb.PoolStatus(
                name=name,
                cidrs=[str(c) for c in spec.cidrs],
                draining_cidrs=[str(c) for c in spec.draining],
                mask_size=spec.mask_size,
                blocks_total=spec.blocks_total(),
                blocks_allocated=held.get(name, 0),
            )
            for name, spec in sorted(pools.items())
        ]
        if self.controller.mode == "cluster-pool":
            ctl = self.controller
            spec = PoolSpec(CLUSTER_POOL, ctl.cluster_cidrs, ctl.cluster_mask_size)
            held_blocks = [b for r in records for b in nodes.pod_cidrs(r)]
            out_pools.append(
                pb.PoolStatus(
                    name="cluster-pool",
                    cidrs=[str(c) for c in spec.cidrs],
                    draining_cidrs=[str(b) for b in sorted(set(ctl.cluster_draining(held_blocks)))],
                    mask_size=spec.mask_size,
                    blocks_total=spec.blocks_total(),
                    blocks_allocated=sum(1 for b in held_blocks if spec.contains(b)),
                )
            )
        migration = self.controller.migration
        return pb.IPAMServiceGetStatusResponse(
            mode=self.controller.mode,
            pools=out_pools,
            nodes=out_nodes,
            migration=migration.state,
            nodes_migrated=migration.nodes_migrated,
            nodes_total=migration.nodes_total,
            leader=self.controller.running,
            service_cidrs=[str(c) for c in self.service_cidrs],
        )

    @streaming
    async def WatchAllocations(  # noqa: N802 (gRPC method name)
        self, request: pb.WatchAllocationsRequest, context: Any
    ) -> AsyncIterator[pb.WatchAllocationsResponse]:
        """Stream the node's allocation now and after every change of its record.

        Errors: NOT_FOUND (node not registered, or deleted while watching), UNAVAILABLE.
        """
        name = request.node_name
        sub = self.controller.subscribe(name, peer_ip(context))
        try:
            current = await self.store.get(NODE.kind, name)
            sent: pb.NodeAllocation | None = None
            while True:
                latest, generation = sub.latest, sub.pools_generation
                if sub.deleted:
                    await context.abort(grpc.StatusCode.NOT_FOUND, f"node {name!r} was deleted")
                if latest is not None and int(resource_version(latest)) > int(
                    resource_version(current)
                ):
                    current = latest
                message = allocation_message(current, await self._pools())
                if message != sent:
                    sent = message
                    yield pb.WatchAllocationsResponse(allocation=message)
                sub.changed.clear()
                if sub.latest is latest and sub.pools_generation == generation and not sub.deleted:
                    await sub.changed.wait()
        finally:
            self.controller.unsubscribe(sub)
