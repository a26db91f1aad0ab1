"""The socket-LB with real sockets: ClusterIPs reached from another netns and from the host.

The maps are programmed through the agent's writer from ``Service`` messages (no operator);
the backends are real TCP and UDP servers in their own netns (see conftest).
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import os
import shutil
import socket
import threading

import pytest

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent.loadbalancer import socklb
from cilia_agent.loadbalancer.maps import LBMaps, ServiceMapWriter, frontend_key
from cilia_agent.loadbalancer.model import Frontend

from .conftest import BACKENDS, TCP_PORT, UDP_PORT, Topology, in_netns

TIMEOUT = 3.0


def service(
    name: str,
    vip: str,
    *,
    ready: tuple[str, ...] = BACKENDS,
    terminating: tuple[str, ...] = (),
    affinity: bool = False,
    alias: tuple[str, ...] = (),
) -> cp.Service:
    """A ClusterIP Service: TCP 80 -> :8080 and UDP 53 -> :5353 on the given backends."""

    def backends(port: int) -> list[cp.ServiceBackend]:
        return [cp.ServiceBackend(ip=ip, port=port, ready=True, serving=True) for ip in ready] + [
            cp.ServiceBackend(ip=ip, port=port, serving=True, terminating=True)
            for ip in terminating
        ]

    return cp.Service(
        namespace="lbt",
        name=name,
        type="ClusterIP",
        cluster_ips=[vip],
        alias_ips=list(alias),
        session_affinity="ClientIP" if affinity else "None",
        session_affinity_timeout_seconds=60 if affinity else 0,
        ports=[
            cp.ServicePort(name="http", protocol="TCP", port=80, backends=backends(TCP_PORT)),
            cp.ServicePort(name="dns", protocol="UDP", port=53, backends=backends(UDP_PORT)),
        ],
    )


def tcp_open(vip: str, port: int = 80) -> tuple[socket.socket, str]:
    """Connect to ``vip:port``; the socket and the backend's greeting ("be <ip>")."""
    conn = socket.create_connection((vip, port), timeout=TIMEOUT)
    greeting = b""
    while not greeting.endswith(b"\n"):
        chunk = conn.recv(64)
        if not chunk:
            raise ConnectionError("closed before the greeting")
        greeting += chunk
    return conn, greeting.decode().strip()


def tcp_backend(vip: str, port: int = 80) -> tuple[str, tuple[str, int]]:
    """One connection: which backend answered and what getpeername said."""
    conn, who = tcp_open(vip, port)
    with conn:
        return who, conn.getpeername()


