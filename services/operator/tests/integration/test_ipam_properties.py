"""Stateful property test of operator IPAM against a real redis-server.

Random interleavings of node join/leave, pod churn (demand up/down, blocks handed back),
pool add/extend/shrink/delete (through the real Apply/Delete servicer code), operator
restarts (a new controller over the same store) and a second replica whose view of the
store is stale (two controllers allocating on one store; only the block claims keep them
apart). After every step, from the store:

- blocks held by nodes are pairwise disjoint;
- every block lies inside a live CIDR or a draining CIDR of its pool;
- no in-use block is lost: a block a node held stays recorded until the node hands it
  back or is deleted, and every recorded block is claimed by its node.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
from collections.abc import Coroutine
from typing import Any, TypeVar

import grpc
import redis.asyncio
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)
from stores import empty_operator_kinds, kube_cilia

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia_operator.controlplane.ipam import IPAMServicer
from cilia_operator.controlplane.resources import ResourceServicer
from cilia_operator.ipam import claims
from cilia_operator.ipam import node as nodes
from cilia_operator.ipam.controller import IPAMController
from cilia_operator.ipam.pool import pool_specs
from cilia_operator.metrics import Metrics
from cilia_operator.store import Store
from cilia_operator.store.kubernetes import KubernetesStore
from cilia_operator.store.redis import RedisStore
from cilia_testkit.kubeapi import KubeAPI

__all__ = ["kube_cilia"]  # the fixture, imported from stores

T = TypeVar("T")
Net = ipaddress.IPv4Network

# A small universe so pools collide, exhaust and drain often: 8 candidate pool CIDRs
# (/26), carved into /28 blocks (4 per CIDR, 14 usable addresses each).
UNIVERSE = [Net(f"10.250.{i // 4}.{(i % 4) * 64}/26") for i in range(8)]
MASK = 28
POOLS = ["p0", "p1", "p2"]
CLUSTER_CIDRS = (Net("10.249.0.0/27"),)  # cluster-pool mode: 2 blocks of /28 only
NODES = [f"n{i}" for i in range(4)]


class Refused(Exception):
    """The servicer aborted the call (what a gRPC client would see)."""

    def __init__(self, code: Any, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code


class Context:
    """The servicer context the real servicers get; ``abort`` ends the call."""

    async def abort(self, code: Any, details: str) -> None:
        raise Refused(code, details)

    async def abort_with_status(self, status: Any) -> None:
        """As grpc.aio's: a ``grpc.Status`` (code, details, the ErrorInfo trailer)."""
        raise Refused(status.code, status.details)

    def time_remaining(self) -> float | None:
        """As grpc.aio's: seconds before the call's deadline; None, no deadline."""
        return None


def pool_doc(name: str, cidrs: list[Net]) -> str:
    listed = ", ".join(str(c) for c in cidrs)
    return (
        f"apiVersion: cilium.io/v2alpha1\nkind: CiliumPodIPPool\nmetadata: {{name: {name}}}\n"
        f"spec: {{ipv4: {{cidrs: [{listed}], maskSize: {MASK}}}}}\n"
    )


