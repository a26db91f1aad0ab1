"""Pod→pod datapath cost: the agent's eBPF programs attached vs the same pair without BPF,
and a 10,000-entry policy map vs a 10-entry one.

Set-up (the real thing, as a container runtime drives it): a stack of this checkout's
redis, ``cilia-operator``, ``cilia-agent`` and ``cilia-relay`` (``--stack private``, default:
started for this run on free ports, its own state dir, pin dir and host device, pods from
``--pool-cidr``, stopped and removed afterwards — the ``scripts/stack.sh`` stack is shared
and ``tests/e2e`` restart it at will; ``--stack shared`` uses it, reused when running, else
started and stopped again), two pods created by exec'ing the real ``cilia-cni`` ADD
(``cilia_testkit.cni``) with the conflist the agent wrote, as netns
``cilia-bench-dp-client`` / ``cilia-bench-dp-server`` in namespace ``bench`` with labels
``app=bench-client`` / ``app=bench-server``, and a CiliumNetworkPolicy applied with
``cilia-operator apply -f`` that lets only the client reach the server on TCP ``--iperf-port``
and ``--rr-port`` (so the server is default-deny for ingress and every new flow is looked up
in the policy map, at both veths).

Three metrics, ``--duration`` seconds each:

* ``TCP stream``: ``iperf3 -c SERVER -t DURATION -J`` from the client netns against
  ``iperf3 -s`` in the server netns (one TCP connection; Gbit/s received);
* ``TCP RR``: one TCP connection, 1-byte request / 1-byte response ping-pong (Python on both
  ends, ``TCP_NODELAY``; transactions/s) — iperf3 cannot do request/response and Debian 12
  has no ``netperf``;
* ``TCP CRR``: connect, 1-byte request, 1-byte response, close, repeated (connections/s;
  the client closes with RST, ``SO_LINGER`` 0, so no TIME_WAIT piles up between runs).
  Only a connection's first packet per direction is looked up in the policy map (later
  packets hit conntrack), so this is the measurement where the policy map's size can show.

Three configurations of the same pod pair, interleaved per metric (stream in all three,
then RR in all three, then CRR; ``--rounds`` times, median reported) so drift on a shared
host hits them alike:

* ``no-bpf``: ``tc qdisc del dev lxc… clsact`` on both host veths — the same veths,
  routes and iptables, without BPF; afterwards the agent's very programs are attached again
  (by program id, ``BPF_PROG_GET_FD_BY_ID``, as the loader attaches them; the ids are
  checked);
* ``bpf-10``: programs attached as the agent attached them; the server endpoint's policy
  map entries padded to ``--base-entries`` (10) with random (identity, protocol, port)
  allow entries that match no traffic here (the allow rule that matters is kept), written
  with the loader's ``table("cilia_policy")`` and ``layout.policy_key``;
* ``bpf-10k``: the same with the server's entries padded to ``--entries`` (10,000).

Before each BPF configuration a connect to an unallowed port must time out (dropped by
policy); in ``no-bpf`` it must be refused (RST: nothing drops it). The padding entries are
removed again afterwards.

Ratios: ``bpf-10 / no-bpf`` and ``bpf-10k / bpf-10`` (1.0 = no cost; below 1 = slower), of
the medians, and per round (each round's pair measured back to back) as median [min-max],
which shows how far host load moved them. ``--metrics`` picks some of stream, rr, crr;
``--agent-args`` adds flags to a private stack's agent (e.g. ``--monitor-aggregation none``).

``--client-cpu``/``--server-cpu`` bind the two ends to CPUs (``taskset -c``, netperf's
``-T``): on this 2-vCPU VM unbound CRR ends move between CPUs and each hand-over may wake an
idle vCPU, which swung one configuration from 540 to 4,300 conn/s between rounds; both ends
on CPU 0 gave rounds within ~10 % of each other. Before the rounds, ``--warmup`` seconds of
CRR run with the programs attached (unmeasured).

Output: a table, and JSON in ``--results-dir`` (``datapath-<UTC time>.json`` and
``datapath-latest.json``), including the CPU seconds the agent spent during each
measurement (it handles the trace events the programs emit for new flows) and, when
``bpftool`` is there, each program's runs and nanoseconds per run. Those come from a further
``--stats-seconds`` (1) of the same traffic right after each BPF measurement with
``kernel.bpf_stats_enabled`` on (restored after): the kernel's accounting reads the
scheduler clock twice per run, ~80 ns per run on this VM, so the measured value itself is
taken with it off.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime as dt
import json
import os
import pathlib
import platform
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from cilia_testkit import ROOT, VENV_BIN, cni, host, netns
from cilia_testkit.stack import (
    SHARED_CONFLIST,
    SHARED_OPERATOR,
    SHARED_RELAY,
    SHARED_RUN,
    StackError,
    stack_sh,
)
from cilia_testkit.stack import Stack as TestkitStack

DEFAULT_DURATION_SECONDS = 5
DEFAULT_ENTRIES = 10_000
DEFAULT_ROUNDS = 1
DEFAULT_WARMUP_SECONDS = 5
DEFAULT_STATS_SECONDS = 1
BPF_STATS_KNOB = pathlib.Path("/proc/sys/kernel/bpf_stats_enabled")
DEFAULT_BASE_ENTRIES = 10
DEFAULT_IPERF_PORT = 5201
DEFAULT_RR_PORT = 5202
DEFAULT_PROBE_PORT = 5203
DEFAULT_SEED = 1
DEFAULT_RESULTS_DIR = ROOT / "bench" / "results"
DEFAULT_UP_TIMEOUT_SECONDS = 90
DEFAULT_STOP_TIMEOUT_SECONDS = 10.0
DEFAULT_POOL_CIDR = "10.253.0.0/16"
DEFAULT_POLICY_WAIT_SECONDS = 20.0
DEFAULT_PROBE_TIMEOUT_SECONDS = 1.0
DEFAULT_READY_TIMEOUT_SECONDS = 10.0
POD_NAMESPACE = "bench"
NETNS_PREFIX = "cilia-bench-dp-"
POLICY_NAME = "bench-datapath"
IPPROTO_TCP = 6
IPPROTO_UDP = 17
CLUSTER_IDENTITY_MIN = 256
CLUSTER_IDENTITY_MAX = 65535


class BenchError(RuntimeError):
    """A benchmark could not run (stack, pods, policy, a tool or a check failed)."""


# ---------------------------------------------------------------------------------------
# Shared with bench.flows: the stack, pods, policies, the agent's pinned maps.


@dataclass
class Stack:
    """Where the benchmark's stack answers.

    Attributes:
        kind: ``shared`` (``scripts/stack.sh``, ``.run/``) or ``private`` (started here).
        operator: operator gRPC address; relay: relay Observer address.
        conflist: the agent's CNI conflist; hubble_socket: the agent's Hubble socket.
        pin_dir: the agent's bpffs pin dir; pids: component → pid (shared: read from
            ``.run/<component>.pid`` on each call of :meth:`pid`).
        started: whether this benchmark started it.
        agent_socket: the agent's gRPC unix socket (private stacks; None = not known).
    """

    kind: str
    operator: str
    relay: str
    conflist: pathlib.Path
    hubble_socket: pathlib.Path
    pin_dir: pathlib.Path
    pids: dict[str, int] = field(default_factory=dict)
    started: bool = False
    agent_socket: pathlib.Path | None = None
    testkit: TestkitStack | None = None

    def pid(self, component: str) -> int | None:
        """Pid of ``redis``, ``operator``, ``agent`` or ``relay`` (None when unknown)."""
        if self.testkit is not None:
            return self.testkit.pid(component)
        try:
            return int((SHARED_RUN / f"{component}.pid").read_text().strip())
        except (OSError, ValueError):
            return None


def _operator_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """``cilia-operator ARGV`` (the caller passes ``--server``); never raises on exit status."""
    return subprocess.run(
        [str(VENV_BIN / "cilia-operator"), *argv],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def grpc_serving(address: str) -> bool:
    """True when the gRPC health service at ``address`` answers SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=1.0
            )
    except grpc.RpcError:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


