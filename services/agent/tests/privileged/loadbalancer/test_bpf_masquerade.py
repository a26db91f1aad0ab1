"""BPF masquerade (``bpf/bpf_host.c``, ``masquerade/bpf.py``) with real packets.

Topology (names ``tbm<hex>…``; removed even when the test fails)::

    [ pod a ] 10.251.7.2/30 ─veth─ lxca 10.251.7.1 ┐
    [ pod b ] 10.251.7.6/30 ─veth─ lxcb 10.251.7.5 ┤ [ node ] eth0 192.0.2.1/24, ip_forward=1,
                                                    ┘          bpf_host.o on eth0 (masquerade)
                                     [ outside ] eth0 192.0.2.2/24 ─veth─┘
                                     TCP and UDP :9300 answer "<peer ip>:<peer port>";
                                     no route to 10.251.7.0/24 (it cannot answer a pod)

Checksum offload is off on the pods' and the outside host's devices (both directions), so
every receiver verifies the TCP, UDP and ICMP checksums in software: a wrong incremental
update in the translation drops the packet (and counts in ``nstat``'s ``*CsumErrors``).
The outside host's own iptables counters say which sources it saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import secrets
import socket
import struct
import subprocess
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent.datapath.layout import ip_from_map
from cilia_agent.datapath.libbpf import PinnedMap
from cilia_agent.loadbalancer import hostlb, layout, socklb
from cilia_agent.loadbalancer.maps import ServiceMapWriter
from cilia_agent.masquerade.bpf import BpfMasqMaps, BpfMasquerade, MasqGC, NatStats
from cilia_agent.masquerade.rules import NatChain
from cilia_testkit import skips
from cilia_testkit.netns import create_netns, delete_netns

from .conftest import in_netns, sh

NODE, OUTSIDE = "192.0.2.1", "192.0.2.2"
POD_A, POD_B = "10.251.7.2", "10.251.7.6"
POD_CIDR = "10.251.7.0/24"
PORT = 9300
SIOCETHTOOL, ETHTOOL_SRXCSUM, ETHTOOL_STXCSUM = 0x8946, 0x15, 0x17


@dataclass(frozen=True)
class Net:
    a: str
    b: str
    node: str
    out: str


def _no_csum_offload(device: str) -> None:
    """Checksum offload off on ``device`` (rx and tx), through the ethtool ioctl."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for cmd in (ETHTOOL_SRXCSUM, ETHTOOL_STXCSUM):
            value = ctypes.create_string_buffer(struct.pack("II", cmd, 0))
            ifreq = struct.pack("16sP", device.encode(), ctypes.addressof(value))
            fcntl.ioctl(s.fileno(), SIOCETHTOOL, ifreq)


