"""The pure merge logic: bounded time-ordered buffer and NODE_ERROR aggregation (fake time)."""

from __future__ import annotations

import pytest

from cilia.hubble.observer import observer_pb2
from cilia.hubble.relay import relay_pb2
from cilia_relay.merge import (
    ErrorAggregator,
    SortBuffer,
    response_time_ns,
    sort_buffer_len,
)

S = 1_000_000_000


def resp(t_ns: int, node: str = "n") -> observer_pb2.GetFlowsResponse:
    r = observer_pb2.GetFlowsResponse(node_name=node)
    r.flow.node_name = node
    r.time.FromNanoseconds(t_ns)
    return r


def err(message: str, *nodes: str) -> observer_pb2.GetFlowsResponse:
    return observer_pb2.GetFlowsResponse(
        node_status=relay_pb2.NodeStatusEvent(
            state_change=relay_pb2.NODE_ERROR, node_names=list(nodes), message=message
        )
    )


def times(items: list[observer_pb2.GetFlowsResponse]) -> list[int]:
    return [response_time_ns(r) for r in items]


def test_drain_returns_items_oldest_first_by_seconds_then_nanos() -> None:
    buf: SortBuffer[observer_pb2.GetFlowsResponse] = SortBuffer(10, response_time_ns)
    for t in (5 * S + 1, 3 * S, 5 * S, 4 * S + 999_999_999, 1):
        assert buf.push(resp(t)) == []
    assert times(buf.drain()) == [1, 3 * S, 4 * S + 999_999_999, 5 * S, 5 * S + 1]
    assert len(buf) == 0


def test_equal_times_keep_arrival_order() -> None:
    buf: SortBuffer[observer_pb2.GetFlowsResponse] = SortBuffer(10, response_time_ns)
    for node in ("a", "b", "c"):
        buf.push(resp(7, node))
    assert [r.node_name for r in buf.drain()] == ["a", "b", "c"]


def test_full_buffer_pops_the_oldest_before_each_push() -> None:
    buf: SortBuffer[observer_pb2.GetFlowsResponse] = SortBuffer(3, response_time_ns)
    assert buf.push(resp(30)) == []
    assert buf.push(resp(10)) == []
    assert buf.push(resp(20)) == []
    assert times(buf.push(resp(40))) == [10]
    # the oldest held leaves even when the new item is older still
    assert times(buf.push(resp(5))) == [20]
    assert len(buf) == 3
    assert times(buf.drain()) == [5, 30, 40]


def test_bound_never_exceeded_and_output_sorted_for_interleaved_streams() -> None:
    buf: SortBuffer[observer_pb2.GetFlowsResponse] = SortBuffer(4, response_time_ns)
    a = [resp(t * S, "a") for t in range(0, 20, 2)]
    b = [resp(t * S, "b") for t in range(1, 20, 2)]
    out: list[observer_pb2.GetFlowsResponse] = []
    for x, y in zip(a, b, strict=True):
        out += buf.push(y)
        out += buf.push(x)
        assert len(buf) <= 4
    out += buf.drain()
    assert times(out) == sorted(times(out))
    assert len(out) == 20


def test_pop_older_than_flushes_only_entries_before_the_cutoff() -> None:
    """Drain timeout with fake time: idle at now=100 s, drain timeout 1 s → cutoff 99 s."""
    buf: SortBuffer[observer_pb2.GetFlowsResponse] = SortBuffer(10, response_time_ns)
    for t in (97 * S, 99 * S + 500_000_000, 98 * S, 99 * S):
        buf.push(resp(t))
    now, drain_timeout = 100 * S, 1 * S
    assert times(buf.pop_older_than(now - drain_timeout)) == [97 * S, 98 * S]
    assert times(buf.pop_older_than(now - drain_timeout)) == []
    assert times(buf.drain()) == [99 * S, 99 * S + 500_000_000]


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity"):
        SortBuffer(0, response_time_ns)


@pytest.mark.parametrize(
    ("len_max", "number", "peers", "expected"),
    [
        (100, 0, 3, 100),  # follow without number
        (100, 20, 2, 40),
        (100, 60, 2, 100),
        (100, 5, 0, 100),  # no peers yet
        (1, 5, 5, 1),
    ],
)
def test_sort_buffer_len_is_min_of_max_and_number_times_peers(
    len_max: int, number: int, peers: int, expected: int
) -> None:
    assert sort_buffer_len(len_max, number, peers) == expected


def test_identical_errors_within_the_window_are_merged() -> None:
    agg = ErrorAggregator(window=10.0)
    assert agg.offer(err("rpc error: boom", "node-a"), now=0.0) == []
    assert agg.offer(err("rpc error: boom", "node-b"), now=4.0) == []
    assert agg.due(9.9) == []
    (merged,) = agg.due(10.0)
    assert list(merged.node_status.node_names) == ["node-a", "node-b"]
    assert agg.flush_at is None


def test_a_different_error_sends_the_pending_one_and_opens_a_new_window() -> None:
    agg = ErrorAggregator(window=10.0)
    agg.offer(err("first", "node-a"), now=0.0)
    (sent,) = agg.offer(err("second", "node-b"), now=1.0)
    assert sent.node_status.message == "first"
    assert agg.flush_at == pytest.approx(11.0)
    (last,) = agg.flush()
    assert last.node_status.message == "second"


def test_flows_pass_through_while_an_error_waits() -> None:
    agg = ErrorAggregator(window=10.0)
    agg.offer(err("boom", "node-a"), now=0.0)
    flow = resp(1)
    assert agg.offer(flow, now=1.0) == [flow]
    # a flow arriving after the window also releases the pending error
    out = agg.offer(resp(2), now=12.0)
    assert [r.WhichOneof("response_types") for r in out] == ["flow", "node_status"]


def test_zero_window_sends_every_error_at_once() -> None:
    agg = ErrorAggregator(window=0.0)
    assert len(agg.offer(err("boom", "node-a"), now=0.0)) == 1
    assert agg.flush() == []
