"""The generation hash: definition, stability, and the ``hash`` sub-command that stamps it."""

from __future__ import annotations

import hashlib
import json
import pathlib

import pytest
import yaml

from cilia_safe_agent_updater.__main__ import main
from cilia_safe_agent_updater.generation import ANNOTATION, canonical_json, stamp, template_hash

TEMPLATE = {
    "metadata": {"labels": {"app": "cilia-agent"}, "annotations": {"checksum/config": "abc"}},
    "spec": {"containers": [{"name": "agent", "image": "cilia-agent:0.2.0"}]},
}


def test_hash_is_sha256_of_canonical_json_without_the_annotation() -> None:
    expected = hashlib.sha256(
        json.dumps(TEMPLATE, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()
    assert template_hash(TEMPLATE) == expected
    stamped = json.loads(json.dumps(TEMPLATE))
    stamped["metadata"]["annotations"][ANNOTATION] = "old"
    assert template_hash(stamped) == expected
    assert stamped["metadata"]["annotations"][ANNOTATION] == "old"  # input untouched


def test_hash_ignores_key_order_but_not_content() -> None:
    reordered = {"spec": TEMPLATE["spec"], "metadata": TEMPLATE["metadata"]}
    assert template_hash(reordered) == template_hash(TEMPLATE)
    changed = json.loads(json.dumps(TEMPLATE))
    changed["spec"]["containers"][0]["image"] = "cilia-agent:0.3.0"
    assert template_hash(changed) != template_hash(TEMPLATE)


def test_canonical_json_escapes_as_go_encoding_json_does() -> None:
    """Helm's toJson (Go's encoding/json) writes <, >, & and U+2028/2029 as \\uXXXX and keeps
    other non-ASCII text as UTF-8; the chart's hash is the sha256 of that text."""
    obj = {"b": "a<b>&c\u2028\u2029", "a": ["é", 1, True, None]}
    assert canonical_json(obj) == (
        '{"a":["é",1,true,null],"b":"a\\u003cb\\u003e\\u0026c\\u2028\\u2029"}'
    )
    template = {"spec": {"containers": [{"args": ["sh", "-c", "a > b && c < d"]}]}}
    want = '{"spec":{"containers":[{"args":["sh","-c","a \\u003e b \\u0026\\u0026 c \\u003c d"]}]}}'
    assert template_hash(template) == hashlib.sha256(want.encode()).hexdigest()


def test_only_annotation_present_hashes_like_no_annotations() -> None:
    bare = {"metadata": {"labels": {"a": "b"}}, "spec": {}}
    with_ann = {"metadata": {"labels": {"a": "b"}, "annotations": {ANNOTATION: "x"}}, "spec": {}}
    assert template_hash(bare) == template_hash(with_ann)


def _docs() -> list[dict[str, object]]:
    agent = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "cilia-agent"},
        "spec": {"template": json.loads(json.dumps(TEMPLATE))},
    }
    updater = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "cilia-safe-agent-updater"},
        "spec": {"template": {"metadata": {}, "spec": {"containers": []}}},
    }
    return [agent, updater, {"kind": "ConfigMap", "metadata": {"name": "x"}}]


def test_stamp_writes_agent_template_and_updater() -> None:
    docs = _docs()
    digest = stamp(docs, "cilia-agent", "cilia-safe-agent-updater")
    agent, updater = docs[0], docs[1]
    assert agent["spec"]["template"]["metadata"]["annotations"][ANNOTATION] == digest  # type: ignore[index]
    assert updater["metadata"]["annotations"][ANNOTATION] == digest  # type: ignore[index]
    assert updater["spec"]["template"]["metadata"]["annotations"][ANNOTATION] == digest  # type: ignore[index]
    assert stamp(docs, "cilia-agent", "cilia-safe-agent-updater") == digest  # idempotent
    with pytest.raises(ValueError, match="nope"):
        stamp(docs, "nope", "cilia-safe-agent-updater")


def test_hash_command(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = tmp_path / "rendered.yaml"
    manifest.write_text(yaml.safe_dump_all(_docs()))
    assert main(["hash", "-f", str(manifest)]) == 0
    digest = capsys.readouterr().out.strip()
    assert digest == template_hash(TEMPLATE)
    assert main(["hash", "-f", str(manifest), "--write"]) == 0
    out = list(yaml.safe_load_all(capsys.readouterr().out))
    assert out[1]["spec"]["template"]["metadata"]["annotations"][ANNOTATION] == digest
    assert main(["hash", "-f", str(tmp_path / "missing.yaml")]) == 2
