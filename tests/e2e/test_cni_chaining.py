"""CNI chaining against the real stack, run as libcni runs a conflist (issue 4, "Chaining").

- generic-veth: ``[ptp (host-local IPAM), cilia-cni]``. Debian's ``ptp`` makes the veth and
  the address; ``cilia-cni`` gets ptp's result as ``prevResult`` and the agent attaches its
  endpoint (``chained``) to ptp's host veth. A CiliumNetworkPolicy then holds for those
  pods (real TCP, as in test_policy.py), and DEL in reverse order leaves nothing behind.
- ``[cilia-cni, portmap]`` with ``runtimeConfig.portMappings``: Debian's ``portmap`` takes
  cilia-cni's result as ``prevResult``; a TCP connection to the host port reaches the pod;
  DEL removes portmap's iptables rules.

Each plugin is looked up in ``CNI_PATH=/usr/lib/cni:.venv/bin`` (libcni ``FindInPath``).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import pathlib
import random
import socket
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import traffic
from support import current_stack, dump_logs, endpoint_keys, node_state, router_ip

from cilia_testkit import VENV_BIN, bpfmaps, cni, host, netns

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

CNI_PATH = f"{cni.DEBIAN_CNI_DIR}:{VENV_BIN}"
NS = "cilia-e2e-chain"
ROLES = ("frontend", "backend", "other")
ALLOWED, OTHER_PORT = 8080, 9090
POLICY = "chained-backend-allow-frontend"
POLICY_WAIT_SECONDS = 15.0
# ptp pods get a random /28 of this range (this module's own addresses on the shared host).
CHAIN_RANGE = ipaddress.ip_network("10.246.0.0/16")
FIREWALL_COMMENT = "cilia-e2e-chain"


def _require(*plugins: str) -> None:
    for plugin in plugins:
        if not (cni.DEBIAN_CNI_DIR / plugin).exists():
            pytest.fail(
                f"{cni.DEBIAN_CNI_DIR / plugin} missing: scripts/setup.sh installs Debian's "
                "containernetworking-plugins"
            )


def _fail_if_unimplemented(outcome: cni.ListOutcome, feature: str) -> None:
    """A clear failure (never a skip) when the agent or plugin lacks ``feature``."""
    text = " ".join(o.stdout for o in outcome.outcomes)
    if "UNIMPLEMENTED" in text or "must be the first plugin" in text:
        pytest.fail(f"{feature} is not implemented yet (issue 4): {text.strip()}")


@pytest.fixture
def subnet() -> ipaddress.IPv4Network:
    """A random /28 of CHAIN_RANGE."""
    blocks = list(CHAIN_RANGE.subnets(new_prefix=28))
    block = random.SystemRandom().choice(blocks[1:])
    assert isinstance(block, ipaddress.IPv4Network)
    return block


@pytest.fixture
def forward_accept(subnet: ipaddress.IPv4Network) -> Iterator[None]:
    """Let the host forward to/from ``subnet`` even under a DROP FORWARD policy.

    In generic-veth chaining the primary plugin's own setup does this (ptp adds nothing);
    the rules carry FIREWALL_COMMENT and are removed afterwards.
    """
    rules = [
        ["FORWARD", flag, str(subnet), "-m", "comment", "--comment", FIREWALL_COMMENT, "-j"]
        for flag in ("-s", "-d")
    ]
    for rule in rules:
        host.sh("iptables", "-I", *rule, "ACCEPT")
    try:
        yield
    finally:
        for rule in rules:
            host.sh("iptables", "-D", *rule, "ACCEPT", check=False)


def _ptp_conflist(
    stack_conflist: dict[str, Any], subnet: ipaddress.IPv4Network, data_dir: pathlib.Path
) -> dict[str, Any]:
    return {
        "cniVersion": stack_conflist["cniVersion"],
        "name": NS,
        "plugins": [
            {
                "type": "ptp",
                "ipMasq": False,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": str(subnet)}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(data_dir),
                },
            },
            dict(stack_conflist["plugins"][0]),
        ],
    }


class ChainedPods:
    """Three ptp+cilia pods (frontend, backend, other) in NS; cleaned up by the fixture."""

    def __init__(self, conflist: dict[str, Any]) -> None:
        self.conflist = conflist
        self.by_role: dict[str, cni.Pod] = {}
        self.added: list[cni.Pod] = []

    def __getitem__(self, role: str) -> cni.Pod:
        return self.by_role[role]

    def reaches(self, src: str, dst: str, port: int) -> bool:
        got = traffic.connect(self[src], self[dst].ip, port)
        return got == traffic.greeting(self[dst].name, port)


@pytest.fixture
def chained(
    conflist: dict[str, Any],
    subnet: ipaddress.IPv4Network,
    forward_accept: None,
    tmp_path: pathlib.Path,
) -> Iterator[ChainedPods]:
    _require("ptp", "host-local")
    pods = ChainedPods(_ptp_conflist(conflist, subnet, tmp_path / "ipam"))
    for role in ROLES:
        pod = cni.Pod(
            name=f"cilia-e2e-{os.getpid()}-chain-{role}", namespace=NS, labels={"app": role}
        )
        pod.create_netns()
        pods.by_role[role] = pod
    try:
        yield pods
    finally:
        current_stack().operator_cli("delete", "cnp", POLICY, "-n", NS)
        for pod in pods.added:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                pod.delete_list(pods.conflist, cni_path=CNI_PATH, timeout=30)
        for pod in pods.by_role.values():
            pod.destroy_netns()


def _eventually(predicate: Callable[[], bool], what: str) -> None:
    assert host.wait_for(predicate, POLICY_WAIT_SECONDS, interval=0.3), (
        f"{what} not within {POLICY_WAIT_SECONDS:g}s\n{dump_logs()}"
    )


def _backend_allow_frontend() -> dict[str, Any]:
    return traffic.backend_from_frontend(POLICY, NS, ALLOWED)


def test_generic_veth_chaining_after_ptp_enforces_policy_and_del_leaves_nothing(
    chained: ChainedPods, subnet: ipaddress.IPv4Network, tmp_path: pathlib.Path
) -> None:
    before = node_state()
    host_veths: dict[str, str] = {}
    for role in ROLES:
        pod = chained[role]
        outcome = pod.add_list(chained.conflist, cni_path=CNI_PATH)
        chained.added.append(pod)  # a failed ADD gets its DEL too (libcni's caller does that)
        _fail_if_unimplemented(outcome, "chaining after another plugin (generic-veth)")
        assert outcome.ok, [o.stdout for o in outcome.outcomes] + [dump_logs()]
        assert [o.command for o in outcome.outcomes] == ["ADD", "ADD"]
        ptp_result = outcome.outcomes[0].json
        result = outcome.result
        assert result is not None
        # cilia-cni passes ptp's address through; the pod has exactly that address.
        assert ipaddress.ip_interface(result["ips"][0]["address"]).ip in subnet, result
        assert result["ips"] == ptp_result["ips"], (result, ptp_result)
        assert f"inet {pod.ip}/" in host.sh("ip", "-n", pod.name, "-4", "addr").stdout
        host_veths[role] = next(i["name"] for i in ptp_result["interfaces"] if not i.get("sandbox"))

    eps = endpoint_keys()
    for role in ROLES:
        pod = chained[role]
        ep = eps.get((pod.container_id, pod.ifname))
        assert ep is not None, f"no Cilia endpoint for chained {role}: {sorted(eps)}"
        assert ep.get("chained") is True, ep
        assert ep["ipv4"] == pod.ip and ep["host_ifname"] == host_veths[role], ep
        ifindex = host.link_ifindex(host_veths[role])
        assert (
            bpfmaps.bpf_endpoints(current_stack().agent.pin_dir).get(ifindex, {}).get("ipv4")
            == pod.ip
        )
        assert f"{pod.ip}/32" in bpfmaps.bpf_ipcache(current_stack().agent.pin_dir)
    assert node_state().used == before.used, "a chained pod took an address from Cilia's pool"

    servers = [traffic.start_servers(chained["backend"], (ALLOWED, OTHER_PORT))]
    try:
        assert chained.reaches("other", "backend", ALLOWED), "no connectivity before the policy"
        applied = traffic.apply(_backend_allow_frontend())
        assert applied.returncode == 0, applied.stderr
        _eventually(lambda: not chained.reaches("other", "backend", ALLOWED), "other blocked")
        assert chained.reaches("frontend", "backend", ALLOWED)
        assert traffic.connect(chained["frontend"], chained["backend"].ip, OTHER_PORT) is None
        enforced = endpoint_keys()[(chained["backend"].container_id, "eth0")]
        assert enforced.get("policy_enforcement", {}).get("ingress") is True, enforced
    finally:
        for server in servers:
            traffic.stop(server)
        current_stack().operator_cli("delete", "cnp", POLICY, "-n", NS)

    ifindexes = {host.link_ifindex(h) for h in host_veths.values()}
    ips = {chained[r].ip for r in ROLES}
    for pod in reversed(list(chained.added)):
        deleted = pod.delete_list(chained.conflist, cni_path=CNI_PATH)
        assert deleted.ok, [o.stdout for o in deleted.outcomes]
        assert [o.command for o in deleted.outcomes] == ["DEL", "DEL"]
        chained.added.remove(pod)
    after = node_state()
    assert after.endpoints == before.endpoints
    assert after.used == before.used
    assert after.state_files == before.state_files
    assert not set(host_veths.values()) & set(host.sh("ip", "-o", "link").stdout.split())
    assert not ifindexes & set(after.bpf_endpoints), after.bpf_endpoints
    assert not {f"{ip}/32" for ip in ips} & set(
        after.ipcache_pods | bpfmaps.bpf_ipcache(current_stack().agent.pin_dir)
    )
    for ip in ips:
        assert not host.sh("ip", "route", "show", f"{ip}/32").stdout.strip(), f"route to {ip}"
    leases = tmp_path / "ipam" / NS
    assert not {ip for ip in ips if (leases / ip).exists()}, "host-local still holds addresses"
    for role in ROLES:
        assert netns.netns_links(chained[role].name) == ["lo"]


def _host_connect(address: str, port: int, timeout: float = 3.0) -> str | None:
    """TCP connect from the host itself; the greeting read, or None."""
    try:
        with socket.create_connection((address, port), timeout=timeout) as conn:
            conn.settimeout(timeout)
            return conn.recv(128).decode().strip() or None
    except OSError:
        return None


def _nat_rules() -> list[str]:
    return host.sh("iptables", "-t", "nat", "-S").stdout.splitlines()


def test_cilia_result_feeds_portmap_host_port_reaches_the_pod_and_del_removes_the_rules(
    conflist: dict[str, Any], make_pod: Callable[..., cni.Pod]
) -> None:
    _require("portmap")
    chain = {
        "cniVersion": conflist["cniVersion"],
        "name": conflist["name"],
        "plugins": [
            dict(conflist["plugins"][0]),
            {"type": "portmap", "capabilities": {"portMappings": True}, "snat": True},
        ],
    }
    # The host port stays bound (not listening) by this process for the whole test, so no
    # other program takes it; portmap's DNAT acts before local delivery.
    holder = host.reserve_tcp_port()
    host_port = int(holder.getsockname()[1])
    mappings = [{"hostPort": host_port, "containerPort": ALLOWED, "protocol": "tcp"}]
    pod, client = make_pod(labels={"app": "portmapped"}), make_pod(labels={"app": "client"})
    assert client.add(conflist).returncode == 0, dump_logs()

    outcome = pod.add_list(chain, cni_path=CNI_PATH, runtime_config={"portMappings": mappings})
    try:
        _fail_if_unimplemented(outcome, "a following plugin (portmap)")
        assert outcome.ok, [o.stdout for o in outcome.outcomes] + [dump_logs()]
        cilia_result = outcome.outcomes[0].json
        assert outcome.result is not None
        assert outcome.result["ips"] == cilia_result["ips"], "portmap changed the result"
        nat = _nat_rules()
        assert any(f"--dport {host_port}" in r for r in nat), "portmap installed no DNAT"

        server = traffic.start_servers(pod, (ALLOWED,))
        try:
            want = traffic.greeting(pod.name, ALLOWED)
            gateway = router_ip()
            # From the node (OUTPUT chain) and from another pod (PREROUTING), both to a
            # local address of the node.
            assert _host_connect(gateway, host_port) == want, "host port unreachable from node"
            assert traffic.connect(client, gateway, host_port) == want, (
                "host port unreachable from another pod"
            )
        finally:
            traffic.stop(server)
    finally:
        deleted = pod.delete_list(
            chain, cni_path=CNI_PATH, runtime_config={"portMappings": mappings}
        )
        holder.close()
    assert deleted.ok, [o.stdout for o in deleted.outcomes]
    assert [o.command for o in deleted.outcomes] == ["DEL", "DEL"]
    nat_after = _nat_rules()
    assert not [r for r in nat_after if f"--dport {host_port}" in r], "DNAT rule left"
    assert not [r for r in nat_after if pod.container_id in r], "portmap rules left"
    assert (pod.container_id, "eth0") not in endpoint_keys()