@contextlib.contextmanager
def private_stack(args: argparse.Namespace) -> Iterator[Stack]:
    """Redis, operator, agent and relay of this checkout for this run only
    (:class:`cilia_testkit.stack.Stack`): its own run dir, sockets, state, pin dir, host
    device and pool ``--pool-cidr``, TCP ports the servers bind themselves. Everything is
    stopped and removed on exit.

    Raises:
        BenchError: a component exited or was not ready within ``--up-timeout`` s.
    """
    tk = TestkitStack(
        "bench",
        pool_cidr=args.pool_cidr,
        ready_seconds=args.up_timeout,
        agent_args=shlex.split(args.agent_args),
    )
    try:
        tk.start()
    except StackError as exc:
        raise BenchError(str(exc)) from None
    try:
        yield Stack(
            kind="private",
            operator=tk.operator_address,
            relay=tk.relay_address,
            conflist=tk.agent.conflist_path,
            hubble_socket=tk.agent.hubble_socket,
            pin_dir=tk.agent.pin_dir,
            started=True,
            agent_socket=tk.agent.socket,
            testkit=tk,
        )
    finally:
        tk.stop()


@contextlib.contextmanager
def shared_stack(args: argparse.Namespace) -> Iterator[Stack]:
    """The local stack of ``scripts/stack.sh`` (``.run/``): reused when running, else started
    and stopped again (unless ``--keep-stack``).

    Raises:
        BenchError: ``scripts/stack.sh up`` failed (its log tail is in the message).
    """
    stack = Stack(
        kind="shared",
        operator=SHARED_OPERATOR,
        relay=SHARED_RELAY,
        conflist=SHARED_CONFLIST,
        hubble_socket=SHARED_RUN / "hubble.sock",
        pin_dir=pathlib.Path("/sys/fs/bpf/cilia"),
    )
    if stack_sh("status", check=False).returncode != 0:
        stack_sh("down", check=False)
        up = stack_sh("up", "--fresh", "--timeout", str(args.up_timeout), check=False)
        if up.returncode != 0:
            stack_sh("down", check=False)  # what this start left running
            raise BenchError(f"scripts/stack.sh up failed:\n{up.stderr}")
        stack.started = True
    try:
        yield stack
    finally:
        if stack.started and not args.keep_stack:
            stack_sh("down", check=False)


def stack_running(args: argparse.Namespace) -> contextlib.AbstractContextManager[Stack]:
    """``--stack private`` (default) or ``shared``; see :func:`private_stack`, :func:`shared_stack`."""
    return private_stack(args) if args.stack == "private" else shared_stack(args)


def describe(stack: Stack) -> str:
    """One line on which stack the run uses."""
    if stack.kind == "private":
        return (
            f"private (operator {stack.operator}, relay {stack.relay}, pins {stack.pin_dir}, "
            f"agent pid {stack.pid('agent')})"
        )
    return "scripts/stack.sh, " + ("started" if stack.started else "already running, reused")


def add_stack_flags(parser: argparse.ArgumentParser) -> None:
    """The stack flags both benchmarks take."""
    parser.add_argument(
        "--stack",
        choices=("private", "shared"),
        default="private",
        help="private: a redis/operator/agent/relay of this checkout on free ports for this run "
        "only (default; tests/e2e restart the shared one at will); shared: scripts/stack.sh's",
    )
    parser.add_argument(
        "--pool-cidr",
        default=DEFAULT_POOL_CIDR,
        help=f"pod CIDR of the private stack (default {DEFAULT_POOL_CIDR})",
    )
    parser.add_argument(
        "--up-timeout",
        type=int,
        default=DEFAULT_UP_TIMEOUT_SECONDS,
        help=f"seconds for each stack component to start (default {DEFAULT_UP_TIMEOUT_SECONDS})",
    )
    parser.add_argument(
        "--stop-timeout",
        type=float,
        default=DEFAULT_STOP_TIMEOUT_SECONDS,
        help=f"seconds a private stack component gets after SIGTERM (default {DEFAULT_STOP_TIMEOUT_SECONDS:g})",
    )
    parser.add_argument(
        "--agent-args",
        default="",
        help="extra cilia-agent serve flags of a private stack (ignored with --stack shared), "
        "one shell-quoted string (e.g. '--monitor-aggregation none'; default none)",
    )
    parser.add_argument(
        "--keep-stack",
        action="store_true",
        help="leave a shared stack started by the benchmark running",
    )


