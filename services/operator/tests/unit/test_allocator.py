import ipaddress
from collections.abc import Mapping, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cilia_operator.ipam.allocator import AllocatorNotReady, MultiPoolAllocator
from cilia_operator.ipam.pool import PoolSpec

Net = ipaddress.IPv4Network
Alloc = dict[str, list[Net]]


def spec(
    name: str, *cidrs: str, mask: int = 24, first: bool = False, last: bool = False
) -> PoolSpec:
    return PoolSpec(name, tuple(Net(c) for c in cidrs), mask, first, last)


def ready(
    *pools: PoolSpec, nodes: Mapping[str, Mapping[str, Sequence[Net]]] | None = None
) -> MultiPoolAllocator:
    alloc = MultiPoolAllocator()
    for p in pools:
        alloc.upsert_pool(p)
    alloc.restore((nodes or {}).items())
    return alloc


def test_reconcile_before_restore_is_refused() -> None:
    alloc = MultiPoolAllocator()
    alloc.upsert_pool(spec("default", "10.0.0.0/16"))
    with pytest.raises(AllocatorNotReady):
        alloc.reconcile("n1", {"default": 1}, {})


def test_demand_is_covered_with_whole_blocks_lowest_first() -> None:
    alloc = ready(spec("default", "10.0.0.0/16"))
    result = alloc.reconcile("n1", {"default": 300}, {})
    assert result.allocated == {"default": [Net("10.0.0.0/24"), Net("10.0.1.0/24")]}
    assert result.error == ""


def test_held_usable_addresses_count_against_demand() -> None:
    alloc = ready(spec("default", "10.0.0.0/16"))
    first = alloc.reconcile("n1", {"default": 254}, {})
    assert len(first.allocated["default"]) == 1
    again = alloc.reconcile("n1", {"default": 254}, first.allocated)
    assert again.allocated == first.allocated and again.added == []
    more = alloc.reconcile("n1", {"default": 255}, first.allocated)
    assert len(more.allocated["default"]) == 2


def test_allow_first_and_last_ip_change_how_many_blocks_are_needed() -> None:
    alloc = ready(spec("p", "10.0.0.0/16", mask=30, first=True, last=True))
    assert len(alloc.reconcile("n1", {"p": 8}, {}).allocated["p"]) == 2  # 4 usable each
    alloc = ready(spec("p", "10.0.0.0/16", mask=30))
    assert len(alloc.reconcile("n1", {"p": 8}, {}).allocated["p"]) == 4  # 2 usable each


def test_restart_never_hands_out_a_block_another_node_holds() -> None:
    nodes = {"n1": {"default": [Net("10.0.0.0/24")]}, "n2": {"default": [Net("10.0.2.0/24")]}}
    alloc = ready(spec("default", "10.0.0.0/22"), nodes=nodes)
    result = alloc.reconcile("n3", {"default": 500}, {})
    assert result.allocated == {"default": [Net("10.0.1.0/24"), Net("10.0.3.0/24")]}


def test_exhausted_pool_reports_an_error_and_keeps_what_it_could_give() -> None:
    alloc = ready(spec("small", "10.0.0.0/23"))
    result = alloc.reconcile("n1", {"small": 1000}, {})
    assert len(result.allocated["small"]) == 2
    assert "pool 'small' exhausted" in result.error and "needed 1000" in result.error


def test_unknown_pool_is_an_error() -> None:
    result = ready().reconcile("n1", {"ghost": 1}, {})
    assert result.error == "pool 'ghost' not found" and result.allocated == {}


def test_block_dropped_from_the_record_is_freed_for_others() -> None:
    alloc = ready(spec("p", "10.0.0.0/24", mask=25))
    held = alloc.reconcile("n1", {"p": 200}, {}).allocated
    assert len(held["p"]) == 2
    # the agent released the second block: it is no longer in the record
    alloc.reconcile("n1", {"p": 10}, {"p": held["p"][:1]})
    assert alloc.reconcile("n2", {"p": 10}, {}).allocated == {"p": [held["p"][1]]}