def udp_ask(vip: str, payload: bytes = b"q") -> tuple[str, tuple[str, int]]:
    """One UDP request to ``vip:53``: the answer and the source it came from."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.settimeout(TIMEOUT)
        udp.sendto(payload, (vip, 53))
        data, source = udp.recvfrom(4096)
        return data.decode(), source


def spread(vip: str, count: int) -> collections.Counter[str]:
    """``count`` connections; how many each backend got."""
    return collections.Counter(tcp_backend(vip)[0] for _ in range(count))


def test_tcp_to_a_clusterip_from_another_netns_sees_the_vip_as_peer(
    topology: Topology, attached: ServiceMapWriter
) -> None:
    vip = "198.18.77.1"
    assert attached.upsert_service(service("web", vip)) == []

    who, peer = in_netns(topology.client, tcp_backend, vip)

    assert who in {f"be {ip}" for ip in BACKENDS}
    assert peer == (vip, 80)


def test_tcp_to_a_clusterip_from_the_host_sees_the_vip_as_peer(
    topology: Topology, attached: ServiceMapWriter
) -> None:
    vip = "198.18.77.2"
    attached.upsert_service(service("web", vip))

    who, peer = tcp_backend(vip)

    assert who in {f"be {ip}" for ip in BACKENDS}
    assert peer == (vip, 80)


@pytest.mark.parametrize("where", ["netns", "host"])
def test_udp_reply_comes_from_the_vip(
    topology: Topology, attached: ServiceMapWriter, where: str
) -> None:
    vip = "198.18.77.3"
    attached.upsert_service(service("dns", vip))

    ask = (lambda: in_netns(topology.client, udp_ask, vip, b"hello")) if where == "netns" else (
        lambda: udp_ask(vip, b"hello")
    )  # fmt: skip
    answer, source = ask()

    assert answer.startswith("be 10.252.77.") and answer.endswith(" hello")
    assert source == (vip, 53)


def test_connected_udp_socket_sees_the_vip_as_peer(
    topology: Topology, attached: ServiceMapWriter
) -> None:
    vip = "198.18.77.4"
    attached.upsert_service(service("dns", vip))

    def ask() -> tuple[tuple[str, int], bytes]:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.settimeout(TIMEOUT)
            udp.connect((vip, 53))
            udp.send(b"x")
            return udp.getpeername(), udp.recv(4096)

    peer, answer = in_netns(topology.client, ask)

    assert peer == (vip, 53)
    assert answer.startswith(b"be 10.252.77.")


def test_alias_ip_is_served_like_the_clusterip(
    topology: Topology, attached: ServiceMapWriter
) -> None:
    attached.upsert_service(service("moved", "198.18.77.5", alias=("198.18.77.6",)))

    for vip in ("198.18.77.5", "198.18.77.6"):
        who, peer = in_netns(topology.client, tcp_backend, vip)
        assert who.startswith("be ") and peer == (vip, 80)


def test_thousand_connections_spread_over_three_backends(
    topology: Topology, attached: ServiceMapWriter
) -> None:
    vip = "198.18.77.7"
    attached.upsert_service(service("web", vip))

    counts = in_netns(topology.client, spread, vip, 1000)

    assert sum(counts.values()) == 1000
    assert set(counts) == {f"be {ip}" for ip in BACKENDS}
    # random choice: each expects 333 (sd ~15); under 200 would be a broken selection
    assert min(counts.values()) >= 200, counts


def test_terminating_backend_keeps_its_connection_and_gets_no_new_ones(
    topology: Topology, attached: ServiceMapWriter
) -> None:
    vip = "198.18.77.8"
    attached.upsert_service(service("web", vip))
    conn, who = in_netns(topology.client, tcp_open, vip)
    leaving = who.split()[1]
    with conn:
        staying = tuple(ip for ip in BACKENDS if ip != leaving)
        attached.upsert_service(service("web", vip, ready=staying, terminating=(leaving,)))

        counts = in_netns(topology.client, spread, vip, 200)

        assert f"be {leaving}" not in counts
        assert set(counts) == {f"be {ip}" for ip in staying}
        conn.sendall(b"still here")
        assert conn.recv(64) == b"still here"
        assert conn.getpeername() == (vip, 80)


def test_client_ip_affinity_sticks_per_client(
    topology: Topology, attached: ServiceMapWriter
) -> None:
    vip = "198.18.77.9"
    attached.upsert_service(service("sticky", vip, affinity=True))

    from_netns = in_netns(topology.client, spread, vip, 50)
    from_host = spread(vip, 50)

    assert len(from_netns) == 1 and len(from_host) == 1, (from_netns, from_host)


def test_affinity_moves_when_the_remembered_backend_terminates(
    topology: Topology, attached: ServiceMapWriter
) -> None:
    vip = "198.18.77.10"
    attached.upsert_service(service("sticky", vip, affinity=True))
    (first,) = in_netns(topology.client, spread, vip, 5)
    leaving = first.split()[1]
    staying = tuple(ip for ip in BACKENDS if ip != leaving)
    attached.upsert_service(
        service("sticky", vip, ready=staying, terminating=(leaving,), affinity=True)
    )

    after = in_netns(topology.client, spread, vip, 20)

    assert len(after) == 1 and first not in after, after


@pytest.mark.parametrize("proto", ["tcp", "udp"])
def test_vip_without_backends_refuses(
    topology: Topology, attached: ServiceMapWriter, sock_config: socklb.SockConfig, proto: str
) -> None:
    """ECONNREFUSED with bpf_set_retval (5.18); without it (bpf_sock_compat.o) the hook's
    default EPERM, as upstream's socket-LB refuses on such kernels."""
    vip = "198.18.77.11"
    attached.upsert_service(service("empty", vip, ready=()))

    def attempt() -> None:
        if proto == "tcp":
            socket.create_connection((vip, 80), timeout=TIMEOUT).close()
        else:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                udp.sendto(b"x", (vip, 53))

    with pytest.raises(OSError) as caught:
        in_netns(topology.client, attempt)
    want = errno.EPERM if sock_config.variant == "compat" else errno.ECONNREFUSED
    assert caught.value.errno == want


