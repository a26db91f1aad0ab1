"""Conformance: cilia-cni driven the way libcni drives it, against a real cilia-agent.

The runtime side (:class:`realagent.Libcni`) reads the conflist the agent wrote, finds
``cilia-cni`` by ``type`` in ``CNI_PATH``, caches the ADD result and passes it as
``prevResult`` to CHECK and DEL, runs DEL in reverse order. Every supported spec version
and every command is exercised, including each error code (1, 3, 4, 6, 7, 11, 50) and
the plugin-specific ones (100 ifname exists, 101 pool exhausted, 102 CHECK mismatch).
Outcomes are checked in the kernel (addresses and routes in the netns, host veths) and in
the agent (its endpoint list and address usage), not just in the plugin's stdout.
"""

from __future__ import annotations

import ipaddress
import json
import os
from typing import Any

import grpc
import pytest
from realagent import (
    Libcni,
    Netns,
    RealAgent,
    assert_cni_error,
    exec_cni,
    host_links,
    sh,
)

from cilia.agent.v1 import agent_pb2

VERSIONS = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]
K8S_ARGS = "IgnoreUnknown=1;K8S_POD_NAMESPACE=team;K8S_POD_NAME=web-0"


def _netns_addresses(netns: str, ifname: str) -> set[str]:
    name = os.path.basename(netns)
    out = json.loads(sh("ip", "-4", "-n", name, "-j", "addr", "show", "dev", ifname))
    return {f"{a['local']}/{a['prefixlen']}" for a in out[0]["addr_info"]}


def _require_agent_rpc(run: Any, what: str) -> None:
    """The agent must implement ``what`` (an UNIMPLEMENTED answer is a failure, not a skip)."""
    details = run.json.get("details", "") if run.returncode != 0 else ""
    assert "UNIMPLEMENTED" not in details, f"cilia-agent does not implement {what}: {details}"


@pytest.mark.parametrize("version", VERSIONS)
def test_lifecycle_add_check_del_in_every_version(
    real_agent: RealAgent, libcni: Libcni, netns: Netns, version: str
) -> None:
    cni = libcni.with_version(version)
    ns = netns.add()
    before = real_agent.usage()
    add = cni.add("conf-1", ns, cni_args=K8S_ARGS)
    assert add.returncode == 0, add
    result = add.json
    assert result["cniVersion"] == version
    host, container = result["interfaces"]
    assert container["name"] == "eth0" and container["sandbox"] == ns and "sandbox" not in host
    (ip,) = result["ips"]
    assert ("version" in ip) is version.startswith("0."), ip  # dropped in 1.0.0
    assert ip["interface"] == 1
    assert ("mtu" in container) is (version == "1.1.0")
    # The kernel and the agent agree with the result.
    assert _netns_addresses(ns, "eth0") == {ip["address"]}
    assert host["name"] in host_links()
    address = ip["address"].split("/")[0]
    assert real_agent.endpoints() == [("conf-1", "eth0", address)]
    assert ipaddress.ip_address(address) in ipaddress.ip_network(real_agent.cidr)

    check = cni.check("conf-1", ns)
    if version in ("0.3.0", "0.3.1"):
        assert_cni_error(check, 1, "does not allow CHECK")
    else:
        _require_agent_rpc(check, "Check")
        assert (check.returncode, check.stdout) == (0, ""), check

    delete = cni.delete("conf-1", ns)
    assert (delete.returncode, delete.stdout) == (0, ""), delete
    assert real_agent.endpoints() == []
    assert real_agent.usage() == before
    assert host["name"] not in host_links()
    assert cni.cached("conf-1") is None
    # Repeated DEL (no cached result any more) succeeds.
    assert cni.delete("conf-1", ns).returncode == 0
    if version not in ("0.3.0", "0.3.1"):
        gone = cni.check("conf-1", ns, prevResult=result)
        _require_agent_rpc(gone, "Check")
        assert_cni_error(gone, 3, "ADD it again")