def netns_argv(netns: str, *argv: str, cpu: str = "") -> list[str]:
    """``ip netns exec NETNS ARGV…``; with ``cpu`` (a ``taskset -c`` list such as ``0`` or
    ``0,1``) the command runs bound to those CPUs, as netperf's ``-T`` binds its ends."""
    pin = ["taskset", "-c", cpu] if cpu else []
    return ["ip", "netns", "exec", netns, *pin, *argv]


@dataclass
class BenchPod:
    """A pod created through ``cilia-cni`` plus what the benches need to know about it.

    Attributes:
        pod: the runtime's view (netns, container id, cached ADD result).
        host_ifname: host side veth (``lxc…``).
        ifindex: its ifindex (key of ``cilia_endpoints``).
        ep_id: the agent's endpoint id; identity: the pod's security identity (filled by
            :meth:`PodSet.wait_endpoints`).
    """

    pod: cni.Pod
    host_ifname: str = ""
    ifindex: int = 0
    ep_id: int = 0
    identity: int = 0

    @property
    def name(self) -> str:
        """netns name = pod name."""
        return str(self.pod.name)

    @property
    def ip(self) -> str:
        """IPv4 address from the ADD result."""
        return str(self.pod.ip)


@dataclass
class PodSet:
    """Pods made with the real CNI binary; :meth:`close` DELs them and deletes their netns."""

    conflist: dict[str, Any]
    pods: list[BenchPod] = field(default_factory=list)

    def add(self, name: str, labels: dict[str, str]) -> BenchPod:
        """Create netns ``name`` and exec ``cilia-cni`` ADD for it.

        Raises:
            BenchError: ADD failed (CNI error included).
        """
        pod = cni.Pod(name=name, namespace=POD_NAMESPACE, labels=labels)
        bench_pod = BenchPod(pod)
        pod.create_netns()
        self.pods.append(bench_pod)
        out = pod.add(self.conflist)
        if out.returncode != 0:
            raise BenchError(f"ADD {name} exited {out.returncode}: {out.stdout.strip()}")
        bench_pod.host_ifname = str(out.json["interfaces"][0]["name"])
        bench_pod.ifindex = int(
            pathlib.Path(f"/sys/class/net/{bench_pod.host_ifname}/ifindex").read_text()
        )
        return bench_pod

    def wait_endpoints(self, endpoints: Callable[[], dict[int, Any]], timeout: float) -> None:
        """Fill ``ep_id`` and ``identity`` of every pod from ``cilia_endpoints``.

        ``endpoints()`` returns the map (ifindex → ``EndpointInfo``).

        Raises:
            BenchError: a pod has no endpoint entry with an identity within ``timeout`` s.
        """

        def ready() -> bool:
            current = endpoints()
            return all(p.ifindex in current and current[p.ifindex].sec_identity for p in self.pods)

        if not host.wait_for(ready, timeout):
            raise BenchError("pods have no identity in cilia_endpoints (agent log: .run/agent.log)")
        current = endpoints()
        for p in self.pods:
            p.ep_id = int(current[p.ifindex].ep_id)
            p.identity = int(current[p.ifindex].sec_identity)

    def close(self) -> None:
        """DEL every pod (cached result as prevResult) and delete its netns; best effort."""
        for p in reversed(self.pods):
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                if p.pod.result is not None:
                    p.pod.delete(self.conflist)
            p.pod.destroy_netns()
        self.pods.clear()


def clear_stale_netns(prefix: str) -> None:
    """Delete netns left by an interrupted run (their veths go with them)."""
    for stale in netns.list_netns(prefix):
        netns.delete_netns(stale)


@contextlib.contextmanager
def policy_applied(operator: str, yaml_text: str, name: str) -> Iterator[None]:
    """``cilia-operator apply -f`` the policy; ``delete cnp NAME -n bench`` on exit.

    Raises:
        BenchError: apply failed (operator output included).
    """
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="cilia-bench-") as f:
        f.write(yaml_text)
        f.flush()
        out = _operator_cli("apply", "-f", f.name, "--server", operator)
    if out.returncode != 0:
        raise BenchError(f"cilia-operator apply failed: {out.stdout}{out.stderr}")
    try:
        yield
    finally:
        _operator_cli("delete", "cnp", name, "-n", POD_NAMESPACE, "--server", operator)


def load_datapath(pin_dir: pathlib.Path) -> Any:
    """The agent's datapath objects over its pinned maps (compiled here, never attached).

    Uses ``cilia_agent.datapath.loader`` with the agent's default sizes and ``pin_dir``, so
    the maps the stack's agent pinned there are the ones opened.

    Raises:
        BenchError: the object is missing (``make bpf``) or does not load.
    """
    from cilia_agent.datapath.loader import BpfUnavailable, Datapath, DatapathConfig
    from cilia_agent.datapath.objects import default_bpf_dir

    try:
        return Datapath.load(DatapathConfig(bpf_dir=default_bpf_dir(), pin_dir=pin_dir))
    except BpfUnavailable as exc:
        raise BenchError(str(exc)) from exc


def process_cpu_seconds(pid: int | None) -> float:
    """utime + stime of ``pid`` in seconds (0.0 when unknown or gone)."""
    if pid is None:
        return 0.0
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def check_same_agent(stack: Stack, pid: int | None) -> None:
    """Fail when the stack's agent is no longer process ``pid``.

    The stack under ``.run/`` is shared: ``tests/e2e`` restarts it (``down``, ``up --fresh``)
    when a session starts, which invalidates a measurement in progress.

    Raises:
        BenchError: the agent was restarted or stopped.
    """
    now = stack.pid("agent")
    if pid is None or now != pid or not pathlib.Path(f"/proc/{pid}").exists():
        raise BenchError(
            f"the stack's agent changed during the measurement (pid {pid} -> {now}): "
            "something else (tests/e2e?) restarted it; run again (or use --stack private)"
        )