class IPAMMachine(RuleBasedStateMachine):
    """Two controller replicas on one Redis store, driven step by step."""

    def __init__(self, url: str | KubeAPI) -> None:
        """``url``: a Redis URL, or a real kube-apiserver serving Cilia's CRDs (the
        ``kube_cilia`` fixture) behind the Kubernetes store, emptied of the operator's kinds
        first."""
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.store: Store
        if isinstance(url, KubeAPI):
            self.url = url.server
            empty_operator_kinds(url)
            self.store = KubernetesStore(kubeconfig=str(url.kubeconfig), watch_timeout=1)
        else:
            self.url = url
            self.store = RedisStore(url, prefix="prop/")
            self.run(self._flush())
        self.replicas: list[IPAMController] = [self._start(), self._start()]
        self.ctx = Context()
        self.resources = ResourceServicer(self.store, None, [Net("10.96.0.0/12")])
        self.held: dict[str, set[Net]] = {}  # node -> blocks seen recorded

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    async def _flush(self) -> None:
        client = redis.asyncio.Redis.from_url(self.url)  # start from an empty store
        try:
            keys = [k async for k in client.scan_iter(match="prop/*")]
            if keys:
                await client.delete(*keys)
        finally:
            await client.aclose()

    mode = "multi-pool"

    def _start(self) -> IPAMController:
        controller = IPAMController(
            self.store, Metrics(), conflict_retries=3, mode=self.mode,
            cluster_cidrs=CLUSTER_CIDRS, cluster_mask_size=MASK,
        )  # fmt: skip
        self.run(controller.start(run=False))
        return controller

    def teardown(self) -> None:
        self.run(self.store.close())
        self.loop.close()

    def ipam(self, replica: int) -> IPAMServicer:
        return IPAMServicer(self.store, self.replicas[replica], 3)

    async def _records(self) -> dict[str, dict[str, Any]]:
        return {o["metadata"]["name"]: o for o in (await self.store.list("CiliumNode")).items}

    # -- nodes -----------------------------------------------------------------------

    @rule(name=st.sampled_from(NODES))
    def node_joins(self, name: str) -> None:
        async def go() -> None:
            if name not in await self._records():
                await self.store.create(nodes.new_node(name))

        self.run(go())

    @rule(name=st.sampled_from(NODES), replica=st.integers(0, 1))
    def node_leaves(self, name: str, replica: int) -> None:
        async def go() -> None:
            if name in await self._records():
                await self.store.delete("CiliumNode", name)
                await self.replicas[replica].reconcile(name)  # releases blocks + claims

        self.run(go())
        self.held.pop(name, None)

    @rule(
        name=st.sampled_from(NODES),
        pool=st.sampled_from(["p0", "p0", *POOLS]),
        needed=st.integers(0, 40),
        release=st.booleans(),
        replica=st.integers(0, 1),
        served=st.booleans(),
    )
    def pod_churn(
        self, name: str, pool: str, needed: int, release: bool, replica: int, served: bool
    ) -> None:
        """Demand up or down; optionally hand back one block (pods gone from it). With
        ``served`` the replica that took the call reconciles the node right away (its
        view of the other nodes may be stale)."""

        async def go() -> None:
            records = await self._records()
            if name not in records:
                return
            mine = nodes.allocated(records[name])
            released = []
            if release and mine:
                p, blocks = sorted(mine.items())[0]
                released = [pb.PoolCIDRs(pool=p, cidrs=[str(blocks[-1])])]
                self.held[name].discard(blocks[-1])
            request = pb.UpdateDemandRequest(
                node_name=name,
                demands=[pb.PoolDemand(pool=pool, needed_ipv4=needed)],
                released=released,
            )
            await self.ipam(replica).UpdateDemand(request, self.ctx)
            if served:
                await self.replicas[replica].reconcile(name)

        self.run(go())

    @initialize()
    def first_pool(self) -> None:
        """Pool p0 exists and both replicas know it (pool events arrive quickly)."""
        self._apply(pool_doc("p0", UNIVERSE[:2]))
        for controller in self.replicas:
            self.run(controller._relist_pools())
        for name in NODES[:3]:
            self.node_joins(name)

    @rule(name=st.sampled_from(NODES), replica=st.integers(0, 1), pools_seen=st.booleans())
    def reconcile(self, name: str, replica: int, pools_seen: bool) -> None:
        """One replica reconciles a node; its view of the other nodes may be stale, and
        with ``pools_seen`` it has received the pool events first."""
        controller = self.replicas[replica]
        if pools_seen:
            self.run(controller._relist_pools())
        self.run(controller.reconcile(name))

    # -- pools -----------------------------------------------------------------------

    def _apply(self, manifest: str) -> None:
        async def go() -> None:
            before = await self.store.list("CiliumPodIPPool")
            try:
                await self.resources.Apply(pb.ApplyRequest(manifest=manifest), self.ctx)
            except Refused as exc:
                assert exc.code == grpc.StatusCode.INVALID_ARGUMENT, exc
                after = await self.store.list("CiliumPodIPPool")
                assert after.items == before.items, "a refused apply changed pools"

        self.run(go())

    def _pools(self) -> dict[str, list[Net]]:
        stored = pool_specs(self.run(self.store.list("CiliumPodIPPool")).items)
        return {name: list(spec.cidrs) for name, spec in stored.items()}

    @rule(pool=st.sampled_from(POOLS), cidrs=st.sets(st.sampled_from(UNIVERSE), min_size=1))
    def pool_set(self, pool: str, cidrs: set[Net]) -> None:
        """Create a pool, or replace its CIDRs (extend and shrink at once)."""
        self._apply(pool_doc(pool, sorted(cidrs)))

    @rule(pool=st.sampled_from(POOLS), cidr=st.sampled_from(UNIVERSE))
    def pool_extend(self, pool: str, cidr: Net) -> None:
        current = self._pools().get(pool)
        if current is not None and cidr not in current:
            self._apply(pool_doc(pool, [*current, cidr]))

    @rule(pool=st.sampled_from(POOLS), index=st.integers(0, 7))
    def pool_shrink(self, pool: str, index: int) -> None:
        current = self._pools().get(pool)
        if current and len(current) > 1:
            self._apply(
                pool_doc(pool, [c for i, c in enumerate(current) if i != index % len(current)])
            )

    @rule(pool=st.sampled_from(POOLS))
    def pool_delete(self, pool: str) -> None:
        async def go() -> None:
            try:
                await self.resources.Delete(
                    pb.DeleteRequest(kind="CiliumPodIPPool", name=pool), self.ctx
                )
            except Refused as exc:
                assert exc.code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND)

        self.run(go())

    @rule(pool=st.sampled_from(POOLS), replica=st.integers(0, 1))
    def sync_draining(self, pool: str, replica: int) -> None:
        self.run(self.replicas[replica].sync_draining(pool))

    # -- replicas --------------------------------------------------------------------

    @rule(replica=st.integers(0, 1))
    def replica_catches_up(self, replica: int) -> None:
        """What the replica's watches would deliver: relist pools, nodes and claims."""
        controller = self.replicas[replica]

        async def go() -> None:
            await controller._relist_pools()
            await controller._relist_nodes()
            await controller._relist_claims()

        self.run(go())

    @rule(replica=st.integers(0, 1))
    def operator_restarts(self, replica: int) -> None:
        self.replicas[replica] = self._start()

    # -- invariants ------------------------------------------------------------------

    @invariant()
    def blocks_disjoint_inside_pools_and_never_lost(self) -> None:
        records = self.run(self._records())
        pools = pool_specs(self.run(self.store.list("CiliumPodIPPool")).items)
        stored_claims = {c.block: c for c in self.run(claims.list_claims(self.store))}
        everything: list[tuple[Net, str]] = []
        for name, record in records.items():
            recorded = nodes.allocated(record)
            mine = {b for blocks in recorded.values() for b in blocks}
            lost = self.held.get(name, set()) - mine
            assert not lost, f"node {name} lost in-use blocks {sorted(lost)}"
            self.held[name] = mine
            for pool, blocks in recorded.items():
                spec = pools.get(pool)
                for block in blocks:
                    everything.append((block, name))
                    assert spec is not None, f"{name} holds {block} of missing pool {pool}"
                    assert spec.contains(block) or spec.draining_cidr(block) is not None, (
                        f"{name}'s {block} is outside pool {pool} {spec.cidrs} "
                        f"and its draining CIDRs {spec.draining}"
                    )
                    claim = stored_claims.get(block)
                    assert claim is not None and claim.node == name, (
                        f"{name}'s {block} is claimed by {claim}"
                    )
        everything.sort()
        for (a, na), (b, nb) in itertools.pairwise(everything):
            assert not a.overlaps(b), f"{a} ({na}) overlaps {b} ({nb})"

    @rule()
    def settle(self) -> None:
        """Both replicas catch up, replica 0 reconciles every node and every pool: each
        node's demand on an existing pool is then met or its error names the pool, and
        no draining CIDR without a block in use is left."""

        async def go() -> None:
            for controller in self.replicas:
                await controller._relist_pools()
                await controller._relist_nodes()
                await controller._relist_claims()
            leader = self.replicas[0]
            for name in sorted(await self._records()):
                await leader.reconcile(name)
            for pool in POOLS:
                await leader.sync_draining(pool)
            pools = pool_specs((await self.store.list("CiliumPodIPPool")).items)
            records = await self._records()
            in_use = [b for r in records.values() for bs in nodes.allocated(r).values()
                      for b in bs]  # fmt: skip
            for name, record in records.items():
                held = nodes.allocated(record)
                error = nodes.operator_error(record)
                if self.mode == "cluster-pool":
                    assert len(nodes.pod_cidrs(record)) == 1 or error.startswith(
                        "cluster-pool exhausted"
                    ), (name, record)
                    continue
                for pool, needed in nodes.requested(record).items():
                    spec = pools.get(pool)
                    have = sum(spec.usable(b) for b in held.get(pool, [])) if spec else 0
                    assert have >= needed or repr(pool) in error, (
                        f"{name} needs {needed} from {pool}, holds {have}, error {error!r}"
                    )
            for pool, spec in pools.items():
                for cidr in spec.draining:
                    assert any(b.overlaps(cidr) for b in in_use), (
                        f"pool {pool} draining CIDR {cidr} holds no block but was not released"
                    )

        self.run(go())


