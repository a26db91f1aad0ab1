import ipaddress
from typing import Any

import pytest

from cilia_operator.config import Config
from cilia_operator.ipam.changes import NodeNetworks, plan_numbers, plan_pool_change
from cilia_operator.ipam.pool import PoolSpec
from cilia_operator.ipam.resolve import NoPoolMatch, resolve_pool, selector_matches

Net = ipaddress.IPv4Network


def pool(name: str, **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": spec}


def resolve(**kw: Any) -> Any:
    args: dict[str, Any] = {
        "namespace": "ns",
        "name": "pod",
        "pod_labels": {},
        "pod_annotations": {},
        "namespace_obj": None,
        "pools": [pool("default"), pool("blue"), pool("red")],
        "default_pool": "default",
    }
    args.update(kw)
    return resolve_pool(**args)


def test_family_key_beats_generic_key_and_pod_beats_namespace() -> None:
    ns = {"metadata": {"annotations": {"ipam.cilium.io/ipv4-pool": "red"}}}
    got = resolve(pod_annotations={"ipam.cilium.io/ip-pool": "blue"}, namespace_obj=ns)
    assert got.pool == "blue" and got.reason == "pod annotation ipam.cilium.io/ip-pool"
    got = resolve(namespace_obj=ns)
    assert got.pool == "red" and got.reason == "namespace annotation ipam.cilium.io/ipv4-pool"


def test_pod_name_and_namespace_are_selectable_labels() -> None:
    pools = [pool("default"), pool("db", podSelector={"matchLabels": {
        "io.kubernetes.pod.namespace": "ns", "io.kubernetes.pod.name": "pod"}})]  # fmt: skip
    assert resolve(pools=pools).pool == "db"
    assert resolve(pools=pools, name="other").pool == "default"


def test_annotation_wins_over_selectors_and_several_matches_fail() -> None:
    pools = [pool("a", podSelector={}), pool("b", namespaceSelector={}), pool("default")]
    with pytest.raises(NoPoolMatch, match="several pools"):
        resolve(pools=pools)
    assert resolve(pools=pools, pod_annotations={"ipam.cilium.io/ip-pool": "a"}).pool == "a"


def test_require_pool_match_forbids_the_default_fallback() -> None:
    strict = {"ipam.cilium.io/require-pool-match": "true"}
    with pytest.raises(NoPoolMatch, match="require-pool-match"):
        resolve(pod_annotations=strict)
    with pytest.raises(NoPoolMatch, match="'ghost'"):
        resolve(pod_annotations={**strict, "ipam.cilium.io/ip-pool": "ghost"})


@pytest.mark.parametrize(
    ("selector", "labels", "expected"),
    [
        ({"matchExpressions": [{"key": "a", "operator": "In", "values": ["1"]}]}, {"a": "1"}, True),
        ({"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["1"]}]}, {"a": "1"},
         False),
        ({"matchExpressions": [{"key": "a", "operator": "Exists"}]}, {}, False),
        ({"matchExpressions": [{"key": "a", "operator": "DoesNotExist"}]}, {}, True),
        ({}, {"x": "y"}, True),
    ],
)  # fmt: skip
def test_selector_operators(selector: Any, labels: Any, expected: bool) -> None:
    assert selector_matches(selector, labels) is expected


def test_plan_numbers_match_the_issue_example() -> None:
    plan = plan_numbers([Net("172.24.0.0/20")], 24, False, False)
    assert (plan.blocks, plan.usable_per_block, plan.total_usable) == (16, 254, 4064)
    assert plan_numbers([Net("172.24.0.0/20")], 24, True, False).usable_per_block == 255
    assert plan_numbers([Net("10.0.0.0/30")], 31, False, False).usable_per_block == 2
    # the agent's router IP takes the first usable address of a node's first block
    assert (plan.pods_per_node, plan.pods_total) == (253, 4048)
    assert plan_numbers([Net("10.0.0.0/30")], 31, False, False).pods_per_node == 1
    assert plan_numbers([Net("10.0.0.0/30")], 32, False, False).pods_per_node == 0
    with pytest.raises(ValueError, match="shorter than the prefix"):
        plan_numbers([Net("172.24.0.0/20")], 16, False, False)


def spec(*cidrs: str, draining: tuple[str, ...] = ()) -> PoolSpec:
    return PoolSpec("blue", tuple(Net(c) for c in cidrs), 24,
                    draining=tuple(Net(c) for c in draining))  # fmt: skip


def test_shrink_drains_the_removed_cidr_and_names_each_holder() -> None:
    holdings = {"n1": [("blue", Net("10.1.1.0/24"))], "n2": [("blue", Net("10.1.0.0/24"))]}
    change = plan_pool_change(spec("10.1.0.0/24"), spec("10.1.0.0/24", "10.1.1.0/24"), holdings)
    assert change.errors == [] and change.draining == [Net("10.1.1.0/24")]
    assert change.effects == [
        "node n1: pool blue CIDR 10.1.1.0/24 would start draining (block 10.1.1.0/24 stays in "
        "use, no new blocks from it; released when the node hands it back)"
    ]


def test_re_adding_a_draining_cidr_ends_draining_and_overlapping_it_is_refused() -> None:
    stored = spec("10.1.0.0/24", draining=("10.1.1.0/24",))
    back = plan_pool_change(spec("10.1.0.0/24", "10.1.1.0/24"), stored, {})
    assert back.draining == [] and "re-added: stops draining" in back.effects[0]
    clash = plan_pool_change(spec("10.1.0.0/24", "10.1.0.0/16"), stored, {})
    assert any("overlaps draining CIDR 10.1.1.0/24" in e.reason for e in clash.errors)


def test_node_network_inside_its_own_block_is_not_a_clash() -> None:
    own = NodeNetworks("n1", (("cilium_host", Net("10.1.0.1/32")),), (Net("10.1.0.0/24"),))
    lan = NodeNetworks("n2", (("eth1", Net("10.1.0.0/25")),))
    change = plan_pool_change(spec("10.1.0.0/24"), None, {}, node_networks=[own, lan])
    assert [e.reason for e in change.errors] == [
        "10.1.0.0/24 overlaps node 'n2' interface eth1 subnet 10.1.0.0/25 (a network attached "
        "to the node: its addresses would be answered by the pod network)"
    ]


def test_cluster_pool_flags_are_validated() -> None:
    with pytest.raises(ValueError, match="--cluster-pool-ipv4-cidr: required"):
        Config(ipam="cluster-pool")
    with pytest.raises(ValueError, match="lies inside --service-cluster-ip-range"):
        Config(ipam="cluster-pool", cluster_pool_ipv4_cidr=["10.96.0.0/16"])
    with pytest.raises(ValueError, match="needs --ipam multi-pool"):
        Config(ipam="cluster-pool", cluster_pool_ipv4_cidr=["10.0.0.0/16"],
               enable_cluster_pool_to_multi_pool_migration=True)  # fmt: skip
    ok = Config(ipam="cluster-pool", cluster_pool_ipv4_cidr=["10.0.0.0/16,10.1.0.0/16"])
    assert ok.cluster_pool_cidrs == (Net("10.0.0.0/16"), Net("10.1.0.0/16"))
    assert ok.service_cidrs == (Net("10.96.0.0/12"),)


def test_cluster_pool_mask_leaving_no_pod_address_is_refused() -> None:
    with pytest.raises(ValueError, match=r"--cluster-pool-ipv4-mask-size: 32: a /32 block has 1 "
                       "usable address and the agent takes the first as its router IP"):  # fmt: skip
        Config(ipam="cluster-pool", cluster_pool_ipv4_cidr=["10.0.0.0/16"],
               cluster_pool_ipv4_mask_size=32)  # fmt: skip
    ok = Config(ipam="cluster-pool", cluster_pool_ipv4_cidr=["10.0.0.0/16"],
                cluster_pool_ipv4_mask_size=31)  # fmt: skip
    assert ok.cluster_pool_ipv4_mask_size == 31


def test_dry_run_of_a_new_pool_counts_pod_ips_like_plan() -> None:
    new = PoolSpec("blue", (Net("10.1.0.0/24"),), 30, allow_first_ip=True)
    change = plan_pool_change(new, None, {})
    plan = plan_numbers(new.cidrs, 30, True, False)
    assert (plan.usable_per_block, plan.pods_per_node) == (3, 2)
    assert change.effects == [
        "pool blue: created with 64 blocks of /30 (2 pod IPs each: 3 usable, the agent's "
        "router IP takes one)"
    ]
