"""Label selectors with upstream semantics: sources, operators, namespace restriction."""

from __future__ import annotations

from typing import Any

import pytest

from cilia_agent.identity.labels import LabelSet
from cilia_agent.policy.selector import Selector
from cilia_common.policy.model import LabelSelector

POD = LabelSet.of(
    [
        "k8s:app=web",
        "k8s:tier=front",
        "container:role=edge",
        "k8s:io.kubernetes.pod.namespace=prod",
    ]
)
HOST = LabelSet.of(["reserved:host"])


def sel(raw: dict[str, Any]) -> Selector:
    return Selector.from_model(LabelSelector.model_validate(raw))


@pytest.mark.parametrize(
    ("selector", "labels", "selected"),
    [
        ({}, POD, True),
        ({}, HOST, True),
        ({"matchLabels": {"app": "web"}}, POD, True),  # no source: any source
        ({"matchLabels": {"k8s:app": "web"}}, POD, True),
        ({"matchLabels": {"any:app": "web"}}, POD, True),
        ({"matchLabels": {"container:app": "web"}}, POD, False),  # wrong source
        ({"matchLabels": {"role": "edge"}}, POD, True),
        ({"matchLabels": {"k8s:role": "edge"}}, POD, False),
        ({"matchLabels": {"app": "web", "tier": "back"}}, POD, False),  # ANDed
        ({"matchLabels": {"reserved:host": ""}}, HOST, True),
        ({"matchLabels": {"$host": ""}}, HOST, True),
        ({"matchLabels": {"app": "web"}}, HOST, False),
        (
            {"matchExpressions": [{"key": "app", "operator": "In", "values": ["a", "web"]}]},
            POD,
            True,
        ),
        ({"matchExpressions": [{"key": "app", "operator": "In", "values": ["a"]}]}, POD, False),
        (
            {"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["web"]}]},
            POD,
            False,
        ),
        ({"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["db"]}]}, POD, True),
        ({"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["db"]}]}, HOST, True),
        ({"matchExpressions": [{"key": "tier", "operator": "Exists"}]}, POD, True),
        ({"matchExpressions": [{"key": "tier", "operator": "Exists"}]}, HOST, False),
        ({"matchExpressions": [{"key": "k8s:tier", "operator": "DoesNotExist"}]}, POD, False),
        ({"matchExpressions": [{"key": "tier", "operator": "DoesNotExist"}]}, HOST, True),
        (
            {
                "matchLabels": {"app": "web"},
                "matchExpressions": [{"key": "tier", "operator": "In", "values": ["back"]}],
            },
            POD,
            False,
        ),
    ],
)
def test_selector_matches_with_upstream_semantics(
    selector: dict[str, Any], labels: LabelSet, selected: bool
) -> None:
    assert sel(selector).matches(labels) is selected


DEV_WEB = LabelSet.of(["k8s:app=web", "k8s:io.kubernetes.pod.namespace=dev"])


@pytest.mark.parametrize(
    ("selector", "selects_prod_web", "selects_dev_web", "selects_host"),
    [
        ({}, True, False, False),
        ({"matchLabels": {"app": "web"}}, True, False, False),
        ({"matchLabels": {"k8s:io.kubernetes.pod.namespace": "dev"}}, False, True, False),
        ({"matchLabels": {"io.kubernetes.pod.namespace": "dev"}}, False, True, False),
        (
            {"matchExpressions": [{"key": "io.kubernetes.pod.namespace", "operator": "Exists"}]},
            True,
            True,
            False,
        ),
        ({"matchLabels": {"reserved:host": ""}}, False, False, True),
    ],
)
def test_peer_selector_is_restricted_to_policy_namespace_unless_it_names_one(
    selector: dict[str, Any], selects_prod_web: bool, selects_dev_web: bool, selects_host: bool
) -> None:
    peer = sel(selector).restricted_to("prod")
    assert peer.matches(POD) is selects_prod_web
    assert peer.matches(DEV_WEB) is selects_dev_web
    assert peer.matches(HOST) is selects_host


def test_subject_selector_always_selects_in_policy_namespace() -> None:
    subject = sel({"matchLabels": {"k8s:io.kubernetes.pod.namespace": "dev"}}).in_namespace("prod")
    assert subject.matches(POD)
    assert not subject.matches(LabelSet.of(["k8s:io.kubernetes.pod.namespace=dev"]))