@pytest.mark.parametrize("version", VERSIONS)
def test_del_succeeds_when_there_is_nothing_to_clean(
    real_agent: RealAgent, libcni: Libcni, netns: Netns, version: str
) -> None:
    cni = libcni.with_version(version)
    # Never added, netns that never existed, and empty CNI_NETNS.
    assert cni.delete("never-added", "/var/run/netns/cilia-cnit-absent").returncode == 0
    assert cni.delete("never-added", "").returncode == 0
    # Added, then the netns disappeared before DEL (the runtime removed the sandbox).
    ns = netns.add()
    assert cni.add("gone-netns", ns).returncode == 0
    netns.delete(ns)
    run = cni.delete("gone-netns", ns)
    assert (run.returncode, run.stdout) == (0, ""), run
    assert real_agent.endpoints() == []


def test_add_of_an_existing_ifname_fails_with_code_100_and_keeps_the_first(
    real_agent: RealAgent, libcni: Libcni, netns: Netns
) -> None:
    ns = netns.add()
    first = libcni.add("dup-1", ns)
    assert first.returncode == 0, first
    again = libcni.add("dup-2", ns)  # another container id, same netns and ifname
    assert_cni_error(again, 100, "eth0")
    assert [e[0] for e in real_agent.endpoints()] == ["dup-1"]
    assert _netns_addresses(ns, "eth0") == {first.json["ips"][0]["address"]}


def test_add_then_del_with_labels_annotations_and_pod_identity(
    real_agent: RealAgent, libcni: Libcni, netns: Netns
) -> None:
    ns = netns.add()
    labels = {"cni": {"labels": [{"key": "app", "value": "web"}], "annotations": {"a": "b"}}}
    assert libcni.add("labelled", ns, cni_args=K8S_ARGS, args=labels).returncode == 0
    (ep,) = real_agent.debug.ListEndpoints(agent_pb2.ListEndpointsRequest(), timeout=10).endpoints
    assert (ep.pod_namespace, ep.pod_name, dict(ep.labels)) == ("team", "web-0", {"app": "web"})
    assert libcni.delete("labelled", ns).returncode == 0


@pytest.mark.parametrize("version", ["0.4.0", "1.0.0", "1.1.0"])
def test_check_reports_a_mismatch_with_prev_result(
    real_agent: RealAgent, libcni: Libcni, netns: Netns, version: str
) -> None:
    cni = libcni.with_version(version)
    ns = netns.add()
    add = cni.add("chk-1", ns)
    assert add.returncode == 0, add
    wrong = json.loads(add.stdout)
    wrong["ips"][0]["address"] = "10.238.255.254/32"
    run = cni.check("chk-1", ns, prevResult=wrong)
    _require_agent_rpc(run, "Check")
    err = assert_cni_error(run, 102, "10.238.255.254")
    assert "DEL and ADD" in err["msg"]
    # The address removed inside the netns is a mismatch too.
    address = add.json["ips"][0]["address"]
    sh("ip", "-n", os.path.basename(ns), "addr", "del", address, "dev", "eth0")
    assert_cni_error(cni.check("chk-1", ns), 102)


