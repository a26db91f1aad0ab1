"""PodCache: endpoint labels from the operator's Pod stream (Kubernetes mode)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent.identity.labels import pod_identity_labels
from cilia_agent.k8s import PodCache, PodRequired, PodUnknown


def _pod(name: str, labels: dict[str, str], ns_labels: dict[str, str] | None = None) -> cp.Pod:
    return cp.Pod(
        namespace="shop",
        name=name,
        uid=f"uid-{name}",
        node_name="node-a",
        labels=labels,
        namespace_labels=ns_labels or {"team": "web"},
        service_account="frontend-sa",
    )


def _upsert(*pods: cp.Pod, synced: bool = False) -> cp.WatchPodsResponse:
    return cp.WatchPodsResponse(
        events=[cp.PodEvent(type=cp.EVENT_TYPE_UPSERT, pod=p) for p in pods], synced=synced
    )


async def _stream(
    messages: list[cp.WatchPodsResponse], gate: asyncio.Event | None = None
) -> AsyncIterator[cp.WatchPodsResponse]:
    for i, message in enumerate(messages):
        if gate is not None and i == 1:
            await gate.wait()
        yield message


async def _test_endpoint_labels_are_built_as_upstream_builds_a_pods_identity_labels() -> None:
    cache = PodCache("node-a", "prod", wait_timeout=1.0)
    cache.set_enabled(True)
    await cache.consume(_stream([_upsert(_pod("web-1", {"app": "web"}), synced=True)]))
    labels = await cache.endpoint_labels("shop", "web-1")
    assert labels is not None
    identity = pod_identity_labels("shop", labels).strings()
    assert identity == (
        "k8s:app=web",
        "k8s:io.cilium.k8s.namespace.labels.team=web",
        "k8s:io.cilium.k8s.policy.cluster=prod",
        "k8s:io.cilium.k8s.policy.serviceaccount=frontend-sa",
        "k8s:io.kubernetes.pod.namespace=shop",
    )


async def _test_standalone_mode_gives_none_so_the_cni_labels_are_used() -> None:
    cache = PodCache("node-a", "default", wait_timeout=0.2)
    cache.set_enabled(False)
    assert await cache.endpoint_labels("shop", "web-1") is None


async def _test_an_add_waits_for_a_pod_that_arrives_later_and_fails_retryably_for_one_that_never_does() -> (
    None
):
    cache = PodCache("node-a", "default", wait_timeout=2.0)
    cache.set_enabled(True)
    gate = asyncio.Event()
    consumer = asyncio.create_task(
        cache.consume(_stream([_upsert(synced=True), _upsert(_pod("late", {"app": "late"}))], gate))
    )
    waiter = asyncio.create_task(cache.endpoint_labels("shop", "late"))
    await asyncio.sleep(0.2)
    assert not waiter.done()
    gate.set()
    labels = await asyncio.wait_for(waiter, 2.0)
    assert labels is not None and labels["app"] == "late"
    await consumer
    cache.wait_timeout = 0.2
    with pytest.raises(PodUnknown, match="shop/never"):
        await cache.endpoint_labels("shop", "never")
    with pytest.raises(PodRequired):
        await cache.endpoint_labels("", "x")


async def _test_a_label_change_reaches_the_observers_and_a_relist_drops_pods_gone() -> None:
    cache = PodCache("node-a", "default", wait_timeout=1.0)
    cache.set_enabled(True)
    seen: list[tuple[str, str, dict[str, str]]] = []

    async def observer(namespace: str, name: str, labels: dict[str, str]) -> None:
        seen.append((namespace, name, labels))

    cache.on_change(observer)
    await cache.consume(
        _stream(
            [
                _upsert(_pod("a", {"app": "x"}), _pod("b", {"app": "y"}), synced=True),
                _upsert(_pod("a", {"app": "x"})),  # unchanged: no observer call
                _upsert(_pod("a", {"app": "other"})),
                _upsert(_pod("b", {"app": "y"}, ns_labels={"team": "ops"})),  # namespace label
            ]
        )
    )
    # first sight of a and b (an agent restart may find stale labels), then the two changes
    assert [(n, labels["app"]) for _, n, labels in seen] == [
        ("a", "x"),
        ("b", "y"),
        ("a", "other"),
        ("b", "y"),
    ]
    assert seen[3][2]["io.cilium.k8s.namespace.labels.team"] == "ops"
    # a new stream (reconnect) whose listing lacks "b": b is forgotten
    await cache.consume(_stream([_upsert(_pod("a", {"app": "other"}), synced=True)]))
    assert cache.get("shop", "a") is not None and cache.get("shop", "b") is None


async def _test_the_stream_opens_only_once_the_operator_said_it_streams_pods() -> None:
    cache = PodCache("node-a", "default", wait_timeout=1.0)
    opened: list[str] = []

    def open_stream(node: str) -> AsyncIterator[cp.WatchPodsResponse]:
        opened.append(node)
        return _stream([_upsert(synced=True)])

    consumer = asyncio.create_task(cache.consume(cache.stream(open_stream)))
    cache.set_enabled(False)
    await asyncio.sleep(0.1)
    assert opened == [] and not consumer.done()
    cache.set_enabled(True)
    assert await asyncio.wait_for(consumer, 2.0) is True
    assert opened == ["node-a"]


def test_endpoint_labels_are_built_as_upstream_builds_a_pods_identity_labels() -> None:
    asyncio.run(_test_endpoint_labels_are_built_as_upstream_builds_a_pods_identity_labels())


def test_standalone_mode_gives_none_so_the_cni_labels_are_used() -> None:
    asyncio.run(_test_standalone_mode_gives_none_so_the_cni_labels_are_used())


def test_an_add_waits_for_a_pod_that_arrives_later_and_fails_retryably_for_one_that_never_does() -> (
    None
):
    asyncio.run(
        _test_an_add_waits_for_a_pod_that_arrives_later_and_fails_retryably_for_one_that_never_does()
    )


def test_a_label_change_reaches_the_observers_and_a_relist_drops_pods_gone() -> None:
    asyncio.run(_test_a_label_change_reaches_the_observers_and_a_relist_drops_pods_gone())


def test_the_stream_opens_only_once_the_operator_said_it_streams_pods() -> None:
    asyncio.run(_test_the_stream_opens_only_once_the_operator_said_it_streams_pods())
