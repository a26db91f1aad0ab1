"""ClusterIP Services: the agent's eBPF socket load balancer vs kube-proxy-style iptables
rules, at 10, 1,000 and 10,000 Services, and the time from a Service change to the map.

``python -m bench services [--services 10,1000,10000] [--duration 2] [--rounds 3]`` (root).

Set-up (everything made for this run, removed at exit even when a step fails)::

    [ client-ebpf netns ] 10.247.0.2 ──veth── 10.247.0.1 [ backends netns ] 10.247.0.5 ──veth── 10.247.0.6 [ client-iptables netns ]
      nothing but a route                      local route 10.248.0.0/16 on lo            nat table: KUBE-SERVICES …
                                               one echo server on 0.0.0.0:8080

Every backend address (from ``--backend-cidr``, a different one for each backend of each
Service: a real cluster's pods) is local in the backends netns, so one server answers them
all. Services: ``bench-svc/svc-NNNNN``, ClusterIP ``--vip-cidr`` + 1 + index, TCP port
``--service-port`` → ``--target-port``, ``--min-backends``..``--max-backends`` ready
backends each (seeded RNG). The measured Service is ``svc-00000``: present at every count.

Two ways to reach the same Services, from two client netns:

* **eBPF**: ``bpf/bpf_sock.c`` compiled and its programs linked to a cgroup2 root of this
  run's own mount (``--cgroup-root``'s default under ``/run``; the machine's one cgroup2
  hierarchy, so every process), maps pinned under a pin dir of this run's own in
  ``/sys/fs/bpf``, Services written with the agent's ``ServiceMapWriter`` — exactly the
  agent's path (``cilia_agent.loadbalancer``), without an operator. The client netns has no
  iptables rules (a kube-proxy-free node).
* **iptables**: the nat chains kube-proxy (iptables mode) writes, for the same VIPs and
  backends, loaded with one ``iptables-restore`` into the other client netns:
  ``PREROUTING``/``OUTPUT`` → ``KUBE-SERVICES`` (one ``-d VIP -p tcp --dport`` match per
  Service port, jumping to ``KUBE-SVC-<hash>``, then the ``KUBE-NODEPORTS`` rule last),
  ``KUBE-SVC-*`` (masquerade mark for sources outside ``--cluster-cidr``, then one
  ``statistic --mode random --probability 1/(n-i)`` rule per backend but the last),
  ``KUBE-SEP-<hash>`` (hairpin mark, ``DNAT --to-destination``), ``KUBE-MARK-MASQ``,
  ``KUBE-POSTROUTING``. The measured Service's rule sits in the middle of
  ``KUBE-SERVICES`` (position N/2: on average where kube-proxy's ordering puts a Service).
  Chain names are kube-proxy's scheme: the first 16 characters of base32(sha256(service
  port name + protocol [+ endpoint])). The socket-LB programs see every connect() of the
  machine, this netns' too, so while the iptables path is measured the measured Service is
  taken out of the eBPF maps (the N-1 others stay) and put back afterwards — a kube-proxy
  node with the socket hook's O(1) map miss; a check proves the iptables rules did the
  translation (:func:`spread`: the VIP reaches the Service's backends, which nothing else
  could do there).

Traffic (``bench.datapath``'s client made long-lived, one per client netns, Python on both
ends, ``TCP_NODELAY``): **RR** — one persistent connection, 1-byte request / 1-byte response
(transactions/s); **CRR** — connect, 1 byte each way, close with RST (as netperf's
TCP_CRR; connections/s). Paths: ``direct`` (the eBPF client to one backend address, no
Service: the baseline, through the socket hook's map miss), ``ebpf`` and ``iptables`` (to
the VIP). For each round (``--rounds``, ≥ 3 for a spread), every count in ``--services`` is
programmed in turn (eBPF: the writer upserts or deletes the difference; iptables: one full
``iptables-restore``, timed), then each metric gets ``--duration`` seconds per path, cut
in ``--slice`` second slices that the three paths take in turn (the first rotated from one
count to the next), so load on the shared host hits them alike. Reported: median and
spread (min-max over rounds) per path and count, and the ratios eBPF@N / eBPF@base (goal
≥ 0.95: flat; also with each side divided by its direct baseline, which cancels drift of
the host between counts), eBPF / iptables at each N (goal ≥ 1.5 at 10,000), and each path
/ direct.

Service change → map (``--change-rounds``, at the largest count): the agent's own
``OperatorAPI.watch_services`` stream and ``run_watch`` feeding its ``ServiceWatcher``,
which writes the pinned maps through the same writer, from an in-process gRPC
``ServiceService`` (port 0 on 127.0.0.1) that lists every Service then sends changes. Each
round changes one random Service's backends (2 ↔ 3) and a thread polling the pinned
services map (its own fd, ``--poll-interval``) stops the clock when the master entry shows
the new backend count. p50/p99 (goal p99 ≤ 1 s).

At exit the socket-LB links are unpinned and ``bpftool link show id`` must no longer know
any of them (``links_left`` in the JSON, 0; a leftover is an error).

Output: a table, and JSON in ``--results-dir`` (``services-<UTC time>.json``,
``services-latest.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import datetime as dt
import hashlib
import ipaddress
import json
import os
import pathlib
import random
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from bench.datapath import host_info, rel, write_results
from cilia_testkit import ROOT, host
from cilia_testkit.netns import create_netns, delete_netns, list_netns

DEFAULT_SERVICES = "10,1000,10000"
DEFAULT_DURATION_SECONDS = 2.0
DEFAULT_ROUNDS = 5
DEFAULT_SLICE_SECONDS = 0.25
DEFAULT_MIN_BACKENDS = 2
DEFAULT_MAX_BACKENDS = 3
DEFAULT_SERVICE_PORT = 80
DEFAULT_TARGET_PORT = 8080
DEFAULT_VIP_CIDR = "198.19.0.0/16"
DEFAULT_BACKEND_CIDR = "10.248.0.0/16"
DEFAULT_LINK_CIDR = "10.247.0.0/29"
DEFAULT_CLUSTER_CIDR = "10.247.0.0/16"
DEFAULT_LB_MAP_MAX = 65536
DEFAULT_SOCK_REV_MAP_MAX = 262144
DEFAULT_CHANGE_ROUNDS = 200
DEFAULT_CHANGE_TIMEOUT_SECONDS = 5.0
DEFAULT_SYNC_TIMEOUT_SECONDS = 120.0
DEFAULT_POLL_INTERVAL_SECONDS = 0.0002
DEFAULT_SPREAD_CONNECTIONS = 30
DEFAULT_CONNECT_TIMEOUT_SECONDS = 2.0
DEFAULT_READY_TIMEOUT_SECONDS = 10.0
DEFAULT_IO_TIMEOUT_SECONDS = 10.0
DEFAULT_COMMAND_TIMEOUT_SECONDS = 60.0
DEFAULT_RESTORE_TIMEOUT_SECONDS = 600.0
DEFAULT_STOP_TIMEOUT_SECONDS = 5.0
DEFAULT_IPTABLES_RESTORE = "iptables-restore"
DEFAULT_SEED = 1
DEFAULT_RESULTS_DIR = ROOT / "bench" / "results"
# The agent's reconnect backoff of the Service stream (its --operator-* defaults are for a
# remote operator; here the in-process server never goes away while measured).
WATCH_MIN_BACKOFF_SECONDS = 0.05
WATCH_MAX_BACKOFF_SECONDS = 1.0
NETNS_PREFIX = "cilia-bench-svc-"
NAMESPACE = "bench-svc"
PATHS = ("direct", "ebpf", "iptables")
METRICS = (("rr", "TCP RR", "trans/s"), ("crr", "TCP CRR", "conn/s"))

# Runs in the backends netns: argv port, I/O timeout (s). One connection at a time; each byte is echoed
# back until EOF, except "?", answered with the address the connection reached (the
# backend the load balancer chose) and the connection closed.
ECHO_SERVER = r"""
import socket, sys
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", int(sys.argv[1])))
srv.listen(1024)
while True:
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.settimeout(float(sys.argv[2]))
    try:
        while True:
            data = conn.recv(1)
            if not data:
                break
            if data == b"?":
                conn.sendall(conn.getsockname()[0].encode() + b"\n")
                break
            conn.send(data)
    except OSError:
        pass
    conn.close()
