"""The unmodified upstream ``hubble`` CLI (v1.19, built by ``scripts/hubble-cli.sh``) against a
real 2-node cluster: through cilia-relay and straight at one agent's Hubble socket (issue 14).

Cluster (:class:`cilia_testkit.cluster.Cluster`, native routing), pods in Kubernetes namespace
:data:`NS`, plumbed by the real ``cilia-cni``; each serves TCP :data:`PORT`:

    node-a: frontend (app=frontend), other (app=other)      node-b: backend (app=backend)

A CiliumNetworkPolicy lets only ``app=frontend`` into ``app=backend`` on TCP :data:`PORT`, so
frontend → backend connects (FORWARDED on both nodes) and other → backend is dropped by node-b's
datapath (DROPPED, POLICY_DENIED). frontend also pings other (ICMP, same node, no policy).
Every assertion reads flows of that traffic as the CLI prints them: verdicts, pod names, node
names, ports and protocols, in the output formats ``-o json|jsonpb|compact|table``.

Traffic happens in two rounds (:class:`Rounds`); round 1's time window is what ``--since`` /
``--until`` are checked against. Tests run in file order on one module-scoped cluster, once
with Hubble over TLS as the Deckhouse module runs it (relay <-> agents mutual TLS, the CLI to
the relay and to an agent's TCP listener over TLS; the agents' unix sockets stay plaintext)
and once in plaintext.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import queue
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import traffic

from cilia_testkit import VENV_BIN, cni, probe, skips
from cilia_testkit.cluster import HUBBLE_PORT, Cluster
from cilia_testkit.host import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

REPO = pathlib.Path(__file__).resolve().parents[2]
NS = "shop"
PORT = 8080
POLICY = "backend-allow-frontend"
#: Seconds one ``hubble`` command may take (a non-follow observe ends by itself).
HUBBLE_TIMEOUT_SECONDS = 30.0
#: Seconds to wait for the policy to be enforced / for flows to reach the ring.
POLICY_WAIT_SECONDS = 20.0
FLOWS_WAIT_SECONDS = 15.0
#: A blocked TCP connect counts as blocked after this long (a dropped SYN is resent after 1 s).
BLOCKED_TIMEOUT_SECONDS = 1.5
#: Seconds a ``--follow`` client waits for the flow of traffic made after it started.
FOLLOW_WAIT_SECONDS = 15.0
#: Pause between traffic rounds, so round windows never share a timestamp.
ROUND_GAP_SECONDS = 0.5
#: The relay re-dials a failed peer after this long (its --retry-timeout).
RELAY_RETRY_SECONDS = 1.0
#: Seconds for the relay to report a refused / recovered peer.
PEER_STATE_WAIT_SECONDS = 20.0
#: A name on the relay's server certificate (``*.hubble-relay.cilium.io``).
RELAY_TLS_NAME = "ui.hubble-relay.cilium.io"


def hubble_binary() -> pathlib.Path:
    """The upstream CLI ``scripts/hubble-cli.sh`` built (skip — in CI fail — when missing)."""
    out = subprocess.run(
        [str(REPO / "scripts" / "hubble-cli.sh"), "--path"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    path = pathlib.Path(out.stdout.strip())
    if not os.access(path, os.X_OK):
        skips.unsupported(
            f"the upstream hubble CLI is not built at {path}: run scripts/hubble-cli.sh "
            "(make test-setup runs it)"
        )
    return path


def rfc3339(ns: int) -> str:
    """``2026-12-01T18:40:00.123456789Z`` for nanoseconds since the epoch (``--since``)."""
    seconds, nanos = divmod(ns, 1_000_000_000)
    stamp = datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC)
    return stamp.strftime("%Y-%m-%dT%H:%M:%S") + f".{nanos:09d}Z"


def flow_time_ns(flow: Mapping[str, Any]) -> int:
    """Nanoseconds since the epoch of a JSON flow's ``time`` (RFC 3339, ns precision)."""
    stamp = str(flow["time"])
    main, _, frac = stamp.rstrip("Z").partition(".")
    seconds = int(
        datetime.datetime.strptime(main, "%Y-%m-%dT%H:%M:%S")
        .replace(tzinfo=datetime.UTC)
        .timestamp()
    )
    return seconds * 1_000_000_000 + int((frac or "0").ljust(9, "0")[:9])


