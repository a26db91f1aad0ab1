"""Masquerade in iptables mode with real packets: pod → node → outside, three netns.

    pod netns   eth0 10.251.<n>.2/24, default via 10.251.<n>.1
      │ veth
    node netns  lxc<tag> 10.251.<n>.1/24 ; eth0 192.0.2.1/24 ; ip_forward=1 ; CILIA_POST_nat
      │ veth
    outside     eth0 192.0.2.2/24, no route to 10.251.<n>.0/24 (cannot answer a pod address)

The manager (:class:`~cilia_agent.masquerade.manager.Masquerade`) writes the chain inside the
node netns (``ip netns exec``); the peer server on the outside host reports the source it saw.
"""

from __future__ import annotations

import asyncio
import secrets
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent.masquerade.manager import Masquerade
from cilia_agent.masquerade.rules import NatChain
from cilia_testkit import peer
from cilia_testkit.netns import create_netns, delete_netns

from .conftest import sh

PORT = 9100
NODE_LAN = "192.0.2.1"
OUTSIDE = "192.0.2.2"


@dataclass
class Net:
    pod: str
    node: str
    outside: str
    cidr: str
    pod_ip: str

    def node_sh(self, *cmd: str) -> str:
        return sh("ip", "netns", "exec", self.node, *cmd)


