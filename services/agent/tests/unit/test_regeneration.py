"""Endpoint regeneration (identity + policy + datapath + ipcache) over an in-memory datapath,
with Hubble's resolver reading the owners.

The datapath stand-in keeps the loader's API (``set_endpoint``, ``upsert_ipcache``,
``attach`` …) in dicts and records the order of calls; the policy map is a dict keyed
by the key's bytes. Everything else is real: IPCache with its BPF writer, IdentityAllocator,
PolicyEngine, PolicyMapWriter, PolicyStreams, OwnerResolver, RetryQueue, the controlplane
protobufs.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent.controlplane import OperatorUnavailable, RetryQueue
from cilia_agent.datapath.fake import FakeDatapath
from cilia_agent.endpoint.regeneration import PolicyMode, PolicyNotReady, Regeneration
from cilia_agent.endpoint.state import EndpointRecord
from cilia_agent.hubble.enrich import OwnerResolver
from cilia_agent.identity.allocator import IdentityAllocator
from cilia_agent.identity.fake import FakeControl
from cilia_agent.identity.watcher import consume_identities
from cilia_agent.ipcache import IPCache
from cilia_agent.ipcache.bpf import BPFWriter
from cilia_agent.ipcache.watcher import consume_ipcache
from cilia_agent.metrics import Metrics
from cilia_agent.policy.engine import PolicyEngine
from cilia_agent.policy.maps import PolicyMapError, PolicyMapWriter
from cilia_agent.policy.watcher import PolicyStreams

NS_LABEL = "k8s:io.kubernetes.pod.namespace=default"


def rec(ep_id: int, app: str, ip: str) -> EndpointRecord:
    return EndpointRecord(
        id=ep_id,
        container_id=f"c{ep_id}",
        ifname="eth0",
        netns="/var/run/netns/x",
        ipv4=ip,
        pool="default",
        host_ifname=f"lxc{ep_id}",
        labels={"app": app},
        pod_namespace="default",
        pod_name=app,
        state="ready",
    )


def backend_policy(name: str = "p") -> cp.PolicyEvent:
    manifest = {
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumNetworkPolicy",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "endpointSelector": {"matchLabels": {"app": "backend"}},
            "ingress": [{"fromEndpoints": [{"matchLabels": {"app": "frontend"}}]}],
        },
    }
    return cp.PolicyEvent(
        type=cp.EVENT_TYPE_UPSERT,
        kind="CiliumNetworkPolicy",
        namespace="default",
        name=name,
        json=json.dumps(manifest),
    )


async def stream(*items: Any) -> Any:
    for item in items:
        yield item


class Harness:
    """The owners wired as the agent wires them (``cilia_agent.enforcement.load``)."""

    def __init__(
        self, mode: PolicyMode = "default", wait: float = 2.0, dp: FakeDatapath | None = None
    ) -> None:
        self.dp = dp or FakeDatapath()
        self.control = FakeControl()
        self.metrics = Metrics()
        self.executor = ThreadPoolExecutor(2)
        self.retry = RetryQueue(min_backoff=0.01, max_backoff=0.05)
        self.ipcache = IPCache([BPFWriter(self.dp)])
        self.engine = PolicyEngine(PolicyMapWriter(self.dp.table("cilia_policy"), capacity=65536))
        self.streams = PolicyStreams(self.engine, self.metrics.policy, wait)
        self.identities = IdentityAllocator(
            self.control, self.retry, self.engine, on_learn_error=(PolicyMapError,)
        )
        self.enf = Regeneration(
            datapath=self.dp,  # type: ignore[arg-type]
            identities=self.identities,
            ipcache=self.ipcache,
            engine=self.engine,
            streams=self.streams,
            control=self.control,
            retry=self.retry,
            executor=self.executor,
            node_name="n1",
            mode=mode,
        )
        self.engine.on_enforce = self.enf.on_enforce
        self.resolver = OwnerResolver(
            endpoints=self.enf,
            ipcache=self.ipcache,
            identities=self.identities,
            kernel_interface_names=False,
        )

    async def consume_ipcache(self, messages: Any) -> bool:
        return await consume_ipcache(self.ipcache, messages)

    async def sync(self, *policies: cp.PolicyEvent) -> None:
        await consume_identities(
            self.engine,
            self.identities,
            stream(cp.WatchIdentitiesResponse(synced=True)),
            self.streams.changed,
        )
        await self.streams.consume_policies(
            stream(cp.WatchPoliciesResponse(events=list(policies), synced=True))
        )

    async def settle(self) -> None:
        for _ in range(20):
            await asyncio.sleep(0.01)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_add_waits_for_policy_sync_then_writes_entries_before_attaching() -> None:
    async def main() -> None:
        h = Harness()
        front = asyncio.create_task(h.enf.create(rec(1, "frontend", "10.0.0.2"), 11))
        back = asyncio.create_task(h.enf.create(rec(2, "backend", "10.0.0.3"), 12))
        await asyncio.sleep(0.05)
        assert not front.done() and not h.dp.attached, "blocked until policy is computable"
        await h.sync(backend_policy())
        ids = {await front, await back}
        assert ids == {256, 257}
        assert h.dp.eps[12].enforce_ingress == 1 and h.dp.eps[12].enforce_egress == 0
        assert h.dp.eps[11].enforce_ingress == 0
        assert h.dp.calls.index("set_endpoint 12") < h.dp.calls.index("attach 12")
        assert len(h.dp.policy.data) == 1, "backend: allow from frontend's identity"
        assert h.dp.ipcache["10.0.0.3/32"] == (257, "")
        assert h.resolver.endpoint_by_ip("10.0.0.3") is not None
        assert h.control.records["backend"].identity == 257
        assert h.metrics.registry.get_sample_value("cilium_policy") == 1

    run(main())


def test_add_without_synced_streams_times_out_unavailable_and_undoes_everything() -> None:
    async def main() -> None:
        h = Harness(wait=0.05)
        with pytest.raises(PolicyNotReady, match="endpoint-policy-wait-timeout"):
            await h.enf.create(rec(1, "frontend", "10.0.0.2"), 11)
        await h.settle()
        assert not h.dp.eps and not h.dp.attached and not h.dp.ipcache
        assert h.control.releases == [256]

    run(main())


def test_failed_endpoint_record_detaches_and_removes_entries() -> None:
    async def main() -> None:
        h = Harness()
        await h.sync(backend_policy())
        h.control.fail_upsert = True
        with pytest.raises(OperatorUnavailable):
            await h.enf.create(rec(2, "backend", "10.0.0.3"), 12)
        await h.settle()
        assert not h.dp.attached and not h.dp.eps and not h.dp.ipcache
        assert not h.dp.policy.data, "policy entries removed"
        assert h.resolver.endpoint_by_id(2) is None
        assert h.control.releases == [256]

    run(main())


def test_failed_attach_deletes_the_operator_record_before_create_returns() -> None:
    async def main() -> None:
        h = Harness()
        await h.sync()
        h.dp.fail_attach = True
        with pytest.raises(OSError, match="attach failed"):
            await h.enf.create(rec(2, "backend", "10.0.0.3"), 12)
        assert h.control.deleted == [("default", "backend")], "not left to a background retry"
        assert not h.dp.eps and not h.dp.ipcache

    run(main())


def test_unreachable_operator_on_upsert_queues_the_record_deletion() -> None:
    async def main() -> None:
        h = Harness()
        await h.sync()
        h.control.fail_upsert = True  # e.g. a deadline after the operator stored it
        with pytest.raises(OperatorUnavailable):
            await h.enf.create(rec(2, "backend", "10.0.0.3"), 12)
        await h.settle()
        assert h.control.deleted == [("default", "backend")]

    run(main())


def test_identity_is_allocated_while_the_veth_is_plumbed_and_the_veth_waited_for() -> None:
    async def main() -> None:
        h = Harness()
        await h.sync()
        identities: list[int] = []

        async def on_identity(identity: int) -> None:
            identities.append(identity)

        plumbed: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        create = asyncio.create_task(h.enf.create(rec(1, "web", "10.0.0.2"), plumbed, on_identity))
        await h.settle()
        assert identities == [256], "allocated and persisted before the veth exists"
        assert not create.done() and not h.dp.calls and not h.dp.ipcache, "veth not touched"
        plumbed.set_result(11)
        assert await create == 256
        assert h.dp.calls == ["set_endpoint 11", "attach 11"] and h.dp.attached == {11}
        assert h.control.records["web"].identity == 256

    run(main())


def test_failed_plumb_releases_the_identity_and_raises_its_error() -> None:
    async def main() -> None:
        h = Harness()
        await h.sync()
        plumbed: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        create = asyncio.create_task(h.enf.create(rec(1, "web", "10.0.0.2"), plumbed))
        await h.settle()
        plumbed.set_exception(OSError("veth add failed (test)"))
        with pytest.raises(OSError, match="veth add failed"):
            await create
        await h.settle()
        assert h.control.releases == [256]
        assert not h.dp.calls and not h.dp.eps and not h.dp.ipcache and not h.control.records
        assert h.resolver.endpoint_by_id(1) is None

    run(main())


def test_delete_before_the_veth_goes_removes_entries_but_leaves_the_programs_to_it() -> None:
    async def main() -> None:
        h = Harness()
        await h.sync()
        own, chained = rec(1, "web", "10.0.0.2"), rec(2, "db", "10.0.0.3")
        for r, ifindex in ((own, 11), (chained, 12)):
            r.identity = await h.enf.create(r, ifindex)
        await h.enf.delete(own, veth_deleted_next=True)
        assert h.dp.attached == {11, 12}, "own veth: the programs go with the device"
        await h.enf.delete(chained)
        assert h.dp.attached == {11}, "chained veth stays: programs detached"
        assert not h.dp.eps and not h.dp.ipcache

    run(main())


def test_identity_released_only_when_its_last_local_endpoint_is_deleted() -> None:
    async def main() -> None:
        h = Harness()
        await h.sync()
        a, b = rec(1, "web", "10.0.0.2"), rec(2, "web", "10.0.0.3")
        ident = await h.enf.create(a, 11)
        assert await h.enf.create(b, 12) == ident
        await h.enf.delete(a.model_copy(update={"identity": ident}))
        await h.settle()
        # b (a newer sandbox of the same pod) owns the operator's web record now
        assert h.control.releases == [] and h.control.deleted == []
        await h.enf.delete(b.model_copy(update={"identity": ident}))
        await h.settle()
        assert h.control.releases == [ident] and h.control.deleted == [("default", "web")]
        assert not h.dp.eps and not h.dp.attached and not h.dp.ipcache

    run(main())


def test_policy_modes_always_and_never() -> None:
    async def main() -> None:
        always = Harness(mode="always")
        await always.sync()
        await always.enf.create(rec(1, "web", "10.0.0.2"), 11)
        assert (always.dp.eps[11].enforce_ingress, always.dp.eps[11].enforce_egress) == (1, 1)
        never = Harness(mode="never")  # does not wait for the streams either
        await never.enf.create(rec(2, "backend", "10.0.0.3"), 12)
        await never.sync(backend_policy())
        assert (never.dp.eps[12].enforce_ingress, never.dp.eps[12].enforce_egress) == (0, 0)
        assert not never.dp.policy.data

    run(main())


def test_ipcache_stream_resync_drops_stale_entries_and_never_overrides_local_ones() -> None:
    async def main() -> None:
        h = Harness()
        await h.sync()
        await h.enf.create(rec(1, "web", "10.0.0.2"), 11)
        h.ipcache.set_host_addresses(["192.0.2.10"])

        def entry(cidr: str, ident: int, owner: str = "") -> cp.IPCacheEvent:
            return cp.IPCacheEvent(
                type=cp.EVENT_TYPE_UPSERT,
                entry=cp.IPCacheEntry(cidr=cidr, identity=ident, host_ip="192.0.2.20", owner=owner),
            )

        first = cp.WatchIPCacheResponse(
            events=[
                entry("10.1.0.5/32", 300, "default/remote"),
                entry("10.1.0.6/32", 301),
                entry("10.0.0.2/32", 999),  # our own pod, stale identity: ignored
                entry("192.0.2.10/32", 6),  # our own address as remote-node: ignored
            ],
            synced=True,
        )
        await h.consume_ipcache(stream(first))
        assert h.dp.ipcache["10.1.0.5/32"] == (300, "192.0.2.20")
        assert h.dp.ipcache["10.0.0.2/32"] == (256, "")
        assert h.dp.ipcache["192.0.2.10/32"] == (1, "")
        ref = h.resolver.endpoint_by_ip("10.1.0.5")
        assert ref is not None and ref.pod_name == "remote"
        # reconnect: the new listing no longer has 10.1.0.6
        await h.consume_ipcache(
            stream(cp.WatchIPCacheResponse(events=[entry("10.1.0.5/32", 300)], synced=True))
        )
        assert "10.1.0.6/32" not in h.dp.ipcache and "10.1.0.5/32" in h.dp.ipcache
        assert h.dp.ipcache["10.0.0.2/32"] == (256, "")

    run(main())


def test_restore_keeps_pinned_flags_until_recomputed_and_prunes_gone_endpoints() -> None:
    async def main() -> None:
        first = Harness()
        await first.sync(backend_policy())
        back = rec(2, "backend", "10.0.0.3").model_copy(update={"host_ifname": "lo"})
        back = back.model_copy(update={"identity": await first.enf.create(back, 1)})
        gone = rec(3, "backend", "10.0.0.4")
        await first.enf.create(gone, 13)
        assert len(first.dp.policy.data) == 0, "no frontend identity yet: nothing to allow"

        # a new agent on the same pinned maps; endpoint 3 disappeared while it was down
        second = Harness(dp=first.dp)
        second.enf.engine.restore()
        first.dp.calls.clear()
        missing = await second.enf.restore([back])  # host veth "lo" = ifindex 1
        assert missing == []
        assert 13 not in first.dp.eps, "entry of the gone endpoint removed"
        assert first.dp.eps[1].enforce_ingress == 1, "pinned flags kept before sync"
        assert first.dp.calls == ["set_endpoint 1", "attach 1"], "programs replaced in place"
        assert not second.enf.ready
        await second.sync()  # the policy was deleted while the agent was down
        assert first.dp.eps[1].enforce_ingress == 0
        assert second.resolver.endpoint_by_ip("10.0.0.3") is not None

    run(main())


def test_relabel_moves_a_running_endpoint_to_a_new_identity_and_its_policy_follows() -> None:
    async def main() -> None:
        h = Harness()
        await h.sync(backend_policy())
        front = await h.enf.create(rec(1, "frontend", "10.0.0.2"), 11)
        back = await h.enf.create(rec(2, "backend", "10.0.0.3"), 12)
        allowed = set(h.dp.policy.data)
        assert len(allowed) == 1, "backend admits frontend's identity"
        # kubectl label pod frontend app=other --overwrite
        moved = rec(1, "other", "10.0.0.2").model_copy(update={"pod_name": "frontend"})
        new = await h.enf.relabel(moved)
        await h.settle()
        assert new not in (front, back)
        assert h.dp.ipcache["10.0.0.2/32"] == (new, ""), "other endpoints see the new identity"
        assert h.dp.eps[11].sec_identity == new
        admitted = {key.sec_label for key, _ in h.dp.policy.items() if key.ep_id == 2}
        assert admitted == {front}, "backend admits frontend's identity, not the new one"
        assert h.control.records["frontend"].identity == new
        assert h.control.releases == [front], "the old identity is released (unused)"
        assert h.resolver.endpoint_by_ip("10.0.0.2").identity == new  # type: ignore[union-attr]
        # back again: admitted again; unchanged labels change nothing
        again = await h.enf.relabel(rec(1, "frontend", "10.0.0.2"))
        assert h.dp.ipcache["10.0.0.2/32"] == (again, "")
        assert {key.sec_label for key, _ in h.dp.policy.items() if key.ep_id == 2} == {again}
        assert await h.enf.relabel(rec(1, "frontend", "10.0.0.2")) == again
        assert await h.enf.relabel(rec(9, "frontend", "10.0.0.9")) == 0, "unknown endpoint"

    run(main())


def test_restart_restores_identity_references_and_the_cache_serves_later_adds() -> None:
    async def main() -> None:
        first = Harness()
        await first.sync()
        web = rec(2, "web", "10.0.0.3").model_copy(update={"host_ifname": "lo"})
        web = web.model_copy(update={"identity": await first.enf.create(web, 1)})
        assert first.control.allocations == 1
        assert await first.enf.create(rec(3, "web", "10.0.0.4"), 13) == web.identity
        assert first.control.allocations == 1, "second endpoint, same labels: no Allocate"

        # a new agent on the same pinned maps restores endpoint 2 (3 went while it was down)
        second = Harness(dp=first.dp)
        second.enf.engine.restore()
        assert await second.enf.restore([web]) == []
        await second.sync()
        assert second.identities.users(web.identity) == 1
        assert second.control.allocations == 0, "restore asks the operator nothing"
        # the first ADD with the labels confirms the restored identity once at the operator
        assert await second.enf.create(rec(5, "web", "10.0.0.6"), 15) == web.identity
        assert await second.enf.create(rec(6, "web", "10.0.0.7"), 16) == web.identity
        assert second.control.allocations == 1
        for gone in (web, rec(5, "web", "10.0.0.6"), rec(6, "web", "10.0.0.7")):
            assert second.control.releases == []
            await second.enf.delete(gone.model_copy(update={"identity": web.identity}))
            await second.settle()
        assert second.control.releases == [web.identity], "released once, after the last"

    run(main())