def wait_listening(netns: str, port: int, timeout: float) -> None:
    """Wait until a TCP socket listens on ``port`` inside ``netns``.

    Raises:
        BenchError: nothing listens after ``timeout`` s.
    """

    def listening() -> bool:
        out = host.sh(*netns_argv(netns, "ss", "-Hltn", f"sport = :{port}"), check=False)
        return bool(out.stdout.strip())

    if not host.wait_for(listening, timeout, interval=0.05):
        raise BenchError(f"nothing listens on {netns} TCP {port} after {timeout:g}s")


def host_info() -> dict[str, Any]:
    """Kernel, CPUs, Python, load average at the time of the run."""
    return {
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "loadavg": list(os.getloadavg()),
    }


def write_results(name: str, report: dict[str, Any], results_dir: pathlib.Path) -> pathlib.Path:
    """Write ``<name>-<UTC time>.json`` and ``<name>-latest.json``; return the first path."""
    results_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    path = results_dir / f"{name}-{stamp}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    shutil.copy(path, results_dir / f"{name}-latest.json")
    return path


def rel(path: pathlib.Path) -> str:
    """``path`` relative to the repository when inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


# ---------------------------------------------------------------------------------------
# Traffic.

# Runs in the server netns: one accepted connection at a time, each byte echoed back until
# EOF (RR: one long connection; CRR: one short connection after the other).
ECHO_SERVER = r"""
import socket, sys
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", int(sys.argv[1])))
srv.listen(128)
while True:
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.settimeout(10.0)
    try:
        while True:
            data = conn.recv(1)
            if not data:
                break
            conn.send(data)
    except OSError:
        pass
    conn.close()
"""

# Runs in the client netns: argv mode (rr|crr), ip, port, seconds; prints {"count", "seconds"}.
PINGPONG_CLIENT = r"""
import json, socket, struct, sys, time
mode, ip, port, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
addr = (ip, port)
count = 0
clock = time.perf_counter
start = clock()
deadline = start + seconds
if mode == "rr":
    s = socket.socket()
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.connect(addr)
    send, recv = s.send, s.recv
    while True:
        send(b"x")
        if recv(1) != b"x":
            raise SystemExit("short read")
        count += 1
        if not count & 63 and clock() >= deadline:
            break
    s.close()
else:
    linger = struct.pack("ii", 1, 0)  # close with RST: no TIME_WAIT piling up over runs
    while True:
        s = socket.socket()
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.connect(addr)
        s.send(b"x")
        if s.recv(1) != b"x":
            raise SystemExit("short read")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
        s.close()
        count += 1
        if not count & 7 and clock() >= deadline:
            break
print(json.dumps({"count": count, "seconds": clock() - start}))
"""

# Runs in the client netns: prints "ok", "refused" or "timeout" for one TCP connect.
CONNECT_PROBE = r"""
import socket, sys
s = socket.socket()
s.settimeout(float(sys.argv[3]))
try:
    s.connect((sys.argv[1], int(sys.argv[2])))
    print("ok")
except ConnectionRefusedError:
    print("refused")
except (TimeoutError, socket.timeout):
    print("timeout")