@pytest.mark.parametrize("version", ["0.4.0", "1.1.0"])
def test_check_fails_on_another_sandbox_no_cached_address_or_a_changed_mtu(
    real_agent: RealAgent, libcni: Libcni, netns: Netns, version: str
) -> None:
    cni = libcni.with_version(version)
    ns, other = netns.add(), netns.add()
    add = cni.add("chk-2", ns)
    assert add.returncode == 0, add
    assert cni.check("chk-2", ns).returncode == 0
    moved = json.loads(add.stdout)
    [container] = [i for i in moved["interfaces"] if i.get("sandbox")]
    assert container["sandbox"] == ns
    container["sandbox"] = other
    assert_cni_error(cni.check("chk-2", ns, prevResult=moved), 102, "sandbox", other, ns)
    no_ips = json.loads(add.stdout)
    no_ips["ips"] = []
    assert_cni_error(cni.check("chk-2", ns, prevResult=no_ips), 102, "prevResult.ips")
    # Another address of ours inside the netns, cached instead of the assigned one.
    elsewhere = json.loads(add.stdout)
    assigned = elsewhere["ips"][0]["address"]
    sh("ip", "-n", os.path.basename(ns), "addr", "add", "10.238.255.253/32", "dev", "eth0")
    elsewhere["ips"][0]["address"] = "10.238.255.253/32"
    assert_cni_error(cni.check("chk-2", ns, prevResult=elsewhere), 102, f"address {assigned}")
    sh("ip", "-n", os.path.basename(ns), "addr", "del", "10.238.255.253/32", "dev", "eth0")
    assert cni.check("chk-2", ns).returncode == 0
    name = os.path.basename(ns)
    [link] = json.loads(sh("ip", "-n", name, "-j", "link", "show", "dev", "eth0"))
    mtu = link["mtu"]  # what the agent set at ADD (its --mtu)
    sh("ip", "-n", name, "link", "set", "eth0", "mtu", str(mtu - 100))
    assert_cni_error(cni.check("chk-2", ns), 102, f"mtu: expected {mtu}, eth0 has {mtu - 100}")
    assert cni.delete("chk-2", ns).returncode == 0


def test_status_is_0_when_ready_with_free_addresses(real_agent: RealAgent, libcni: Libcni) -> None:
    run = libcni.with_version("1.1.0").status()
    assert (run.returncode, run.stdout) == (0, ""), run


def test_pool_exhaustion_gives_101_on_add_and_50_on_status(
    real_agent: RealAgent, libcni: Libcni, netns: Netns
) -> None:
    cni = libcni.with_version("1.1.0")
    ((_, used, capacity),) = real_agent.usage()
    # Fill the pool through the agent's API directly (fast), then ask the plugin.
    for i in range(capacity - used):
        real_agent.attach.Add(
            agent_pb2.AddRequest(container_id=f"fill-{i}", ifname="eth0", netns=netns.add()),
            timeout=30,
        )
    assert_cni_error(cni.add("one-too-many", netns.add()), 101)
    err = assert_cni_error(cni.status(), 50, "no free pod address")
    assert f"default {capacity}/{capacity}" in err["msg"]


def test_gc_releases_every_attachment_not_listed(
    real_agent: RealAgent, libcni: Libcni, netns: Netns
) -> None:
    cni = libcni.with_version("1.1.0")
    keep_ns, drop_ns = netns.add(), netns.add()
    keep = cni.add("gc-keep", keep_ns)
    drop = cni.add("gc-drop", drop_ns)
    assert keep.returncode == drop.returncode == 0
    before = real_agent.usage()
    run = cni.gc([("gc-keep", "eth0"), ("not-held", "eth0")])
    _require_agent_rpc(run, "GC")
    assert (run.returncode, run.stdout) == (0, ""), run
    assert [e[0] for e in real_agent.endpoints()] == ["gc-keep"]
    assert drop.json["interfaces"][0]["name"] not in host_links()
    assert keep.json["interfaces"][0]["name"] in host_links()
    ((_, used_before, _),) = before
    ((_, used_after, _),) = real_agent.usage()
    assert used_after == used_before - 1
    # An empty list releases everything.
    assert cni.gc([]).returncode == 0
    assert real_agent.endpoints() == []


@pytest.mark.parametrize("key", ["cni.dev/valid-attachments", "cni.dev/attachments"])
def test_gc_with_either_keep_list_key_alone_keeps_the_listed_attachment(
    real_agent: RealAgent, libcni: Libcni, netns: Netns, key: str
) -> None:
    """Spec 1.1.0 names the keep-list `cni.dev/valid-attachments`; older libcni only
    `cni.dev/attachments`: either alone keeps what it lists."""
    cni = libcni.with_version("1.1.0")
    keep = cni.add("gc-key-keep", netns.add())
    drop = cni.add("gc-key-drop", netns.add())
    assert keep.returncode == drop.returncode == 0
    run = cni.gc([("gc-key-keep", "eth0")], keys=(key,))
    assert (run.returncode, run.stdout) == (0, ""), run
    assert [e[0] for e in real_agent.endpoints()] == ["gc-key-keep"]
    assert keep.json["interfaces"][0]["name"] in host_links()
    assert drop.json["interfaces"][0]["name"] not in host_links()


