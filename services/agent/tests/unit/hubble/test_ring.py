"""Flow ring: capacity rules, wraparound, readers, follow and lost accounting."""

from __future__ import annotations

import asyncio

import pytest

from cilia_agent.hubble.errors import InvalidCapacity
from cilia_agent.hubble.ring import Lost, Ring, validate_capacity

from .helpers import run


@pytest.mark.parametrize("capacity", [1, 3, 7, 4095, 65535])
def test_capacity_of_the_form_2n_minus_1_is_accepted(capacity: int) -> None:
    assert validate_capacity(capacity) == capacity
    assert Ring[int](capacity).capacity == capacity


@pytest.mark.parametrize("capacity", [0, -1, 2, 4, 4096, 1000, 65536, 131071])
def test_other_capacities_are_refused_with_the_rule_in_the_message(capacity: int) -> None:
    with pytest.raises(InvalidCapacity, match=r"2\^n-1 between 1 and 65535"):
        Ring[int](capacity)


def test_wraparound_keeps_exactly_the_last_capacity_items() -> None:
    ring = Ring[int](7)
    for i in range(20):
        ring.write(i)
    assert len(ring) == 7
    assert (ring.oldest, ring.next_seq, ring.written) == (13, 20, 20)
    assert list(ring.iter_range(0)) == list(range(13, 20))
    with pytest.raises(IndexError):
        ring.get(12)
    with pytest.raises(IndexError):
        ring.get(20)
    assert ring.get(19) == 19


def test_last_and_first_n_are_returned_oldest_first() -> None:
    ring = Ring[int](15)
    for i in range(30):
        ring.write(i)
    assert ring.last(3) == [27, 28, 29]
    assert ring.first(3) == [15, 16, 17]
    assert ring.last(100) == list(range(15, 30))
    assert ring.first(0) == [] and ring.last(0) == []


def test_partially_filled_ring_reads_from_zero() -> None:
    ring = Ring[int](15)
    for i in range(4):
        ring.write(i)
    assert (len(ring), ring.oldest) == (4, 0)
    assert ring.first(2) == [0, 1] and ring.last(2) == [2, 3]


def test_time_range_skips_before_since_and_stops_after_until() -> None:
    ring = Ring[int](15, time_of=lambda x: x * 10)
    for i in range(10):
        ring.write(i)
    assert ring.read_time_range(30, 60) == [3, 4, 5, 6]
    assert ring.read_time_range(None, 15) == [0, 1]
    assert ring.read_time_range(85, None) == [9]


def test_follow_yields_existing_then_new_items_without_polling() -> None:
    async def scenario() -> list[int | Lost]:
        ring = Ring[int](7)
        ring.write(0)
        got: list[int | Lost] = []

        async def reader() -> None:
            async for item in ring.follow(start=0):
                got.append(item)
                if len(got) == 3:
                    return

        task = asyncio.create_task(reader())
        await asyncio.sleep(0)
        assert got == [0]
        ring.write(1)
        ring.write(2)
        await asyncio.wait_for(task, 1)
        return got

    assert run(scenario()) == [0, 1, 2]


def test_follow_from_next_seq_sees_only_new_items() -> None:
    async def scenario() -> list[int | Lost]:
        ring = Ring[int](7)
        for i in range(5):
            ring.write(i)
        agen = ring.follow()
        first = asyncio.ensure_future(agen.__anext__())
        await asyncio.sleep(0)
        assert not first.done()
        ring.write(99)
        return [await asyncio.wait_for(first, 1)]

    assert run(scenario()) == [99]


def test_follower_overtaken_by_the_writer_gets_a_lost_count_then_the_oldest() -> None:
    async def scenario() -> list[int | Lost]:
        ring = Ring[int](7)
        agen = ring.follow(start=0)
        ring.write(0)
        got = [await agen.__anext__()]  # reads 0, now at seq 1
        for i in range(1, 20):  # writer laps the reader: seqs 1..12 are overwritten
            ring.write(i)
        got.append(await agen.__anext__())
        got.append(await agen.__anext__())
        return got

    assert run(scenario()) == [0, Lost(12), 13]


def test_cancelled_follower_leaves_no_live_waiter() -> None:
    async def scenario() -> None:
        ring = Ring[int](3)
        task = asyncio.create_task(ring.wait_beyond(0))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        ring.write(1)  # must not fail on the cancelled future

    run(scenario())
