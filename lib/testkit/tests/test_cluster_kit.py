"""The cluster kit's pure parts, and the probe run for real inside a netns of its own."""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest

from cilia_testkit import probe
from cilia_testkit.cluster import Cluster, lan_network, netns_prefix, node_letter_name
from cilia_testkit.netns import NetnsRegistry
from cilia_testkit.stackctl import LEFTOVER_NETNS


def test_each_slot_has_its_own_lan_and_netns_prefix() -> None:
    assert lan_network(0) == ipaddress.IPv4Network("198.18.0.0/24")
    assert lan_network(7) == ipaddress.IPv4Network("198.18.7.0/24")
    assert not lan_network(1).overlaps(lan_network(2))
    assert netns_prefix(3) == "cilia-cl3-"
    assert LEFTOVER_NETNS.match("cilia-cl3-node-a") and LEFTOVER_NETNS.match("cilia-cl12-x")
    with pytest.raises(ValueError, match="slot 256"):
        lan_network(256)


def test_nodes_are_named_by_letter() -> None:
    assert [node_letter_name(i) for i in (0, 1, 25, 26)] == [
        "node-a",
        "node-b",
        "node-z",
        "node-26",
    ]


def test_tunnel_clusters_pass_vxlan_and_the_mtu_to_every_agent() -> None:
    assert Cluster(routing="tunnel", mtu=9000).agent_args() == [
        "--routing-mode",
        "tunnel",
        "--mtu",
        "9000",
        "--enable-node-port=true",
        "--enable-ipv4-masquerade=true",
        "--tunnel-protocol",
        "vxlan",
    ]
    assert Cluster(agent_args=("--log-level", "debug")).agent_args()[-2:] == [
        "--log-level",
        "debug",
    ]
    with pytest.raises(ValueError, match="routing"):
        Cluster(routing="geneve")  # type: ignore[arg-type]


def test_echo_requests_carry_a_valid_checksum() -> None:
    packet = probe._echo(0x1234, 7)
    assert probe._checksum(packet) == 0  # a correct checksum sums the packet to 0
    assert packet[:1] == b"\x08" and packet[4:8] == b"\x12\x34\x00\x07"


@pytest.fixture
def netns() -> Iterator[str]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 for a network namespace")
    registry = NetnsRegistry("cilia-tk-probe-")
    registry.remove_stale()
    try:
        yield registry.create()
    finally:
        registry.cleanup()


@pytest.mark.privileged
def test_probe_checks_icmp_and_tcp_with_payload_and_counts_pings(netns: str) -> None:
    server = probe.start_server(netns, "srv", (8080,))
    try:
        ok = probe.check_from(
            netns, "icmp:127.0.0.1", "tcp:127.0.0.1:8080", payload=3 * probe.CHUNK + 5
        )
        assert [(r.target, r.ok) for r in ok] == [
            ("icmp:127.0.0.1", True),
            ("tcp:127.0.0.1:8080", True),
        ]
        assert ok[1].detail == probe.greeting("srv", 8080)
        refused = probe.check_from(netns, "tcp:127.0.0.1:8081", timeout=1)[0]
        assert not refused.ok and "ConnectionRefused" in refused.detail
        silent = probe.check_from(netns, "icmp:192.0.2.1", timeout=0.6)[0]
        assert not silent.ok  # no route in the empty netns
        ping = probe.start_ping(netns, "127.0.0.1", 0.01)  # returns once the first echo went
        outcome = probe.finish_ping(ping)  # stops sending, waits for the replies, counts
        assert outcome["sent"] >= 1 and outcome["lost"] == [], outcome
        assert outcome["received"] == outcome["sent"]
    finally:
        probe.stop(server)


@pytest.mark.parametrize("target", ["sctp:1.2.3.4:80", "udp:1.2.3.4", "tcp:1.2.3.4:http"])
def test_probe_rejects_an_unknown_or_malformed_target(target: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "cilia_testkit.probe", "check", target],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 2 and "not icmp:IP, tcp:IP:PORT or udp:IP:PORT" in out.stderr
