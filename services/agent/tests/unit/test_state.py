"""State files: round trip, atomicity, bad files."""

from __future__ import annotations

import json
import pathlib

import pytest

from cilia_agent.endpoint import EndpointRecord, StateError, StateStore
from cilia_agent.node import NodeState


def _record(**kw: object) -> EndpointRecord:
    base: dict[str, object] = {
        "id": 3,
        "container_id": "abc",
        "ifname": "eth0",
        "netns": "/var/run/netns/x",
        "ipv4": "10.251.0.3",
        "pool": "default",
        "host_ifname": "lxc0123456789a",
        "labels": {"app": "web"},
        "pod_namespace": "ns",
        "pod_name": "pod",
        "state": "ready",
    }
    base.update(kw)
    return EndpointRecord.model_validate(base)


def test_endpoint_state_round_trips(tmp_path: pathlib.Path) -> None:
    store = StateStore(tmp_path)
    rec = _record()
    store.write_endpoint(rec)
    records, bad = store.load_endpoints()
    assert records == [rec] and bad == []
    assert [p.name for p in (tmp_path / "endpoints").iterdir()] == [
        store.endpoint_path("abc", "eth0").name
    ]


def test_rewrite_replaces_file_without_leaving_temporaries(tmp_path: pathlib.Path) -> None:
    store = StateStore(tmp_path)
    store.write_endpoint(_record(state="creating"))
    store.write_endpoint(_record(state="ready"))
    files = list((tmp_path / "endpoints").iterdir())
    assert len(files) == 1
    assert json.loads(files[0].read_text())["state"] == "ready"
    assert files[0].stat().st_mode & 0o777 == 0o600


def test_unreadable_state_file_is_reported_not_raised(tmp_path: pathlib.Path) -> None:
    store = StateStore(tmp_path)
    (tmp_path / "endpoints" / "junk.json").write_text("{not json")
    store.write_endpoint(_record())
    records, bad = store.load_endpoints()
    assert len(records) == 1 and [p.name for p in bad] == ["junk.json"]


def test_node_state_round_trips_and_defaults_when_absent(tmp_path: pathlib.Path) -> None:
    store = StateStore(tmp_path)
    assert store.load_node() == NodeState()
    node = NodeState(
        router_ip="10.251.0.1",
        default_pool="default",
        allocation={"default": ["10.251.0.0/24"]},
        registered=True,
    )
    store.write_node(node)
    assert store.load_node() == node


def test_corrupt_node_state_raises_state_error(tmp_path: pathlib.Path) -> None:
    (tmp_path / "node.json").write_text("[]")
    with pytest.raises(StateError, match="invalid node state"):
        StateStore(tmp_path).load_node()