def test_auto_loads_the_object_this_kernel_supports() -> None:
    """``auto`` probes for bpf_set_retval (5.18): this kernel has it when the probe says so,
    and the probe agrees with the release."""
    from cilia_agent.preflight.kernel import parse_version

    release = parse_version(os.uname().release)
    want = socklb.OBJECT if release[:2] >= (5, 18) else socklb.COMPAT_OBJECT
    assert socklb.object_stem("auto") == want
    assert socklb.object_stem("compat") == socklb.COMPAT_OBJECT
    with pytest.raises(socklb.SocketLBUnavailable, match="--bpf-sock-variant"):
        socklb.object_stem("newest")


def test_not_a_service_passes_untouched(topology: Topology, attached: ServiceMapWriter) -> None:
    attached.upsert_service(service("web", "198.18.77.12"))

    who, peer = in_netns(topology.client, tcp_backend, BACKENDS[0], TCP_PORT)  # a backend itself

    assert who == f"be {BACKENDS[0]}" and peer == (BACKENDS[0], TCP_PORT)


def test_deleted_service_stops_translating(topology: Topology, attached: ServiceMapWriter) -> None:
    vip = "198.18.77.13"
    attached.upsert_service(service("web", vip))
    in_netns(topology.client, tcp_backend, vip)

    assert attached.delete_service("lbt", "web") == 2

    with pytest.raises(OSError):
        in_netns(topology.client, tcp_backend, vip)  # nothing serves 198.18.77.13 itself


def test_restart_keeps_ids_attachment_and_connections(
    topology: Topology, attached: ServiceMapWriter, sock_config: socklb.SockConfig
) -> None:
    vip = "198.18.77.14"
    attached.upsert_service(service("web", vip))
    attached.upsert_service(service("dns", "198.18.77.15", ready=BACKENDS[:2]))
    before = {f: (p.rev_nat, list(p.active)) for f, p in attached.frontends.items()}
    backend_ids = dict(attached.backends)
    conn, _ = in_netns(topology.client, tcp_open, vip)
    failures: list[BaseException] = []
    stop = threading.Event()

    def keep_connecting() -> None:
        while not stop.is_set():
            try:
                tcp_backend(vip)
            except OSError as exc:
                failures.append(exc)

    loop = threading.Thread(target=keep_connecting)
    loop.start()
    try:
        outcome = socklb.attach(sock_config)  # the restarted agent swaps its programs in
        again = ServiceMapWriter(LBMaps(sock_config.pin_dir), sock_config.lb_map_max)
        restored = again.restore()
    finally:
        stop.set()
        loop.join()

    assert set(outcome.values()) == {"replaced"}
    assert failures == []
    assert restored == 4
    assert {f: (p.rev_nat, list(p.active)) for f, p in again.frontends.items()} == before
    assert again.backends == backend_ids
    with conn:
        conn.sendall(b"ping")
        assert conn.recv(16) == b"ping"
    # the listing after the restart rewrites nothing and drops what it lacks
    again.begin_resync()
    again.upsert_service(service("web", vip))
    assert again.end_resync() == 2
    assert {f: p.rev_nat for f, p in again.frontends.items()} == {
        f: rev for f, (rev, _) in before.items() if f.address == vip
    }
    assert again.maps.services.lookup(frontend_key(Frontend("198.18.77.15", 53, 17))) is None
    _, peer = in_netns(topology.client, tcp_backend, vip)
    assert peer == (vip, 80)
    again.maps.close()


def test_two_agents_attached_to_one_cgroup_serve_side_by_side(
    topology: Topology, attached: ServiceMapWriter, sock_config: socklb.SockConfig
) -> None:
    """Two agents on one machine (a test cluster): each its own maps and links on the same
    root cgroup. Each serves its own VIPs; a VIP both have is translated once."""
    other = dataclasses.replace(sock_config, pin_dir=sock_config.pin_dir.with_name(
        sock_config.pin_dir.name + "-b"))  # fmt: skip
    try:
        assert set(socklb.attach(other).values()) == {"attached"}
        second = ServiceMapWriter(LBMaps(other.pin_dir), other.lb_map_max)
        attached.upsert_service(service("one", "198.18.77.20", ready=BACKENDS[:1]))
        second.upsert_service(service("two", "198.18.77.21", ready=BACKENDS[1:2]))
        attached.upsert_service(service("both", "198.18.77.22", ready=BACKENDS[2:]))
        second.upsert_service(service("both", "198.18.77.22", ready=BACKENDS[2:]))

        for vip, backend in zip(
            ("198.18.77.20", "198.18.77.21", "198.18.77.22"), BACKENDS, strict=True
        ):
            who, peer = in_netns(topology.client, tcp_backend, vip)
            assert (who, peer) == (f"be {backend}", (vip, 80))
            answer, source = in_netns(topology.client, udp_ask, vip)
            assert answer.startswith(f"be {backend} ") and source == (vip, 53)
        second.maps.close()
    finally:
        socklb.detach(other.pin_dir)
        shutil.rmtree(other.pin_dir, ignore_errors=True)


