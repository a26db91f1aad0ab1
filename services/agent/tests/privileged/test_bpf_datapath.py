"""The BPF loader with real traffic: a netns behind a veth whose host side carries the programs."""

from __future__ import annotations

import ctypes
import dataclasses
import pathlib
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from cilia_agent.datapath.layout import (
    DIR_EGRESS,
    DIR_INGRESS,
    IDENTITY_WORLD,
    EndpointInfo,
    PolicyValue,
    ip_to_map,
    policy_key,
)
from cilia_agent.datapath.loader import (
    PARENT_EGRESS,
    PARENT_INGRESS,
    PROG_FROM_CONTAINER,
    PROG_TO_CONTAINER,
    Datapath,
    DatapathConfig,
)
from cilia_agent.datapath.objects import default_bpf_dir
from cilia_agent.hubble.metrics import read_counters
from cilia_testkit import skips

pytestmark = pytest.mark.privileged

HOST_IP, POD_IP = "10.251.200.1", "10.251.200.2"
EP_ID = 7


def sh(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=True, capture_output=True, text=True)


def ping(netns: str, address: str, count: int = 1) -> bool:
    result = subprocess.run(
        ["ip", "netns", "exec", netns, "ping", "-c", str(count), "-W", "1", "-i", "0.2", address],
        capture_output=True,
    )
    return result.returncode == 0


@dataclass
class Pod:
    netns: str
    host_if: str
    ifindex: int


@pytest.fixture
def pod() -> Iterator[Pod]:
    skips.require_bpf("netns, tc, BPF")
    tag = uuid.uuid4().hex[:6]
    netns, host_if = f"cilia-t-bpf{tag}", f"cilia_tb{tag}"
    sh("ip", "netns", "add", netns)
    try:
        sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", netns)
        sh("ip", "addr", "add", f"{HOST_IP}/30", "dev", host_if)
        sh("ip", "link", "set", host_if, "up")
        sh("ip", "-n", netns, "addr", "add", f"{POD_IP}/30", "dev", "eth0")
        sh("ip", "-n", netns, "link", "set", "eth0", "up")
        ifindex = int(pathlib.Path(f"/sys/class/net/{host_if}/ifindex").read_text())
        yield Pod(netns, host_if, ifindex)
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", netns], capture_output=True)


@pytest.fixture
def config() -> Iterator[DatapathConfig]:
    pin_dir = pathlib.Path(f"/sys/fs/bpf/cilia-test-{uuid.uuid4().hex[:8]}")
    yield DatapathConfig(bpf_dir=default_bpf_dir(), pin_dir=pin_dir, ipcache_max=1024, ct_max=1024)
    if pin_dir.exists():
        for pinned in pin_dir.iterdir():
            pinned.unlink()
        pin_dir.rmdir()


def enforce_egress(dp: Datapath, pod: Pod) -> None:
    dp.set_endpoint(
        pod.ifindex,
        EndpointInfo(ep_id=EP_ID, sec_identity=1000, ipv4=ip_to_map(POD_IP), enforce_egress=1),
    )


def test_default_deny_egress_drops_real_ping_until_a_rule_allows_it(
    pod: Pod, config: DatapathConfig
) -> None:
    events: list[int] = []
    dp = Datapath.load(config)
    ring = dp.ring_buffer(lambda record: events.append(len(record)))
    try:
        # three tries: the first echo also waits for ARP, and one 1 s wait can lapse on a loaded
        # machine (seen once in make test while a Go build ran)
        assert ping(pod.netns, HOST_IP, count=3), "baseline: the veth works before any program"
        dp.attach(pod.ifindex)
        enforce_egress(dp, pod)

        assert not ping(pod.netns, HOST_IP)
        ring.poll(100)
        assert events, "a drop event reached the ring buffer"

        dp.policy_map[policy_key(EP_ID, IDENTITY_WORLD, DIR_EGRESS)] = PolicyValue(flags=0)
        assert ping(pod.netns, HOST_IP)

        drops = {
            (c.reason, c.direction): sum(c.packets)
            for c in read_counters(dp.metrics_map)
            if c.reason
        }
        assert drops[(133, DIR_EGRESS)] >= 1
    finally:
        ring.close()
        dp.detach(pod.ifindex)
        dp.close()
    assert ping(pod.netns, HOST_IP), "detached: traffic flows without enforcement"


def test_reload_replaces_programs_and_keeps_pinned_state(pod: Pod, config: DatapathConfig) -> None:
    first = Datapath.load(config)
    first.attach(pod.ifindex)
    enforce_egress(first, pod)
    first.close()  # the agent exits; filters and pinned maps stay
    assert not ping(pod.netns, HOST_IP), "enforcement survives the loader's exit"

    second = Datapath.load(config)
    try:
        assert pod.ifindex in second.endpoints(), "endpoint map kept across reload"
        second.attach(pod.ifindex)
        second.policy_map[policy_key(EP_ID, IDENTITY_WORLD, DIR_EGRESS, protocol=1)] = PolicyValue(
            flags=0
        )
        assert ping(pod.netns, HOST_IP)
    finally:
        second.detach(pod.ifindex)
        second.close()


