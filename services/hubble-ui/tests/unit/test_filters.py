"""Page filters → the relay's FlowFilter whitelist, combined as ``hubble observe`` does."""

from __future__ import annotations

import pytest

from cilia.hubble.flow import flow_pb2
from cilia_hubble_ui.filters import FilterError, parse_filters


def test_no_filter_asks_for_every_flow() -> None:
    assert parse_filters([]).whitelist == ()
    assert parse_filters([("verdict", ""), ("pod", "")]).whitelist == ()


def test_namespace_is_either_side_pod_prefix() -> None:
    left, right = parse_filters([("namespace", "shop")]).whitelist
    assert list(left.source_pod) == ["shop/"] and not left.destination_pod
    assert list(right.destination_pod) == ["shop/"] and not right.source_pod


def test_symmetric_filters_are_in_both_sides_and_collapse_to_one() -> None:
    (only,) = parse_filters([("verdict", "forwarded"), ("protocol", "TCP")]).whitelist
    assert list(only.verdict) == [flow_pb2.FORWARDED]
    assert list(only.protocol) == ["tcp"]


def test_either_side_filters_with_a_verdict() -> None:
    left, right = parse_filters(
        [("pod", "backend"), ("namespace", "shop"), ("port", "8080"), ("verdict", "DROPPED"),
         ("label", "k8s:app=backend")]
    ).whitelist  # fmt: skip
    assert list(left.source_pod) == ["shop/backend"]
    assert list(right.destination_pod) == ["shop/backend"]
    assert list(left.source_port) == ["8080"] and list(right.destination_port) == ["8080"]
    assert list(left.source_label) == ["k8s:app=backend"]
    assert list(right.destination_label) == ["k8s:app=backend"]
    assert list(left.verdict) == list(right.verdict) == [flow_pb2.DROPPED]


def test_from_and_to_filters_are_one_sided() -> None:
    (only,) = parse_filters(
        [("from-pod", "shop/frontend"), ("to-label", "app in (backend, db)")]
    ).whitelist
    assert list(only.source_pod) == ["shop/frontend"]
    assert list(only.destination_label) == ["app in (backend, db)"]


def test_repeated_values_are_ored_in_one_field() -> None:
    (only,) = parse_filters([("verdict", "DROPPED"), ("verdict", "ERROR")]).whitelist
    assert list(only.verdict) == [flow_pb2.DROPPED, flow_pb2.ERROR]
    assert parse_filters([("verdict", "DROPPED")]).params == {"verdict": ("DROPPED",)}


@pytest.mark.parametrize(
    ("pairs", "message"),
    [
        ([("verdict", "MAYBE")], "verdict: 'MAYBE' is not one of"),
        ([("port", "70000")], "port: '70000' is not a number 0-65535"),
        ([("port", "http")], "port: 'http'"),
        ([("protocol", "xtp")], "protocol: 'xtp'"),
        ([("pod", "a/b/c")], "pod: 'a/b/c' is not [namespace/]pod-name"),
        ([("pod", "Bad_Name")], "pod: 'Bad_Name'"),
        ([("namespace", "no spaces")], "namespace: 'no spaces'"),
        ([("label", "=oops")], "label: '=oops' is not a label selector"),
        ([("label", "app=(x")], "label: 'app=(x'"),
        ([("colour", "red")], "unknown filter 'colour'"),
        ([("pod", "x"), ("from-pod", "y")], "filters 'pod' and 'from-pod' cannot be combined"),
        ([("port", " 80")], "leading or trailing blanks"),
        ([("port", str(p)) for p in range(17)], "port: more than 16 values"),
    ],
)  # fmt: skip
def test_malformed_filters_are_refused_with_the_parameter_named(
    pairs: list[tuple[str, str]], message: str
) -> None:
    with pytest.raises(FilterError) as err:
        parse_filters(pairs)
    assert message in str(err.value)


def test_label_selectors_in_the_forms_hubble_takes() -> None:
    for selector in ("app=backend", "k8s:app=backend", "reserved:world", "app!=x,tier",
                     "!canary", "app in (a,b)", "k8s:io.kubernetes.pod.namespace=shop"):  # fmt: skip
        assert parse_filters([("label", selector)]).params == {"label": (selector,)}