def test_deleted_node_releases_every_block() -> None:
    alloc = ready(spec("p", "10.0.0.0/24", mask=25))
    alloc.reconcile("n1", {"p": 200}, {})
    assert len(alloc.release_node("n1")) == 2
    assert alloc.stats()["p"].available == 2


def test_blocks_of_a_removed_pool_stay_occupied_when_it_comes_back() -> None:
    alloc = ready(spec("p", "10.0.0.0/24", mask=25))
    held = alloc.reconcile("n1", {"p": 1}, {}).allocated
    alloc.remove_pool("p")
    alloc.upsert_pool(spec("p", "10.0.0.0/24", mask=25))
    assert alloc.reconcile("n2", {"p": 1}, {}).allocated["p"] != held["p"]


def test_record_claiming_another_nodes_block_is_reported() -> None:
    alloc = ready(spec("p", "10.0.0.0/16"), nodes={"n1": {"p": [Net("10.0.0.0/24")]}})
    result = alloc.reconcile("n2", {}, {"p": [Net("10.0.0.0/24")]})
    assert "also held by node 'n1'" in result.error


POOLS = [spec("a", "10.0.0.0/22", mask=24), spec("b", "10.1.0.0/24", "10.2.0.0/25", mask=26)]
NODES = ["n1", "n2", "n3", "n4"]

step = st.one_of(
    st.tuples(
        st.just("demand"), st.sampled_from(NODES), st.sampled_from(["a", "b"]), st.integers(0, 700)
    ),
    st.tuples(
        st.just("release"), st.sampled_from(NODES), st.sampled_from(["a", "b"]), st.integers(0, 5)
    ),
    st.tuples(st.just("delete"), st.sampled_from(NODES), st.just(""), st.just(0)),
    st.tuples(st.just("restart"), st.just(""), st.just(""), st.just(0)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(step, max_size=40))
def test_random_demands_releases_and_restarts_keep_blocks_disjoint(
    steps: list[tuple[str, str, str, int]],
) -> None:
    records: dict[str, Alloc] = {}  # what the store holds: the truth across restarts
    demand: dict[str, dict[str, int]] = {}
    alloc = ready(*POOLS)
    for op, node, pool, n in steps:
        if op == "restart":
            before = {b for rec in records.values() for bl in rec.values() for b in bl}
            alloc = ready(*POOLS, nodes=records)
            for name in sorted(records):
                result = alloc.reconcile(name, demand.get(name, {}), records[name])
                for _, block in result.added:
                    assert block not in before, f"restart re-handed {block}"
                records[name] = result.allocated
            continue
        if op == "delete":
            records.pop(node, None)
            demand.pop(node, None)
            alloc.release_node(node)
            continue
        current = records.get(node, {})
        if op == "release":
            blocks = current.get(pool, [])
            if blocks:
                current = {
                    **current,
                    pool: [b for i, b in enumerate(blocks) if i != n % len(blocks)],
                }
        else:
            demand.setdefault(node, {})[pool] = n
        result = alloc.reconcile(node, demand.get(node, {}), current)
        records[node] = result.allocated
        by_name = {p.name: p for p in POOLS}
        for pool_name, blocks in result.allocated.items():
            p = by_name[pool_name]
            have = sum(p.usable(b) for b in blocks)
            if not result.errors:
                assert have >= demand.get(node, {}).get(pool_name, 0)
        # invariants over every node's record
        every = [(name, pool_name, b) for name, rec in records.items()
                 for pool_name, bl in rec.items() for b in bl]  # fmt: skip
        for i, (n1, p1, b1) in enumerate(every):
            assert b1.prefixlen == by_name[p1].mask_size
            assert any(b1.subnet_of(c) for c in by_name[p1].cidrs), f"{b1} outside pool {p1}"
            for n2, _, b2 in every[i + 1 :]:
                assert not b1.overlaps(b2), f"{b1} ({n1}) overlaps {b2} ({n2})"