@dataclasses.dataclass
class Rounds:
    """Wall-clock windows (ns) of the traffic rounds: ``[(start, end), ...]``."""

    windows: list[tuple[int, int]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class World:
    """The cluster, its pods by short name, their servers, the CLI and the traffic rounds."""

    cluster: Cluster
    hubble: pathlib.Path
    pods: dict[str, cni.Pod]
    servers: list[subprocess.Popen[str]]
    rounds: Rounds
    tls: bool = False

    @property
    def relay(self) -> str:
        return self.cluster.relay_address

    def agent(self, node: str) -> str:
        """``unix://…`` of ``node``'s Hubble socket (what ``--server`` takes)."""
        return f"unix://{self.cluster.node(node).agent.hubble_socket}"

    def pod_name(self, short: str) -> str:
        return self.pods[short].name

    def ns_pod(self, short: str) -> str:
        """``namespace/pod`` as ``--from-pod`` takes it."""
        return f"{NS}/{self.pod_name(short)}"

    def run(
        self, *argv: str, timeout: float = HUBBLE_TIMEOUT_SECONDS
    ) -> subprocess.CompletedProcess[str]:
        """``hubble ARGV`` with a config-free environment; with :attr:`tls`, a ``--server``
        that is not a unix socket gets the TLS flags (the relay's CA and name; an agent's
        name and the relay's client pair, which its Hubble server accepts)."""
        return subprocess.run(
            [str(self.hubble), *argv, *self.tls_flags(argv)],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env={**os.environ, "HUBBLE_CONFIG": "/dev/null", "NO_COLOR": "1"},
        )

    def tls_flags(self, argv: tuple[str, ...]) -> list[str]:
        """The ``--tls*`` flags for the ``--server`` in ``argv`` ([] without TLS)."""
        if not self.tls or "--server" not in argv:
            return []
        server = argv[argv.index("--server") + 1]
        if server.startswith("unix"):
            return []
        d = self.cluster.stack.tls_dir
        flags = ["--tls", "--tls-ca-cert-files", str(d / "ca.crt")]
        if server == self.relay:
            return [*flags, "--tls-server-name", RELAY_TLS_NAME]
        node = next(n for n in self.cluster.nodes.values() if server.startswith(n.address + ":"))
        return [*flags, "--tls-server-name", f"{node.name}.default.hubble-grpc.cilium.io",
                "--tls-client-cert-file", str(d / "hubble-relay-client.crt"),
                "--tls-client-key-file", str(d / "hubble-relay-client.key")]  # fmt: skip

    def observe(self, server: str, *argv: str, output: str = "jsonpb") -> list[dict[str, Any]]:
        """``hubble observe --server SERVER ARGV -o OUTPUT`` (json/jsonpb): the flows printed.

        Raises:
            AssertionError: the command failed or printed a line that is not a response.
        """
        out = self.run("observe", "--server", server, *argv, "-o", output)
        assert out.returncode == 0, f"hubble observe {argv}: {out.stderr}"
        flows: list[dict[str, Any]] = []
        for line in out.stdout.splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            if "flow" in record:
                flows.append(record["flow"])
        return flows

    def tcp_ok(self, src: str, dst: str) -> bool:
        result = probe.check_from(
            self.pods[src].name,
            f"tcp:{self.pods[dst].ip}:{PORT}",
            timeout=BLOCKED_TIMEOUT_SECONDS,
        )[0]
        return result.ok and result.detail == probe.greeting(self.pods[dst].name, PORT)

    def ping_ok(self, src: str, dst: str) -> bool:
        result = probe.check_from(self.pods[src].name, f"icmp:{self.pods[dst].ip}")[0]
        return result.ok

    def traffic_round(self) -> None:
        """One round: frontend→backend TCP (allowed), other→backend TCP (dropped), a ping
        frontend→other; its window is appended to :attr:`rounds`."""
        start = time.time_ns()
        assert self.tcp_ok("frontend", "backend"), self.cluster.logs(30)
        assert not self.tcp_ok("other", "backend"), "the policy must drop other -> backend"
        assert self.ping_ok("frontend", "other")
        self.rounds.windows.append((start, time.time_ns()))
        time.sleep(ROUND_GAP_SECONDS)


def _policy() -> dict[str, Any]:
    return traffic.backend_from_frontend(POLICY, NS, PORT)


@pytest.fixture(scope="module", params=["tls", "plaintext"])
def world(request: pytest.FixtureRequest, cluster: Any) -> Iterator[World]:
    binary = hubble_binary()
    tls = request.param == "tls"
    c: Cluster = cluster(
        nodes=2, routing="native", name=f"e2e-hubble-cli-{request.param}", hubble_tls=tls,
        relay_args=("--retry-timeout", f"{RELAY_RETRY_SECONDS}s"),
    )  # fmt: skip
    w = World(c, binary, {}, [], Rounds(), tls=tls)
    try:
        for node, short, app in (
            ("node-a", "frontend", "frontend"),
            ("node-a", "other", "other"),
            ("node-b", "backend", "backend"),
        ):
            pod = c.add_pod(node, f"hub-{short}", {"app": app}, namespace=NS)
            w.pods[short] = pod
            w.servers.append(probe.start_server(pod.name, pod.name, (PORT,)))
        applied = subprocess.run(
            [str(VENV_BIN / "cilia-operator"), "apply", "-f", "-", "--server", c.operator_address],
            input=json.dumps(_policy()),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert applied.returncode == 0, applied.stderr
        enforced = wait_for(
            lambda: w.tcp_ok("frontend", "backend") and not w.tcp_ok("other", "backend"),
            POLICY_WAIT_SECONDS,
        )
        assert enforced, c.logs(30)
        time.sleep(ROUND_GAP_SECONDS)
        w.traffic_round()
        w.traffic_round()
        yield w
    finally:
        for server in w.servers:
            probe.stop(server)
        c.stop()


def _src(flow: Mapping[str, Any]) -> str:
    return str(flow.get("source", {}).get("pod_name", ""))


def _dst(flow: Mapping[str, Any]) -> str:
    return str(flow.get("destination", {}).get("pod_name", ""))


def _ports(flow: Mapping[str, Any]) -> set[int]:
    l4 = flow.get("l4", {})
    tcp = l4.get("TCP") or l4.get("UDP") or {}
    return {int(tcp.get("source_port", 0)), int(tcp.get("destination_port", 0))}


def _in_round(w: World, flows: list[dict[str, Any]], index: int) -> list[dict[str, Any]]:
    start, end = w.rounds.windows[index]
    return [f for f in flows if start <= flow_time_ns(f) <= end]


# -- status and nodes ---------------------------------------------------------------------


def test_status_is_healthy_against_the_relay_and_counts_both_nodes(world: World) -> None:
    out = world.run("status", "--server", world.relay)
    assert out.returncode == 0, out.stderr
    assert f"Healthcheck (via {world.relay}): Ok" in out.stdout, out.stdout
    assert "Connected Nodes: 2/2" in out.stdout, out.stdout
    status = json.loads(world.run("status", "--server", world.relay, "-o", "json").stdout)
    assert int(status["num_flows"]) > 0 and int(status["max_flows"]) == 2 * 4095, status
    assert int(status["seen_flows"]) >= int(status["num_flows"]), status
    assert status["version"].startswith("cilia-relay"), status


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_status_is_healthy_against_an_agent(world: World, transport: str) -> None:
    """Through the agent's Hubble socket and its ``<node address>:4244`` listener."""
    node = world.cluster.node("node-b")
    server = world.agent("node-b") if transport == "unix" else f"{node.address}:{HUBBLE_PORT}"
    out = world.run("status", "--server", server)
    assert out.returncode == 0, out.stderr
    assert f"Healthcheck (via {server}): Ok" in out.stdout, out.stdout
    assert "Current/Max Flows: " in out.stdout and "/4,095" in out.stdout, out.stdout
    assert "Connected Nodes" not in out.stdout, "an agent reports no node counts (upstream)"
    status = json.loads(world.run("status", "--server", server, "-o", "json").stdout)
    assert int(status["num_flows"]) > 0 and int(status["max_flows"]) == 4095, status
    assert int(status["uptime_ns"]) > 0, status


def test_list_nodes_through_the_relay_shows_both_nodes_connected(world: World) -> None:
    out = world.run("list", "nodes", "--server", world.relay, "-o", "json")
    assert out.returncode == 0, out.stderr
    nodes = {n["name"]: n for n in json.loads(out.stdout)}
    assert sorted(nodes) == ["node-a", "node-b"], out.stdout
    for node in nodes.values():
        assert node["state"] == "NODE_CONNECTED", node
        assert int(node["num_flows"]) > 0 and int(node["max_flows"]) == 4095, node
    table = world.run("list", "nodes", "--server", world.relay)
    assert table.returncode == 0, table.stderr
    rows = [line.split() for line in table.stdout.splitlines()[1:]]
    assert sorted((r[0], r[1]) for r in rows) == [
        ("node-a", "Connected"),
        ("node-b", "Connected"),
    ], table.stdout


def test_list_nodes_against_an_agent_shows_that_node(world: World) -> None:
    out = world.run("list", "nodes", "--server", world.agent("node-a"), "-o", "json")
    assert out.returncode == 0, out.stderr
    nodes = json.loads(out.stdout)
    assert [(n["name"], n["state"]) for n in nodes] == [("node-a", "NODE_CONNECTED")], nodes


def test_list_namespaces_shows_the_pods_namespace(world: World) -> None:
    for server in (world.relay, world.agent("node-b")):
        out = world.run("list", "namespaces", "--server", server, "-o", "json")
        assert out.returncode == 0, out.stderr
        assert [n["namespace"] for n in json.loads(out.stdout)] == [NS], out.stdout


# -- observe: verdicts, pods, labels ------------------------------------------------------


def test_verdict_dropped_shows_other_to_backend_dropped_by_policy_at_node_b(world: World) -> None:
    w = world
    since = rfc3339(w.rounds.windows[0][0])
    drops = w.observe(w.relay, "--since", since, "--verdict", "DROPPED")
    assert drops, "no DROPPED flow through the relay"
    assert {f["verdict"] for f in drops} == {"DROPPED"}
    ours = [f for f in drops if _src(f) == w.pod_name("other") and _dst(f) == w.pod_name("backend")]
    assert len(_in_round(w, ours, 0)) >= 1 and len(_in_round(w, ours, 1)) >= 1, drops
    for f in ours:
        assert f["node_name"] == "node-b", f
        assert f["drop_reason_desc"] == "POLICY_DENIED", f
        assert f["traffic_direction"] == "INGRESS", f
        assert f["source"]["namespace"] == NS and f["destination"]["namespace"] == NS, f
        assert f["l4"]["TCP"]["destination_port"] == PORT, f
    assert not [f for f in drops if _src(f) == w.pod_name("frontend")], drops


def test_from_pod_to_pod_with_forwarded_shows_frontend_to_backend_on_both_nodes(
    world: World,
) -> None:
    w = world
    since = rfc3339(w.rounds.windows[0][0])
    flows = w.observe(
        w.relay,
        "--since", since,
        "--verdict", "FORWARDED",
        "--from-pod", w.ns_pod("frontend"),
        "--to-pod", w.ns_pod("backend"),
    )  # fmt: skip
    assert flows
    assert {(_src(f), _dst(f)) for f in flows} == {(w.pod_name("frontend"), w.pod_name("backend"))}
    assert {f["verdict"] for f in flows} == {"FORWARDED"}
    # leaves node-a (egress from frontend) and enters node-b (ingress to backend)
    assert {(f["node_name"], f["traffic_direction"]) for f in flows} >= {
        ("node-a", "EGRESS"),
        ("node-b", "INGRESS"),
    }, flows
    # the reverse direction selects the replies only
    back = w.observe(
        w.relay,
        "--since", since,
        "--from-pod", w.ns_pod("backend"),
        "--to-pod", w.ns_pod("frontend"),
    )  # fmt: skip
    assert back and all(f.get("is_reply") is True for f in back), back


@pytest.mark.parametrize("prefix", ["", "k8s:"])
def test_from_and_to_label_select_the_labelled_pods(world: World, prefix: str) -> None:
    w = world
    since = rfc3339(w.rounds.windows[0][0])
    from_other = w.observe(w.relay, "--since", since, "--from-label", f"{prefix}app=other")
    assert from_other
    assert {_src(f) for f in from_other} == {w.pod_name("other")}, from_other
    assert all("k8s:app=other" in f["source"]["labels"] for f in from_other)
    verdicts = {(_dst(f), f["verdict"]) for f in from_other}
    assert (w.pod_name("backend"), "DROPPED") in verdicts, verdicts
    to_backend = w.observe(
        w.relay, "--since", since, "--to-label", f"{prefix}app=backend", "--verdict", "DROPPED"
    )
    assert to_backend and {_dst(f) for f in to_backend} == {w.pod_name("backend")}
    assert {_src(f) for f in to_backend} == {w.pod_name("other")}, to_backend
    # a label no pod has selects nothing
    assert w.observe(w.relay, "--since", since, "--from-label", f"{prefix}app=nobody") == []


# -- observe: ports, protocols, types, nodes ----------------------------------------------


def test_port_and_protocol_filters(world: World) -> None:
    w = world
    since = rfc3339(w.rounds.windows[0][0])
    tcp = w.observe(w.relay, "--since", since, "--port", str(PORT), "--protocol", "tcp")
    assert tcp and all("TCP" in f["l4"] and PORT in _ports(f) for f in tcp), tcp
    assert {f["verdict"] for f in tcp} == {"FORWARDED", "DROPPED"}
    icmp = w.observe(
        w.relay, "--since", since, "--protocol", "icmp", "--from-pod", w.ns_pod("frontend")
    )
    assert icmp and all("ICMPv4" in f["l4"] for f in icmp), icmp
    assert {_dst(f) for f in icmp} == {w.pod_name("other")}, icmp
    assert {f["Summary"] for f in icmp} == {"ICMPv4 EchoRequest"}, icmp
    assert w.observe(w.relay, "--since", since, "--port", "9") == []


def test_type_drop_and_trace(world: World) -> None:
    w = world
    since = rfc3339(w.rounds.windows[0][0])
    drops = w.observe(w.relay, "--since", since, "--type", "drop")
    assert drops and {f["verdict"] for f in drops} == {"DROPPED"}, drops
    assert {f["event_type"]["type"] for f in drops} == {1}
    traces = w.observe(w.relay, "--since", since, "--type", "trace")
    assert traces and {f["verdict"] for f in traces} == {"FORWARDED"}, traces
    assert {f["event_type"]["type"] for f in traces} == {4}


def test_node_name_selects_one_nodes_flows(world: World) -> None:
    w = world
    since = rfc3339(w.rounds.windows[0][0])
    at_b = w.observe(w.relay, "--since", since, "--node-name", "node-b")
    assert at_b and {f["node_name"] for f in at_b} == {"node-b"}
    assert {f["verdict"] for f in at_b} == {"FORWARDED", "DROPPED"}
    at_a = w.observe(w.relay, "--since", since, "--node-name", "node-a")
    assert at_a and {f["node_name"] for f in at_a} == {"node-a"}
    assert "DROPPED" not in {f["verdict"] for f in at_a}, at_a


# -- observe: --last, --since/--until, --follow ---------------------------------------------


def test_last_returns_the_newest_matching_flows(world: World) -> None:
    w = world
    every = w.observe(w.agent("node-b"), "--since", rfc3339(w.rounds.windows[0][0]),
                      "--verdict", "DROPPED")  # fmt: skip
    assert len(every) >= 2, every
    last2 = w.observe(w.agent("node-b"), "--last", "2", "--verdict", "DROPPED")
    assert [flow_time_ns(f) for f in last2] == [flow_time_ns(f) for f in every[-2:]], last2
    # through the relay each node answers its own newest 2: only node-b has drops
    relayed = w.observe(w.relay, "--last", "2", "--verdict", "DROPPED")
    assert [flow_time_ns(f) for f in relayed] == [flow_time_ns(f) for f in every[-2:]], relayed


def test_since_and_until_bound_the_flows_to_a_time_window(world: World) -> None:
    w = world
    (start0, end0), (start1, _) = w.rounds.windows
    for server in (w.relay, w.agent("node-b")):
        first = w.observe(server, "--since", rfc3339(start0), "--until", rfc3339(end0))
        assert first, server
        assert all(start0 <= flow_time_ns(f) <= end0 for f in first), first
        assert "DROPPED" in {f["verdict"] for f in first}
        later = w.observe(server, "--since", rfc3339(start1))
        assert later and all(flow_time_ns(f) >= start1 for f in later), later


class _Lines:
    """Lines of a running process's stdout, read by a thread."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.queue: queue.Queue[str] = queue.Queue()
        self.proc = proc
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.queue.put(line)

    def wait_flow(self, predicate: Any, timeout: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.queue.get(timeout=left)
            except queue.Empty:
                return None
            record = json.loads(line) if line.strip() else {}
            if "flow" in record and predicate(record["flow"]):
                return dict(record["flow"])
        return None


@pytest.mark.parametrize("target", ["relay", "agent"])
def test_follow_streams_the_drop_of_traffic_made_after_it_started(
    world: World, target: str
) -> None:
    w = world
    server = w.relay if target == "relay" else w.agent("node-b")
    argv = ("observe", "--server", server, "--follow", "--verdict", "DROPPED",
            "--from-pod", w.ns_pod("other"), "-o", "jsonpb")  # fmt: skip
    proc = subprocess.Popen(
        [str(w.hubble), *argv, *w.tls_flags(argv)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HUBBLE_CONFIG": "/dev/null"},
    )  # fmt: skip
    try:
        lines = _Lines(proc)
        time.sleep(1.0)  # the client is connected and has sent its request
        started = time.time_ns()
        assert not w.tcp_ok("other", "backend")
        flow = lines.wait_flow(lambda f: flow_time_ns(f) >= started, FOLLOW_WAIT_SECONDS)
        assert flow is not None, f"no new drop followed; stderr: {proc.stderr}"
        assert (_src(flow), _dst(flow), flow["node_name"]) == (
            w.pod_name("other"),
            w.pod_name("backend"),
            "node-b",
        ), flow
        assert proc.poll() is None, "a --follow client keeps running"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# -- output formats and --print-node-name ---------------------------------------------------


def test_output_formats_print_the_same_drop(world: World) -> None:
    w = world
    start, end = w.rounds.windows[0]
    window = ["--since", rfc3339(start), "--until", rfc3339(end), "--verdict", "DROPPED",
              "--from-pod", w.ns_pod("other")]  # fmt: skip
    as_json = w.observe(w.relay, *window, output="json")
    as_jsonpb = w.observe(w.relay, *window, output="jsonpb")
    assert as_json and as_json == as_jsonpb
    count = len(as_jsonpb)
    other, backend = w.ns_pod("other"), w.ns_pod("backend")

    compact = w.run("observe", "--server", w.relay, *window, "-o", "compact", "--print-node-name")
    assert compact.returncode == 0, compact.stderr
    lines = [ln for ln in compact.stdout.splitlines() if ln.strip()]
    assert len(lines) == count, compact.stdout
    for line in lines:
        assert " [node-b]: " in line and f"{other}:" in line, line
        assert f"{backend}:{PORT}" in line and line.endswith("DROPPED (TCP Flags: SYN)"), line

    table = w.run("observe", "--server", w.relay, *window, "-o", "table", "--print-node-name")
    assert table.returncode == 0, table.stderr
    header, *rows = [ln for ln in table.stdout.splitlines() if ln.strip()]
    assert header.split() == ["TIMESTAMP", "NODE", "SOURCE", "DESTINATION", "TYPE", "VERDICT",
                              "SUMMARY"], header  # fmt: skip
    assert len(rows) == count, table.stdout
    for row in rows:
        cells = row.split()
        assert "node-b" in cells and "DROPPED" in cells, row
        assert any(c.startswith(f"{other}:") for c in cells), row
        assert f"{backend}:{PORT}" in cells, row

    plain = w.run("observe", "--server", w.relay, *window, "-o", "compact")
    assert plain.returncode == 0 and "[node-b]" not in plain.stdout, plain.stdout


def test_agent_events_from_an_agent_and_unimplemented_on_the_relay(world: World) -> None:
    w = world
    out = w.run("observe", "agent-events", "--server", w.agent("node-a"), "--last", "10",
                "-o", "jsonpb")  # fmt: skip
    assert out.returncode == 0, out.stderr
    events = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    assert [e["agent_event"]["type"] for e in events][:1] == ["AGENT_STARTED"], events
    assert {e["node_name"] for e in events} == {"node-a"}
    debug = w.run("observe", "debug-events", "--server", w.agent("node-a"), "--last", "10")
    assert debug.returncode == 0 and debug.stdout.strip() == "", debug.stdout + debug.stderr
    relayed = w.run("observe", "agent-events", "--server", w.relay, "--last", "10")
    assert relayed.returncode != 0 and "Unimplemented" in relayed.stderr, relayed.stderr


# -- TLS refusals (last: restarts node-b's agent) ---------------------------------------


def _node_states(w: World) -> dict[str, str]:
    out = w.run("list", "nodes", "--server", w.relay, "-o", "json")
    assert out.returncode == 0, out.stderr
    return {n["name"]: n["state"] for n in json.loads(out.stdout)}


def test_a_peer_with_a_certificate_of_another_ca_is_reported_node_error_then_recovers(
    world: World, tmp_path: pathlib.Path
) -> None:
    """node-b's agent restarts serving a certificate of a CA the relay does not trust: the
    relay refuses it and reports it as NODE_ERROR naming the handshake failure (list nodes,
    and a status event of observe), while node-a keeps being served; once node-b serves its
    own certificate again it is NODE_CONNECTED. (In the plaintext run: no peer is announced
    with TLS.)"""
    w = world
    out = w.run("list", "nodes", "--server", w.relay, "-o", "json")
    assert out.returncode == 0, out.stderr
    tls = {n["name"]: n.get("tls", {}) for n in json.loads(out.stdout)}
    if not w.tls:  # the plaintext run: no peer is announced with TLS
        assert not any(t.get("enabled") for t in tls.values()), tls
        return
    assert tls == {
        n: {"enabled": True, "server_name": f"{n}.default.hubble-grpc.cilium.io"}
        for n in ("node-a", "node-b")
    }, tls
    stranger = tmp_path / "stranger"  # a CA of its own (the CLI writes it)
    made = subprocess.run(
        [str(VENV_BIN / "cilia-operator"), "certs", "generate", "--dir", str(stranger),
         "--nodes", "node-b", "--admins", "", "--hubble-cluster", "default"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    cert, key = str(stranger / "hubble-node-b.crt"), str(stranger / "hubble-node-b.key")
    agent = w.cluster.node("node-b").agent
    original = agent.extra_args
    agent.extra_args = (*original, "--hubble-tls-cert-file", cert, "--hubble-tls-key-file", key)
    try:
        w.cluster.restart_agent("node-b")
        assert wait_for(lambda: _node_states(w).get("node-b") == "NODE_ERROR",
                        PEER_STATE_WAIT_SECONDS), _node_states(w)  # fmt: skip
        assert _node_states(w)["node-a"] == "NODE_CONNECTED"
        # the CLI prints node status events on stderr; node-a's flows still come
        out = w.run("observe", "--server", w.relay, "--last", "1", "-o", "jsonpb")
        assert out.returncode == 0, out.stderr
        statuses = [json.loads(line)["node_status"] for line in out.stderr.splitlines()
                    if line.startswith("{") and "node_status" in line]  # fmt: skip
        errors = [e for e in statuses if e.get("state_change") == "NODE_ERROR"]
        assert [e["node_names"] for e in errors] == [["node-b"]], out.stderr
        assert "TLS handshake failed" in errors[0]["message"], errors
        flows = [json.loads(line)["flow"] for line in out.stdout.splitlines() if line.strip()]
        assert {f["node_name"] for f in flows} == {"node-a"}, out.stdout
    finally:
        agent.extra_args = original
        w.cluster.restart_agent("node-b")
    assert wait_for(lambda: _node_states(w).get("node-b") == "NODE_CONNECTED",
                    PEER_STATE_WAIT_SECONDS), _node_states(w)  # fmt: skip