def test_gc_without_a_keep_list_is_code_7_and_releases_nothing(
    real_agent: RealAgent, libcni: Libcni, netns: Netns
) -> None:
    cni = libcni.with_version("1.1.0")
    add = cni.add("gc-nokey", netns.add())
    assert add.returncode == 0, add
    before = real_agent.usage()
    err = assert_cni_error(
        cni.gc([], keys=()), 7, "`cni.dev/valid-attachments`", "`cni.dev/attachments`"
    )
    assert "missing" in err["msg"]
    assert [e[0] for e in real_agent.endpoints()] == ["gc-nokey"]
    assert add.json["interfaces"][0]["name"] in host_links()
    assert real_agent.usage() == before


def test_agent_down_del_is_queued_and_replayed_other_commands_fail_clearly(
    real_agent: RealAgent, libcni: Libcni, netns: Netns
) -> None:
    cni = libcni.with_version("1.1.0")
    ns = netns.add()
    add = cni.add("down-1", ns)
    assert add.returncode == 0, add
    address = add.json["ips"][0]["address"].split("/")[0]
    real_agent.stop()
    try:
        assert_cni_error(cni.add("down-2", netns.add()), 11, "start or check cilia-agent")
        assert_cni_error(cni.check("down-1", ns), 11)
        assert_cni_error(cni.gc([]), 11)
        assert_cni_error(cni.status(), 50, real_agent.socket)
        run = cni.delete("down-1", ns)
        assert (run.returncode, run.stdout) == (0, ""), run
        assert len(os.listdir(real_agent.del_queue)) == 1
    finally:
        real_agent.start()
    # The agent replayed the queue before serving: the attachment and its address are gone.
    assert real_agent.endpoints() == []
    assert os.listdir(real_agent.del_queue) == []
    assert address not in {e[2] for e in real_agent.endpoints()}


def test_chained_after_ptp_and_followed_by_portmap(
    real_agent: RealAgent, libcni: Libcni, netns: Netns, short_tmp: str
) -> None:
    """generic-veth chaining: Debian's ptp + host-local create the veth and address,
    cilia-cni attaches to them, Debian's portmap takes cilia-cni's result as prevResult."""
    ours = libcni.conflist["plugins"][0]
    conflist = {
        "cniVersion": "1.0.0",
        "name": "cilia-chain",
        "plugins": [
            {
                "type": "ptp",
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": "10.238.254.0/28"}]],
                    "dataDir": os.path.join(short_tmp, "ipam"),
                },
            },
            ours,
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }
    cni = Libcni(conflist, libcni.cni_path, libcni.cache_dir)
    ns = netns.add()
    run = cni.add("chain-1", ns)
    assert "UNIMPLEMENTED" not in run.stdout, (
        f"cilia-agent does not implement chaining: {run.stdout}"
    )
    assert run.returncode == 0, run
    result = run.json
    assert result["ips"][0]["address"].startswith("10.238.254.")
    assert _netns_addresses(ns, "eth0") == {result["ips"][0]["address"]}
    (ep,) = real_agent.debug.ListEndpoints(agent_pb2.ListEndpointsRequest(), timeout=10).endpoints
    assert ep.chained and ep.container_id == "chain-1"
    assert ep.ipv4 == result["ips"][0]["address"].split("/")[0]
    check = cni.check("chain-1", ns)
    _require_agent_rpc(check, "Check")
    assert check.returncode == 0, check
    delete = cni.delete("chain-1", ns)
    assert delete.returncode == 0, delete
    assert real_agent.endpoints() == []