"""

# Runs in a client netns: argv ip, port, connections, timeout; prints the JSON list of the
# addresses that answered "?" (one connection each), "error: ..." entries for failures.
SPREAD_CLIENT = r"""
import json, socket, sys
ip, port, n, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
seen = []
for _ in range(n):
    try:
        s = socket.create_connection((ip, port), timeout=timeout)
        s.sendall(b"?")
        seen.append(s.makefile().readline().strip())
        s.close()
    except OSError as exc:
        seen.append(f"error: {exc}")
print(json.dumps(seen))
"""


# Runs in a client netns (argv: I/O timeout, s), one measurement per stdin line "rr|crr IP PORT SECONDS", one JSON
# line out: {"count", "seconds"} or {"error"}. RR: one connection (opened before the clock
# starts), 1-byte request / 1-byte response; CRR: connect, 1 byte each way, close with RST
# (SO_LINGER 0: no TIME_WAIT piles up), repeated. bench.datapath's client, long-lived.
TRAFFIC_CLIENT = r"""
import json, socket, struct, sys, time
clock = time.perf_counter
linger = struct.pack("ii", 1, 0)
io_timeout = float(sys.argv[1])
for line in sys.stdin:
    mode, ip, port, seconds = line.split()
    addr, seconds, count = (ip, int(port)), float(seconds), 0
    try:
        if mode == "rr":
            s = socket.create_connection(addr, timeout=io_timeout)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            send, recv = s.send, s.recv
            start = clock()
            deadline = start + seconds
            while True:
                send(b"x")
                if recv(1) != b"x":
                    raise OSError("short read")
                count += 1
                if not count & 63 and clock() >= deadline:
                    break
            elapsed = clock() - start
            s.close()
        else:
            start = clock()
            deadline = start + seconds
            while True:
                s = socket.socket()
                s.settimeout(io_timeout)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.connect(addr)
                s.send(b"x")
                if s.recv(1) != b"x":
                    raise OSError("short read")
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
                s.close()
                count += 1
                if not count & 7 and clock() >= deadline:
                    break
            elapsed = clock() - start
        print(json.dumps({"count": count, "seconds": elapsed}), flush=True)
    except OSError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