class ClusterPoolMachine(IPAMMachine):
    """The same interleavings with both replicas in cluster-pool mode: 2 blocks, so nodes
    compete for them; a node holds at most one podCIDR, ever."""

    mode = "cluster-pool"

    @invariant()
    def one_pod_cidr_per_node_disjoint_claimed_never_lost(self) -> None:
        records = self.run(self._records())
        stored_claims = {c.block: c for c in self.run(claims.list_claims(self.store))}
        seen: dict[Net, str] = {}
        for name, record in records.items():
            pod = nodes.pod_cidrs(record)
            assert len(pod) <= 1, f"{name} holds {pod}"
            previous = self.pod_held.get(name)
            assert previous is None or pod == [previous], f"{name} lost {previous}"
            for block in pod:
                assert any(block.subnet_of(c) for c in CLUSTER_CIDRS), block
                assert block not in seen, f"{block} held by {seen[block]} and {name}"
                seen[block] = name
                claim = stored_claims.get(block)
                assert claim is not None and claim.node == name, (name, block, claim)
                self.pod_held[name] = block
        for name in set(self.pod_held) - set(records):
            del self.pod_held[name]

    @property
    def pod_held(self) -> dict[str, Net]:
        if not hasattr(self, "_pod_held"):
            self._pod_held: dict[str, Net] = {}
        return self._pod_held


