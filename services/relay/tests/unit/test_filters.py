"""FlowFilter building of ``observe``: hubble's left/right semantics and validation."""

from __future__ import annotations

import pytest

from cilia.hubble.flow import flow_pb2
from cilia_relay.cli.filters import FilterError, build_whitelist
from cilia_relay.cli.observe import ObserveOptions, build_request


def test_no_filter_flags_give_an_empty_whitelist() -> None:
    assert build_whitelist([]) == []


def test_pod_matches_either_side_as_two_filters() -> None:
    assert build_whitelist([("pod", "default/frontend")]) == [
        flow_pb2.FlowFilter(source_pod=["default/frontend"]),
        flow_pb2.FlowFilter(destination_pod=["default/frontend"]),
    ]


def test_from_pod_and_to_pod_make_one_filter_with_both_fields() -> None:
    assert build_whitelist([("from-pod", "default/frontend"), ("to-pod", "default/backend")]) == [
        flow_pb2.FlowFilter(source_pod=["default/frontend"], destination_pod=["default/backend"])
    ]


def test_symmetric_flags_are_added_to_both_sides() -> None:
    filters = build_whitelist(
        [("pod", "default/backend"), ("verdict", "DROPPED"), ("protocol", "tcp")]
    )
    assert filters == [
        flow_pb2.FlowFilter(
            source_pod=["default/backend"], verdict=[flow_pb2.DROPPED], protocol=["tcp"]
        ),
        flow_pb2.FlowFilter(
            destination_pod=["default/backend"], verdict=[flow_pb2.DROPPED], protocol=["tcp"]
        ),
    ]


def test_port_and_label_are_strings_on_source_left_and_destination_right() -> None:
    filters = build_whitelist([("port", "8080"), ("label", "k8s:app=backend")])
    assert filters == [
        flow_pb2.FlowFilter(source_port=["8080"], source_label=["k8s:app=backend"]),
        flow_pb2.FlowFilter(destination_port=["8080"], destination_label=["k8s:app=backend"]),
    ]


def test_repeated_flags_accumulate_in_order() -> None:
    filters = build_whitelist([("verdict", "FORWARDED"), ("verdict", "dropped")])
    assert filters == [flow_pb2.FlowFilter(verdict=[flow_pb2.FORWARDED, flow_pb2.DROPPED])]


def test_protocol_is_passed_as_typed() -> None:
    assert build_whitelist([("protocol", "UDP")]) == [flow_pb2.FlowFilter(protocol=["UDP"])]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ([("verdict", "MAYBE")], "invalid --verdict value"),
        ([("port", "70000")], "invalid --port value"),
        ([("port", "http")], "invalid --port value"),
        ([("protocol", "carrier-pigeon")], "invalid --protocol value"),
        ([("pod", "")], "invalid --pod value"),
        ([("pod", "a/b/c")], "invalid --pod value"),
        ([("label", "")], "invalid --label value"),
        ([("pod", "x"), ("from-pod", "y")], "filters --from-pod and --pod cannot be combined"),
        ([("to-pod", "x"), ("pod", "y")], "filters --to-pod and --pod cannot be combined"),
    ],
)
def test_bad_filter_values_are_refused(flags: list[tuple[str, str]], message: str) -> None:
    with pytest.raises(FilterError, match=message):
        build_whitelist(flags)


def test_request_defaults_to_the_last_20_flows_without_follow() -> None:
    assert build_request(ObserveOptions()).number == 20
    followed = build_request(ObserveOptions(follow=True))
    assert (followed.number, followed.follow) == (0, True)
    assert build_request(ObserveOptions(last=5, follow=True)).number == 5
