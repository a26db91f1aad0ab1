"""Node-local IPAM: demand formula and the allocator's guarantees."""

from __future__ import annotations

import ipaddress
import re
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cilia_agent.ipam import IPAM, AddressInUse, PoolExhausted, needed_ip_ceil


@pytest.mark.parametrize(
    ("n", "pre", "want"),
    [(3, 8, 16), (9, 8, 24), (17, 8, 32), (8, 8, 16), (0, 8, 8), (1, 0, 1), (0, 0, 0), (5, 0, 5)],
)
def test_needed_ip_ceil_matches_upstream_values(n: int, pre: int, want: int) -> None:
    assert needed_ip_ceil(n, pre) == want


def test_needed_ip_ceil_rejects_negative_input() -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        needed_ip_ceil(-1, 8)


def test_allocator_skips_network_and_broadcast_addresses() -> None:
    ipam = IPAM()
    ipam.add_cidrs("default", ["10.251.0.0/30"])
    got = {ipam.allocate("default", f"o{i}") for i in range(2)}
    assert got == {ipaddress.IPv4Address("10.251.0.1"), ipaddress.IPv4Address("10.251.0.2")}
    with pytest.raises(PoolExhausted, match="'default'"):
        ipam.allocate("default", "o3")


def test_slash_32_and_31_cidrs_use_every_address() -> None:
    ipam = IPAM()
    ipam.add_cidrs("p", ["10.251.1.0/31", "10.251.2.7/32"])
    assert ipam.status()[0].capacity == 3


def test_reserved_router_ip_is_never_handed_out() -> None:
    ipam = IPAM()
    ipam.add_cidrs("default", ["10.251.0.0/29"])
    ipam.occupy("10.251.0.1", "router")
    got = [ipam.allocate("default", f"o{i}") for i in range(5)]
    assert ipaddress.IPv4Address("10.251.0.1") not in got


def test_occupy_by_another_owner_raises_address_in_use() -> None:
    ipam = IPAM()
    ipam.add_cidrs("default", ["10.251.0.0/24"])
    ipam.occupy("10.251.0.5", "a")
    ipam.occupy("10.251.0.5", "a")  # same owner: no-op
    with pytest.raises(AddressInUse):
        ipam.occupy("10.251.0.5", "b")


def test_unknown_pool_is_exhausted_and_counts_as_pending_demand() -> None:
    ipam = IPAM({"default": 8})
    with pytest.raises(PoolExhausted, match="'blue'"):
        ipam.allocate("blue", "pod")
    assert ipam.demand() == {"blue": 1, "default": 8}


def test_pending_demand_expires_after_ttl() -> None:
    now = [0.0]
    ipam = IPAM({}, pending_ttl=300, clock=lambda: now[0])
    with pytest.raises(PoolExhausted):
        ipam.allocate("blue", "pod")
    now[0] = 301
    assert ipam.demand() == {}


def test_demand_counts_in_use_addresses_with_pre_allocation() -> None:
    ipam = IPAM({"default": 8})
    ipam.add_cidrs("default", ["10.251.0.0/24"])
    for i in range(9):
        ipam.allocate("default", f"o{i}")
    assert ipam.demand() == {"default": 24}


def test_overlapping_cidrs_are_rejected() -> None:
    ipam = IPAM()
    ipam.add_cidrs("a", ["10.251.0.0/24"])
    with pytest.raises(ValueError, match="overlaps"):
        ipam.add_cidrs("b", ["10.251.0.128/25"])


def test_cidr_in_use_is_not_dropped() -> None:
    ipam = IPAM()
    ipam.add_cidrs("p", ["10.251.0.0/24", "10.251.1.0/24"])
    ipam.occupy("10.251.0.9", "x")
    dropped = ipam.remove_unused_cidrs("p", [])
    assert [str(c) for c in dropped] == ["10.251.1.0/24"]
    assert ipam.cidrs() == {"p": ["10.251.0.0/24"]}


def test_released_address_is_not_reused_before_the_rest_of_the_cidr() -> None:
    ipam = IPAM()
    ipam.add_cidrs("p", ["10.251.0.0/29"])
    a = ipam.allocate("p", "a")
    ipam.release(a)
    assert ipam.allocate("p", "b") != a


def test_concurrent_threads_never_get_the_same_address() -> None:
    ipam = IPAM()
    ipam.add_cidrs("p", ["10.251.0.0/22"])
    results: list[ipaddress.IPv4Address] = []
    lock = threading.Lock()

    def worker(k: int) -> None:
        for i in range(100):
            addr = ipam.allocate("p", f"{k}-{i}")
            with lock:
                results.append(addr)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 800 and len(set(results)) == 800


