"""The test kit's pure parts: libcni stdin, chaining order, listener read-back, netns names."""

from __future__ import annotations

import json
import pathlib
from typing import Any

from cilia_testkit import cni
from cilia_testkit.netns import NetnsRegistry
from cilia_testkit.stack import read_listeners

CONFLIST: dict[str, Any] = {
    "cniVersion": "1.0.0",
    "name": "cilia",
    "plugins": [
        {"type": "cilia-cni", "mtu": 1500},
        {"type": "portmap", "capabilities": {"portMappings": True}},
    ],
}


def test_plugin_netconf_injects_name_version_labels_and_prev_result() -> None:
    conf = cni.plugin_netconf(CONFLIST, labels={"b": "2", "a": "1"}, prev_result={"ips": []})
    assert conf["name"] == "cilia" and conf["cniVersion"] == "1.0.0"
    assert conf["args"] == {
        "cni": {"labels": [{"key": "a", "value": "1"}, {"key": "b", "value": "2"}]}
    }
    assert conf["prevResult"] == {"ips": []}
    assert "prevResult" not in CONFLIST["plugins"][0]


def test_list_netconf_passes_only_declared_capabilities() -> None:
    wanted = {"portMappings": [{"hostPort": 1}], "bandwidth": {}}
    assert "runtimeConfig" not in cni.list_netconf(CONFLIST, 0, runtime_config=wanted)
    assert cni.list_netconf(CONFLIST, 1, runtime_config=wanted)["runtimeConfig"] == {
        "portMappings": [{"hostPort": 1}]
    }


def test_cni_args_are_what_containerd_sends() -> None:
    assert cni.cni_args("ns", "pod", "c1") == (
        "IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=pod;K8S_POD_INFRA_CONTAINER_ID=c1"
    )


def test_exec_list_runs_del_in_reverse_with_the_cached_result(tmp_path: pathlib.Path) -> None:
    log = tmp_path / "calls"
    for name in ("cilia-cni", "portmap"):
        plugin = tmp_path / name
        plugin.write_text(
            "#!/bin/sh\n"
            f'echo "{name} $CNI_COMMAND $(cat)" >> {log}\n'
            'echo \'{"cniVersion": "1.0.0", "ips": [{"address": "10.0.0.2/32"}]}\'\n'
        )
        plugin.chmod(0o755)
    add = cni.exec_list(
        "ADD", CONFLIST, container_id="c", netns="/x", cni_path=str(tmp_path)
    ).check()
    assert add.result is not None and add.result["ips"][0]["address"] == "10.0.0.2/32"
    cni.exec_list(
        "DEL",
        CONFLIST,
        container_id="c",
        netns="/x",
        cni_path=str(tmp_path),
        prev_result=add.result,
    ).check()
    calls = [line.split(" ", 2) for line in log.read_text().splitlines()]
    assert [(c[0], c[1]) for c in calls] == [
        ("cilia-cni", "ADD"),
        ("portmap", "ADD"),
        ("portmap", "DEL"),
        ("cilia-cni", "DEL"),
    ]
    assert "prevResult" not in json.loads(calls[0][2])
    assert json.loads(calls[1][2])["prevResult"] == add.result
    assert json.loads(calls[2][2])["prevResult"] == add.result


def test_read_listeners_reads_listening_lines_from_this_start_only(tmp_path: pathlib.Path) -> None:
    log = tmp_path / "agent.log"
    old = json.dumps({"msg": "listening", "listener": "api", "address": "unix:/old"}) + "\n"
    log.write_text(old)
    offset = log.stat().st_size
    with log.open("a") as f:
        f.write("# 2026-01-01T00:00:00Z cilia-agent serve\nnot json\n")
        f.write(
            json.dumps({"msg": "listening", "listener": "metrics", "address": "127.0.0.1:41234"})
            + "\n"
        )
        f.write(
            json.dumps({"msg": "operator serving", "listen": "127.0.0.1:5000", "metrics": 5001})
            + "\n"
        )
    assert read_listeners(log, offset) == {
        "metrics": "127.0.0.1:41234",
        "grpc": "127.0.0.1:5000",
    }
    assert read_listeners(log)["api"] == "unix:/old"
    assert read_listeners(tmp_path / "missing.log") == {}


def test_netns_registry_names_carry_prefix_and_pid() -> None:
    registry = NetnsRegistry("cilia-unit-")
    first, second = registry.name(), registry.name("x")
    assert first == f"cilia-unit-{registry.pid}-1" and second == f"cilia-unit-{registry.pid}-x"
    assert registry.adopt(first) == first and registry.created == [first]


def test_slot_ports_lie_below_the_ephemeral_range() -> None:
    # A fixed port inside it can be the source port of any outgoing connection when a
    # stack starts (then "Address already in use").
    from cilia_testkit.stack import MAX_AGENTS, SLOT_PORT_BASE, SLOTS

    low = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert low >= SLOT_PORT_BASE + SLOTS * MAX_AGENTS