"""


def connect_probe(client: BenchPod, ip: str, port: int, timeout: float) -> str:
    """One TCP connect from ``client``: ``ok``, ``refused`` (RST) or ``timeout`` (dropped)."""
    out = host.sh(
        *netns_argv(client.name, sys.executable, "-c", CONNECT_PROBE, ip, str(port), str(timeout)),
        check=False,
        timeout=timeout + 15,
    )
    return out.stdout.strip() or f"error: {out.stderr.strip()[-200:]}"


def iperf_stream(
    client: BenchPod, server_ip: str, port: int, seconds: int, cpu: str = ""
) -> dict[str, float]:
    """``iperf3 -c`` for ``seconds``; Gbit/s received by the server, sender retransmits.

    Raises:
        BenchError: iperf3 failed or printed no summary.
    """
    argv = netns_argv(
        client.name, "iperf3", "-c", server_ip, "-p", str(port), "-t", str(seconds), "-J", cpu=cpu
    )
    out = host.sh(*argv, check=False, timeout=seconds + 30)
    try:
        report = json.loads(out.stdout)
        end = report["end"]
        bps = float(end["sum_received"]["bits_per_second"])
    except (ValueError, KeyError) as exc:
        raise BenchError(
            f"iperf3 failed ({out.returncode}): {out.stdout[-500:]}{out.stderr}"
        ) from exc
    return {
        "gbit_per_s": round(bps / 1e9, 3),
        "retransmits": int(end.get("sum_sent", {}).get("retransmits", 0)),
    }


def pingpong(
    client: BenchPod, server_ip: str, port: int, mode: str, seconds: int, cpu: str = ""
) -> float:
    """Run the RR or CRR client for ``seconds``; transactions (or connections) per second.

    Raises:
        BenchError: the client failed.
    """
    argv = netns_argv(
        client.name,
        sys.executable,
        "-c",
        PINGPONG_CLIENT,
        mode,
        server_ip,
        str(port),
        str(seconds),
        cpu=cpu,
    )
    out = host.sh(*argv, check=False, timeout=seconds + 30)
    try:
        result = json.loads(out.stdout)
    except ValueError as exc:
        raise BenchError(f"{mode} client failed ({out.returncode}): {out.stderr[-500:]}") from exc
    return round(float(result["count"]) / float(result["seconds"]), 1)


# ---------------------------------------------------------------------------------------
# BPF attach / detach / restore and policy padding.


def attached_prog_ids(
    ifname: str, run: Callable[..., subprocess.CompletedProcess[str]] = host.sh
) -> dict[str, int]:
    """Program id of the tc bpf filter on each clsact hook of ``ifname`` (missing = absent).

    ``run(*argv, check=False)`` runs ``tc`` where the device is (default: this host's
    namespace; a cluster node's ``Node.exec`` for a device in its netns)."""
    ids: dict[str, int] = {}
    for hook in ("ingress", "egress"):
        out = run("tc", "-j", "filter", "show", "dev", ifname, hook, check=False)
        if out.returncode != 0 or not out.stdout.strip():
            continue
        for entry in json.loads(out.stdout):
            prog = entry.get("options", {}).get("prog")
            if prog:
                ids[hook] = int(prog["id"])
    return ids


def detach(ifname: str) -> None:
    """``tc qdisc del dev IFNAME clsact`` (both filters go with it).

    Raises:
        BenchError: tc failed.
    """
    out = host.sh("tc", "qdisc", "del", "dev", ifname, "clsact", check=False)
    if out.returncode != 0:
        raise BenchError(f"tc qdisc del dev {ifname} clsact: {out.stderr.strip()}")


def reattach(ifindex: int, ids: dict[str, int]) -> None:
    """Attach the programs with these ids again, as the agent's loader attaches them.

    Raises:
        BenchError: a program id no longer exists.
    """
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    from cilia_agent.datapath.libbpf import libbpf
    from cilia_agent.datapath.loader import (
        PARENT_EGRESS,
        PARENT_INGRESS,
        PROG_FROM_CONTAINER,
        PROG_TO_CONTAINER,
    )

    lib = libbpf()
    lib.bpf_prog_get_fd_by_id.argtypes = [ctypes.c_uint32]
    lib.bpf_prog_get_fd_by_id.restype = ctypes.c_int
    hooks = {
        "ingress": (PARENT_INGRESS, PROG_FROM_CONTAINER),
        "egress": (PARENT_EGRESS, PROG_TO_CONTAINER),
    }
    with IPRoute() as ipr:
        with contextlib.suppress(NetlinkError):
            ipr.tc("add", "clsact", ifindex)
        for hook, prog_id in ids.items():
            fd = lib.bpf_prog_get_fd_by_id(prog_id)
            if fd < 0:
                raise BenchError(f"BPF program id {prog_id} is gone (agent restarted?)")
            parent, name = hooks[hook]
            try:
                ipr.tc(
                    "replace-filter",
                    "bpf",
                    ifindex,
                    ":1",
                    fd=fd,
                    name=name,
                    parent=parent,
                    classid=1,
                    direct_action=True,
                )
            finally:
                os.close(fd)


def entries_of(datapath: Any, ep_id: int) -> list[Any]:
    """Keys of ``cilia_policy`` belonging to endpoint ``ep_id``."""
    return [k for k in datapath.policy_map if int(k.ep_id) == ep_id]


def pad_policy(
    datapath: Any, ep_id: int, total: int, avoid_identities: set[int], rng: random.Random
) -> list[Any]:
    """Add random ingress allow entries for ``ep_id`` until it has ``total``; return them.

    Entries: a cluster identity not in ``avoid_identities``, TCP or UDP, a random port
    (prefix 96, ``layout.policy_key``). No traffic of the bench matches them.
    """
    from cilia_agent.datapath.layout import DIR_INGRESS, PolicyValue, policy_key

    table = datapath.policy_map
    existing = {bytes(k) for k in entries_of(datapath, ep_id)}
    added: list[Any] = []
    while len(existing) < total:
        identity = rng.randint(CLUSTER_IDENTITY_MIN, CLUSTER_IDENTITY_MAX)
        if identity in avoid_identities:
            continue
        key = policy_key(
            ep_id,
            identity,
            DIR_INGRESS,
            rng.choice((IPPROTO_TCP, IPPROTO_UDP)),
            rng.randint(1, 65535),
        )
        if bytes(key) in existing:
            continue
        table[key] = PolicyValue()
        existing.add(bytes(key))
        added.append(key)
    return added


def unpad_policy(datapath: Any, keys: list[Any]) -> None:
    """Delete the entries :func:`pad_policy` added (absent is fine)."""
    table = datapath.policy_map
    for key in keys:
        with contextlib.suppress(KeyError):
            del table[key]


# ---------------------------------------------------------------------------------------
# The benchmark.

POLICY_YAML = """\
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata:
  name: {name}
  namespace: {namespace}
spec:
  endpointSelector:
    matchLabels:
      app: bench-server
  ingress:
    - fromEndpoints:
        - matchLabels:
            app: bench-client
      toPorts:
        - ports:
            - port: "{iperf_port}"
              protocol: TCP
            - port: "{rr_port}"
              protocol: TCP
"""

METRICS = (
    ("stream_gbit_per_s", "TCP stream", "Gbit/s"),
    ("rr_per_s", "TCP RR", "trans/s"),
    ("crr_per_s", "TCP CRR", "conn/s"),
)
CONFIGS = ("no-bpf", "bpf-10", "bpf-10k")


def expect_probe(client: BenchPod, server: BenchPod, args: argparse.Namespace, want: str) -> None:
    """A connect to the unallowed probe port must give ``want`` (timeout = dropped by BPF).

    Raises:
        BenchError: it did not.
    """
    got = connect_probe(client, server.ip, args.probe_port, args.probe_timeout)
    if got != want:
        attached = {p.host_ifname: attached_prog_ids(p.host_ifname) for p in (client, server)}
        raise BenchError(
            f"connect to unallowed port {args.probe_port}: expected {want}, got {got} "
            f"({'policy not enforced' if want == 'timeout' else 'BPF still attached'}; "
            f"programs now {attached}; another agent or test on this host changing the "
            "stack's pods or maps?)"
        )


class Configurations:
    """Switches the pod pair between ``no-bpf``, ``bpf-10`` and ``bpf-10k``.

    ``close()`` leaves the agent's state as found: programs attached (by their original
    ids), padding entries removed.
    """

    def __init__(
        self, datapath: Any, client: BenchPod, server: BenchPod, args: argparse.Namespace
    ) -> None:
        self.datapath = datapath
        self.client = client
        self.server = server
        self.args = args
        self.rng = random.Random(args.seed)
        self.avoid = {client.identity, server.identity}
        self.ids = {p.host_ifname: attached_prog_ids(p.host_ifname) for p in (client, server)}
        if any(set(v) != {"ingress", "egress"} for v in self.ids.values()):
            raise BenchError(f"expected both programs on both veths, found {self.ids}")
        self.attached = True
        self.small: list[Any] = []
        self.large: list[Any] = []
        self.entries: dict[str, int] = {}
        self.pad_seconds = 0.0

    def set(self, name: str) -> None:
        """Switch to configuration ``name`` and check enforcement is (not) in effect.

        Raises:
            BenchError: a check failed.
        """
        if name == "no-bpf":
            if self.attached:
                for p in (self.client, self.server):
                    detach(p.host_ifname)
                self.attached = False
            expect_probe(self.client, self.server, self.args, "refused")
            return
        self._attach()
        if not self.small:
            self.small = pad_policy(
                self.datapath, self.server.ep_id, self.args.base_entries, self.avoid, self.rng
            )
        if name == "bpf-10k" and not self.large:
            t = time.perf_counter()
            self.large = pad_policy(
                self.datapath, self.server.ep_id, self.args.entries, self.avoid, self.rng
            )
            self.pad_seconds = time.perf_counter() - t
        elif name == "bpf-10" and self.large:
            unpad_policy(self.datapath, self.large)
            self.large = []
        self.entries[name] = len(entries_of(self.datapath, self.server.ep_id))
        expect_probe(self.client, self.server, self.args, "timeout")

    def _attach(self) -> None:
        if self.attached:
            return
        for p in (self.client, self.server):
            reattach(p.ifindex, self.ids[p.host_ifname])
        self.attached = True
        now = {p.host_ifname: attached_prog_ids(p.host_ifname) for p in (self.client, self.server)}
        if now != self.ids:
            raise BenchError(f"programs not restored: before {self.ids}, after {now}")

    def close(self) -> None:
        """Re-attach the programs, remove every padding entry."""
        try:
            self._attach()
        finally:
            unpad_policy(self.datapath, self.large + self.small)
            self.large, self.small = [], []


@contextlib.contextmanager
def bpf_stats(enabled: bool) -> Iterator[None]:
    """``kernel.bpf_stats_enabled`` set to ``enabled`` meanwhile (on, the kernel counts each
    program's runs and run time: two scheduler-clock reads per run, ~80 ns on this VM), the
    earlier value restored afterwards. The run holds it off (a value left on by a killed
    run would otherwise tax every measurement); only the ``--stats-seconds`` windows turn it
    on. Stats enabled by another process through ``BPF_ENABLE_STATS`` are not visible here."""
    knob = BPF_STATS_KNOB
    before = knob.read_text().strip()
    knob.write_text("1" if enabled else "0")
    try:
        yield
    finally:
        knob.write_text(before)


def prog_stats(ids: Iterator[int] | list[int]) -> dict[str, tuple[int, int]]:
    """``{program name: (runs, run time ns)}`` of these program ids (``bpftool prog show``;
    0 while ``kernel.bpf_stats_enabled`` is off)."""
    stats: dict[str, tuple[int, int]] = {}
    for prog_id in ids:
        out = host.sh("bpftool", "-j", "prog", "show", "id", str(prog_id), check=False)
        if out.returncode != 0:
            continue
        info = json.loads(out.stdout)
        stats[info.get("name", str(prog_id))] = (
            int(info.get("run_cnt", 0)),
            int(info.get("run_time_ns", 0)),
        )
    return stats


def traffic(
    client: BenchPod, server: BenchPod, args: argparse.Namespace, metric: str, seconds: int
) -> tuple[float, dict[str, Any]]:
    """``metric``'s traffic for ``seconds``: (value, extra details such as retransmits)."""
    if metric == "stream_gbit_per_s":
        stream = iperf_stream(client, server.ip, args.iperf_port, seconds, args.client_cpu)
        return stream["gbit_per_s"], {"retransmits": stream["retransmits"]}
    mode = "rr" if metric == "rr_per_s" else "crr"
    return pingpong(client, server.ip, args.rr_port, mode, seconds, args.client_cpu), {}


def measure_one(
    stack: Stack,
    client: BenchPod,
    server: BenchPod,
    args: argparse.Namespace,
    metric: str,
    prog_ids: list[int] | None = None,
) -> tuple[float, dict[str, Any]]:
    """One measurement: (value, extra details incl. the agent's CPU seconds meanwhile and,
    with ``prog_ids`` and ``--stats-seconds``, each program's runs and ns per run).

    The value is measured with ``kernel.bpf_stats_enabled`` off: the kernel's run-time
    accounting reads the scheduler clock twice per program run, which cost ~80 ns per run on
    this project's VM (an established packet of ``cil_from_container`` under
    BPF_PROG_TEST_RUN: 160 ns without, 240 ns with), i.e. more than half of what it
    measures. The programs' costs come from a further ``--stats-seconds`` of the same
    traffic with the accounting on, right after.
    """
    agent = stack.pid("agent")
    cpu = process_cpu_seconds(agent)
    value, extra = traffic(client, server, args, metric, args.duration)
    extra["agent_cpu_s"] = round(process_cpu_seconds(agent) - cpu, 2)
    if prog_ids and args.stats_seconds and shutil.which("bpftool"):
        with bpf_stats(True):
            progs = prog_stats(prog_ids)
            traffic(client, server, args, metric, args.stats_seconds)
            after = prog_stats(prog_ids)
        for name, (runs, ns) in after.items():
            runs0, ns0 = progs.get(name, (0, 0))
            if runs > runs0:
                extra.setdefault("programs", {})[name] = {
                    "runs": runs - runs0,
                    "ns_per_run": round((ns - ns0) / (runs - runs0)),
                }
    check_same_agent(stack, agent)
    return value, extra


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Set everything up, measure every metric in every configuration, clean up.

    The configurations are interleaved per metric (no-bpf, bpf-10, bpf-10k for the stream,
    then for RR, then for CRR; ``--rounds`` times), so slow drift on a shared host hits
    them alike. Returns the report's data.
    """
    samples: dict[str, dict[str, list[float]]] = {
        c: {m: [] for m, _, _ in METRICS} for c in CONFIGS
    }
    details: dict[str, dict[str, list[dict[str, Any]]]] = {
        c: {m: [] for m, _, _ in METRICS} for c in CONFIGS
    }
    with contextlib.ExitStack() as stack:
        cilia = stack.enter_context(stack_running(args))
        print(f"stack: {describe(cilia)}", flush=True)
        print("compiling the datapath in this process to reach the pinned maps ...", flush=True)
        datapath = load_datapath(cilia.pin_dir)
        stack.callback(datapath.close)
        pods = PodSet(cni.load_conflist(cilia.conflist))
        stack.callback(pods.close)
        client = pods.add(f"{NETNS_PREFIX}client", {"app": "bench-client"})
        server = pods.add(f"{NETNS_PREFIX}server", {"app": "bench-server"})
        pods.wait_endpoints(datapath.endpoints, args.policy_wait)
        print(
            f"pods: client {client.ip} ({client.host_ifname}, identity {client.identity}), "
            f"server {server.ip} ({server.host_ifname}, endpoint {server.ep_id})",
            flush=True,
        )
        stack.enter_context(
            policy_applied(
                cilia.operator,
                POLICY_YAML.format(
                    name=POLICY_NAME,
                    namespace=POD_NAMESPACE,
                    iperf_port=args.iperf_port,
                    rr_port=args.rr_port,
                ),
                POLICY_NAME,
            )
        )

        def enforced() -> bool:
            info = datapath.endpoints().get(server.ifindex)
            allowed = {int(k.sec_label) for k in entries_of(datapath, server.ep_id)}
            return bool(info and info.enforce_ingress and client.identity in allowed)

        if not host.wait_for(enforced, args.policy_wait):
            raise BenchError("the policy was not written for the server endpoint in time")
        from_agent = len(entries_of(datapath, server.ep_id))

        for argv, port in (
            (["iperf3", "-s", "-p", str(args.iperf_port)], args.iperf_port),
            ([sys.executable, "-c", ECHO_SERVER, str(args.rr_port)], args.rr_port),
        ):
            proc = subprocess.Popen(
                netns_argv(server.name, *argv, cpu=args.server_cpu),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            stack.callback(proc.wait)
            stack.callback(proc.kill)
            wait_listening(server.name, port, args.ready_timeout)

        configs = Configurations(datapath, client, server, args)
        stack.callback(configs.close)
        prog_ids = sorted({i for ids in configs.ids.values() for i in ids.values()})
        if BPF_STATS_KNOB.exists():
            stack.enter_context(bpf_stats(False))
        if args.warmup and any(m == "crr_per_s" for m, _, _ in selected_metrics(args)):
            # Short connections between the same two pods reuse the client's ports within
            # seconds, and a reused tuple's conntrack entries are reset in place: after a
            # warm-up the measurement sees the steady state, not the first insert of each
            # tuple into a fresh map.
            configs.set("bpf-10")
            rate = pingpong(client, server.ip, args.rr_port, "crr", args.warmup, args.client_cpu)
            print(f"  warm-up   TCP CRR    bpf-10   {rate:>10.2f} conn/s", flush=True)
        for round_no in range(args.rounds):
            for metric, title, unit in selected_metrics(args):
                for config in CONFIGS:
                    configs.set(config)
                    value, extra = measure_one(
                        cilia,
                        client,
                        server,
                        args,
                        metric,
                        None if config == "no-bpf" else prog_ids,
                    )
                    samples[config][metric].append(value)
                    details[config][metric].append(extra)
                    print(
                        f"  round {round_no + 1} {title:<10} {config:<8} {value:>10.2f} {unit:<8}"
                        f" agent CPU {extra['agent_cpu_s']:.1f} s"
                        + "".join(
                            f"  {n} {v['ns_per_run']} ns/run"
                            for n, v in extra.get("programs", {}).items()
                        ),
                        flush=True,
                    )
        configs.close()
    return {
        "samples": samples,
        "details": details,
        "policy_entries": {"from_agent": from_agent, **configs.entries},
        "padding_write_seconds": round(configs.pad_seconds, 2),
        "stack": {"kind": cilia.kind, "started_by_bench": cilia.started},
    }


def selected_metrics(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """The METRICS rows ``--metrics`` names (all by default)."""
    wanted = {m.strip() for m in args.metrics.split(",") if m.strip()}
    return [row for row in METRICS if row[0].split("_")[0] in wanted]


def paired_ratios(
    samples: dict[str, dict[str, list[float]]], over: str, under: str
) -> dict[str, dict[str, float | None]]:
    """Per metric, the ratio ``over / under`` of each round's pair (measured back to back,
    so host load hits both alike): median, min and max over the rounds."""
    out: dict[str, dict[str, float | None]] = {}
    for m, values in samples[over].items():
        pairs = [a / b for a, b in zip(values, samples[under][m], strict=True) if b]
        out[m] = {
            "median": round(statistics.median(pairs), 3) if pairs else None,
            "min": round(min(pairs), 3) if pairs else None,
            "max": round(max(pairs), 3) if pairs else None,
        }
    return out


def ratio(a: float, b: float) -> float | None:
    """a / b rounded, or None when b is 0."""
    return round(a / b, 3) if b else None


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return 0 on success, 1 when it could not run."""
    parser = argparse.ArgumentParser(
        prog="python -m bench datapath",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--duration",
        type=int,
        default=DEFAULT_DURATION_SECONDS,
        help=f"seconds per measurement (default {DEFAULT_DURATION_SECONDS})",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=DEFAULT_ROUNDS,
        help=f"measurements per metric and configuration; the median is reported (default {DEFAULT_ROUNDS})",
    )
    parser.add_argument(
        "--entries",
        type=int,
        default=DEFAULT_ENTRIES,
        help=f"server policy entries, large configuration (default {DEFAULT_ENTRIES})",
    )
    parser.add_argument(
        "--base-entries",
        type=int,
        default=DEFAULT_BASE_ENTRIES,
        help=f"server policy entries, small configuration (default {DEFAULT_BASE_ENTRIES})",
    )
    parser.add_argument(
        "--iperf-port",
        type=int,
        default=DEFAULT_IPERF_PORT,
        help=f"iperf3 server port (default {DEFAULT_IPERF_PORT})",
    )
    parser.add_argument(
        "--rr-port",
        type=int,
        default=DEFAULT_RR_PORT,
        help=f"RR/CRR echo server port (default {DEFAULT_RR_PORT})",
    )
    parser.add_argument(
        "--probe-port",
        type=int,
        default=DEFAULT_PROBE_PORT,
        help=f"unallowed port probed to check enforcement (default {DEFAULT_PROBE_PORT})",
    )
    parser.add_argument(
        "--probe-timeout",
        type=float,
        default=DEFAULT_PROBE_TIMEOUT_SECONDS,
        help=f"seconds a dropped probe connect waits (default {DEFAULT_PROBE_TIMEOUT_SECONDS:g})",
    )
    parser.add_argument(
        "--policy-wait",
        type=float,
        default=DEFAULT_POLICY_WAIT_SECONDS,
        help=f"seconds for identities and policy to reach the maps (default {DEFAULT_POLICY_WAIT_SECONDS:g})",
    )
    parser.add_argument(
        "--ready-timeout",
        type=float,
        default=DEFAULT_READY_TIMEOUT_SECONDS,
        help=f"seconds for the servers to listen (default {DEFAULT_READY_TIMEOUT_SECONDS:g})",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=DEFAULT_SEED,
        help=f"padding entries' RNG seed (default {DEFAULT_SEED})",
    )
    parser.add_argument(
        "--results-dir",
        type=pathlib.Path,
        default=DEFAULT_RESULTS_DIR,
        help="where the JSON goes (default bench/results)",
    )
    parser.add_argument(
        "--metrics",
        default="stream,rr,crr",
        help="which of stream, rr, crr to measure, comma-separated (default all three)",
    )
    parser.add_argument(
        "--stats-seconds",
        type=int,
        default=DEFAULT_STATS_SECONDS,
        help="seconds of further traffic after each BPF measurement, with "
        "kernel.bpf_stats_enabled on, for each program's ns per run (default "
        f"{DEFAULT_STATS_SECONDS}; 0: none). The measured value itself is taken with it off",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=DEFAULT_WARMUP_SECONDS,
        help="seconds of CRR traffic with the programs attached before the first round, "
        f"not measured (default {DEFAULT_WARMUP_SECONDS}; 0: none)",
    )
    for end in ("client", "server"):
        parser.add_argument(
            f"--{end}-cpu",
            default="",
            metavar="CPUS",
            help=f"bind the {end} end to these CPUs (a taskset -c list, e.g. 0; netperf's -T); "
            "default: unbound",
        )
    add_stack_flags(parser)
    args = parser.parse_args(argv)
    if not selected_metrics(args):
        parser.error("--metrics must name at least one of stream, rr, crr")
    if args.duration < 1 or args.rounds < 1 or not 1 <= args.base_entries <= args.entries:
        parser.error("--duration and --rounds must be >= 1 and 1 <= --base-entries <= --entries")
    if args.warmup < 0 or args.stats_seconds < 0:
        parser.error("--warmup and --stats-seconds must be >= 0")
    if os.geteuid() != 0:
        print("the datapath benchmark needs root (netns, tc, bpf)", file=sys.stderr)
        return 1
    if shutil.which("iperf3") is None:
        print("iperf3 not found: apt-get install iperf3 (scripts/setup.sh)", file=sys.stderr)
        return 1
    clear_stale_netns(NETNS_PREFIX)
    started = time.perf_counter()
    try:
        out = run(args)
    except (BenchError, cni.CniRunError, OSError, subprocess.SubprocessError) as exc:
        print(f"\nbenchmark failed: {exc}", file=sys.stderr)
        return 1
    metrics = selected_metrics(args)
    samples = {c: {m: v for m, v in out["samples"][c].items() if v} for c in CONFIGS}
    med = {c: {m: statistics.median(v) for m, v in samples[c].items()} for c in CONFIGS}
    ratios = {
        m: {
            "bpf_over_nobpf": ratio(med["bpf-10"][m], med["no-bpf"][m]),
            "10k_over_10": ratio(med["bpf-10k"][m], med["bpf-10"][m]),
        }
        for m, _, _ in metrics
    }
    paired = {
        "bpf_over_nobpf": paired_ratios(samples, "bpf-10", "no-bpf"),
        "10k_over_10": paired_ratios(samples, "bpf-10k", "bpf-10"),
    }
    n_small = out["policy_entries"].get("bpf-10", args.base_entries)
    n_large = out["policy_entries"].get("bpf-10k", args.entries)
    head = (
        f"{'metric':<12} {'unit':<8} {'no BPF':>10} {f'BPF {n_small}':>10} "
        f"{f'BPF {n_large}':>11} {'BPF/noBPF':>10} {f'{n_large}/{n_small}':>11}"
    )
    print()
    print(
        f"pod→pod, {args.duration} s per measurement, median of {args.rounds} round(s); "
        f"BPF N = programs attached, N policy entries on the server endpoint "
        f"({out['policy_entries']['from_agent']} written by the agent)"
    )
    print(head)
    print("-" * len(head))
    for m, title, unit in metrics:
        r = ratios[m]
        print(
            f"{title:<12} {unit:<8} {med['no-bpf'][m]:>10.2f} {med['bpf-10'][m]:>10.2f} "
            f"{med['bpf-10k'][m]:>11.2f} {r['bpf_over_nobpf'] or 0:>9.3f}x "
            f"{r['10k_over_10'] or 0:>10.3f}x"
        )
    print("\nper-round ratios (each round's pair back to back), median [min-max]:")
    for m, title, _unit in metrics:
        a, b = paired["bpf_over_nobpf"][m], paired["10k_over_10"][m]
        cpu = [d["agent_cpu_s"] for d in out["details"]["bpf-10"][m]]
        print(
            f"{title:<12} BPF/noBPF {a['median']}x [{a['min']}-{a['max']}]   "
            f"{n_large}/{n_small} {b['median']}x [{b['min']}-{b['max']}]   "
            f"agent CPU s per measurement (BPF {n_small}): {cpu}"
        )
    report = {
        "benchmark": "datapath",
        "time": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "host": host_info(),
        "parameters": {
            k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()
        },
        "wall_seconds": round(time.perf_counter() - started, 1),
        "median": med,
        "ratios": ratios,
        "paired_ratios": paired,
        **out,
    }
    path = write_results("datapath", report, args.results_dir)
    print(f"\nwrote {rel(path)} ({report['wall_seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