@settings(max_examples=150, deadline=None)
@given(
    prefix=st.integers(min_value=26, max_value=32),
    ops=st.lists(st.tuples(st.booleans(), st.integers(min_value=0, max_value=80)), max_size=120),
)
def test_allocator_never_hands_out_an_address_twice(
    prefix: int, ops: list[tuple[bool, int]]
) -> None:
    net = ipaddress.IPv4Network(f"10.251.7.0/{prefix}")
    ipam = IPAM()
    ipam.add_cidrs("p", [net])
    held: dict[ipaddress.IPv4Address, str] = {}
    for n, (alloc, pick) in enumerate(ops):
        if alloc or not held:
            try:
                addr = ipam.allocate("p", f"o{n}")
            except PoolExhausted:
                assert len(held) == ipam.status()[0].capacity
                continue
            assert addr not in held
            assert addr in net
            if prefix <= 30:
                assert addr not in (net.network_address, net.broadcast_address)
            held[addr] = f"o{n}"
        else:
            addr = sorted(held)[pick % len(held)]
            assert ipam.release(addr)
            del held[addr]
    assert ipam.allocated() == held


def test_empty_cidr_is_handed_back_only_when_the_rest_covers_the_demand() -> None:
    ipam = IPAM({"default": 8})
    ipam.add_cidrs("default", ["10.251.0.0/28", "10.251.0.16/28", "10.251.0.32/28"])
    ipam.occupy("10.251.0.1", "router")
    # 14 usable per /28; 1 in use → 16 needed: two /28 (28) cover it, the last goes.
    taken = ipam.take_unneeded(ipam.demand())
    assert taken == {"default": [ipaddress.IPv4Network("10.251.0.32/28")]}
    assert ipam.cidrs() == {"default": ["10.251.0.0/28", "10.251.0.16/28"]}
    assert ipam.take_unneeded(ipam.demand()) == {}  # one /28 (14) < 16 needed
    with pytest.raises(PoolExhausted):
        for i in range(30):
            ipam.allocate("default", f"o{i}")
    assert all(a not in ipaddress.IPv4Network("10.251.0.32/28") for a in ipam.allocated())


def test_draining_cidr_gives_no_new_address_and_is_handed_back_when_empty() -> None:
    ipam = IPAM()
    ipam.add_cidrs("blue", ["10.251.1.0/29", "10.251.2.0/29"])
    old = ipam.allocate("blue", "old")
    assert old in ipaddress.IPv4Network("10.251.1.0/29")
    ipam.set_draining("blue", ["10.251.1.0/29"])
    assert ipam.free("blue") == 6
    new = [ipam.allocate("blue", f"n{i}") for i in range(6)]
    assert all(a in ipaddress.IPv4Network("10.251.2.0/29") for a in new)
    with pytest.raises(PoolExhausted, match=re.escape("draining, no new addresses: 10.251.1.0/29")):
        ipam.allocate("blue", "late")
    assert ipam.take_unneeded({"blue": 8}) == {}  # the draining CIDR still holds "old"
    ipam.release(old)
    assert ipam.take_unneeded({"blue": 8}) == {"blue": [ipaddress.IPv4Network("10.251.1.0/29")]}
    assert ipam.status()[0].draining == []


def test_node_pools_never_bring_back_a_cidr_handed_back_while_still_listed() -> None:
    from cilia_agent.ipam.node import NodePools

    ipam = IPAM({"default": 8})
    pools = NodePools(ipam, "multi-pool")
    listed = {"default": ["10.251.0.0/24", "10.251.1.0/24"]}
    pools.apply("default", listed)
    demand = pools.demand("default")
    assert demand is not None and demand.released == {"default": ["10.251.1.0/24"]}
    pools.apply("default", listed)  # sent before the operator processed the release
    assert ipam.cidrs() == {"default": ["10.251.0.0/24"]}
    again = pools.demand("default")
    assert again is not None and again.released == demand.released  # repeated until gone
    pools.apply("default", {"default": ["10.251.0.0/24"]})
    final = pools.demand("default")
    assert final is not None and final.released == {}


