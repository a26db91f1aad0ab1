"""Leader election: two operator replicas on one store (real redis-server, or a real
kube-apiserver with a coordination.k8s.io Lease). Only the leader allocates; when it
dies the other takes over; no block is ever handed to two nodes."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from cluster import POOL, register
from grpc_health.v1 import health_pb2, health_pb2_grpc
from stores import kube_cilia

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia.controlplane.v1 import controlplane_pb2_grpc as pb_grpc
from cilia_operator.app import Operator
from cilia_operator.config import Config
from cilia_operator.ipam import node as nodes
from cilia_operator.leader import LeaderElector, RedisLock, validate_durations
from cilia_operator.store import Store
from cilia_testkit.kubeapi import KubeAPI, unique_name

__all__ = ["kube_cilia"]  # the fixture, imported from stores

FAST_LEASE = 3.0
FAST = {
    "enable_leader_election": True,
    "leader_election_lease_duration": FAST_LEASE,
    "leader_election_renew_deadline": 2.0,
    "leader_election_retry_period": 0.1,
}


@contextlib.asynccontextmanager
async def replica(store: str, name: str, **extra: Any) -> AsyncIterator[tuple[Operator, Any]]:
    op = Operator(
        Config(
            store=store,
            listen="127.0.0.1:0",
            prometheus_serve_addr="",
            auto_create_cilium_pod_ip_pools=[POOL],
            store_watch_block_timeout=0.5,
            shutdown_grace_period=0.1,
            identity_gc_interval=0,
            leader_election_id=name,
            **{**FAST, **extra},
        )
    )
    await op.start()
    channel = grpc.aio.insecure_channel(op.address)
    try:
        yield op, channel
    finally:
        await channel.close()
        await op.stop()


async def until(predicate: Any) -> None:
    while not predicate():
        await asyncio.sleep(0.05)


async def demand(channel: Any, name: str) -> None:
    await pb_grpc.IPAMServiceStub(channel).UpdateDemand(
        pb.UpdateDemandRequest(
            node_name=name, demands=[pb.PoolDemand(pool="default", needed_ipv4=8)]
        )
    )


async def allocated_blocks(store: Store, name: str) -> list[ipaddress.IPv4Network]:
    while True:
        record = await store.get("CiliumNode", name)
        blocks = [b for bs in nodes.allocated(record).values() for b in bs]
        if blocks:
            return blocks
        await asyncio.sleep(0.05)


async def health(channel: Any) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    return int(reply.status)


async def two_replicas_then_failover(store_url: str, **extra: Any) -> None:
    async with (
        replica(store_url, "a", **extra) as (a, ch_a),
        replica(store_url, "b", **extra) as (b, ch_b),
    ):
        await until(lambda: a.is_leader or b.is_leader)
        await asyncio.sleep(0.3)  # several retry periods: the other must not lead too
        assert [a.is_leader, b.is_leader].count(True) == 1
        leader, follower = (a, b) if a.is_leader else (b, a)
        ch_leader, ch_follower = (ch_a, ch_b) if leader is a else (ch_b, ch_a)
        # both replicas are ready (a rollout of two replicas can finish) and serve agents
        assert await health(ch_leader) == health_pb2.HealthCheckResponse.SERVING
        assert await health(ch_follower) == health_pb2.HealthCheckResponse.SERVING
        # agents may register through either replica; only the leader allocates, and the
        # follower's allocation stream delivers what the leader allocated
        for name in ("n1", "n2"):
            await register(ch_follower, name)
        watch = pb_grpc.IPAMServiceStub(ch_follower).WatchAllocations(
            pb.WatchAllocationsRequest(node_name="n1")
        )
        for name in ("n1", "n2"):
            await demand(ch_follower, name)
        first = {n: await allocated_blocks(leader.store, n) for n in ("n1", "n2")}

        async def streamed_blocks() -> list[str]:
            while True:
                message = await watch.read()
                cidrs = [c for p in message.allocation.pools for c in p.cidrs]
                if cidrs:
                    return cidrs

        got = await asyncio.wait_for(streamed_blocks(), 10)
        assert got == [str(b) for b in first["n1"]]
        watch.cancel()
        assert not follower.controller.running
        assert follower.controller.allocator.stats().get("default") is None or (
            follower.controller.allocator.stats()["default"].allocated == 0
        )
        # the leader dies without releasing its lock: the follower takes over once the
        # lease expires, restores every block from the store and allocates new ones
        assert leader.elector is not None
        lost = asyncio.get_running_loop().time()
        await leader.elector.stop(release=False)
        await until(lambda: follower.is_leader)
        took = asyncio.get_running_loop().time() - lost
        lease = float(extra.get("leader_election_lease_duration", FAST_LEASE))
        assert took <= lease + 2.0, f"the follower led {took:.1f} s after (lease {lease} s)"
        for name in ("n3", "n4"):
            await register(ch_follower, name)
            await demand(ch_follower, name)
        later = {n: await allocated_blocks(follower.store, n) for n in ("n3", "n4")}
        every = [b for bs in (*first.values(), *later.values()) for b in bs]
        assert len(every) == 4
        for i, x in enumerate(every):
            for y in every[:i]:
                assert not x.overlaps(y), f"{x} handed out twice (overlaps {y})"
        # blocks of the old leader's nodes are still theirs
        for name, blocks in first.items():
            assert await allocated_blocks(follower.store, name) == blocks


async def test_redis_lock_two_replicas_one_allocates_and_failover(redis_url: str) -> None:
    await two_replicas_then_failover(redis_url)


async def test_kubernetes_lease_two_replicas_one_allocates_and_failover(
    kube_cilia: KubeAPI,
) -> None:
    """On a real kube-apiserver: the coordination.k8s.io Lease is the lock."""
    ns = unique_name("leader")
    kube_cilia.kubectl("create", "namespace", ns)
    await two_replicas_then_failover(
        "kubernetes", kubeconfig=str(kube_cilia.kubeconfig), leader_election_lease_namespace=ns
    )
    leases = json.loads(kube_cilia.kubectl("get", "leases", "-n", ns, "-o", "json").stdout)
    [lease] = leases["items"]
    assert lease["metadata"]["name"] == "cilia-operator-resource-lock"
    assert lease["spec"]["leaseTransitions"] >= 1


async def test_graceful_stop_releases_the_lock_at_once(redis_url: str) -> None:
    slow = {"leader_election_lease_duration": 60.0, "leader_election_renew_deadline": 30.0}
    async with replica(redis_url, "a", **slow) as (a, _):
        await until(lambda: a.is_leader)
        async with replica(redis_url, "b", **slow) as (b, _):
            await asyncio.sleep(0.3)
            assert not b.is_leader
            await a.stop()
            # with a 60 s lease, only an explicit release lets b lead within the test
            await until(lambda: b.is_leader)


async def test_redis_lock_only_the_holder_renews_or_releases(redis_url: str) -> None:
    one = RedisLock(redis_url, "test/leader", 30.0)
    two = RedisLock(redis_url, "test/leader", 30.0)
    try:
        assert await one.try_acquire_or_renew("one")
        assert not await two.try_acquire_or_renew("two")
        assert await one.try_acquire_or_renew("one")  # renew
        await two.release("two")  # not the holder: nothing happens
        assert await one.holder() == "one"
        await one.release("one")
        assert await two.try_acquire_or_renew("two")
        assert await one.holder() == "two"
    finally:
        await one.close()
        await two.close()


async def test_leader_steps_down_and_reports_loss_when_the_lock_is_taken(redis_url: str) -> None:
    events: list[str] = []

    async def started() -> None:
        events.append("started")

    async def stopped() -> None:
        events.append("stopped")

    lock = RedisLock(redis_url, "test/steal", 5.0)
    elector = LeaderElector(
        lock, identity="me", lease_duration=5.0, renew_deadline=2.0, retry_period=0.05,
        on_started=started, on_stopped=stopped,
    )  # fmt: skip
    thief = RedisLock(redis_url, "test/steal", 5.0)
    try:
        elector.start()
        await until(lambda: elector.is_leader)
        await thief._r.set("test/steal", "thief")  # another replica's lock now
        await asyncio.wait_for(elector.lost.wait(), 10)
        assert events == ["started", "stopped"] and not elector.is_leader
    finally:
        await elector.stop()
        await thief.close()


def test_durations_must_be_ordered_and_the_error_names_the_flags() -> None:
    with pytest.raises(ValueError, match="--leader-election-renew-deadline"):
        validate_durations(10.0, 15.0, 2.0)
    with pytest.raises(ValueError, match="--leader-election-retry-period"):
        Config(leader_election_retry_period=12.0)
    validate_durations(15.0, 10.0, 2.0)
