"""NodePort from the LAN through ``bpf/bpf_host.c`` (``hostlb``), with real packets.

Topology (names ``tnp<hex>…``; removed even when the test fails)::

    [ lan netns ]  bridge 10.252.79.2/24 = the client (not a node)
        ├─veth── [ node netns ]   10.252.79.1/24 on the device (--devices); ip_forward=1
        │                          └─veth 10.252.80.1/30 ── [ pod netns ] 10.252.80.2/30
        │                                                    server :8080 TCP+UDP (node-1)
        └─veth── [ remote netns ] 10.252.79.3/24, server :8080 TCP+UDP (node-2)

The servers answer ``be <own address> from <peer address>`` so the test sees what each
backend saw as the client. The node's programs are loaded and attached inside the node
netns; the Service is written by the agent's own :class:`ServiceMapWriter` for node
``node-1``.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import secrets
import socket
import subprocess
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent.datapath.btf import btf_of_map, ctypes_layout, layout_diff
from cilia_agent.datapath.layout import ip_from_map
from cilia_agent.datapath.libbpf import PinnedMap
from cilia_agent.loadbalancer import hostlb, layout, socklb
from cilia_agent.loadbalancer.maps import ServiceMapWriter
from cilia_testkit import skips
from cilia_testkit.netns import create_netns, delete_netns

from .conftest import in_netns, link_exists, sh

NODE_ADDR, CLIENT_ADDR, REMOTE_ADDR = "10.252.79.1", "10.252.79.2", "10.252.79.3"
POD_GW, POD_ADDR = "10.252.80.1", "10.252.80.2"
TARGET = 8080
TCP_NODE_PORT, UDP_NODE_PORT = 30080, 30053
#: Requests per protocol; each backend must answer at least MIN_SHARE of them (random
#: choice, p = 1/2 each: fewer than 5 of 40 has a chance below 1e-6).
REQUESTS = 40
MIN_SHARE = 5
TIMEOUT = 2.0


@dataclass(frozen=True)
class Lan:
    lan: str
    node: str
    pod: str
    remote: str
    device: str


class Servers:
    """TCP and UDP servers on one address: ``be <own> from <peer>``."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.tcp.bind((address, TARGET))
        self.tcp.listen(256)
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind((address, TARGET))

    def serve(self) -> None:
        threading.Thread(target=self._accept, daemon=True).start()
        threading.Thread(target=self._answer, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self.tcp.accept()
            except OSError:
                return
            with conn, contextlib.suppress(OSError):
                conn.sendall(f"be {self.address} from {peer[0]}\n".encode())

    def _answer(self) -> None:
        while True:
            try:
                _, peer = self.udp.recvfrom(512)
                if peer is None:
                    return
                self.udp.sendto(f"be {self.address} from {peer[0]}".encode(), peer)
            except OSError:
                return

    def close(self) -> None:
        for s in (self.tcp, self.udp):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


@pytest.fixture
def lan() -> Iterator[Lan]:
    skips.require(skips.bpf_missing("tc/tcx programs, BPF links, pinned maps"))
    tag = secrets.token_hex(3)
    t = Lan(*(f"tnp{tag}{s}" for s in ("l", "n", "p", "r")), device=f"tnp{tag}d")
    servers: list[Servers] = []
    try:
        for ns in (t.lan, t.node, t.pod, t.remote):
            create_netns(ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", t.lan, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", t.lan, "addr", "add", f"{CLIENT_ADDR}/24", "dev", "br0")
        sh("ip", "-n", t.lan, "link", "set", "br0", "up")
        for ns, dev, addr in ((t.node, t.device, NODE_ADDR), (t.remote, "eth0", REMOTE_ADDR)):
            port = f"tnp{tag}{'a' if ns == t.node else 'b'}"
            sh("ip", "-n", t.lan, "link", "add", port, "type", "veth", "peer", "name", dev,
               "netns", ns)  # fmt: skip
            sh("ip", "-n", t.lan, "link", "set", port, "master", "br0", "up")
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("ip", "-n", t.node, "link", "add", "lxc0", "type", "veth", "peer", "name", "eth0",
           "netns", t.pod)  # fmt: skip
        sh("ip", "-n", t.node, "addr", "add", f"{POD_GW}/30", "dev", "lxc0")
        sh("ip", "-n", t.node, "link", "set", "lxc0", "up")
        sh("ip", "-n", t.pod, "addr", "add", f"{POD_ADDR}/30", "dev", "eth0")
        sh("ip", "-n", t.pod, "link", "set", "eth0", "up")
        sh("ip", "-n", t.pod, "route", "add", "default", "via", POD_GW)
        sh("ip", "netns", "exec", t.node, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        servers = [in_netns(t.pod, Servers, POD_ADDR), in_netns(t.remote, Servers, REMOTE_ADDR)]
        for s in servers:
            s.serve()
        yield t
    finally:
        for s in servers:
            s.close()
        for ns in (t.lan, t.node, t.pod, t.remote):
            delete_netns(ns)


def nodeport_service(external_policy: str = "Cluster") -> cp.Service:
    backends = [
        cp.ServiceBackend(ip=POD_ADDR, port=TARGET, ready=True, node_name="node-1"),
        cp.ServiceBackend(ip=REMOTE_ADDR, port=TARGET, ready=True, node_name="node-2"),
    ]
    return cp.Service(
        namespace="e", name="np", type="NodePort", cluster_ips=["198.18.77.50"],
        external_traffic_policy=external_policy,
        ports=[
            cp.ServicePort(protocol="TCP", port=80, node_port=TCP_NODE_PORT, backends=backends),
            cp.ServicePort(protocol="UDP", port=53, node_port=UDP_NODE_PORT, backends=backends),
        ],
    )  # fmt: skip


def tcp_once(address: str, port: int) -> str:
    """One connection: ``"<greeting> | <peer>"``, or ``"failed: …"``."""
    try:
        with socket.create_connection((address, port), timeout=TIMEOUT) as conn:
            peer = conn.getpeername()
            line = conn.makefile().readline().strip()
            return f"{line} | {peer[0]}:{peer[1]}"
    except OSError as exc:
        return f"failed: {exc}"


def udp_once(address: str, port: int) -> str:
    """One datagram: ``"<answer> | <reply source>"``, or ``"failed: …"``."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(TIMEOUT)
        try:
            s.sendto(b"hi", (address, port))
            data, source = s.recvfrom(512)
        except OSError as exc:
            return f"failed: {exc}"
        return f"{data.decode()} | {source[0]}:{source[1]}"


def many(fn: object, port: int, n: int) -> Counter[str]:
    assert callable(fn)
    return Counter(fn(NODE_ADDR, port) for _ in range(n))


def test_nodeport_from_the_lan_translates_both_ways_and_honours_local_policy(
    lan: Lan, sock_config: socklb.SockConfig, writer: ServiceMapWriter
) -> None:
    writer.node_name = "node-1"
    config = hostlb.HostConfig(
        bpf_dir=sock_config.bpf_dir, pin_dir=sock_config.pin_dir, devices=(lan.device,),
        lb_map_max=sock_config.lb_map_max, nat_max=4096,
    )  # fmt: skip
    assert in_netns(lan.node, hostlb.attach, config) == {lan.device: "attached"}
    assert writer.upsert_service(nodeport_service()) == []
    # the NodePorts are the 0.0.0.0 surrogate frontends, flagged NodePort
    for port, proto in ((TCP_NODE_PORT, 6), (UDP_NODE_PORT, 17)):
        master = writer.maps.services.lookup(
            layout.Lb4Key(address=0, dport=socket.htons(port), proto=proto)
        )
        assert master is not None and master.count == 2
        assert master.flags & layout.SVC_FLAG_NODEPORT

    local = f"be {POD_ADDR} from {CLIENT_ADDR}"  # the pod sees the client (world)
    remote = f"be {REMOTE_ADDR} from {NODE_ADDR}"  # SNAT: the remote backend sees the node
    tcp = in_netns(lan.lan, many, tcp_once, TCP_NODE_PORT, REQUESTS)
    want_peer = f"{NODE_ADDR}:{TCP_NODE_PORT}"
    assert set(tcp) == {f"{local} | {want_peer}", f"{remote} | {want_peer}"}, tcp
    assert min(tcp.values()) >= MIN_SHARE, tcp
    udp = in_netns(lan.lan, many, udp_once, UDP_NODE_PORT, REQUESTS)
    want_source = f"{NODE_ADDR}:{UDP_NODE_PORT}"  # the reply comes from node:nodePort
    assert set(udp) == {f"{local} | {want_source}", f"{remote} | {want_source}"}, udp
    assert min(udp.values()) >= MIN_SHARE, udp

    # translation state: the remote backend's replies are keyed by node:NAT port
    nat_pin = sock_config.pin_dir / layout.NAT_MAP
    with PinnedMap(nat_pin, layout.NatTuple, layout.NatEntry) as nat:
        entries = list(nat.items())
    snat = [
        k for k, v in entries
        if k.flags == layout.NAT_DIR_REPLY and v.to_daddr and ip_from_map(k.saddr) == REMOTE_ADDR
    ]  # fmt: skip
    assert snat and all(32768 <= socket.ntohs(k.dport) <= 65535 for k in snat)
    assert all(ip_from_map(k.daddr) == NODE_ADDR for k in snat)
    # the local backend's replies are keyed by the client (DNAT only), rewritten to node:port
    dnat = [
        (k, v) for k, v in entries
        if k.flags == layout.NAT_DIR_REPLY and ip_from_map(k.saddr) == POD_ADDR
    ]  # fmt: skip
    assert dnat and all(ip_from_map(k.daddr) == CLIENT_ADDR and not v.to_daddr for k, v in dnat)
    assert all(ip_from_map(v.to_saddr) == NODE_ADDR for _, v in dnat)
    forward = [k for k, _ in entries if k.flags == layout.NAT_DIR_FWD]
    assert len(forward) == len(snat) + len(dnat)  # one forward entry per flow
    if not skips.binary_missing("bpftool", "bpftool"):
        key_mirror, value_mirror = layout.HOST_MAP_LAYOUTS[layout.NAT_MAP]
        key, value = btf_of_map(pinned=nat_pin).map_key_value(layout.NAT_MAP)
        assert layout_diff(key, ctypes_layout(key_mirror)) == []
        assert layout_diff(value, ctypes_layout(value_mirror)) == []

    # an agent restart loads again and swaps the programs into the pinned links
    assert in_netns(lan.node, hostlb.attach, config) == {lan.device: "replaced"}
    again = in_netns(lan.lan, many, tcp_once, TCP_NODE_PORT, 4)
    assert set(again) <= {f"{local} | {want_peer}", f"{remote} | {want_peer}"}, again

    # externalTrafficPolicy Local: only node-1's own backend, the client address kept
    writer.upsert_service(nodeport_service("Local"))
    tcp = in_netns(lan.lan, many, tcp_once, TCP_NODE_PORT, 10)
    assert tcp == Counter({f"{local} | {want_peer}": 10}), tcp
    # ... and a node without a local backend drops NodePort traffic for the Service
    writer.node_name = "node-3"
    writer.upsert_service(nodeport_service("Local"))
    dropped = in_netns(lan.lan, many, udp_once, UDP_NODE_PORT, 1)
    assert all(k.startswith("failed") for k in dropped), dropped

    # the links are pinned beside the maps; detach unpins them, which detaches them
    pins = sorted(sock_config.pin_dir.glob(f"{hostlb.LINK_PREFIX}cil_*_netdev_{lan.device}"))
    assert [p.name for p in pins] == [
        f"{hostlb.LINK_PREFIX}{hostlb.PROG_FROM_NETDEV}_{lan.device}",
        f"{hostlb.LINK_PREFIX}{hostlb.PROG_TO_NETDEV}_{lan.device}",
    ]
    bpftool = not skips.binary_missing("bpftool", "bpftool")
    ids = [link_id(p) for p in pins] if bpftool else []
    assert all(link_exists(i) for i in ids)
    gone = in_netns(lan.node, hostlb.detach, sock_config.pin_dir, (lan.device,))
    assert sorted(gone) == sorted(p.name for p in pins)
    assert not any(p.exists() for p in pins)
    assert not [i for i in ids if link_exists(i)], "NodePort links still attached after detach"


def link_id(pin: pathlib.Path) -> int:
    out = subprocess.run(["bpftool", "-j", "link", "show", "pinned", str(pin)],
                         capture_output=True, text=True, check=True)  # fmt: skip
    return int(json.loads(out.stdout)["id"])


def _tc_fallback(config: hostlb.HostConfig, device: str) -> list[str]:
    """In the node netns: the programs attached as clsact filters (a kernel without tcx),
    then the ingress filters' text."""
    obj, fds = hostlb.load_programs(config)
    try:
        ifindex = hostlb.resolve_devices((device,))[device]
        hostlb.attach_fds(ifindex, fds)
        hostlb.attach_fds(ifindex, fds)  # idempotent: replaces
    finally:
        obj.close()
    return [
        sh_out("tc", "filter", "show", "dev", device, "ingress"),
        sh_out("tc", "filter", "show", "dev", device, "egress"),
    ]


def sh_out(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


def test_without_tcx_the_programs_attach_as_tc_filters_and_detach(
    lan: Lan, sock_config: socklb.SockConfig, writer: ServiceMapWriter
) -> None:
    writer.node_name = "node-1"
    writer.upsert_service(nodeport_service("Local"))  # local backend only: no SNAT needed
    config = hostlb.HostConfig(
        bpf_dir=sock_config.bpf_dir, pin_dir=sock_config.pin_dir, devices=(lan.device,),
        lb_map_max=sock_config.lb_map_max, nat_max=4096,
    )  # fmt: skip
    ingress, egress = in_netns(lan.node, _tc_fallback, config, lan.device)
    # one filter each (attached twice: replaced, not doubled)
    assert ingress.count("handle 0xc1") == 1 and hostlb.PROG_FROM_NETDEV in ingress, ingress
    assert egress.count("handle 0xc1") == 1 and hostlb.PROG_TO_NETDEV in egress, egress
    got = in_netns(lan.lan, many, tcp_once, TCP_NODE_PORT, 3)
    want = f"be {POD_ADDR} from {CLIENT_ADDR} | {NODE_ADDR}:{TCP_NODE_PORT}"
    assert got == Counter({want: 3}), got
    assert in_netns(lan.node, hostlb.detach, sock_config.pin_dir, (lan.device,)) == [lan.device]
    ingress = in_netns(lan.node, sh_out, "tc", "filter", "show", "dev", lan.device, "ingress")
    assert hostlb.PROG_FROM_NETDEV not in ingress


#: Tunnel routing (``--routing-mode tunnel``): node-2's pod CIDR behind a VXLAN device, as
#: ``datapath.routing`` sets it up (FDB + permanent neighbour + onlink route via node-2).
TUNNEL_POD_CIDR, TUNNEL_POD_ADDR = "10.252.81.0/24", "10.252.81.3"
TUNNEL_VNI, TUNNEL_PORT = 7, 8472
TUNNEL_MACS = {"node": "02:c1:00:00:00:01", "remote": "02:c1:00:00:00:03"}


def _tunnel(lan: Lan) -> None:
    for ns, local in ((lan.node, NODE_ADDR), (lan.remote, REMOTE_ADDR)):
        role = "node" if ns == lan.node else "remote"
        sh("ip", "-n", ns, "link", "add", "vx0", "address", TUNNEL_MACS[role], "type",
           "vxlan", "id", str(TUNNEL_VNI), "dstport", str(TUNNEL_PORT), "local", local,
           "nolearning")  # fmt: skip
        sh("ip", "-n", ns, "link", "set", "vx0", "up")
    # the pod on node-2 and its node's rp_filter off on the tunnel (preflight's sysctl step)
    sh("ip", "-n", lan.remote, "addr", "add", f"{TUNNEL_POD_ADDR}/32", "dev", "lo")
    for key in ("all", "vx0"):
        sh("ip", "netns", "exec", lan.remote, "sysctl", "-qw", f"net.ipv4.conf.{key}.rp_filter=0")
    sh("ip", "netns", "exec", lan.node, "bridge", "fdb", "append", TUNNEL_MACS["remote"],
       "dev", "vx0", "dst", REMOTE_ADDR)  # fmt: skip
    sh("ip", "-n", lan.node, "neigh", "add", REMOTE_ADDR, "lladdr", TUNNEL_MACS["remote"],
       "dev", "vx0", "nud", "permanent")  # fmt: skip
    sh("ip", "-n", lan.node, "route", "add", TUNNEL_POD_CIDR, "via", REMOTE_ADDR, "dev", "vx0",
       "onlink")  # fmt: skip


def test_tunnel_routing_snats_a_backend_behind_the_tunnel_device(
    lan: Lan, sock_config: socklb.SockConfig, writer: ServiceMapWriter
) -> None:
    """With tunnel routing a backend on another node is reached through the tunnel device,
    not the device the request came in by: it is SNATed all the same, so its replies come
    back through this node and reach the client from node:nodePort."""
    _tunnel(lan)
    servers = in_netns(lan.remote, Servers, TUNNEL_POD_ADDR)
    servers.serve()
    try:
        writer.node_name = "node-1"
        backends = [cp.ServiceBackend(ip=TUNNEL_POD_ADDR, port=TARGET, ready=True,
                                      node_name="node-2")]  # fmt: skip
        writer.upsert_service(cp.Service(
            namespace="e", name="np", type="NodePort", cluster_ips=["198.18.77.51"],
            ports=[
                cp.ServicePort(protocol="TCP", port=80, node_port=TCP_NODE_PORT,
                               backends=backends),
                cp.ServicePort(protocol="UDP", port=53, node_port=UDP_NODE_PORT,
                               backends=backends),
            ],
        ))  # fmt: skip
        config = hostlb.HostConfig(
            bpf_dir=sock_config.bpf_dir, pin_dir=sock_config.pin_dir, devices=(lan.device,),
            lb_map_max=sock_config.lb_map_max, nat_max=4096, tunnel=True,
        )  # fmt: skip
        assert in_netns(lan.node, hostlb.attach, config) == {lan.device: "attached"}
        want = f"be {TUNNEL_POD_ADDR} from {NODE_ADDR}"
        tcp = in_netns(lan.lan, many, tcp_once, TCP_NODE_PORT, 3)
        assert tcp == Counter({f"{want} | {NODE_ADDR}:{TCP_NODE_PORT}": 3}), tcp
        udp = in_netns(lan.lan, many, udp_once, UDP_NODE_PORT, 3)
        assert udp == Counter({f"{want} | {NODE_ADDR}:{UDP_NODE_PORT}": 3}), udp
    finally:
        servers.close()
        in_netns(lan.node, hostlb.detach, sock_config.pin_dir, (lan.device,))
