"""A pool CIDR that contains a service range (upstream's default pod range 10.0.0.0/8 contains
kube-apiserver's default 10.96.0.0/12): the operator starts, and no block overlapping the
service range is ever handed out (a pod there would shadow a ClusterIP), also after a node's
attached networks change the allocator's exclusions. On the real Redis store, through the
servicer agents call (``UpdateDemand``)."""

from __future__ import annotations

import ipaddress

from test_ipam_properties import Context

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia_operator.config import Config
from cilia_operator.controlplane.ipam import IPAMServicer
from cilia_operator.ipam import node as nodes
from cilia_operator.ipam.controller import IPAMController
from cilia_operator.ipam.pool import PoolSpec, pool_manifest
from cilia_operator.metrics import Metrics
from cilia_operator.store.redis import RedisStore

Net = ipaddress.IPv4Network
SERVICES = Net("10.96.0.0/12")  # 10.96.0.0 - 10.111.255.255
POOL = Net("10.96.0.0/11")  # 10.96.0.0 - 10.127.255.255: its lower half is the service range


def test_the_upstream_default_pod_range_is_accepted_beside_the_default_service_range() -> None:
    cfg = Config(ipam="cluster-pool", cluster_pool_ipv4_cidr=["10.0.0.0/8"])
    assert cfg.service_cidrs == (SERVICES,)


async def test_no_block_overlapping_a_service_range_is_handed_out(redis_url: str) -> None:
    store = RedisStore(redis_url, prefix="svc-ranges/")
    try:
        controller = IPAMController(store, Metrics(), service_cidrs=[SERVICES])
        ipam = IPAMServicer(store, controller, 3)
        await store.create(pool_manifest(PoolSpec("default", (POOL,), 16)))
        for name in ("a", "b"):
            await store.create(nodes.new_node(name))
        await controller.start(run=False)
        await controller.run_queued()

        async def demand(name: str, blocks: int) -> list[Net]:
            need = pb.PoolDemand(pool="default", needed_ipv4=blocks * 65534)
            await ipam.UpdateDemand(
                pb.UpdateDemandRequest(node_name=name, demands=[need]), Context()
            )
            await controller.run_queued()
            record = await store.get("CiliumNode", name)
            return list(nodes.allocated(record).get("default", []))

        first = await demand("a", 1)
        assert first == [Net("10.112.0.0/16")], first  # the lowest block outside the range
        # a node's attached network changes the exclusions: the service range stays out
        record = await store.get("CiliumNode", "b")
        record.setdefault("status", {})["localNetworks"] = [
            {"interface": "eth1", "cidr": "192.168.7.0/24"}
        ]
        await store.update(record)
        controller.enqueue("b")
        await controller.run_queued()
        every = await demand("b", 20)  # more than the 15 blocks left outside the range
        held = first + every
        assert len(held) == 16 and not any(b.overlaps(SERVICES) for b in held), held
        status = await store.get("CiliumNode", "b")
        assert "exhausted" in str(status.get("status")), status.get("status")
    finally:
        await store.close()