def test_cluster_pool_holds_pod_cidrs_as_the_default_pool_and_sends_no_demand() -> None:
    from cilia_agent.ipam.node import NodePools

    ipam = IPAM({"default": 8})
    pools = NodePools(ipam, "cluster-pool")
    pools.apply("default", {"blue": ["10.251.5.0/24"]}, ["10.251.4.0/24"])
    assert ipam.cidrs() == {"default": ["10.251.4.0/24"]}
    assert pools.demand("default") is None
    # After the operator's migration: the same CIDR as pools.allocated[default].
    pools.apply("default", {"default": ["10.251.4.0/24"]}, [])
    assert ipam.cidrs() == {"default": ["10.251.4.0/24"]}
    with pytest.raises(ValueError, match="ipam"):
        NodePools(ipam, "crd")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("allow_first", "allow_last", "want"),
    [
        (False, False, ["10.251.6.1", "10.251.6.2"]),
        (True, False, ["10.251.6.0", "10.251.6.1", "10.251.6.2"]),
        (False, True, ["10.251.6.1", "10.251.6.2", "10.251.6.3"]),
        (True, True, ["10.251.6.0", "10.251.6.1", "10.251.6.2", "10.251.6.3"]),
    ],
)
def test_allow_first_and_last_ip_decide_the_usable_addresses_of_a_slash_30(
    allow_first: bool, allow_last: bool, want: list[str]
) -> None:
    ipam = IPAM()
    ipam.set_reservation("p", allow_first, allow_last)
    ipam.add_cidrs("p", ["10.251.6.0/30"])
    assert ipam.free("p") == len(want) and ipam.status()[0].capacity == len(want)
    got = sorted(ipam.allocate("p", f"o{i}") for i in range(len(want)))
    assert got == [ipaddress.IPv4Address(a) for a in want]
    with pytest.raises(PoolExhausted):
        ipam.allocate("p", "one-too-many")
    assert ipam.first_usable("10.251.6.0/30") == ipaddress.IPv4Address(want[0])


def test_slash_31_and_32_ignore_the_reservation_flags() -> None:
    ipam = IPAM()
    ipam.set_reservation("p", False, False)
    ipam.add_cidrs("p", ["10.251.7.0/31", "10.251.7.9/32"])
    assert ipam.free("p") == 3
    assert ipam.first_usable("10.251.7.0/31") == ipaddress.IPv4Address("10.251.7.0")


def test_node_pools_take_allow_first_last_from_the_allocation_into_hand_back_math() -> None:
    from cilia_agent.ipam.node import NodePools

    ipam = IPAM({"blue": 16})
    pools = NodePools(ipam, "multi-pool")
    listed = {"blue": ["10.251.8.0/28", "10.251.8.16/28"]}
    # Reserved (default): 14 + 14 usable; 16 needed → both /28 stay.
    pools.apply("default", listed)
    demand = pools.demand("blue")
    assert demand is not None and demand.released == {} and ipam.free("blue") == 28
    # allowFirstIP + allowLastIP: 16 per /28 → one /28 covers 16, the other is handed back.
    pools.apply("default", listed, reservation={"blue": (True, True)})
    assert ipam.free("blue") == 32
    demand = pools.demand("blue")
    assert demand is not None and demand.released == {"blue": ["10.251.8.16/28"]}
    assert ipam.free("blue") == 16
    got = {ipam.allocate("blue", f"o{i}") for i in range(16)}
    assert got == set(ipaddress.IPv4Network("10.251.8.0/28"))


def test_pool_status_lists_draining_cidrs() -> None:
    ipam = IPAM()
    ipam.add_cidrs("blue", ["10.251.9.0/29", "10.251.9.8/29"])
    ipam.allocate("blue", "old")
    ipam.set_draining("blue", ["10.251.9.0/29"])
    (st,) = ipam.status()
    assert st.draining == ["10.251.9.0/29"] and st.cidrs == ["10.251.9.0/29", "10.251.9.8/29"]


def test_node_pools_ignore_an_allocation_older_than_the_last_release_listing_its_cidrs() -> None:
    from cilia_agent.ipam.node import NodePools

    ipam = IPAM({"default": 8})
    pools = NodePools(ipam, "multi-pool")
    both = {"default": ["10.251.10.0/24", "10.251.11.0/24"]}
    pools.apply("default", both, resource_version="5")
    demand = pools.demand("default")
    assert demand is not None and demand.released == {"default": ["10.251.11.0/24"]}
    pools.release_acknowledged(demand.released, "7")  # the operator wrote the release at 7
    # The operator processed it (8): the CIDR leaves the remembered set.
    assert not pools.apply("default", {"default": ["10.251.10.0/24"]}, resource_version="8").stale
    assert pools.released == set()
    # A replayed allocation from before the release (6) must not bring it back.
    old = pools.apply("default", {**both, "blue": ["10.251.12.0/24"]}, resource_version="6")
    assert old.stale and old.added == {}
    assert ipam.cidrs() == {"default": ["10.251.10.0/24"]}
    # Older allocations not listing a released CIDR, and newer ones listing it, apply.
    assert pools.apply("default", {"default": ["10.251.10.0/24"]}, resource_version="6").added == {}
    newer = pools.apply("default", both, resource_version="9")
    assert not newer.stale and newer.added == {"default": ["10.251.11.0/24"]}
    # Non-numeric versions cannot be ordered: never ignored.
    pools.release_acknowledged({"default": ["10.251.11.0/24"]}, "x")
    assert pools.last_release is not None and pools.last_release[0] == 7
    assert not pools.apply("default", both, resource_version="abc").stale