def test_port_without_protocol_is_refused() -> None:
    with pytest.raises(ValueError, match="needs a protocol"):
        policy_key(1, 2, DIR_EGRESS, port=80)


def filters(host_if: str, hook: str) -> list[str]:
    """The ``tc filter show`` lines of ``hook`` that name a program (one per filter)."""
    out = sh("tc", "filter", "show", "dev", host_if, hook).stdout
    return [line for line in out.splitlines() if "handle" in line]


def test_attach_again_replaces_the_filters_in_place_and_detach_removes_them(
    pod: Pod, config: DatapathConfig
) -> None:
    first = Datapath.load(config)
    with IPRoute() as ipr:  # what agents before 2026-12-02 attached (priority 0), restarted once
        ipr.tc("add", "clsact", pod.ifindex)
        for _ in range(2):
            for parent, prog in (
                (PARENT_INGRESS, PROG_FROM_CONTAINER),
                (PARENT_EGRESS, PROG_TO_CONTAINER),
            ):
                ipr.tc(
                    "replace-filter",
                    "bpf",
                    pod.ifindex,
                    ":1",
                    fd=first.prog_fd(prog),
                    name=prog,
                    parent=parent,
                    classid=1,
                    direct_action=True,
                )
    assert len(filters(pod.host_if, "ingress")) == 2, "the kernel added one per attach"
    first.close()
    second = Datapath.load(config)  # a restarted agent: new programs, same maps
    try:
        second.attach(pod.ifindex)
        second.attach(pod.ifindex)
        ingress, egress = filters(pod.host_if, "ingress"), filters(pod.host_if, "egress")
        assert len(ingress) == 1 and "cil_from_container" in ingress[0], ingress
        assert len(egress) == 1 and "cil_to_container" in egress[0], egress
        assert "pref 1 " in ingress[0] and "direct-action" in ingress[0]
        second.detach(pod.ifindex)
        assert "clsact" not in sh("tc", "qdisc", "show", "dev", pod.host_if).stdout
        second.detach(pod.ifindex)  # nothing attached: not an error
    finally:
        second.close()
    third = Datapath.load(config)
    try:
        with pytest.raises(NetlinkError) as err:
            third.attach(2**31 - 1)  # no such device
    finally:
        third.close()
    assert err.value.code == 19 and "ifindex 2147483647" in str(err.value)  # ENODEV


def test_cilia_lxc_indexes_the_endpoints_by_address_and_is_rebuilt_at_load(
    config: DatapathConfig,
) -> None:
    skips.require_bpf("BPF maps")
    first = Datapath.load(config)
    try:
        a, b = ip_to_map("10.251.201.1"), ip_to_map("10.251.201.2")
        first.set_endpoint(11, EndpointInfo(ep_id=1, sec_identity=1000, ipv4=a))
        first.set_endpoint(12, EndpointInfo(ep_id=2, sec_identity=1000, ipv4=b))
        assert {k.value: v.value for k, v in first.lxc_map.items()} == {a: 11, b: 12}
        # a new address for endpoint 12 replaces its old one; a deleted endpoint's goes
        c = ip_to_map("10.251.201.3")
        first.set_endpoint(12, EndpointInfo(ep_id=2, sec_identity=1000, ipv4=c))
        first.delete_endpoint(11)
        assert {k.value: v.value for k, v in first.lxc_map.items()} == {c: 12}
        # pins as an agent before cilia_lxc (or a crash between the two writes) left them:
        # an endpoint missing from the index, an address of no endpoint in it
        first.lxc_map.delete(ctypes.c_uint32(c))
        first.lxc_map.update(ctypes.c_uint32(a), ctypes.c_uint32(11))
    finally:
        first.close()

    second = Datapath.load(config)
    try:
        assert {k.value: v.value for k, v in second.lxc_map.items()} == {c: 12}
    finally:
        second.close()


ROUTER_IP = "10.251.202.1"


@dataclass
class LocalPods:
    a: Pod
    b: Pod
    ip_a: str
    ip_b: str