"""


class BenchError(RuntimeError):
    """The benchmark could not run (a tool, the topology, a program or a check failed)."""


# ---------------------------------------------------------------------------------------
# Services.


@dataclass(frozen=True)
class Svc:
    """One generated Service: ``name``, ClusterIP ``vip`` and its backend addresses."""

    name: str
    vip: str
    backends: tuple[str, ...]


def make_services(
    count: int, vip_cidr: str, backend_cidr: str, min_backends: int, max_backends: int, seed: int
) -> list[Svc]:
    """``count`` Services (see the module docstring), backends drawn without reuse.

    Raises:
        BenchError: a CIDR is too small for ``count`` Services.
    """
    vips = ipaddress.ip_network(vip_cidr)
    pool = ipaddress.ip_network(backend_cidr)
    if vips.num_addresses < count + 2 or pool.num_addresses < count * max_backends + 2:
        raise BenchError(f"--vip-cidr or --backend-cidr too small for {count} Services")
    rng = random.Random(seed)
    out, next_backend = [], 1
    for i in range(count):
        n = rng.randint(min_backends, max_backends)
        backends = tuple(str(pool[next_backend + j]) for j in range(n))
        next_backend += n
        out.append(Svc(f"svc-{i:05d}", str(vips[1 + i]), backends))
    return out


def service_message(svc: Svc, port: int, target_port: int, backends: int | None = None) -> Any:
    """``svc`` as the ``cilia.controlplane.v1.Service`` the operator sends (ClusterIP, one
    TCP port named ``http``, every backend ready); ``backends`` keeps only the first n."""
    from cilia.controlplane.v1 import controlplane_pb2 as cp

    chosen = svc.backends if backends is None else svc.backends[:backends]
    return cp.Service(
        namespace=NAMESPACE,
        name=svc.name,
        type="ClusterIP",
        cluster_ips=[svc.vip],
        ports=[
            cp.ServicePort(
                name="http",
                protocol="TCP",
                port=port,
                backends=[
                    cp.ServiceBackend(ip=ip, port=target_port, ready=True, serving=True)
                    for ip in chosen
                ],
            )
        ],
    )


# ---------------------------------------------------------------------------------------
# kube-proxy-style iptables rules.


def chain_hash(prefix: str, text: str) -> str:
    """``prefix`` + the first 16 characters of base32(sha256(text)) (kube-proxy's scheme for
    ``KUBE-SVC-``/``KUBE-SEP-`` chain names, which fit iptables' 28-character limit)."""
    digest = hashlib.sha256(text.encode()).digest()
    return prefix + base64.b32encode(digest).decode()[:16]


def kube_proxy_rules(
    services: list[Svc], measured: Svc, port: int, target_port: int, cluster_cidr: str
) -> str:
    """The ``iptables-restore`` input of kube-proxy's nat table for ``services`` (plus
    ``measured``, placed in the middle of ``KUBE-SERVICES``); see the module docstring."""
    ordered = [s for s in services if s != measured]
    ordered.insert(len(ordered) // 2, measured)
    chains = ["KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ"]
    rules = [
        '-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
        '-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
        '-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING',
        "-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000",
        "-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN",
        "-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000",
        '-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT"'
        " -j MASQUERADE --random-fully",
    ]
    svc_rules: list[str] = []
    for s in ordered:
        port_name = f"{NAMESPACE}/{s.name}:http"
        svc_chain = chain_hash("KUBE-SVC-", port_name + "tcp")
        chains.append(svc_chain)
        match = f"-d {s.vip}/32 -p tcp -m comment --comment"
        rules.append(
            f'-A KUBE-SERVICES {match} "{port_name} cluster IP" -m tcp --dport {port} '
            f"-j {svc_chain}"
        )
        svc_rules.append(
            f'-A {svc_chain} ! -s {cluster_cidr} {match} "{port_name} cluster IP" -m tcp '
            f"--dport {port} -j KUBE-MARK-MASQ"
        )
        n = len(s.backends)
        for i, ip in enumerate(s.backends):
            endpoint = f"{ip}:{target_port}"
            sep = chain_hash("KUBE-SEP-", port_name + "tcp" + endpoint)
            chains.append(sep)
            pick = (
                f"-m statistic --mode random --probability {1 / (n - i):.10f} " if i < n - 1 else ""
            )
            svc_rules.append(
                f'-A {svc_chain} -m comment --comment "{port_name} -> {endpoint}" {pick}-j {sep}'
            )
            svc_rules.append(
                f'-A {sep} -s {ip}/32 -m comment --comment "{port_name}" -j KUBE-MARK-MASQ'
            )
            svc_rules.append(
                f'-A {sep} -p tcp -m comment --comment "{port_name}" -m tcp '
                f"-j DNAT --to-destination {endpoint}"
            )
    rules.append(
        '-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must '
        'be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS'
    )
    lines = ["*nat", *(f":{c} - [0:0]" for c in chains), *rules, *svc_rules, "COMMIT", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# Topology.


def netns_argv(netns: str, *argv: str) -> list[str]:
    """``argv`` run inside ``netns``."""
    return ["ip", "netns", "exec", netns, *argv]


def run(
    *argv: str, timeout: float = DEFAULT_COMMAND_TIMEOUT_SECONDS, stdin: str | None = None
) -> str:
    """Run a command; its stdout.

    Raises:
        BenchError: non-zero exit (message with its stderr) or timeout.
    """
    try:
        proc = subprocess.run(
            argv, input=stdin, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise BenchError(f"{' '.join(argv[:6])}: no answer in {timeout:g} s") from exc
    if proc.returncode != 0:
        raise BenchError(f"{' '.join(argv[:8])}: {proc.stderr.strip()[-500:]}")
    return proc.stdout


@dataclass
class Topology:
    """The three netns, the echo server and the addresses (see the module docstring)."""

    backends: str
    client_ebpf: str
    client_iptables: str
    server: subprocess.Popen[bytes] | None = None


@contextlib.contextmanager
def topology(args: argparse.Namespace, tag: str) -> Iterator[Topology]:
    """Create the netns, veths, routes and the echo server; removed on exit.

    Raises:
        BenchError: a step failed or the server did not answer within ``--ready-timeout``.
    """
    topo = Topology(
        backends=f"{NETNS_PREFIX}{tag}-be",
        client_ebpf=f"{NETNS_PREFIX}{tag}-ebpf",
        client_iptables=f"{NETNS_PREFIX}{tag}-ipt",
    )
    link = list(ipaddress.ip_network(args.link_cidr))

    def cmd(*argv: str) -> str:
        return run(*argv, timeout=args.command_timeout)

    try:
        for ns in (topo.backends, topo.client_ebpf, topo.client_iptables):
            create_netns(ns)
        pairs = (
            (topo.client_ebpf, link[1], link[2], "e"),
            (topo.client_iptables, link[5], link[6], "i"),
        )
        for client, be_addr, cl_addr, side in pairs:
            be_if, cl_if = f"sb{tag}{side}", f"sc{tag}{side}"
            cmd("ip", "-n", topo.backends, "link", "add", be_if, "type", "veth", "peer", "name",
                cl_if, "netns", client)  # fmt: skip
            cmd("ip", "-n", topo.backends, "addr", "add", f"{be_addr}/30", "dev", be_if)
            cmd("ip", "-n", topo.backends, "link", "set", be_if, "up")
            cmd("ip", "-n", client, "addr", "add", f"{cl_addr}/30", "dev", cl_if)
            cmd("ip", "-n", client, "link", "set", cl_if, "up")
            cmd("ip", "-n", client, "route", "add", "default", "via", str(be_addr))
        cmd("ip", "-n", topo.backends, "route", "add", "local", args.backend_cidr, "dev", "lo")
        topo.server = subprocess.Popen(
            netns_argv(
                topo.backends,
                sys.executable,
                "-c",
                ECHO_SERVER,
                str(args.target_port),
                str(args.io_timeout),
            ),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        probe = str(ipaddress.ip_network(args.backend_cidr)[1])
        deadline = time.monotonic() + args.ready_timeout
        while (
            spread(topo.client_ebpf, probe, args.target_port, 1, args.connect_timeout)[0] != probe
        ):
            if time.monotonic() > deadline or topo.server.poll() is not None:
                raise BenchError(f"the echo server did not answer on {probe}:{args.target_port}")
            time.sleep(0.1)
        yield topo
    finally:
        if topo.server is not None:
            topo.server.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                topo.server.wait(timeout=args.stop_timeout)
            if topo.server.poll() is None:
                topo.server.kill()
        for ns in (topo.client_ebpf, topo.client_iptables, topo.backends):
            delete_netns(ns)


def spread(netns: str, ip: str, port: int, connections: int, timeout: float) -> list[str]:
    """The backend addresses that answered ``connections`` connections to ``ip:port`` from
    ``netns`` (one per connection; ``error: …`` for a failed one)."""
    out = host.sh(
        *netns_argv(
            netns, sys.executable, "-c", SPREAD_CLIENT, ip, str(port), str(connections),
            str(timeout),
        ),
        check=False,
        timeout=connections * timeout + 30,
    )  # fmt: skip
    try:
        return list(json.loads(out.stdout))
    except ValueError:
        return [f"error: spread client failed: {out.stderr.strip()[-300:]}"]


def check_spread(netns: str, svc: Svc, args: argparse.Namespace, what: str) -> list[str]:
    """``--spread-connections`` connections to ``svc``'s VIP from ``netns``: each must reach
    one of its backends and at least two backends must answer; returns the addresses seen.

    Raises:
        BenchError: a connection failed or reached something else, or no spread.
    """
    seen = spread(netns, svc.vip, args.service_port, args.spread_connections, args.connect_timeout)
    wrong = [s for s in seen if s not in svc.backends]
    if wrong or len(set(seen)) < min(2, len(svc.backends)):
        raise BenchError(
            f"{what}: {svc.vip}:{args.service_port} should reach {list(svc.backends)}, "
            f"got {sorted(set(seen))}"
        )
    return sorted(set(seen))


class Client:
    """A long-lived traffic client in ``netns`` (:data:`TRAFFIC_CLIENT`): one short
    measurement per call, no process start between slices."""

    def __init__(self, netns: str, io_timeout: float, stop_timeout: float) -> None:
        self.netns = netns
        self.stop_timeout = stop_timeout
        self.proc = subprocess.Popen(
            netns_argv(netns, sys.executable, "-c", TRAFFIC_CLIENT, str(io_timeout)),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
        )

    def run(self, mode: str, ip: str, port: int, seconds: float) -> tuple[int, float]:
        """RR (``rr``) or CRR (``crr``) to ``ip:port`` for ``seconds``; (count, seconds).

        Raises:
            BenchError: the client failed or exited.
        """
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(f"{mode} {ip} {port} {seconds}\n")
            line = self.proc.stdout.readline()
        except OSError as exc:
            raise BenchError(f"traffic client in {self.netns}: {exc}") from exc
        try:
            result = json.loads(line)
        except ValueError:
            err = self.proc.stderr.read()[-500:] if self.proc.stderr else ""
            result = {"error": f"client exited: {err}"}
        if "error" in result:
            raise BenchError(f"{mode} from {self.netns} to {ip}:{port}: {result['error']}")
        return int(result["count"]), float(result["seconds"])

    def close(self) -> None:
        """End the client (EOF on its stdin; killed when it does not exit)."""
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=self.stop_timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---------------------------------------------------------------------------------------
# The socket-LB.


@dataclass
class SocketLB:
    """The attached socket-LB of this run: its config, link ids and the map writer."""

    config: Any
    link_ids: list[int]
    maps: Any
    writer: Any
    programmed: list[Svc] = field(default_factory=list)


def bpftool_link_ids(pin_dir: pathlib.Path, timeout: float) -> list[int]:
    """Kernel ids of the socket-LB links pinned under ``pin_dir`` (``bpftool link show``)."""
    from cilia_agent.loadbalancer import socklb

    ids = []
    for name in socklb.attached(pin_dir):
        pin = str(socklb.link_pin(pin_dir, name))
        out = run("bpftool", "-j", "link", "show", "pinned", pin, timeout=timeout)
        ids.append(int(json.loads(out)["id"]))
    return ids


def link_exists(link_id: int) -> bool:
    """True while the kernel still has BPF link ``link_id`` (``bpftool link show id``)."""
    proc = subprocess.run(
        ["bpftool", "link", "show", "id", str(link_id)], capture_output=True, check=False
    )
    return proc.returncode == 0


@contextlib.contextmanager
def socket_lb(args: argparse.Namespace, tag: str, report: dict[str, Any]) -> Iterator[SocketLB]:
    """Compile and attach ``bpf/bpf_sock.c`` as the agent does (``socklb.attach``), maps
    pinned in a pin dir of this run; detached, unpinned and unmounted on exit, and
    ``report["links_left"]`` set to the link ids the kernel still knows (must be none).

    Raises:
        BenchError: attaching failed, or a link is left after detaching.
    """
    from cilia_agent.datapath.objects import default_bpf_dir
    from cilia_agent.loadbalancer import socklb
    from cilia_agent.loadbalancer.maps import LBMaps, ServiceMapWriter

    run_dir = pathlib.Path(f"/run/{NETNS_PREFIX}{tag}")
    config = socklb.SockConfig(
        bpf_dir=default_bpf_dir(),
        pin_dir=pathlib.Path(f"/sys/fs/bpf/{NETNS_PREFIX}{tag}"),
        cgroup_root=args.cgroup_root or run_dir / "cgroupv2",
        lb_map_max=args.lb_map_max,
        sock_rev_map_max=args.sock_rev_map_max,
    )
    ids: list[int] = []
    maps = None
    try:
        try:
            socklb.attach(config)
        except socklb.SocketLBUnavailable as exc:
            raise BenchError(str(exc)) from exc
        ids = bpftool_link_ids(config.pin_dir, args.command_timeout)
        if len(ids) != len(socklb.PROGRAMS):
            raise BenchError(f"{len(ids)} socket-LB links pinned, {len(socklb.PROGRAMS)} expected")
        maps = LBMaps(config.pin_dir)
        yield SocketLB(config, ids, maps, ServiceMapWriter(maps, args.lb_map_max))
    finally:
        if maps is not None:
            maps.close()
        socklb.detach(config.pin_dir)
        left = [i for i in ids if link_exists(i)]
        report["links_left"] = left
        shutil.rmtree(config.pin_dir, ignore_errors=True)
        if args.cgroup_root is None and config.cgroup_root.is_dir():
            subprocess.run(["umount", str(config.cgroup_root)], capture_output=True, check=False)
        shutil.rmtree(run_dir, ignore_errors=True)
        if left:
            raise BenchError(f"socket-LB links still attached after detach: {left}")


def program_ebpf(lb: SocketLB, services: list[Svc], args: argparse.Namespace) -> float:
    """Make the maps hold exactly ``services`` (upsert the new, delete the extra); seconds."""
    started = time.perf_counter()
    want = {s.name for s in services}
    for s in lb.programmed:
        if s.name not in want:
            lb.writer.delete_service(NAMESPACE, s.name)
    have = {s.name for s in lb.programmed}
    for s in services:
        if s.name not in have:
            problems = lb.writer.upsert_service(
                service_message(s, args.service_port, args.target_port)
            )
            if problems:
                raise BenchError(f"{s.name}: {problems}")
    lb.programmed = list(services)
    return time.perf_counter() - started


def program_iptables(topo: Topology, services: list[Svc], args: argparse.Namespace) -> float:
    """Load kube-proxy's nat rules for ``services`` into the iptables client netns with one
    ``iptables-restore`` (replacing the table); seconds it took."""
    text = kube_proxy_rules(
        services, services[0], args.service_port, args.target_port, args.cluster_cidr
    )
    started = time.perf_counter()
    run(
        *netns_argv(topo.client_iptables, args.iptables_restore),
        stdin=text,
        timeout=args.restore_timeout,
    )
    return time.perf_counter() - started


def iptables_rule_count(topo: Topology, timeout: float) -> int:
    """Rules in the iptables client netns' nat table (``iptables-save`` lines with ``-A``)."""
    out = run(*netns_argv(topo.client_iptables, "iptables-save", "-t", "nat"), timeout=timeout)
    return sum(1 for line in out.splitlines() if line.startswith("-A "))


# ---------------------------------------------------------------------------------------
# Service change → map latency.


class ServiceServer:
    """An in-process ``ServiceService``: each ``WatchServices`` stream gets every Service
    (UPSERT events), ``synced``, then every change published with :meth:`upsert` until
    :meth:`close`."""

    def __init__(self, services: dict[str, Any]) -> None:
        self.services = services
        self.streams: list[asyncio.Queue[Any]] = []

    async def WatchServices(  # noqa: N802 (gRPC method name)
        self, request: Any, context: Any
    ) -> AsyncIterator[Any]:
        """The stream (see the class docstring)."""
        from cilia.controlplane.v1 import controlplane_pb2 as cp

        queue: asyncio.Queue[Any] = asyncio.Queue()
        self.streams.append(queue)
        try:
            listing = [
                cp.ServiceEvent(type=cp.EVENT_TYPE_UPSERT, service=s)
                for s in self.services.values()
            ]
            yield cp.WatchServicesResponse(events=listing)
            yield cp.WatchServicesResponse(synced=True)
            while (event := await queue.get()) is not None:
                yield cp.WatchServicesResponse(events=[event])
        finally:
            self.streams.remove(queue)

    def close(self) -> None:
        """End every open stream (so none is cancelled mid-flight by the server's stop)."""
        for q in self.streams:
            q.put_nowait(None)

    def upsert(self, service: Any) -> None:
        """Publish ``service`` (whole) to every open stream."""
        from cilia.controlplane.v1 import controlplane_pb2 as cp

        self.services[service.name] = service
        for q in self.streams:
            q.put_nowait(cp.ServiceEvent(type=cp.EVENT_TYPE_UPSERT, service=service))


def wait_count(
    maps: Any, frontend: Any, count: int, timeout: float, interval: float
) -> float | None:
    """Poll the pinned services map until ``frontend``'s master entry has ``count``
    backends; ``time.perf_counter()`` then, None after ``timeout`` s."""
    from cilia_agent.loadbalancer.maps import frontend_key

    key = frontend_key(frontend)
    deadline = time.perf_counter() + timeout
    while True:
        value = maps.services.lookup(key)
        now = time.perf_counter()
        if value is not None and value.count == count:
            return now
        if now > deadline:
            return None
        time.sleep(interval)


async def change_latency(
    lb: SocketLB, services: list[Svc], args: argparse.Namespace
) -> dict[str, Any]:
    """Service change → pinned map, through the agent's stream and watcher (see the module
    docstring); seconds per round and the initial sync time.

    Raises:
        BenchError: the listing did not sync in ``--sync-timeout`` s, or a change did not
            reach the map in ``--change-timeout`` s.
    """
    import grpc
    from prometheus_client import CollectorRegistry

    from cilia.controlplane.v1 import controlplane_pb2_grpc as cp_grpc
    from cilia_agent.controlplane import OperatorAPI, run_watch
    from cilia_agent.loadbalancer.maps import LBMaps
    from cilia_agent.loadbalancer.model import Frontend
    from cilia_agent.loadbalancer.watcher import ServiceMetrics, ServiceWatcher

    messages = {s.name: service_message(s, args.service_port, args.target_port) for s in services}
    op = ServiceServer(messages)
    server = grpc.aio.server()
    cp_grpc.add_ServiceServiceServicer_to_server(op, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    api = OperatorAPI(
        address=f"127.0.0.1:{port}", node_name="bench", timeout=args.command_timeout,
        min_backoff=WATCH_MIN_BACKOFF_SECONDS, max_backoff=WATCH_MAX_BACKOFF_SECONDS,
    )  # fmt: skip
    watcher = ServiceWatcher(lb.writer, ServiceMetrics(CollectorRegistry()))
    started = time.perf_counter()
    task = asyncio.create_task(
        run_watch("services", api.watch_services, watcher.consume,
                  min_backoff=WATCH_MIN_BACKOFF_SECONDS, max_backoff=WATCH_MAX_BACKOFF_SECONDS)
    )  # fmt: skip
    poller = LBMaps(lb.config.pin_dir)  # the polling thread's own fds
    rng = random.Random(args.seed + 1)
    counts = {s.name: len(s.backends) for s in services}
    samples: list[float] = []
    try:
        while not watcher.synced:
            if time.perf_counter() - started > args.sync_timeout or task.done():
                raise BenchError(f"the Service listing did not sync in {args.sync_timeout:g} s")
            await asyncio.sleep(0.01)
        sync_seconds = time.perf_counter() - started
        loop = asyncio.get_running_loop()
        for _ in range(args.change_rounds):
            svc = rng.choice(services)
            full = len(svc.backends)  # toggles: all backends <-> all but the last
            want = full - 1 if counts[svc.name] == full else full
            front = Frontend(svc.vip, args.service_port, 6)
            waiter = loop.run_in_executor(
                None, wait_count, poller, front, want, args.change_timeout, args.poll_interval
            )
            t0 = time.perf_counter()
            op.upsert(service_message(svc, args.service_port, args.target_port, want))
            seen = await waiter
            if seen is None:
                raise BenchError(f"{svc.name}: change not in the map in {args.change_timeout} s")
            samples.append(max(0.0, seen - t0))
            counts[svc.name] = want
            await asyncio.sleep(args.poll_interval * 10)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await api.close()
        op.close()
        closing = time.perf_counter() + args.stop_timeout
        while op.streams and time.perf_counter() < closing:  # streams end, then the server
            await asyncio.sleep(0.01)
        await server.stop(args.stop_timeout)
        poller.close()
    lb.programmed = list(services)
    return {"sync_seconds": sync_seconds, "samples": samples}


# ---------------------------------------------------------------------------------------
# The run.


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def ratio(a: float, b: float) -> float | None:
    """a / b rounded, or None when b is 0."""
    return round(a / b, 3) if b else None


def measure(
    args: argparse.Namespace,
    clients: dict[str, Client],
    lb: SocketLB,
    measured: Svc,
    start: int,
) -> dict[str, dict[str, float]]:
    """One round at the programmed count: per metric, ``--duration`` s of each path cut in
    ``--slice`` s slices taken in turn (direct, eBPF, iptables, direct, …; the first path
    rotated by ``start``), so that load on the shared host hits the three alike; returns
    metric -> path -> rate (per second, over all its slices)."""
    order = PATHS[start % 3 :] + PATHS[: start % 3]
    slices = max(1, round(args.duration / args.slice))
    out: dict[str, dict[str, float]] = {}
    for metric, _, _ in METRICS:
        totals = {p: [0, 0.0] for p in PATHS}
        for _ in range(slices):
            for path in order:
                if path == "direct":
                    got = clients["ebpf"].run(
                        metric, measured.backends[0], args.target_port, args.slice
                    )
                elif path == "ebpf":
                    got = clients["ebpf"].run(metric, measured.vip, args.service_port, args.slice)
                else:
                    lb.writer.delete_service(NAMESPACE, measured.name)  # the iptables path alone
                    try:
                        got = clients["iptables"].run(
                            metric, measured.vip, args.service_port, args.slice
                        )
                    finally:
                        lb.writer.upsert_service(
                            service_message(measured, args.service_port, args.target_port)
                        )
                totals[path][0] += got[0]
                totals[path][1] += got[1]
        out[metric] = {p: round(c / t, 1) if t else 0.0 for p, (c, t) in totals.items()}
    return out


def bench(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """Everything (see the module docstring); fills ``report``.

    Raises:
        BenchError: a step or a check failed.
    """
    counts = args.services
    services = make_services(
        max(counts), args.vip_cidr, args.backend_cidr, args.min_backends, args.max_backends,
        args.seed,
    )  # fmt: skip
    measured = services[0]
    tag = secrets.token_hex(2)
    samples: dict[int, dict[str, dict[str, list[float]]]] = {
        n: {m: {p: [] for p in PATHS} for m, _, _ in METRICS} for n in counts
    }
    programming: dict[int, dict[str, list[float]]] = {
        n: {"ebpf_seconds": [], "iptables_seconds": []} for n in counts
    }
    rules: dict[int, int] = {}
    with contextlib.ExitStack() as stack:
        topo = stack.enter_context(topology(args, tag))
        lb = stack.enter_context(socket_lb(args, tag, report))
        clients = {
            name: Client(netns, args.io_timeout, args.stop_timeout)
            for name, netns in (("ebpf", topo.client_ebpf), ("iptables", topo.client_iptables))
        }
        for client in clients.values():
            stack.callback(client.close)
        for r in range(args.rounds):
            for i, n in enumerate(counts):
                subset = services[:n]
                t_ebpf = program_ebpf(lb, subset, args)
                t_ipt = program_iptables(topo, subset, args)
                programming[n]["ebpf_seconds"].append(round(t_ebpf, 3))
                programming[n]["iptables_seconds"].append(round(t_ipt, 3))
                if r == 0:
                    rules[n] = iptables_rule_count(topo, args.restore_timeout)
                    check_spread(topo.client_ebpf, measured, args, f"eBPF at {n} Services")
                    lb.writer.delete_service(NAMESPACE, measured.name)
                    try:
                        check_spread(
                            topo.client_iptables, measured, args, f"iptables at {n} Services"
                        )
                    finally:
                        lb.writer.upsert_service(
                            service_message(measured, args.service_port, args.target_port)
                        )
                got = measure(args, clients, lb, measured, r + i)
                for m, by_path in got.items():
                    for p, v in by_path.items():
                        samples[n][m][p].append(v)
                print(
                    f"  round {r + 1}/{args.rounds} {n:>6} Services: "
                    + "  ".join(f"{m} " + "/".join(f"{got[m][p]:.0f}" for p in PATHS) for m in got)
                    + f"  (direct/ebpf/iptables; programmed eBPF {t_ebpf:.2f} s, "
                    f"iptables-restore {t_ipt:.2f} s)",
                    flush=True,
                )
        report["samples"] = {str(n): v for n, v in samples.items()}
        report["programming"] = {str(n): v for n, v in programming.items()}
        report["iptables_nat_rules"] = {str(n): v for n, v in rules.items()}
        report["measured_service"] = {
            "name": f"{NAMESPACE}/{measured.name}",
            "vip": measured.vip,
            "backends": list(measured.backends),
        }
        if args.change_rounds:
            top = max(counts)
            program_ebpf(lb, services[:top], args)
            print(f"  Service change → map: {args.change_rounds} changes at {top} Services",
                  flush=True)  # fmt: skip
            lat = asyncio.run(change_latency(lb, services[:top], args))
            report["change_latency"] = {
                "services": top,
                "initial_sync_seconds": round(lat["sync_seconds"], 3),
                "p50_ms": round(percentile(lat["samples"], 0.5) * 1000, 3),
                "p99_ms": round(percentile(lat["samples"], 0.99) * 1000, 3),
                "max_ms": round(max(lat["samples"]) * 1000, 3),
                "rounds": len(lat["samples"]),
            }


def summarize(report: dict[str, Any], counts: list[int]) -> None:
    """Medians, spreads and ratios into ``report`` (from ``report["samples"]``)."""
    med: dict[str, Any] = {}
    spread_: dict[str, Any] = {}
    for n in counts:
        s = report["samples"][str(n)]
        med[str(n)] = {m: {p: statistics.median(v) for p, v in s[m].items()} for m in s}
        spread_[str(n)] = {m: {p: [min(v), max(v)] for p, v in s[m].items()} for m in s}
    base = str(counts[0])
    ratios: dict[str, Any] = {}
    for n in counts:
        k = str(n)
        ratios[k] = {
            m: {
                "ebpf_over_ebpf_base": ratio(med[k][m]["ebpf"], med[base][m]["ebpf"]),
                "ebpf_over_ebpf_base_per_direct": ratio(
                    med[k][m]["ebpf"] * med[base][m]["direct"],
                    med[base][m]["ebpf"] * med[k][m]["direct"],
                ),
                "ebpf_over_iptables": ratio(med[k][m]["ebpf"], med[k][m]["iptables"]),
                "ebpf_over_direct": ratio(med[k][m]["ebpf"], med[k][m]["direct"]),
                "iptables_over_direct": ratio(med[k][m]["iptables"], med[k][m]["direct"]),
                "iptables_over_iptables_base": ratio(
                    med[k][m]["iptables"], med[base][m]["iptables"]
                ),
            }
            for m, _, _ in METRICS
        }
    report["median"] = med
    report["spread_min_max"] = spread_
    report["ratios"] = ratios


def print_table(report: dict[str, Any], args: argparse.Namespace) -> None:
    """The report as a table on stdout."""
    counts = args.services
    base = counts[0]
    print()
    print(
        f"ClusterIP {report['measured_service']['vip']}:{args.service_port} "
        f"({len(report['measured_service']['backends'])} backends), {args.duration:g} s per "
        f"measurement, median of {args.rounds} rounds [min-max]"
    )
    head = (
        f"{'metric':<8} {'Services':>8} {'direct':>18} {'eBPF':>18} {'iptables':>18} "
        f"{f'eBPF/@{base}':>10} {'(÷dir)':>8} {'eBPF/ipt':>9} {'eBPF/dir':>9} {'ipt/dir':>8}"
    )
    print(head)
    print("-" * len(head))
    for m, title, _unit in METRICS:
        for n in counts:
            k = str(n)
            cells = []
            for p in PATHS:
                lo, hi = report["spread_min_max"][k][m][p]
                cells.append(f"{report['median'][k][m][p]:>7.0f} [{lo:.0f}-{hi:.0f}]".rjust(18))
            r = report["ratios"][k][m]
            print(
                f"{title:<8} {n:>8} {' '.join(cells)} {r['ebpf_over_ebpf_base'] or 0:>9.3f}x "
                f"{r['ebpf_over_ebpf_base_per_direct'] or 0:>7.3f}x "
                f"{r['ebpf_over_iptables'] or 0:>8.3f}x {r['ebpf_over_direct'] or 0:>8.3f}x "
                f"{r['iptables_over_direct'] or 0:>7.3f}x"
            )
    print("(÷dir: eBPF/@base with each side divided by its direct baseline, taken in the same "
          "slices: drift of the host between counts cancels)")  # fmt: skip
    print("(RR in transactions/s, CRR in connections/s; goals: eBPF/@base ≥ 0.95, "
          f"eBPF/iptables ≥ 1.5 at {max(counts)})")  # fmt: skip
    print()
    print("Programming, median s (eBPF: ServiceMapWriter, difference to the previous count; "
          "iptables: one full iptables-restore):")  # fmt: skip
    for n in counts:
        p = report["programming"][str(n)]
        print(
            f"  {n:>6} Services: eBPF {statistics.median(p['ebpf_seconds']):6.2f} s   "
            f"iptables {statistics.median(p['iptables_seconds']):6.2f} s "
            f"({report['iptables_nat_rules'][str(n)]} nat rules)"
        )
    lat = report.get("change_latency")
    if lat:
        print()
        print(
            f"Service change → agent's map at {lat['services']} Services "
            f"(gRPC WatchServices → ServiceWatcher → pinned map), {lat['rounds']} changes: "
            f"p50 {lat['p50_ms']:.2f} ms, p99 {lat['p99_ms']:.2f} ms, max {lat['max_ms']:.2f} ms"
            f" (goal p99 ≤ 1000 ms); initial listing synced in {lat['initial_sync_seconds']} s"
        )
    print(f"iptables: {report['iptables']}")
    print(f"socket-LB links left attached after the run: {len(report.get('links_left', []))}")


def counts_arg(text: str) -> list[int]:
    """``10,1000,10000`` → ``[10, 1000, 10000]`` (ascending, ≥ 1)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from exc
    if not values or values != sorted(set(values)) or values[0] < 1:
        raise argparse.ArgumentTypeError("Service counts must be ascending, distinct, >= 1")
    return values


def parser() -> argparse.ArgumentParser:
    """The command line (every limit a flag with its default)."""
    p = argparse.ArgumentParser(
        prog="python -m bench services",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = p.add_argument
    add(
        "--services",
        type=counts_arg,
        default=counts_arg(DEFAULT_SERVICES),
        help=f"Service counts, the first is the base of the flatness ratio (default {DEFAULT_SERVICES})",
    )
    add(
        "--duration",
        type=float,
        default=DEFAULT_DURATION_SECONDS,
        help=f"seconds per measurement (default {DEFAULT_DURATION_SECONDS:g})",
    )
    add(
        "--slice",
        type=float,
        default=DEFAULT_SLICE_SECONDS,
        help=f"seconds of one slice; the paths take turns slice by slice (default {DEFAULT_SLICE_SECONDS:g})",
    )
    add(
        "--rounds",
        type=int,
        default=DEFAULT_ROUNDS,
        help=f"rounds over every count and path; median and min-max reported (default {DEFAULT_ROUNDS})",
    )
    add(
        "--min-backends",
        type=int,
        default=DEFAULT_MIN_BACKENDS,
        help=f"fewest backends of a Service (default {DEFAULT_MIN_BACKENDS})",
    )
    add(
        "--max-backends",
        type=int,
        default=DEFAULT_MAX_BACKENDS,
        help=f"most backends of a Service (default {DEFAULT_MAX_BACKENDS})",
    )
    add(
        "--service-port",
        type=int,
        default=DEFAULT_SERVICE_PORT,
        help=f"the Services' TCP port (default {DEFAULT_SERVICE_PORT})",
    )
    add(
        "--target-port",
        type=int,
        default=DEFAULT_TARGET_PORT,
        help=f"the backends' port, where the echo server listens (default {DEFAULT_TARGET_PORT})",
    )
    add(
        "--vip-cidr",
        default=DEFAULT_VIP_CIDR,
        help=f"ClusterIPs, one per Service (default {DEFAULT_VIP_CIDR}; benchmarking range)",
    )
    add(
        "--backend-cidr",
        default=DEFAULT_BACKEND_CIDR,
        help=f"backend addresses, local in the backends netns (default {DEFAULT_BACKEND_CIDR})",
    )
    add(
        "--link-cidr",
        default=DEFAULT_LINK_CIDR,
        help=f"/29 of the two veth /30s (default {DEFAULT_LINK_CIDR})",
    )
    add(
        "--cluster-cidr",
        default=DEFAULT_CLUSTER_CIDR,
        help="kube-proxy's --cluster-cidr: sources outside it are masqueraded; holds the "
        f"clients, which play pods (default {DEFAULT_CLUSTER_CIDR})",
    )
    add(
        "--lb-map-max",
        type=int,
        default=DEFAULT_LB_MAP_MAX,
        help=f"the agent's --bpf-lb-map-max (default {DEFAULT_LB_MAP_MAX})",
    )
    add(
        "--sock-rev-map-max",
        type=int,
        default=DEFAULT_SOCK_REV_MAP_MAX,
        help=f"the agent's --bpf-sock-rev-map-max (default {DEFAULT_SOCK_REV_MAP_MAX})",
    )
    add(
        "--cgroup-root",
        type=pathlib.Path,
        default=None,
        help="cgroup2 mount to attach to (default: a mount of this run's own under /run)",
    )
    add(
        "--iptables-restore",
        default=DEFAULT_IPTABLES_RESTORE,
        help=f"the restore binary, e.g. iptables-legacy-restore (default {DEFAULT_IPTABLES_RESTORE})",
    )
    add(
        "--change-rounds",
        type=int,
        default=DEFAULT_CHANGE_ROUNDS,
        help=f"Service changes timed to the map at the largest count; 0 skips (default {DEFAULT_CHANGE_ROUNDS})",
    )
    add(
        "--change-timeout",
        type=float,
        default=DEFAULT_CHANGE_TIMEOUT_SECONDS,
        help=f"seconds one change may take to reach the map (default {DEFAULT_CHANGE_TIMEOUT_SECONDS:g})",
    )
    add(
        "--sync-timeout",
        type=float,
        default=DEFAULT_SYNC_TIMEOUT_SECONDS,
        help=f"seconds for the watcher's initial listing (default {DEFAULT_SYNC_TIMEOUT_SECONDS:g})",
    )
    add(
        "--poll-interval",
        type=float,
        default=DEFAULT_POLL_INTERVAL_SECONDS,
        help=f"seconds between map polls while timing a change (default {DEFAULT_POLL_INTERVAL_SECONDS:g})",
    )
    add(
        "--spread-connections",
        type=int,
        default=DEFAULT_SPREAD_CONNECTIONS,
        help=f"connections of the path check at each count (default {DEFAULT_SPREAD_CONNECTIONS})",
    )
    add(
        "--connect-timeout",
        type=float,
        default=DEFAULT_CONNECT_TIMEOUT_SECONDS,
        help=f"seconds a check connection may take (default {DEFAULT_CONNECT_TIMEOUT_SECONDS:g})",
    )
    add(
        "--ready-timeout",
        type=float,
        default=DEFAULT_READY_TIMEOUT_SECONDS,
        help=f"seconds for the echo server to answer (default {DEFAULT_READY_TIMEOUT_SECONDS:g})",
    )
    add(
        "--io-timeout",
        type=float,
        default=DEFAULT_IO_TIMEOUT_SECONDS,
        help=f"seconds a traffic socket waits for its peer (default {DEFAULT_IO_TIMEOUT_SECONDS:g})",
    )
    add(
        "--command-timeout",
        type=float,
        default=DEFAULT_COMMAND_TIMEOUT_SECONDS,
        help=f"seconds an ip or bpftool command may take (default {DEFAULT_COMMAND_TIMEOUT_SECONDS:g})",
    )
    add(
        "--restore-timeout",
        type=float,
        default=DEFAULT_RESTORE_TIMEOUT_SECONDS,
        help=f"seconds iptables-restore or -save may take (default {DEFAULT_RESTORE_TIMEOUT_SECONDS:g})",
    )
    add(
        "--stop-timeout",
        type=float,
        default=DEFAULT_STOP_TIMEOUT_SECONDS,
        help=f"seconds a server or client has to exit before it is killed (default {DEFAULT_STOP_TIMEOUT_SECONDS:g})",
    )
    add(
        "--seed",
        type=int,
        default=DEFAULT_SEED,
        help=f"RNG seed of backend counts and changes (default {DEFAULT_SEED})",
    )
    add("--results-dir", type=pathlib.Path, default=DEFAULT_RESULTS_DIR,
        help="where the JSON goes (default bench/results)")  # fmt: skip
    return p


def _interrupted(signum: int, frame: Any) -> None:
    """SIGTERM unwinds like Ctrl-C, so the links, netns and mounts are removed."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 on success, 1 when it could not run."""
    p = parser()
    args = p.parse_args(argv)
    if args.duration <= 0 or args.slice <= 0 or args.rounds < 1 or args.change_rounds < 0:
        p.error("--duration and --slice must be > 0, --rounds >= 1, --change-rounds >= 0")
    if not 1 <= args.min_backends <= args.max_backends:
        p.error("need 1 <= --min-backends <= --max-backends")
    if ipaddress.ip_network(args.link_cidr).prefixlen > 29:
        p.error("--link-cidr must hold two /30s (a /29 or larger)")
    if os.geteuid() != 0:
        print("the services benchmark needs root (netns, iptables, bpf)", file=sys.stderr)
        return 1
    for tool in ("bpftool", args.iptables_restore, "iptables-save"):
        if shutil.which(tool) is None:
            print(f"{tool} not found (scripts/setup.sh installs it)", file=sys.stderr)
            return 1
    for stale in list_netns(NETNS_PREFIX):
        delete_netns(stale)
    signal.signal(signal.SIGTERM, _interrupted)
    started = time.perf_counter()
    report: dict[str, Any] = {
        "benchmark": "services",
        "time": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "host": host_info(),
        "parameters": {
            k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()
        },
    }
    print(
        f"services: {args.services} Services, {args.rounds} rounds x {args.duration:g} s "
        "(direct / eBPF socket-LB / kube-proxy iptables)",
        flush=True,
    )
    try:
        report["iptables"] = run(args.iptables_restore, "--version").strip()
        bench(args, report)
    except (BenchError, OSError, subprocess.SubprocessError) as exc:
        print(f"\nbenchmark failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted (netns, socket-LB links and pins removed)", file=sys.stderr)
        return 130
    summarize(report, args.services)
    report["wall_seconds"] = round(time.perf_counter() - started, 1)
    print_table(report, args)
    path = write_results("services", report, args.results_dir)
    print(f"\nwrote {rel(path)} ({report['wall_seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
