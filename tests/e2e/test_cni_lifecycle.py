"""CNI ADD/DEL through the real ``cilia-cni`` binary against the real stack."""

from __future__ import annotations

import hashlib
import ipaddress
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from support import POD_CIDR, assert_pod_ip, dump_logs, endpoint_ips, pool_used

from cilia_testkit import cni, host, netns

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

PARALLEL_PODS = 20


def test_add_returns_a_valid_1_0_0_result_and_configures_the_pod(
    conflist: dict[str, Any], make_pod: Callable[..., cni.Pod]
) -> None:
    assert conflist["cniVersion"] == "1.0.0"
    assert conflist["plugins"][0]["type"] == "cilia-cni"
    pod = make_pod(labels={"app": "e2e"})

    outcome = pod.add(conflist)

    assert outcome.returncode == 0, outcome.stdout + outcome.stderr + dump_logs()
    result = outcome.json
    assert result["cniVersion"] == "1.0.0"
    host_if, pod_if = result["interfaces"]
    expected_host = "lxc" + hashlib.sha256(f"{pod.container_id}/eth0".encode()).hexdigest()[:11]
    assert host_if["name"] == expected_host
    assert "sandbox" not in host_if or not host_if["sandbox"]
    assert pod_if["name"] == "eth0"
    assert pod_if["sandbox"] == pod.netns
    for iface in (host_if, pod_if):
        assert re.fullmatch(r"([0-9a-f]{2}:){5}[0-9a-f]{2}", iface["mac"]), iface
    [ipconf] = result["ips"]
    assert "version" not in ipconf  # removed in CNI 1.0.0
    assert ipconf["interface"] == 1
    assert ipconf["address"].endswith("/32")
    ip = assert_pod_ip(pod)
    gateway = ipaddress.ip_address(ipconf["gateway"])
    assert gateway in POD_CIDR and gateway != ip
    assert any(r["dst"] == "0.0.0.0/0" for r in result.get("routes", [])), result

    addr = host.sh("ip", "-n", pod.name, "addr").stdout
    assert f"inet {ip}/32" in addr and "eth0" in addr, addr
    route = host.sh("ip", "-n", pod.name, "route").stdout
    assert f"default via {gateway} dev eth0" in route and "onlink" in route, route
    host_route = host.sh("ip", "route", "show", f"{ip}/32").stdout
    assert f"dev {expected_host}" in host_route, host_route
    assert netns.ping(pod.name, str(gateway)), "pod cannot reach the node's router IP"
    assert netns.ping("", str(ip)), "node cannot reach the pod"
    assert str(ip) in endpoint_ips()


def test_del_is_idempotent_and_releases_the_address(
    conflist: dict[str, Any], make_pod: Callable[..., cni.Pod]
) -> None:
    used_before = pool_used()
    pod = make_pod()
    added = pod.add(conflist)
    assert added.returncode == 0, added.stdout + dump_logs()
    ip = str(assert_pod_ip(pod))
    host_if = added.json["interfaces"][0]["name"]
    assert pool_used() == used_before + 1

    first = pod.delete(conflist)
    second = pod.delete(conflist)

    assert first.returncode == 0, first.stdout + first.stderr
    assert second.returncode == 0, second.stdout + second.stderr
    assert host_if not in host.host_lxc_links()
    assert "eth0" not in host.sh("ip", "-n", pod.name, "link").stdout
    assert ip not in endpoint_ips()
    assert not host.sh("ip", "route", "show", f"{ip}/32").stdout.strip()
    # Allocatable again: the pool's usage is back to where it was.
    assert pool_used() == used_before
    # DEL after the netns is gone (runtime already tore the sandbox down) is fine too.
    pod.destroy_netns()
    third = pod.delete(conflist)
    assert third.returncode == 0, third.stdout + third.stderr


def test_twenty_parallel_adds_get_distinct_pingable_addresses(
    conflist: dict[str, Any], make_pod: Callable[..., cni.Pod]
) -> None:
    pods = [make_pod(labels={"app": f"par{i}"}) for i in range(PARALLEL_PODS)]

    with ThreadPoolExecutor(max_workers=PARALLEL_PODS) as pool:
        outcomes = list(pool.map(lambda p: p.add(conflist), pods))

    failed = [(p.name, o.stdout) for p, o in zip(pods, outcomes, strict=True) if o.returncode]
    assert not failed, f"{failed}\n{dump_logs()}"
    ips = [str(assert_pod_ip(p)) for p in pods]
    assert len(set(ips)) == PARALLEL_PODS, ips
    listed = endpoint_ips()
    assert set(ips) <= listed

    def reachable(pair: tuple[str, str]) -> bool:
        return netns.ping(pair[0], pair[1], count=1, wait_seconds=2)

    checks = [(pods[0].name, ip) for ip in ips[1:]]  # pod -> pod
    checks += [(p.name, ips[0]) for p in pods[1:]]  # every pod -> the first one
    checks += [("", ip) for ip in ips]  # node -> pod
    with ThreadPoolExecutor(max_workers=10) as pool:
        results = list(pool.map(reachable, checks))
    unreachable = [c for c, ok in zip(checks, results, strict=True) if not ok]
    assert not unreachable, unreachable

    with ThreadPoolExecutor(max_workers=PARALLEL_PODS) as pool:
        deleted = list(pool.map(lambda p: p.delete(conflist), pods))
    assert all(d.returncode == 0 for d in deleted), [d.stdout for d in deleted if d.returncode]
    # By name: other runs on this host (private agents, other tests) make lxc* links too.
    assert not {p.host_veth for p in pods} & set(host.host_lxc_links())
    assert not set(ips) & endpoint_ips()
