"""Bounded manifest parsing: every limit refuses with INVALID_ARGUMENT-bound errors naming
its flag, before anything is expanded; duplicate keys refused; fuzzed input never escapes
as anything but InvalidManifest."""

from __future__ import annotations

import contextlib
import json
import time

import pytest
from hostile import alias_bomb
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cilia_operator.manifests import (
    InvalidManifest,
    ManifestLimits,
    parse_manifest,
    validate_documents,
    validate_manifest,
)


def refused(text: str, limits: ManifestLimits | None = None) -> str:
    with pytest.raises(InvalidManifest) as info:
        parse_manifest(text, limits)
    return str(info.value)


def test_a_1kb_alias_bomb_is_refused_naming_the_alias_limit_at_once() -> None:
    bomb = alias_bomb()
    assert len(bomb) < 1024
    started = time.monotonic()
    message = refused(bomb)
    assert "--apply-max-alias-nodes=10000" in message
    assert time.monotonic() - started < 1


def test_aliases_within_the_limit_are_expanded_as_yaml_says() -> None:
    docs = parse_manifest("base: &b {x: 1}\nuse: *b\nmerged: {<<: *b, x: 2}\n")
    assert docs == [{"base": {"x": 1}, "use": {"x": 1}, "merged": {"x": 2}}]


@pytest.mark.parametrize(
    "text",
    [
        "[" * 10_000 + "]" * 10_000,  # flow sequences
        "{a: " * 10_000 + "1" + "}" * 10_000,  # flow mappings
        "- " * 10_000 + "x\n",  # block sequences on one line
    ],
    ids=["flow-seq", "flow-map", "block-seq"],
)
def test_10000_level_nesting_is_refused_naming_the_depth_limit(text: str) -> None:
    message = refused(text)
    assert "--apply-max-depth=100" in message
    assert "Traceback" not in message


def test_aliases_cannot_build_depth_the_text_does_not_show() -> None:
    lines = ["l0: &l0 [x]"] + [f"l{i}: &l{i} [*l{i - 1}]" for i in range(1, 150)]
    assert "--apply-max-depth=100" in refused("\n".join(lines))


def test_a_recursive_alias_is_refused() -> None:
    assert "recursive" in refused("a: &a [*a]\n")


def test_a_100mb_document_is_refused_naming_the_size_limit_before_parsing() -> None:
    text = "a: " + "x" * (100 * 1024 * 1024)
    started = time.monotonic()
    message = refused(text)
    assert "--apply-max-manifest-bytes=3145728" in message
    assert time.monotonic() - started < 1


def test_size_counts_utf8_bytes_not_characters() -> None:
    text = "a: " + "é" * 600
    assert "--apply-max-manifest-bytes=1000" in refused(text, ManifestLimits(max_bytes=1000))
    parse_manifest(text, ManifestLimits(max_bytes=2000))


def test_too_many_documents_are_refused_naming_the_limit() -> None:
    text = "a: 1\n---\n" * 11
    assert "--apply-max-documents=10" in refused(text, ManifestLimits(max_documents=10))
    ten = "---\n".join(["a: 1\n"] * 10)
    assert len(parse_manifest(ten, ManifestLimits(max_documents=10))) == 10


def test_a_document_too_large_to_store_is_refused_naming_its_index_and_the_limit() -> None:
    text = "a: 1\n---\nb: " + "y" * 2000 + "\n"
    message = refused(text, ManifestLimits(max_record_bytes=1000))
    assert message.startswith("document 1:") and "--apply-max-record-bytes=1000" in message


def test_a_key_given_twice_is_refused_with_both_lines() -> None:
    message = refused("metadata:\n  name: a\n  name: b\n")
    assert "duplicate key 'name'" in message and "line 3" in message and "line 2" in message


def test_same_key_in_different_mappings_is_fine() -> None:
    assert parse_manifest("a: {name: 1}\nb: {name: 2}\n") == [{"a": {"name": 1}, "b": {"name": 2}}]


POOL = {
    "apiVersion": "cilium.io/v2alpha1",
    "kind": "CiliumPodIPPool",
    "metadata": {"name": "blue"},
    "spec": {"ipv4": {"cidrs": ["10.1.0.0/16"], "maskSize": 24}},
}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=400))
def test_fuzzed_text_is_either_accepted_or_refused_as_invalid(text: str) -> None:
    with contextlib.suppress(InvalidManifest):
        validate_manifest(text, {}, ManifestLimits(max_depth=20, max_alias_nodes=200))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["metadata", "spec", "apiVersion", "kind", "status", "extra"]), json_values)
def test_fuzzed_pool_fields_are_either_accepted_or_refused_as_invalid(
    field: str, value: object
) -> None:
    doc = json.loads(json.dumps(POOL))
    doc[field] = value
    with contextlib.suppress(InvalidManifest):
        validate_documents(parse_manifest(json.dumps(doc)), {})


def test_an_unknown_pool_field_is_reported_as_kubernetes_does() -> None:
    doc = json.loads(json.dumps(POOL))
    doc["spec"]["ipv4"]["maskSzie"] = 24
    with pytest.raises(InvalidManifest) as info:
        validate_documents(parse_manifest(json.dumps(doc)), {})
    assert "spec.ipv4.maskSzie: unknown field" in str(info.value)