def test_dual_stack_sockets_reach_an_ipv4_vip_through_its_mapped_address(
    topology: Topology, attached: ServiceMapWriter
) -> None:
    """AF_INET6 sockets addressing ``::ffff:VIP`` (Java's default sockets, for one)."""
    vip = "198.18.77.30"
    attached.upsert_service(service("dual", vip))
    mapped = f"::ffff:{vip}"

    def tcp6() -> tuple[str, tuple[str, int]]:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as conn:
            conn.settimeout(TIMEOUT)
            conn.connect((mapped, 80))
            return conn.recv(64).decode().strip(), conn.getpeername()[:2]

    def udp6() -> tuple[str, tuple[str, int]]:
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as udp:
            udp.settimeout(TIMEOUT)
            udp.sendto(b"six", (mapped, 53))
            data, source = udp.recvfrom(4096)
            return data.decode(), source[:2]

    who, peer = in_netns(topology.client, tcp6)
    assert who.startswith("be 10.252.77.") and peer == (mapped, 80)
    answer, source = in_netns(topology.client, udp6)
    assert answer.startswith("be 10.252.77.") and answer.endswith(" six")
    assert source == (mapped, 53)
    who, peer = tcp6()  # from the host
    assert who.startswith("be 10.252.77.") and peer == (mapped, 80)


def test_a_nodeport_through_the_nodes_own_address_reaches_a_backend_both_ways(
    topology: Topology, attached: ServiceMapWriter, sock_config: socklb.SockConfig
) -> None:
    """``<own node address>:<nodePort>`` from the host and from another netns: the exact
    lookup misses, the address is in ``cilia_lb4_node_addrs``, so the (0.0.0.0, nodePort)
    surrogate serves it (bpf_sock.c's wildcard lookup); the client sees the node address
    as its peer (reverse path). An address that is not the node's gets nothing."""
    from cilia_agent.loadbalancer import nodeaddrs
    from cilia_agent.loadbalancer.model import NODE_PORT_ADDRESS

    node_addr, other = "198.18.79.1", "198.18.79.2"  # the "node" address: on no interface
    svc = service("np", "198.18.77.40")
    svc.type = "NodePort"
    svc.ports[0].node_port = 30080
    svc.ports[1].node_port = 30053
    attached.upsert_service(svc)
    assert any(k.address == 0 for k in attached.maps.services), NODE_PORT_ADDRESS

    def refused() -> bool:
        try:
            tcp_backend(node_addr, 30080)
        except OSError:
            return True
        return False

    assert in_netns(topology.client, refused), "not a node address yet: untouched"
    assert nodeaddrs.sync(sock_config.pin_dir, [node_addr]) == ([node_addr], [])

    who, peer = in_netns(topology.client, tcp_backend, node_addr, 30080)
    assert who in {f"be {ip}" for ip in BACKENDS}
    assert peer == (node_addr, 30080)
    who, peer = tcp_backend(node_addr, 30080)  # from the host
    assert who in {f"be {ip}" for ip in BACKENDS}
    assert peer == (node_addr, 30080)

    def udp_to(addr: str) -> tuple[str, tuple[str, int]]:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.settimeout(TIMEOUT)
            udp.sendto(b"q", (addr, 30053))
            data, source = udp.recvfrom(4096)
            return data.decode(), source

    answer, source = in_netns(topology.client, udp_to, node_addr)
    assert answer.startswith("be ") and source == (node_addr, 30053)

    def other_refused() -> bool:
        try:
            tcp_backend(other, 30080)
        except OSError:
            return True
        return False

    assert in_netns(topology.client, other_refused), "another address is not a NodePort"
    assert nodeaddrs.sync(sock_config.pin_dir, []) == ([], [node_addr])
    assert in_netns(topology.client, refused), "removed: untouched again"