@pytest.fixture
def net() -> Iterator[Net]:
    tag = secrets.token_hex(3)
    n = secrets.randbelow(250) + 1
    names = [f"mq{tag}-{what}" for what in ("pod", "node", "out")]
    for name in names:
        create_netns(name)
    pod, node, out = names
    try:
        sh("ip", "-n", node, "link", "add", "lxcpod", "type", "veth", "peer", "name", "eth0",
           "netns", pod)  # fmt: skip
        sh("ip", "-n", node, "link", "add", "eth0", "type", "veth", "peer", "name", "eth0",
           "netns", out)  # fmt: skip
        sh("ip", "-n", node, "addr", "add", f"10.251.{n}.1/24", "dev", "lxcpod")
        sh("ip", "-n", node, "addr", "add", f"{NODE_LAN}/24", "dev", "eth0")
        sh("ip", "-n", pod, "addr", "add", f"10.251.{n}.2/24", "dev", "eth0")
        sh("ip", "-n", out, "addr", "add", f"{OUTSIDE}/24", "dev", "eth0")
        for ns, devs in (
            (pod, ("lo", "eth0")),
            (node, ("lo", "lxcpod", "eth0")),
            (out, ("lo", "eth0")),
        ):
            for dev in devs:
                sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("ip", "-n", pod, "route", "add", "default", "via", f"10.251.{n}.1")
        sh("ip", "netns", "exec", node, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        yield Net(pod, node, out, f"10.251.{n}.0/24", f"10.251.{n}.2")
    finally:
        for name in names:
            delete_netns(name)


def _manager(net: Net, **kw: object) -> Masquerade:
    chain = NatChain("iptables", 10.0, prefix=("ip", "netns", "exec", net.node))
    return Masquerade(
        chain,
        lambda: {"default": [net.cidr]},
        lambda: "default",
        lambda: [("eth0", "192.0.2.0/24")],
        ThreadPoolExecutor(1),
        CollectorRegistry(),
        devices=("eth0",),
        **kw,  # type: ignore[arg-type]
    )


def _nat_rules(net: Net) -> str:
    return net.node_sh("iptables", "-t", "nat", "-S")


def test_pod_reaches_outside_as_the_node_and_repairs_and_exclusions_hold(net: Net) -> None:
    # one server port per phase: a connection that failed un-NATed leaves a conntrack entry
    # (SYN_SENT, 120 s) that a later SYN from the same pod port would match, NAT or not
    ports = {
        phase: PORT + i for i, phase in enumerate(("before", "masq", "nojump", "back", "excl"))
    }
    servers = {phase: peer.start(net.outside, port) for phase, port in ports.items()}
    try:
        # without masquerade the outside host cannot answer the pod's address
        assert peer.ask(net.pod, OUTSIDE, ports["before"], timeout=1.0) == [None]
        assert servers["before"].seen() == []  # its SYN-ACK went nowhere: nothing accepted

        m = _manager(net)
        asyncio.run(m.start())
        rules = _nat_rules(net)
        assert "-A POSTROUTING -j CILIA_POST_nat" in rules
        assert (f"-A CILIA_POST_nat -s {net.cidr} -o eth0 -m comment --comment \"cilia: "
                "masquerade\" -j MASQUERADE --random-fully") in rules  # fmt: skip
        answers = peer.ask(net.pod, OUTSIDE, ports["masq"], rounds=5)
        assert all(a is not None and a.ip == NODE_LAN for a in answers), answers
        assert set(servers["masq"].seen()) == {NODE_LAN}

        # a second start writes nothing
        asyncio.run(m.sync(check=True))
        assert m.syncs.labels(what="chain_rebuilt")._value.get() == 1

        # someone removes the jump: the periodic check puts it back
        net.node_sh("iptables", "-t", "nat", "-D", "POSTROUTING", "-j", "CILIA_POST_nat")
        assert peer.ask(net.pod, OUTSIDE, ports["nojump"], timeout=1.0) == [None]
        asyncio.run(m.sync(check=True))
        assert m.syncs.labels(what="jump_inserted")._value.get() == 2
        answer = peer.ask(net.pod, OUTSIDE, ports["back"])[0]
        assert answer is not None and answer.ip == NODE_LAN

        # another node's pod CIDR arrives: excluded (the outside address stands for it here)
        node = cp.Node(name="other", pod_cidrs=[f"{OUTSIDE}/32"])
        asyncio.run(m.nodes_changed({"other": node}))
        assert f"-A CILIA_POST_nat -d {OUTSIDE}/32" in _nat_rules(net)
        assert peer.ask(net.pod, OUTSIDE, ports["excl"], timeout=1.0) == [None]
        assert servers["excl"].seen() == []
    finally:
        for server in servers.values():
            peer.stop(server)


def test_native_routing_cidr_and_ip_masq_agent_keep_the_pod_address(
    net: Net, tmp_path: object
) -> None:
    import pathlib

    conf = pathlib.Path(str(tmp_path)) / "ip-masq-agent"
    conf.write_text("nonMasqueradeCIDRs:\n- 203.0.113.0/24\n")
    # the outside host can answer pods for this test
    sh("ip", "-n", net.outside, "route", "add", net.cidr, "via", NODE_LAN)
    ports = {phase: PORT + 10 + i for i, phase in enumerate(("masq", "excl", "broken"))}
    servers = {phase: peer.start(net.outside, port) for phase, port in ports.items()}

    def seen_as(phase: str) -> str | None:
        answer = peer.ask(net.pod, OUTSIDE, ports[phase])[0]
        return answer.ip if answer else None

    try:
        m = _manager(net, native_routing_cidr="198.51.100.0/24", ip_masq_agent=conf)
        asyncio.run(m.start())
        rules = _nat_rules(net)
        for cidr in ("198.51.100.0/24", "203.0.113.0/24", "169.254.0.0/16", net.cidr):
            assert f"-A CILIA_POST_nat -d {cidr} " in rules, rules
        assert seen_as("masq") == NODE_LAN
        conf.write_text(f"nonMasqueradeCIDRs: [{OUTSIDE}/32]\nmasqLinkLocal: true\n")
        asyncio.run(m.sync(check=True))
        assert "169.254.0.0/16" not in _nat_rules(net)
        assert seen_as("excl") == net.pod_ip
        # a broken file keeps the last good list
        conf.write_text("nonMasqueradeCIDRs: [not-a-cidr]\n")
        asyncio.run(m.sync(check=True))
        assert seen_as("broken") == net.pod_ip
    finally:
        for server in servers.values():
            peer.stop(server)


def test_only_default_pool_masquerades_only_that_pools_cidrs(net: Net) -> None:
    chain = NatChain("iptables", 10.0, prefix=("ip", "netns", "exec", net.node))
    m = Masquerade(chain, lambda: {"default": [net.cidr], "routable": ["10.252.0.0/24"]},
                   lambda: "default", lambda: [], ThreadPoolExecutor(1), CollectorRegistry(),
                   devices=("eth0",), only_default_pool=True)  # fmt: skip
    asyncio.run(m.start())
    rules = _nat_rules(net)
    assert f"-s {net.cidr} -o eth0" in rules and "-s 10.252.0.0/24" not in rules
    assert "-A CILIA_POST_nat -d 10.252.0.0/24" in rules  # still a pod CIDR of the cluster


def test_remove_deletes_the_jump_and_the_chain_and_nothing_else(net: Net) -> None:
    net.node_sh("iptables", "-t", "nat", "-A", "POSTROUTING", "-s", "10.9.0.0/16", "-j",
                "MASQUERADE")  # fmt: skip
    m = _manager(net)
    asyncio.run(m.start())
    removed = m.chain.remove()
    assert removed == ["-t nat -A POSTROUTING -j CILIA_POST_nat", "-t nat -N CILIA_POST_nat"]
    rules = _nat_rules(net)
    assert "CILIA_POST_nat" not in rules and "-A POSTROUTING -s 10.9.0.0/16 -j MASQUERADE" in rules
    assert m.chain.remove() == []
    proc = subprocess.run(["ip", "netns", "exec", net.node, "iptables", "-t", "nat", "-S",
                           "CILIA_POST_nat"], capture_output=True, text=True, check=False)  # fmt: skip
    assert proc.returncode != 0


def test_a_restarting_agent_keeps_other_nodes_exclusions_until_the_node_stream_says(
    net: Net,
) -> None:
    first = _manager(net)
    asyncio.run(first.nodes_changed({"b": cp.Node(name="b", pod_cidrs=["10.253.0.0/24"])}))
    asyncio.run(first.start())
    assert "-A CILIA_POST_nat -d 10.253.0.0/24" in _nat_rules(net)
    second = _manager(net)  # the restarted agent, before its node stream synced
    asyncio.run(second.start())
    assert "-A CILIA_POST_nat -d 10.253.0.0/24" in _nat_rules(net)
    asyncio.run(second.nodes_changed({}))  # node b is gone
    assert "10.253.0.0/24" not in _nat_rules(net)
