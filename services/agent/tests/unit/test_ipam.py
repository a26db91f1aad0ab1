"""Node-local IPAM: demand formula and the allocator's guarantees."""

from __future__ import annotations

import ipaddress
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