def test_cluster_pool_nodes_hold_one_disjoint_block_each(redis_url: str) -> None:
    run_state_machine_as_test(
        lambda: ClusterPoolMachine(redis_url),
        settings=settings(
            max_examples=15,
            stateful_step_count=15,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            # no explain phase: its line tracer (Python < 3.12) makes a failing run outlast
            # the test timeout instead of reporting the failing steps
            phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
        ),
    )


def test_ipam_blocks_stay_disjoint_inside_pools_and_are_never_lost(redis_url: str) -> None:
    run_state_machine_as_test(
        lambda: IPAMMachine(redis_url),
        settings=settings(
            max_examples=30,
            stateful_step_count=20,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            # no explain phase: its line tracer (Python < 3.12) makes a failing run outlast
            # the test timeout instead of reporting the failing steps
            phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
        ),
    )


def test_two_allocators_share_no_block_on_the_kubernetes_store(kube_cilia: KubeAPI) -> None:
    """The same machine on the Kubernetes store (a real kube-apiserver): block claims rely
    on its 409 AlreadyExists the same way."""
    run_state_machine_as_test(
        lambda: IPAMMachine(kube_cilia),
        settings=settings(
            max_examples=20,
            stateful_step_count=20,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            # no explain phase: its line tracer (Python < 3.12) makes a failing run outlast
            # the test timeout instead of reporting the failing steps
            phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
        ),
    )
