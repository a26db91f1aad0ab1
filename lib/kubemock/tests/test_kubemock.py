"""The mock API server, driven by the OFFICIAL ``kubernetes`` client over real HTTP."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from cilia_kubemock import KubeMock
from cilia_kubemock.pytest_fixtures import KubeAPI

CN = ("cilium.io", "v2", "ciliumnodes")


def pod(name: str, node: str = "n1", labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox"}]},
    }


def cnode(name: str, cidr: str = "10.0.0.0/24") -> dict[str, Any]:
    return {
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumNode",
        "metadata": {"name": name},
        "spec": {"ipam": {"podCIDRs": [cidr]}},
    }


def test_core_create_get_list_delete_with_increasing_resource_versions(kube_api: KubeAPI) -> None:
    with kube_api.api_client() as api:
        core = client.CoreV1Api(api)
        a = core.create_namespaced_pod("default", pod("a"))
        b = core.create_namespaced_pod("default", pod("b"))
        assert isinstance(a, client.V1Pod) and a.metadata.uid
        assert int(b.metadata.resource_version) > int(a.metadata.resource_version) > 0
        got = core.read_namespaced_pod("a", "default")
        assert (
            got.spec.node_name == "n1"
            and got.metadata.resource_version == a.metadata.resource_version
        )
        listed = core.list_namespaced_pod("default")
        assert [p.metadata.name for p in listed.items] == ["a", "b"]
        assert listed.metadata.resource_version == b.metadata.resource_version
        core.delete_namespaced_pod("a", "default")
        with pytest.raises(ApiException) as err:
            core.read_namespaced_pod("a", "default")
        assert err.value.status == 404
        assert int(kube_api.mock.resource_version()) == int(b.metadata.resource_version) + 1


def test_create_of_existing_is_409_already_exists(kube_api: KubeAPI) -> None:
    with kube_api.api_client() as api:
        core = client.CoreV1Api(api)
        core.create_namespaced_pod("default", pod("a"))
        with pytest.raises(ApiException) as err:
            core.create_namespaced_pod("default", pod("a", node="n2"))
        assert err.value.status == 409 and "AlreadyExists" in str(err.value.body)
        assert core.read_namespaced_pod("a", "default").spec.node_name == "n1"


def test_replace_with_stale_resource_version_is_409_conflict_and_changes_nothing(
    kube_api: KubeAPI,
) -> None:
    with kube_api.api_client() as api:
        co = client.CustomObjectsApi(api)
        first = co.create_cluster_custom_object(*CN, cnode("n1"))
        assert first["metadata"]["resourceVersion"]
        fresh = dict(first, spec={"ipam": {"podCIDRs": ["10.0.1.0/24"]}})
        second = co.replace_cluster_custom_object(*CN, "n1", fresh)
        assert int(second["metadata"]["resourceVersion"]) > int(
            first["metadata"]["resourceVersion"]
        )
        stale = dict(first, spec={"ipam": {"podCIDRs": ["10.9.9.0/24"]}})
        with pytest.raises(ApiException) as err:
            co.replace_cluster_custom_object(*CN, "n1", stale)
        assert err.value.status == 409 and "Conflict" in str(err.value.body)
        now = co.get_cluster_custom_object(*CN, "n1")
        assert now["spec"]["ipam"]["podCIDRs"] == ["10.0.1.0/24"]
        # delete with a stale precondition is refused too
        with pytest.raises(ApiException) as err:
            co.delete_cluster_custom_object(
                *CN, "n1", body=client.V1DeleteOptions(
                    preconditions=client.V1Preconditions(resource_version=first["metadata"]["resourceVersion"])
                ),
            )  # fmt: skip
        assert err.value.status == 409
        with pytest.raises(ApiException) as err:
            co.get_cluster_custom_object(*CN, "missing")
        assert err.value.status == 404


def test_patch_merge_and_strategic_and_status_subresource(kube_api: KubeAPI) -> None:
    with kube_api.api_client() as api:
        core = client.CoreV1Api(api)
        core.create_namespaced_pod("default", pod("a"))
        core.patch_namespaced_pod("a", "default", {"metadata": {"annotations": {"k": "v"}}})
        core.patch_namespaced_pod_status(
            "a", "default",
            {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}},
        )  # fmt: skip
        # a status change through the main resource is ignored (status subresource)
        core.patch_namespaced_pod("a", "default", {"status": {"phase": "Failed"}})
        got = core.read_namespaced_pod("a", "default")
        assert got.metadata.annotations == {"k": "v"}
        assert got.status.phase == "Running"
        assert [(c.type, c.status) for c in got.status.conditions] == [("Ready", "True")]
        co = client.CustomObjectsApi(api)
        co.create_cluster_custom_object(*CN, cnode("n1"))
        co.patch_cluster_custom_object(*CN, "n1", {"metadata": {"labels": {"a": "b"}}})
        assert co.get_cluster_custom_object(*CN, "n1")["metadata"]["labels"] == {"a": "b"}


def test_selectors_field_spec_node_name_and_labels(kube_api: KubeAPI) -> None:
    with kube_api.api_client() as api:
        core = client.CoreV1Api(api)
        core.create_namespaced_pod("default", pod("a", "n1", {"app": "agent"}))
        core.create_namespaced_pod("default", pod("b", "n2", {"app": "agent"}))
        core.create_namespaced_pod("kube-system", pod("c", "n1", {"app": "other"}))
        on_n1 = core.list_pod_for_all_namespaces(field_selector="spec.nodeName=n1")
        assert sorted(p.metadata.name for p in on_n1.items) == ["a", "c"]
        agents = core.list_pod_for_all_namespaces(label_selector="app=agent")
        assert sorted(p.metadata.name for p in agents.items) == ["a", "b"]
        both = core.list_namespaced_pod("default", label_selector="app in (agent)",
                                        field_selector="spec.nodeName=n2")  # fmt: skip
        assert [p.metadata.name for p in both.items] == ["b"]


def test_watch_from_resource_version_streams_changes_in_order(kube_api: KubeAPI) -> None:
    with kube_api.api_client() as api:
        co = client.CustomObjectsApi(api)
        co.create_cluster_custom_object(*CN, cnode("old"))
        rv = co.list_cluster_custom_object(*CN)["metadata"]["resourceVersion"]
        a = co.create_cluster_custom_object(*CN, cnode("a"))
        co.replace_cluster_custom_object(*CN, "a", dict(a, spec={"x": 1}))
        co.delete_cluster_custom_object(*CN, "a")
        seen = []
        w = watch.Watch()
        for event in w.stream(
            co.list_cluster_custom_object, *CN, resource_version=rv, timeout_seconds=5
        ):
            seen.append((event["type"], event["object"]["metadata"]["name"],
                         int(event["object"]["metadata"]["resourceVersion"])))  # fmt: skip
            if len(seen) == 3:
                w.stop()
        assert [s[:2] for s in seen] == [("ADDED", "a"), ("MODIFIED", "a"), ("DELETED", "a")]
        assert [s[2] for s in seen] == sorted(s[2] for s in seen)


def test_watch_without_version_lists_then_follows_live_changes(kube_api: KubeAPI) -> None:
    with kube_api.api_client() as api:
        core = client.CoreV1Api(api)
        core.create_namespaced_pod("default", pod("a", "n1"))
        core.create_namespaced_pod("default", pod("other-node", "n2"))
        seen: list[tuple[str, str]] = []
        w = watch.Watch()
        started = threading.Event()

        def writer() -> None:
            started.wait()
            core.create_namespaced_pod("default", pod("b", "n1"))
            core.patch_namespaced_pod("b", "default", {"spec": {"nodeName": "n2"}})

        t = threading.Thread(target=writer)
        t.start()
        for event in w.stream(core.list_namespaced_pod, "default",
                              field_selector="spec.nodeName=n1", timeout_seconds=10):  # fmt: skip
            seen.append((event["type"], event["object"].metadata.name))
            started.set()
            if len(seen) == 3:
                w.stop()
        t.join()
        # b moved away from n1: reported as DELETED for this selector
        assert seen == [("ADDED", "a"), ("ADDED", "b"), ("DELETED", "b")]


@pytest.mark.kubemock(event_history=3)
def test_watch_from_a_trimmed_version_gets_410(kube_api: KubeAPI) -> None:
    with kube_api.api_client() as api:
        co = client.CustomObjectsApi(api)
        for i in range(6):
            co.create_cluster_custom_object(*CN, cnode(f"n{i}"))
        w = watch.Watch()
        with pytest.raises(ApiException) as err:
            for _ in w.stream(
                co.list_cluster_custom_object, *CN, resource_version="1", timeout_seconds=5
            ):
                pass
        assert err.value.status == 410
        # compaction expires every older version
        rv = co.list_cluster_custom_object(*CN)["metadata"]["resourceVersion"]
        kube_api.mock.compact()
        co.create_cluster_custom_object(*CN, cnode("late"))
        names = [e["object"]["metadata"]["name"]
                 for e in w.stream(co.list_cluster_custom_object, *CN, resource_version=rv,
                                   timeout_seconds=1)]  # fmt: skip
        assert names == ["late"]
        with pytest.raises(ApiException):
            for _ in w.stream(co.list_cluster_custom_object, *CN,
                              resource_version=str(int(rv) - 1), timeout_seconds=1):  # fmt: skip
                pass


@pytest.mark.kubemock(pod_termination_delay=0.5)
def test_deleted_pod_is_terminating_then_gone(kube_api: KubeAPI) -> None:
    with kube_api.api_client() as api:
        core = client.CoreV1Api(api)
        created = core.create_namespaced_pod("default", pod("a"))
        core.delete_namespaced_pod("a", "default")
        terminating = core.read_namespaced_pod("a", "default")
        assert terminating.metadata.deletion_timestamp is not None
        types = []
        w = watch.Watch()
        for event in w.stream(core.list_namespaced_pod, "default",
                              resource_version=created.metadata.resource_version,
                              timeout_seconds=10):  # fmt: skip
            types.append(event["type"])
            if event["type"] == "DELETED":
                w.stop()
        assert types == ["MODIFIED", "DELETED"]
        with pytest.raises(ApiException) as err:
            core.read_namespaced_pod("a", "default")
        assert err.value.status == 404


def test_finalizers_hold_deletion_until_removed(kube_api: KubeAPI) -> None:
    with kube_api.api_client() as api:
        co = client.CustomObjectsApi(api)
        body = cnode("n1")
        body["metadata"]["finalizers"] = ["cilia.io/test"]
        co.create_cluster_custom_object(*CN, body)
        co.delete_cluster_custom_object(*CN, "n1")
        held = co.get_cluster_custom_object(*CN, "n1")
        assert held["metadata"]["deletionTimestamp"]
        co.patch_cluster_custom_object(*CN, "n1", {"metadata": {"finalizers": None}})
        with pytest.raises(ApiException) as err:
            co.get_cluster_custom_object(*CN, "n1")
        assert err.value.status == 404


def test_daemonsets_leases_events_and_discovery(kube_api: KubeAPI) -> None:
    with kube_api.api_client() as api:
        apps = client.AppsV1Api(api)
        ds = client.V1DaemonSet(
            metadata=client.V1ObjectMeta(name="agent"),
            spec=client.V1DaemonSetSpec(
                selector=client.V1LabelSelector(match_labels={"app": "agent"}),
                template=client.V1PodTemplateSpec(
                    metadata=client.V1ObjectMeta(labels={"app": "agent"}, annotations={"h": "1"}),
                    spec=client.V1PodSpec(containers=[client.V1Container(name="a", image="x")]),
                ),
            ),
        )
        made = apps.create_namespaced_daemon_set("kube-system", ds)
        assert made.metadata.generation == 1
        apps.patch_namespaced_daemon_set(
            "agent",
            "kube-system",
            {"spec": {"template": {"metadata": {"annotations": {"h": "2"}}}}},
        )
        got = apps.read_namespaced_daemon_set("agent", "kube-system")
        assert got.spec.template.metadata.annotations == {"h": "2"} and got.metadata.generation == 2
        coord = client.CoordinationV1Api(api)
        lease = client.V1Lease(
            metadata=client.V1ObjectMeta(name="l"),
            spec=client.V1LeaseSpec(holder_identity="me", lease_duration_seconds=15),
        )
        coord.create_namespaced_lease("default", lease)
        assert coord.read_namespaced_lease("l", "default").spec.holder_identity == "me"
        client.CoreV1Api(api).create_namespaced_event(
            "default",
            client.CoreV1Event(
                metadata=client.V1ObjectMeta(generate_name="e-"),
                involved_object=client.V1ObjectReference(kind="Pod", name="a"),
                reason="Test", message="hello",
            ),
        )  # fmt: skip
        events = client.CoreV1Api(api).list_namespaced_event("default").items
        assert [e.reason for e in events] == ["Test"] and events[0].metadata.name.startswith("e-")
        assert client.VersionApi(api).get_code().major == "1"
        groups = {g.name for g in client.ApisApi(api).get_api_versions().groups}
        assert {"apps", "cilium.io", "coordination.k8s.io"} <= groups
        names = {r.name for r in client.CoreV1Api(api).get_api_resources().resources}
        assert {"pods", "pods/status", "nodes", "namespaces", "events"} <= names


def test_new_crd_is_served_at_once(kube_api: KubeAPI) -> None:
    with kube_api.api_client() as api:
        crd = {
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": "widgets.example.com"},
            "spec": {
                "group": "example.com",
                "scope": "Namespaced",
                "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
                "versions": [{"name": "v1", "served": True, "storage": True}],
            },
        }
        client.ApiextensionsV1Api(api).create_custom_resource_definition(crd)
        co = client.CustomObjectsApi(api)
        co.create_namespaced_custom_object(
            "example.com", "v1", "default", "widgets",
            {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}},
        )  # fmt: skip
        assert co.get_namespaced_custom_object("example.com", "v1", "default", "widgets", "w")


def test_thread_safe_helpers_are_visible_to_clients(kube_api: KubeAPI) -> None:
    kube_api.mock.put_object(cnode("direct"))
    with kube_api.api_client() as api:
        co = client.CustomObjectsApi(api)
        assert co.get_cluster_custom_object(*CN, "direct")["spec"]["ipam"]["podCIDRs"]
    assert [o["metadata"]["name"] for o in kube_api.mock.objects("CiliumNode")] == ["direct"]
    kube_api.mock.delete_object("CiliumNode", "direct")
    assert kube_api.mock.objects("CiliumNode") == []


def test_kubeconfig_file_loads_in_the_official_client(kube_api: KubeAPI) -> None:
    from kubernetes import config

    api = config.new_client_from_config(str(kube_api.kubeconfig))
    with api:
        assert client.CoreV1Api(api).list_node().items == []


def test_bad_selector_is_400() -> None:
    with KubeMock() as mock:
        cfg = client.Configuration()
        cfg.host = mock.url
        with client.ApiClient(cfg) as api, pytest.raises(ApiException) as err:
            client.CoreV1Api(api).list_pod_for_all_namespaces(label_selector="a in b")
        assert err.value.status == 400