class Echo:
    """TCP and UDP on OUTSIDE:PORT answering ``<peer ip>:<peer port>``; remembers peers."""

    def __init__(self) -> None:
        self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.tcp.bind((OUTSIDE, PORT))
        self.tcp.listen(64)
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind((OUTSIDE, PORT))
        self.seen: list[tuple[str, int]] = []
        threading.Thread(target=self._accept, daemon=True).start()
        threading.Thread(target=self._answer, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self.tcp.accept()
            except OSError:
                return
            self.seen.append(peer)
            with conn, contextlib.suppress(OSError):
                conn.sendall(f"{peer[0]}:{peer[1]}\n".encode())

    def _answer(self) -> None:
        while True:
            try:
                _, peer = self.udp.recvfrom(512)
                if peer is None:
                    return
                self.seen.append(peer)
                self.udp.sendto(f"{peer[0]}:{peer[1]}".encode(), peer)
            except OSError:
                return

    def close(self) -> None:
        for s in (self.tcp, self.udp):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


def tcp_from(sport: int = 0, timeout: float = 2.0) -> str:
    """In a pod: connect to the outside (from ``sport``); the peer the server saw."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.settimeout(timeout)
            s.bind(("0.0.0.0", sport))
            s.connect((OUTSIDE, PORT))
            return s.makefile().readline().strip()
    except OSError as exc:
        return f"failed: {exc}"


def udp_from(sport: int = 0, timeout: float = 2.0) -> str:
    """In a pod: one datagram to the outside; the peer the server saw."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout)
        s.bind(("0.0.0.0", sport))
        try:
            s.sendto(b"hi", (OUTSIDE, PORT))
            return s.recvfrom(512)[0].decode()
        except OSError as exc:
            return f"failed: {exc}"


def out(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


@pytest.fixture
def net() -> Iterator[Net]:
    skips.require(skips.bpf_missing("tc/tcx programs, BPF links, pinned maps"))
    tag = secrets.token_hex(3)
    t = Net(*(f"tbm{tag}{s}" for s in ("a", "b", "n", "o")))
    try:
        for ns in (t.a, t.b, t.node, t.out):
            create_netns(ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", t.node, "link", "add", "eth0", "type", "veth", "peer", "name", "eth0",
           "netns", t.out)  # fmt: skip
        sh("ip", "-n", t.node, "addr", "add", f"{NODE}/24", "dev", "eth0")
        sh("ip", "-n", t.out, "addr", "add", f"{OUTSIDE}/24", "dev", "eth0")
        for ns in (t.node, t.out):
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
        for pod, lxc, gw, addr in ((t.a, "lxca", "10.251.7.1", POD_A),
                                   (t.b, "lxcb", "10.251.7.5", POD_B)):  # fmt: skip
            sh("ip", "-n", t.node, "link", "add", lxc, "type", "veth", "peer", "name", "eth0",
               "netns", pod)  # fmt: skip
            sh("ip", "-n", t.node, "addr", "add", f"{gw}/30", "dev", lxc)
            sh("ip", "-n", t.node, "link", "set", lxc, "up")
            sh("ip", "-n", pod, "addr", "add", f"{addr}/30", "dev", "eth0")
            sh("ip", "-n", pod, "link", "set", "eth0", "up")
            sh("ip", "-n", pod, "route", "add", "default", "via", gw)
            in_netns(pod, _no_csum_offload, "eth0")
        in_netns(t.out, _no_csum_offload, "eth0")
        sh("ip", "netns", "exec", t.node, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        sh("ip", "netns", "exec", t.out, "sysctl", "-qw", "net.ipv4.ping_group_range=0 0")
        # the outside host's own record of the sources it saw
        for src in (POD_CIDR, f"{NODE}/32"):
            sh("ip", "netns", "exec", t.out, "iptables", "-A", "INPUT", "-s", src, "-j", "RETURN")
        yield t
    finally:
        for ns in (t.a, t.b, t.node, t.out):
            delete_netns(ns)


def seen_by_outside(t: Net) -> dict[str, int]:
    """Packets the outside host received, by source (its INPUT counters)."""
    counts: dict[str, int] = {}
    for line in out("ip", "netns", "exec", t.out, "iptables", "-nvxL", "INPUT").splitlines()[2:]:
        f = line.split()
        counts[f[7]] = int(f[0])
    return counts


def csum_errors(netns: str) -> dict[str, int]:
    text = out("ip", "netns", "exec", netns, "nstat", "-az")
    return {
        f[0]: int(f[1])
        for f in (line.split() for line in text.splitlines())
        if "CsumErrors" in f[0]
    }


def _manager(t: Net, pin: socklb.SockConfig, **kw: object) -> BpfMasquerade:
    ifindex = in_netns(t.node, lambda: socket.if_nametoindex("eth0"))
    return BpfMasquerade(
        BpfMasqMaps(pin.pin_dir),
        NatChain("iptables", 10.0, prefix=("ip", "netns", "exec", t.node)),
        lambda: {"default": [POD_CIDR]},
        lambda: "default",
        lambda: {ifindex: NODE},
        lambda: [NODE],
        ThreadPoolExecutor(1),
        CollectorRegistry(),
        **kw,  # type: ignore[arg-type]
    )


def _attach(t: Net, pin: socklb.SockConfig) -> None:
    config = hostlb.HostConfig(
        bpf_dir=pin.bpf_dir, pin_dir=pin.pin_dir, devices=("eth0",),
        lb_map_max=pin.lb_map_max, nat_max=4096, masquerade=True,
    )  # fmt: skip
    assert in_netns(t.node, hostlb.attach, config) == {"eth0": "attached"}


def masq_entries(pin: socklb.SockConfig) -> list[tuple[layout.NatTuple, layout.NatEntry]]:
    with PinnedMap(pin.pin_dir / layout.NAT_MAP, layout.NatTuple, layout.NatEntry) as nat:
        return [(k, v) for k, v in nat.items() if v.flags & layout.NAT_F_MASQ]


def test_pods_reach_the_outside_as_the_node_over_tcp_udp_and_icmp(
    net: Net, sock_config: socklb.SockConfig, writer: ServiceMapWriter
) -> None:
    _attach(net, sock_config)
    echo = in_netns(net.out, Echo)
    try:
        # maps empty: nothing is masqueraded, the outside cannot answer a pod
        assert in_netns(net.a, tcp_from, 0, 1.0).startswith("failed")
        unmasqueraded = seen_by_outside(net)[POD_CIDR]
        assert unmasqueraded >= 1
        m = _manager(net, sock_config)
        asyncio.run(m.start())
        for _ in range(3):
            assert in_netns(net.a, tcp_from).startswith(f"{NODE}:")
            assert in_netns(net.a, udp_from).startswith(f"{NODE}:")
        ping = subprocess.run(["ip", "netns", "exec", net.a, "ping", "-c", "3", "-i", "0.2",
                               "-W", "2", OUTSIDE], capture_output=True, text=True)  # fmt: skip
        assert ping.returncode == 0, ping.stdout + ping.stderr
        assert "3 received" in ping.stdout
        seen = seen_by_outside(net)
        assert seen[POD_CIDR] == unmasqueraded, seen  # only before the maps were written
        assert seen[NODE] >= 3 * 3 + 3, seen
        assert {p for p, _ in echo.seen[1:]} == {NODE}, echo.seen
        for ns in (net.a, net.out):
            assert not any(csum_errors(ns).values()), csum_errors(ns)

        # two pods, the same source port, the same destination: two NAT ports
        got = {in_netns(pod, fn, 40000) for pod in (net.a, net.b) for fn in (tcp_from,)}
        assert len(got) == 2 and all(g.startswith(f"{NODE}:") for g in got), got
        entries = masq_entries(sock_config)
        fwd = [(k, v) for k, v in entries
               if k.flags == layout.NAT_DIR_FWD and socket.ntohs(k.sport) == 40000]  # fmt: skip
        assert {ip_from_map(k.saddr) for k, _ in fwd} == {POD_A, POD_B}
        ports = {socket.ntohs(v.to_sport) for _, v in fwd}
        assert len(ports) == 2 and all(32768 <= p <= 65535 for p in ports), ports
        assert {f"{NODE}:{p}" for p in ports} == got
        icmp = [k for k, _ in entries if k.nexthdr == layout.IPPROTO_ICMP]
        assert icmp, "no ICMP echo entry"

        # the BPF counters; no port ran out
        stats = {m.name: m.samples for m in NatStats(sock_config.pin_dir).collect()}
        assert stats["cilia_nat_masquerade_flows"][0].value >= 9
        assert all(s.value == 0 for s in stats["cilia_nat_port_exhausted"])

        # idle flows are collected (both entries); a fresh flow works again after
        assert MasqGC(sock_config.pin_dir, 600, 0, None, CollectorRegistry()).sweep() == 0
        gc = MasqGC(sock_config.pin_dir, 0.000001, 0, None, CollectorRegistry())
        assert gc.sweep() == len(entries) and masq_entries(sock_config) == []
        assert in_netns(net.b, udp_from).startswith(f"{NODE}:")
    finally:
        echo.close()


def test_excluded_destinations_and_nodes_keep_the_pod_address(
    net: Net, sock_config: socklb.SockConfig, writer: ServiceMapWriter, tmp_path: object
) -> None:
    import pathlib

    conf = pathlib.Path(str(tmp_path)) / "ip-masq-agent"
    conf.write_text("nonMasqueradeCIDRs: [203.0.113.0/24]\n")
    # the outside host can answer pods for this test, so an unmasqueraded flow succeeds
    sh("ip", "-n", net.out, "route", "add", POD_CIDR, "via", NODE)
    _attach(net, sock_config)
    echo = in_netns(net.out, Echo)
    try:
        m = _manager(net, sock_config, native_routing_cidr="198.51.100.0/24", ip_masq_agent=conf)
        asyncio.run(m.start())
        assert in_netns(net.a, tcp_from).startswith(f"{NODE}:")
        excl = BpfMasqMaps(sock_config.pin_dir).exclusions()
        for cidr in ("198.51.100.0/24", "203.0.113.0/24", "169.254.0.0/16", POD_CIDR, f"{NODE}/32"):
            assert cidr in excl, excl
        # the outside address as an ip-masq-agent exclusion: the pod's own address
        conf.write_text(f"nonMasqueradeCIDRs: [{OUTSIDE}/32]\n")
        asyncio.run(m.sync(check=True))
        assert in_netns(net.a, tcp_from).startswith(f"{POD_A}:")
        assert in_netns(net.a, udp_from).startswith(f"{POD_A}:")
        # ... and as another node's address (the node stream): never masqueraded either
        conf.write_text("nonMasqueradeCIDRs: [203.0.113.0/24]\n")
        asyncio.run(m.nodes_changed({"b": cp.Node(name="b", addresses=[OUTSIDE])}))
        assert in_netns(net.b, tcp_from).startswith(f"{POD_B}:")
        asyncio.run(m.nodes_changed({}))
        assert in_netns(net.b, tcp_from).startswith(f"{NODE}:")
        # only the default pool's pods with --only-masquerade-default-pool
        m2 = _manager(net, sock_config, only_default_pool=True)
        m2.pod_cidrs = lambda: {"default": ["10.251.7.4/30"], "other": ["10.251.7.0/30"]}
        asyncio.run(m2.start())
        assert in_netns(net.a, tcp_from).startswith(f"{POD_A}:")
        assert in_netns(net.b, tcp_from).startswith(f"{NODE}:")
    finally:
        echo.close()


def test_start_removes_the_iptables_chain_of_an_earlier_run(
    net: Net, sock_config: socklb.SockConfig, writer: ServiceMapWriter
) -> None:
    _attach(net, sock_config)
    chain = NatChain("iptables", 10.0, prefix=("ip", "netns", "exec", net.node))
    chain.ensure([["-s", POD_CIDR, "-j", "MASQUERADE"]])
    assert "CILIA_POST_nat" in out("ip", "netns", "exec", net.node, "iptables", "-t", "nat", "-S")
    asyncio.run(_manager(net, sock_config).start())
    assert "CILIA_POST_nat" not in out("ip", "netns", "exec", net.node, "iptables", "-t", "nat",
                                       "-S")  # fmt: skip


ROUNDS, CONNECTS = 6, 100


def _connect_times(n: int) -> list[float]:
    """In a pod: ``n`` connects to the outside, each timed from connect() to the server's
    line read (µs); raises on a failed one or on an answer that is not the node's."""
    import time

    times = []
    for _ in range(n):
        started = time.perf_counter()
        with socket.create_connection((OUTSIDE, PORT), timeout=2.0) as s:
            line = s.makefile().readline()
        times.append((time.perf_counter() - started) * 1e6)
        assert line.startswith(f"{NODE}:"), line
    return times


def test_connect_latency_through_bpf_snat_against_iptables_masquerade(
    net: Net, sock_config: socklb.SockConfig, writer: ServiceMapWriter
) -> None:
    """Same topology, same run: rounds alternate between BPF masquerade (maps written, no
    chain) and iptables masquerade (``CILIA_POST_nat``, BPF maps emptied); printed: the
    median and p10-p90 of each mode and each round's median (``pytest -s``)."""
    import statistics

    from cilia_agent.masquerade.rules import chain_rules, make_plan

    _attach(net, sock_config)
    echo = in_netns(net.out, Echo)
    m = _manager(net, sock_config)
    chain = m.chain
    gc = MasqGC(sock_config.pin_dir, 1e-9, 0, None, CollectorRegistry())
    results: dict[str, list[float]] = {"bpf": [], "iptables": []}
    medians: dict[str, list[float]] = {"bpf": [], "iptables": []}
    try:
        for i in range(ROUNDS * 2):
            mode = ("bpf", "iptables")[i % 2]
            if mode == "bpf":
                chain.remove()
                m.applied = None
                asyncio.run(m.sync(check=True))
            else:
                m.maps.clear()
                # as a switch of mode does (bpf_host.o loaded with CONFIG.masquerade 0 no
                # longer reverses them): the BPF rounds' flows go, or a reply to a port the
                # kernel's MASQUERADE picked again would be taken for an old BPF flow
                gc.sweep()
                chain.ensure(chain_rules(make_plan([POD_CIDR], [], ["eth0"])))
            times = in_netns(net.a, _connect_times, CONNECTS)
            results[mode] += times
            medians[mode].append(statistics.median(times))
        for mode, times in results.items():
            q = statistics.quantiles(times, n=10)
            print(f"\n{mode}: {len(times)} connects, median {statistics.median(times):.0f} µs, "
                  f"p10 {q[0]:.0f} p90 {q[-1]:.0f} µs; round medians "
                  f"{', '.join(f'{x:.0f}' for x in medians[mode])}")  # fmt: skip
        assert len(results["bpf"]) == len(results["iptables"]) == ROUNDS * CONNECTS
        # each BPF round's connects went through the SNAT map (two entries per flow)
        assert gc.deleted._value.get() >= 2 * (ROUNDS - 1) * CONNECTS
    finally:
        echo.close()