def test_cilia_first_result_is_a_valid_prev_result_for_portmap(
    real_agent: RealAgent, libcni: Libcni, netns: Netns
) -> None:
    conflist = dict(libcni.conflist)
    conflist["plugins"] = [
        *libcni.conflist["plugins"],
        {"type": "portmap", "capabilities": {"portMappings": True}},
    ]
    for version in ("0.4.0", "1.0.0"):
        cni = Libcni(dict(conflist, cniVersion=version), libcni.cni_path, libcni.cache_dir)
        ns = netns.add()
        cid = f"pm-{version.replace('.', '')}"
        portmappings = [{"hostPort": 18080, "containerPort": 80, "protocol": "tcp"}]
        run = cni.add(cid, ns, runtimeConfig={"portMappings": portmappings})
        assert run.returncode == 0, run
        assert run.json["cniVersion"] == version
        assert cni.check(cid, ns).returncode == 0
        assert cni.delete(cid, ns).returncode == 0
    assert real_agent.endpoints() == []


@pytest.mark.parametrize(
    ("mutate", "code", "needle"),
    [
        (lambda env, conf: env.pop("CNI_CONTAINERID"), 4, "CNI_CONTAINERID"),
        (lambda env, conf: env.update(CNI_IFNAME="bad/name"), 4, "CNI_IFNAME"),
        (lambda env, conf: conf.update(cniVersion="0.2.0"), 1, "0.2.0"),
        (lambda env, conf: conf.update(mtu=-1), 7, "`mtu`"),
        (lambda env, conf: conf.pop("name"), 7, "`name`"),
        (lambda env, conf: conf.update({"del-queue-max": 0}), 7, "`del-queue-max`"),
    ],
)
def test_errors_leave_the_agent_unchanged(
    real_agent: RealAgent, libcni: Libcni, netns: Netns, mutate: Any, code: int, needle: str
) -> None:
    env = {
        "CNI_COMMAND": "ADD",
        "CNI_CONTAINERID": "err-1",
        "CNI_NETNS": netns.add(),
        "CNI_IFNAME": "eth0",
        "CNI_PATH": ":".join(libcni.cni_path),
    }
    conf = libcni.stdin(0)
    mutate(env, conf)
    before = (real_agent.endpoints(), real_agent.usage())
    assert_cni_error(exec_cni(env, conf), code, needle)
    assert (real_agent.endpoints(), real_agent.usage()) == before


def test_undecodable_stdin_gives_6_and_missing_netns_gives_8(
    real_agent: RealAgent, libcni: Libcni
) -> None:
    env = {"CNI_COMMAND": "ADD", "CNI_CONTAINERID": "x1", "CNI_IFNAME": "eth0"}
    env["CNI_NETNS"] = "/var/run/netns/cilia-cnit-absent"
    assert_cni_error(exec_cni(env, b"{not json"), 6, "stdin")
    assert_cni_error(exec_cni(env, libcni.stdin(0)), 8)
    assert real_agent.endpoints() == []


def test_log_file_lines_carry_the_container_id(
    real_agent: RealAgent, libcni: Libcni, netns: Netns
) -> None:
    ns = netns.add()
    with open(real_agent.log_file, "a"):
        pass
    start = os.path.getsize(real_agent.log_file)
    assert libcni.add("logged-1", ns).returncode == 0
    assert libcni.delete("logged-1", ns).returncode == 0
    with open(real_agent.log_file) as f:
        f.seek(start)
        lines = [json.loads(line) for line in f]
    assert {line["command"] for line in lines} == {"ADD", "DEL"}
    assert all(line["containerID"] == "logged-1" for line in lines), lines


def test_agent_status_rpc_is_reachable(real_agent: RealAgent) -> None:
    status = real_agent.debug.Status(agent_pb2.StatusRequest(), timeout=10)
    assert status.ready, status.message
    with pytest.raises(grpc.RpcError):
        real_agent.attach.Add(agent_pb2.AddRequest(container_id=""), timeout=10)