@pytest.fixture
def local_pods() -> Iterator[LocalPods]:
    """Two pods of one node as the agent plumbs them: a /32 on each pod's eth0, a default
    route via the router IP ``onlink``, a /32 route on the host to each pod via its veth."""
    skips.require_bpf("netns, tc, BPF")
    tag = uuid.uuid4().hex[:6]
    ips = ("10.251.202.2", "10.251.202.3")
    pods: list[Pod] = []
    try:
        for i, ip in enumerate(ips):
            netns, host_if = f"cilia-t-ld{i}{tag}", f"cilia_ld{i}{tag}"
            sh("ip", "netns", "add", netns)
            pods.append(Pod(netns, host_if, 0))
            sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", netns)
            sh("ip", "addr", "add", f"{ROUTER_IP}/32", "dev", host_if)
            sh("ip", "link", "set", host_if, "up")
            sh("ip", "route", "add", f"{ip}/32", "dev", host_if)
            sh("ip", "-n", netns, "addr", "add", f"{ip}/32", "dev", "eth0")
            sh("ip", "-n", netns, "link", "set", "eth0", "up")
            sh("ip", "-n", netns, "route", "add", "default", "via", ROUTER_IP, "dev", "eth0",
               "onlink")  # fmt: skip
            ifindex = int(pathlib.Path(f"/sys/class/net/{host_if}/ifindex").read_text())
            pods[-1] = Pod(netns, host_if, ifindex)
        sh("sysctl", "-qw", "net.ipv4.ip_forward=1")
        yield LocalPods(pods[0], pods[1], *ips)
    finally:
        for pod in pods:
            subprocess.run(["ip", "link", "del", pod.host_if], capture_output=True)
            subprocess.run(["ip", "netns", "del", pod.netns], capture_output=True)


def ping_ttl(netns: str, address: str) -> int | None:
    """The TTL of the echo reply to one ping, None when none came back."""
    result = subprocess.run(
        ["ip", "netns", "exec", netns, "ping", "-c", "1", "-W", "1", address],
        capture_output=True,
        text=True,
    )
    for word in result.stdout.split():
        if word.startswith("ttl="):
            return int(word[4:])
    return None


def forward_drop_packets(rule: list[str]) -> int:
    """Packets the host's FORWARD rule ``rule`` (as given to ``iptables -A``: ``-s A -d B
    -j DROP``) matched; ``iptables -S -v`` puts the counters (``-c PACKETS BYTES``) before
    the target."""
    out = sh("iptables", "-w", "-S", "FORWARD", "-v").stdout
    match, target = " ".join(rule[:4]), " ".join(rule[4:])
    for line in out.splitlines():
        if match in line and line.endswith(target):
            return int(line.split(" -c ")[1].split()[0])
    raise AssertionError(f"rule {rule} not in FORWARD:\n{out}")


TRANSFER_SERVER = """
import socket, sys
srv = socket.create_server((sys.argv[1], 5201))
print("listening", flush=True)
conn, _ = srv.accept()
total = 0
while chunk := conn.recv(1 << 16):
    total += len(chunk)
print(total, flush=True)
"""


def tcp_transfer(
    src: Pod, dst: Pod, dst_ip: str, size: int, via: tuple[str, int] | None = None
) -> int:
    """Send ``size`` bytes over one TCP connection from ``src`` to ``dst_ip:5201`` in
    ``dst`` (a bulk transfer: the sender's stack hands the veth GSO packets of up to 64 KiB),
    connecting to ``via`` (address, port) instead when given; returns the bytes the receiver
    counted."""
    server = subprocess.Popen(
        ["ip", "netns", "exec", dst.netns, sys.executable, "-c", TRANSFER_SERVER, dst_ip],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        assert server.stdout.readline().strip() == "listening"
        client = (
            "import socket, sys\n"
            "c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)\n"
            "c.sendall(bytes(int(sys.argv[3])))\n"
            "c.close()\n"
        )
        address, port = via or (dst_ip, 5201)
        sh("ip", "netns", "exec", src.netns, sys.executable, "-c", client, address, str(port),
           str(size))  # fmt: skip
        out, _ = server.communicate(timeout=15)
        return int(out.strip())
    finally:
        server.kill()
        server.wait()


def test_local_delivery_skips_the_host_stack_and_keeps_the_destinations_policy(
    local_pods: LocalPods, config: DatapathConfig
) -> None:
    pods = local_pods
    # Drops everything the host forwards from pod a to pod b: only a packet that goes
    # through the host's IP stack can meet it.
    rule = ["-s", f"{pods.ip_a}/32", "-d", f"{pods.ip_b}/32", "-j", "DROP"]
    sh("iptables", "-w", "-I", "FORWARD", "1", *rule)
    try:
        dp = Datapath.load(config)
        try:
            assert ping_ttl(pods.a.netns, pods.ip_b) is None, (
                "baseline: the host forwards it, the rule drops it"
            )
            dropped = forward_drop_packets(rule)
            assert dropped >= 1
            for n, (pod, ip) in enumerate(((pods.a, pods.ip_a), (pods.b, pods.ip_b))):
                dp.attach(pod.ifindex)
                dp.set_endpoint(
                    pod.ifindex,
                    EndpointInfo(ep_id=20 + n, sec_identity=1000 + n, ipv4=ip_to_map(ip)),
                )
                dp.upsert_ipcache(ip, 32, 1000 + n)

            # Delivered by the program: the rule never sees it; each way one hop (64 - 1).
            assert ping_ttl(pods.a.netns, pods.ip_b) == 63
            assert forward_drop_packets(rule) == dropped
            # A source address that is not the pod's own is dropped by the pod's program
            # (source address verification, upstream's DROP_INVALID_SIP 132, counted): it
            # reaches neither the local pod nor the host stack (the rule sees nothing).
            spoofed = "10.251.202.9"
            sh("ip", "-n", pods.a.netns, "addr", "add", f"{spoofed}/32", "dev", "eth0")
            spoof_rule = ["-s", f"{spoofed}/32", "-d", f"{pods.ip_b}/32", "-j", "DROP"]
            sh("iptables", "-w", "-I", "FORWARD", "1", *spoof_rule)
            try:
                forged = subprocess.run(
                    ["ip", "netns", "exec", pods.a.netns, "ping", "-c", "1", "-W", "1", "-I",
                     spoofed, pods.ip_b],
                    capture_output=True,
                )  # fmt: skip
                assert forged.returncode != 0, "no reply to a forged source"
                assert forward_drop_packets(spoof_rule) == 0
                drops = {
                    (c.reason, c.direction): sum(c.packets)
                    for c in read_counters(dp.metrics_map)
                    if c.reason
                }
                assert drops[(132, DIR_EGRESS)] >= 1
            finally:
                sh("iptables", "-w", "-D", "FORWARD", *spoof_rule)
                sh("ip", "-n", pods.a.netns, "addr", "del", f"{spoofed}/32", "dev", "eth0")

            # A bulk transfer too: its GSO packets exceed the MTU, which the FIB's MTU
            # check would refuse (FRAG_NEEDED), handing them to the stack and the rule.
            assert tcp_transfer(pods.a, pods.b, pods.ip_b, 8 << 20) == 8 << 20
            assert forward_drop_packets(rule) == dropped

            # A connection the host translated (a hostPort: DNAT of the router's address to
            # b) is not pod to pod for the programs: its original goes up the stack, and so
            # must its replies (b -> a), for the host's conntrack to translate them back.
            dnat = ["-d", f"{ROUTER_IP}/32", "-p", "tcp", "--dport", "5202", "-j", "DNAT",
                    "--to-destination", f"{pods.ip_b}:5201"]  # fmt: skip
            # the host forwards both ways (its FORWARD policy may be DROP, as Docker's)
            accept = ["-s", "10.251.202.0/24", "-d", "10.251.202.0/24", "-j", "ACCEPT"]
            sh("iptables", "-w", "-t", "nat", "-I", "PREROUTING", "1", *dnat)
            sh("iptables", "-w", "-I", "FORWARD", "1", *accept)
            try:
                assert tcp_transfer(pods.a, pods.b, pods.ip_b, 1 << 20, via=(ROUTER_IP, 5202)) == (
                    1 << 20
                )
            finally:
                sh("iptables", "-w", "-D", "FORWARD", *accept)
                sh("iptables", "-w", "-t", "nat", "-D", "PREROUTING", *dnat)

            # The destination's to-container still decides: b enforces ingress, nothing allows.
            dp.set_endpoint(
                pods.b.ifindex,
                EndpointInfo(
                    ep_id=21, sec_identity=1001, ipv4=ip_to_map(pods.ip_b), enforce_ingress=1
                ),
            )
            assert ping_ttl(pods.a.netns, pods.ip_b) is None
            drops = {
                (c.reason, c.direction): sum(c.packets)
                for c in read_counters(dp.metrics_map)
                if c.reason
            }
            assert drops[(133, DIR_INGRESS)] >= 1
            dp.policy_map[policy_key(21, 1000, DIR_INGRESS, protocol=1)] = PolicyValue(flags=0)
            assert ping_ttl(pods.a.netns, pods.ip_b) == 63
            assert forward_drop_packets(rule) == dropped
        finally:
            dp.close()

        # --enable-host-legacy-routing: the same programs hand it to the host's stack.
        legacy = Datapath.load(dataclasses.replace(config, host_legacy_routing=True))
        try:
            legacy.attach(pods.a.ifindex)
            legacy.attach(pods.b.ifindex)
            assert ping_ttl(pods.a.netns, pods.ip_b) is None
            assert forward_drop_packets(rule) > dropped
        finally:
            legacy.detach(pods.a.ifindex)
            legacy.detach(pods.b.ifindex)
            legacy.close()
    finally:
        sh("iptables", "-w", "-D", "FORWARD", *rule)
