"""Flows per second from the kernel to an ``observe`` client, and how many are lost.

Set-up (shared with ``bench.datapath``, see there): a private stack of this checkout for
the run (``--stack private``, default) or ``scripts/stack.sh``'s (``--stack shared``), two
pods made by the real ``cilia-cni`` ADD — netns
``cilia-bench-fl-<pid>-client`` (``app=flows-client``) and ``cilia-bench-fl-<pid>-server``
(``app=flows-server``), namespace ``bench`` — and a CiliumNetworkPolicy with
``egressDeny`` from the client to the server (L3, any port). Every UDP packet the client
sends to the server is then dropped by ``cil_from_container`` on the client's host veth
with ``POLICY_DENY`` (181), and every drop emits exactly one ``flow_event`` on the ring
buffer: one packet = one flow. The packets go to distinct destination ports
(1024..65535, cycling), from one socket.

Counted, per offered rate (``--rates`` packets/s, 0 = as fast as one Python sender goes,
``--duration`` s each):

* ``sent``: packets the sender handed to the kernel;
* ``kernel``: the deny entry's packet counter in the pinned ``cilia_policy`` map (this
  endpoint only, exact) = drop events the programs tried to emit;
* ``agent seen``: the agent's ``ServerStatus.seen_flows`` delta (every flow it decoded,
  from any pod of the node);
* ``sent/s``: packets per second the sender reached (on a loaded host below the asked rate);
* ``received``: flows printed by the upstream ``hubble observe --follow -o compact
  --from-pod bench/cilia-bench-fl-<pid>-client`` (Go, built by ``scripts/hubble-cli.sh``;
  ``--output json|jsonpb`` for the JSON printers) through the relay (``--via relay``,
  default; or straight from the agent's Hubble socket, ``--via agent``), counted once the
  stream is quiet for ``--drain`` s; ``--client cilia`` runs ``cilia-relay observe``
  instead; the CLI's stdout goes to a file that is read once the rate is over (a reader
  parsing it live would take CPU from the processes measured);
* ``LostEvent``: ``lost_events`` records the stream carried (by source);
* ``lost`` = kernel - received, split into: ``ringbuf`` (LostEvent PERF_EVENT_RING_BUFFER:
  the BPF ring buffer was full and ``bpf_ringbuf_output`` failed; the datapath counts them),
  ``queue`` (LostEvent OBSERVER_EVENTS_QUEUE: the agent's hand-off queue was full) and
  ``ring`` (LostEvent HUBBLE_RING_BUFFER: the follower fell behind Hubble's flow ring);
  ``unreported`` = losses no LostEvent accounts for (kernel - received - all three; 0 is
  the goal: every loss reported with its source);
* ``delivered/s`` = received / (last flow received - first packet sent);
* CPU per flow of the agent, the relay and the observe CLI: each process's CPU seconds
  during the rate (sending and draining) / received, in microseconds.

Baseline = the kernel's count in the same run: the table shows ``received / kernel``.

Run it niced (``nice -n 10``) on a shared host: the processes it starts inherit that.

Output: a table, and JSON in ``--results-dir`` (``flows-<UTC time>.json`` and
``flows-latest.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

from bench.datapath import (
    POD_NAMESPACE,
    BenchError,
    BenchPod,
    PodSet,
    Stack,
    add_stack_flags,
    check_same_agent,
    clear_stale_netns,
    connect_probe,
    describe,
    entries_of,
    host_info,
    load_datapath,
    netns_argv,
    policy_applied,
    process_cpu_seconds,
    rel,
    stack_running,
    write_results,
)
from cilia_testkit import ROOT, VENV_BIN, cni, host, netns

DEFAULT_RATES = "5000,10000,20000,40000"
DEFAULT_DURATION_SECONDS = 5
DEFAULT_DRAIN_SECONDS = 2.0
DEFAULT_DRAIN_MAX_SECONDS = 20.0
DEFAULT_WARMUP_TIMEOUT_SECONDS = 20.0
DEFAULT_POLICY_WAIT_SECONDS = 20.0
DEFAULT_RESULTS_DIR = ROOT / "bench" / "results"
PROBE_PORT = 9  # TCP connect probe: refused before the policy, dropped (timeout) after
PROBE_TIMEOUT_SECONDS = 1.0
WARMUP_PORT = 7  # UDP packets sent until the observe stream shows one
NETNS_PREFIX = "cilia-bench-fl-"
POLICY_NAME = "bench-flows"
DIR_EGRESS = 1

POLICY_YAML = """\
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata:
  name: {name}
  namespace: {namespace}
spec:
  endpointSelector:
    matchLabels:
      app: flows-client
  egressDeny:
    - toEndpoints:
        - matchLabels:
            app: flows-server
"""

# Runs in the client netns: argv ip, rate (0 = unpaced), seconds, first port, last port.
# One UDP socket; destination port cycles first..last; prints {"sent", "seconds", "errors"}.
UDP_SENDER = r"""
import json, socket, sys, time
ip, rate, seconds = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
first, last = int(sys.argv[4]), int(sys.argv[5])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
send = s.sendto
clock = time.perf_counter
port, sent, errors, payload = first, 0, 0, b"x"
start = clock()
deadline = start + seconds
while True:
    now = clock()
    if now >= deadline:
        break
    # At most 256 packets between clock reads, so a slow host cannot overrun the deadline.
    target = min(int((now - start) * rate) + 1, sent + 256) if rate else sent + 256
    while sent < target:
        try:
            send(payload, (ip, port))
        except OSError:
            errors += 1
            break
        else:
            sent += 1
        port = first if port == last else port + 1
    if rate and sent >= target:
        time.sleep(0.0005)
print(json.dumps({"sent": sent, "seconds": clock() - start, "errors": errors}))
"""


class ObserveReader:
    """Runs the observe CLI with its stdout and stderr going to files, and counts afterwards.

    The CLI's output is not read while a rate runs (a Python reader parsing every line would
    take a share of the 2 cores from the processes measured): the bench only stats the file
    (size, mtime) to see when the stream went quiet and reads the new part once a rate is
    over.

    ``output``: the CLI's ``-o``: ``json``/``jsonpb`` (one JSON object per line: a
    ``{"flow": ...}`` or a ``{"lost_events": ...}`` response) or ``compact`` (a flow per
    line; a lost event as ``<time> EVENTS LOST: <SOURCE> CPU(<n>) <count>``, upstream's
    printer; node status goes to stderr).
    """

    def __init__(self, argv: list[str], output: str, directory: pathlib.Path) -> None:
        self.argv = argv
        self.output = output
        self.out_path = directory / "observe.out"
        self.err_path = directory / "observe.err"
        with self.out_path.open("wb") as out, self.err_path.open("wb") as err:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=err)
        self.offset = 0
        self.flows = 0
        self.lost: Counter[str] = Counter()
        self.other = 0

    def _count(self, data: bytes) -> None:
        compact = self.output == "compact"
        for raw in data.splitlines():
            line = raw.decode("utf-8", "replace")
            if compact:
                _, sep, tail = line.partition(" EVENTS LOST: ")
                if sep:
                    words = tail.split()
                    self.lost[words[0]] += int(words[-1]) if words[-1].isdigit() else 0
                elif line.strip():
                    self.flows += 1
                continue
            if line[:16].startswith('{"flow"'):
                self.flows += 1
            elif '"lost_events"' in line:
                lost = json.loads(line)["lost_events"]
                self.lost[str(lost.get("source", "UNKNOWN"))] += int(lost.get("num_events_lost", 0))
            else:
                self.other += 1

    def snapshot(self) -> tuple[int, Counter[str], float]:
        """(flows, lost by source, wall time of the output's last write): reads the complete
        lines written since the last call."""
        with self.out_path.open("rb") as out:
            out.seek(self.offset)
            data = out.read()
        end = data.rfind(b"\n") + 1
        self._count(data[:end])
        self.offset += end
        return self.flows, Counter(self.lost), self.out_path.stat().st_mtime

    def quiet_for(self) -> float:
        """Seconds since the CLI last wrote to its stdout."""
        return time.time() - self.out_path.stat().st_mtime

    def alive(self) -> bool:
        """True while the CLI runs."""
        return self.proc.poll() is None

    def stderr(self) -> str:
        """The last lines the CLI wrote to stderr."""
        return "".join(self.err_path.read_text(errors="replace").splitlines(True)[-20:])

    def close(self) -> None:
        """Stop the CLI (SIGTERM, then SIGKILL)."""
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def clear_dead_runs_netns() -> None:
    """Delete the netns of earlier runs whose process is gone (``cilia-bench-fl-<pid>-…``,
    and the older ``cilia-bench-fl-client``/``-server``), leaving a concurrent run's alone."""
    for name in netns.list_netns(NETNS_PREFIX):
        pid = name[len(NETNS_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and pathlib.Path(f"/proc/{pid}").exists():
            continue
        clear_stale_netns(name)


def seen_flows(hubble_socket: pathlib.Path) -> int:
    """The agent's ServerStatus.seen_flows over its Hubble unix socket.

    Raises:
        BenchError: the agent does not answer.
    """
    import grpc

    from cilia.hubble.observer import observer_pb2, observer_pb2_grpc

    try:
        with grpc.insecure_channel(f"unix:{hubble_socket}") as channel:
            stub = observer_pb2_grpc.ObserverStub(channel)  # type: ignore[no-untyped-call]
            status = stub.ServerStatus(observer_pb2.ServerStatusRequest(), timeout=5)
    except grpc.RpcError as exc:
        raise BenchError(f"agent ServerStatus failed: {exc}") from exc
    return int(status.seen_flows)


def send_udp(
    client: BenchPod, ip: str, rate: int, seconds: float, ports: tuple[int, int]
) -> dict[str, float]:
    """Run the UDP sender in the client netns; returns {"sent", "seconds", "errors"}
    (errors: sendto calls that failed, e.g. ENOBUFS).

    Raises:
        BenchError: the sender failed.
    """
    argv = netns_argv(
        client.name,
        sys.executable,
        "-c",
        UDP_SENDER,
        ip,
        str(rate),
        str(seconds),
        str(ports[0]),
        str(ports[1]),
    )
    out = host.sh(*argv, check=False, timeout=seconds + 30)
    try:
        result = json.loads(out.stdout)
    except ValueError as exc:
        raise BenchError(f"UDP sender failed ({out.returncode}): {out.stderr[-500:]}") from exc
    return {
        "sent": int(result["sent"]),
        "seconds": float(result["seconds"]),
        "errors": int(result.get("errors", 0)),
    }


def wait_quiet(reader: ObserveReader, quiet: float, limit: float) -> None:
    """Wait until the observe stream printed nothing for ``quiet`` s (at most ``limit`` s)."""
    deadline = time.monotonic() + limit
    while reader.quiet_for() < quiet and time.monotonic() < deadline:
        time.sleep(0.1)


@contextlib.contextmanager
def observing(args: argparse.Namespace, stack: Stack, client: BenchPod) -> Iterator[ObserveReader]:
    """Start the observe CLI (relay or agent socket) filtered on the client pod.

    Raises:
        BenchError: ``--client hubble`` and the upstream CLI is not built.
    """
    server = stack.relay if args.via == "relay" else f"unix:{stack.hubble_socket}"
    if args.client == "hubble":
        path = host.sh(str(ROOT / "scripts" / "hubble-cli.sh"), "--path", check=False)
        binary = pathlib.Path(path.stdout.strip())
        if not binary.is_file():
            raise BenchError(f"no upstream hubble CLI at {binary}: run scripts/hubble-cli.sh")
        if server.startswith("unix:"):
            server = "unix://" + server[len("unix:") :]
        command = [str(binary)]
    else:
        command = [str(VENV_BIN / "cilia-relay")]
    argv = [
        *command,
        "observe",
        "--server",
        server,
        "--follow",
        "-o",
        args.output,
        "--from-pod",
        f"{POD_NAMESPACE}/{client.name}",
    ]
    with tempfile.TemporaryDirectory(prefix="cilia-bench-flows-") as directory:
        reader = ObserveReader(argv, args.output, pathlib.Path(directory))
        try:
            yield reader
        finally:
            reader.close()


def run(args: argparse.Namespace, rates: list[int]) -> dict[str, Any]:
    """Set up, warm the stream up, measure each rate, clean up; return the report's data."""
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        cilia = stack.enter_context(stack_running(args))
        print(f"stack: {describe(cilia)}", flush=True)
        print("compiling the datapath in this process to reach the pinned maps ...", flush=True)
        datapath = load_datapath(cilia.pin_dir)
        stack.callback(datapath.close)
        pods = PodSet(cni.load_conflist(cilia.conflist))
        stack.callback(pods.close)
        prefix = f"{NETNS_PREFIX}{os.getpid()}-"  # concurrent runs (other checkouts) differ
        client = pods.add(f"{prefix}client", {"app": "flows-client"})
        server = pods.add(f"{prefix}server", {"app": "flows-server"})
        pods.wait_endpoints(datapath.endpoints, args.policy_wait)
        stack.enter_context(
            policy_applied(
                cilia.operator,
                POLICY_YAML.format(name=POLICY_NAME, namespace=POD_NAMESPACE),
                POLICY_NAME,
            )
        )

        def deny_entry() -> Any:
            for key in entries_of(datapath, client.ep_id):
                if int(key.sec_label) == server.identity and int(key.egress) == DIR_EGRESS:
                    value = datapath.policy_map[key]
                    if value.flags & 1:
                        return key
            return None

        if not host.wait_for(lambda: deny_entry() is not None, args.policy_wait):
            raise BenchError("the deny entry was not written for the client endpoint in time")
        key = deny_entry()
        probe = connect_probe(client, server.ip, PROBE_PORT, PROBE_TIMEOUT_SECONDS)
        if probe != "timeout":
            raise BenchError(f"client→server connect not dropped by the deny policy: {probe}")

        def kernel_count() -> int:
            return int(datapath.policy_map[key].packets)

        print(
            f"pods: client {client.ip} (endpoint {client.ep_id}), server {server.ip} "
            f"(identity {server.identity}); deny entry in place; observing via {args.via}",
            flush=True,
        )
        reader = stack.enter_context(observing(args, cilia, client))
        deadline = time.monotonic() + args.warmup_timeout
        while reader.snapshot()[0] == 0:
            if not reader.alive():
                raise BenchError(f"observe exited: {reader.stderr().strip()[-500:]}")
            if time.monotonic() > deadline:
                raise BenchError(f"no flow reached the observe client in {args.warmup_timeout}s")
            send_udp(client, server.ip, 10, 0.2, (WARMUP_PORT, WARMUP_PORT))
        agent = cilia.pid("agent")
        relay = cilia.pid("relay")
        for rate in rates:
            wait_quiet(reader, args.drain, args.drain_max)
            flows0, lost0, _ = reader.snapshot()
            kernel0, seen0 = kernel_count(), seen_flows(cilia.hubble_socket)
            cpu0 = (
                process_cpu_seconds(agent),
                process_cpu_seconds(relay),
                process_cpu_seconds(reader.proc.pid),
            )
            t0 = time.time()
            sent = send_udp(client, server.ip, rate, args.duration, (1024, 65535))
            wait_quiet(reader, args.drain, args.drain_max)
            flows1, lost1, last_flow = reader.snapshot()
            kernel = kernel_count() - kernel0
            received = flows1 - flows0
            lost_events = dict(lost1 - lost0)
            span = max(last_flow - t0, 1e-9) if received else 0.0
            agent_seen = seen_flows(cilia.hubble_socket) - seen0
            queue_lost = lost_events.get("OBSERVER_EVENTS_QUEUE", 0)
            ring_lost = lost_events.get("HUBBLE_RING_BUFFER", 0)
            ringbuf_lost = lost_events.get("PERF_EVENT_RING_BUFFER", 0)
            cpu = (
                process_cpu_seconds(agent) - cpu0[0],
                process_cpu_seconds(relay) - cpu0[1],
                process_cpu_seconds(reader.proc.pid) - cpu0[2],
            )
            row = {
                "rate": rate,
                "sent": sent["sent"],
                "send_seconds": round(sent["seconds"], 3),
                "send_errors": sent["errors"],
                "offered_per_s": round(sent["sent"] / sent["seconds"], 1),
                "kernel_events": kernel,
                "agent_seen": agent_seen,
                "received": received,
                "lost": kernel - received,
                "lost_events_reported": lost_events,
                # Where they went, as the LostEvents say: the BPF ring buffer was full
                # (PERF_EVENT_RING_BUFFER), the agent's hand-off queue was full
                # (OBSERVER_EVENTS_QUEUE), the follower fell behind Hubble's flow ring
                # (HUBBLE_RING_BUFFER); unreported = what no LostEvent accounts for.
                "lost_bpf_ringbuf": ringbuf_lost,
                "lost_agent_queue": queue_lost,
                "lost_hubble_ring": ring_lost,
                "lost_unreported": kernel - received - ringbuf_lost - queue_lost - ring_lost,
                "lost_before_agent_unreported": kernel - agent_seen - queue_lost - ringbuf_lost,
                "delivered_per_s": round(received / span, 1) if span else 0.0,
                "received_over_kernel": round(received / kernel, 4) if kernel else None,
                "agent_cpu_s": round(cpu[0], 2),
                "relay_cpu_s": round(cpu[1], 2),
                "observe_cli_cpu_s": round(cpu[2], 2),
                "cpu_us_per_flow": {
                    name: round(c / received * 1e6, 1) if received else None
                    for name, c in zip(("agent", "relay", "cli"), cpu, strict=True)
                },
            }
            rows.append(row)
            print(
                f"  rate {rate or 'max'}: sent {row['sent']}, kernel {kernel}, "
                f"agent seen {row['agent_seen']}, received {received}, "
                f"LostEvent {sum(lost_events.values())}",
                flush=True,
            )
            if not reader.alive():
                raise BenchError(f"observe exited: {reader.stderr().strip()[-500:]}")
            check_same_agent(cilia, agent)
    return {"rows": rows, "stack": {"kind": cilia.kind, "started_by_bench": cilia.started}}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return 0 on success, 1 when it could not run."""
    parser = argparse.ArgumentParser(
        prog="python -m bench flows",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--rates",
        default=DEFAULT_RATES,
        help=f"offered packets/s, comma-separated, 0 = unpaced (default {DEFAULT_RATES})",
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=DEFAULT_DURATION_SECONDS,
        help=f"seconds of sending per rate (default {DEFAULT_DURATION_SECONDS})",
    )
    parser.add_argument(
        "--via",
        choices=("relay", "agent"),
        default="relay",
        help="observe through the relay or straight from the agent's hubble.sock (default relay)",
    )
    parser.add_argument(
        "--client",
        choices=("cilia", "hubble"),
        default="hubble",
        help="the observe client: the upstream hubble CLI built by scripts/hubble-cli.sh "
        "(what users run; default), or cilia-relay observe",
    )
    parser.add_argument(
        "--output",
        choices=("compact", "json", "jsonpb"),
        default="compact",
        help="the client's -o (default compact: upstream hubble's cheapest to print; "
        "cilia-relay observe knows compact and json)",
    )
    parser.add_argument(
        "--drain",
        type=float,
        default=DEFAULT_DRAIN_SECONDS,
        help=f"seconds without output that end a rate's counting (default {DEFAULT_DRAIN_SECONDS:g})",
    )
    parser.add_argument(
        "--drain-max",
        type=float,
        default=DEFAULT_DRAIN_MAX_SECONDS,
        help=f"longest wait for the stream to go quiet (default {DEFAULT_DRAIN_MAX_SECONDS:g})",
    )
    parser.add_argument(
        "--warmup-timeout",
        type=float,
        default=DEFAULT_WARMUP_TIMEOUT_SECONDS,
        help=f"seconds for a first flow to reach the client (default {DEFAULT_WARMUP_TIMEOUT_SECONDS:g})",
    )
    parser.add_argument(
        "--policy-wait",
        type=float,
        default=DEFAULT_POLICY_WAIT_SECONDS,
        help=f"seconds for identities and policy to reach the maps (default {DEFAULT_POLICY_WAIT_SECONDS:g})",
    )
    parser.add_argument(
        "--results-dir",
        type=pathlib.Path,
        default=DEFAULT_RESULTS_DIR,
        help="where the JSON goes (default bench/results)",
    )
    add_stack_flags(parser)
    args = parser.parse_args(argv)
    try:
        rates = [int(r) for r in args.rates.split(",") if r.strip()]
    except ValueError:
        parser.error(f"--rates must be comma-separated integers, got {args.rates!r}")
    if not rates or any(r < 0 for r in rates) or args.duration <= 0:
        parser.error("--rates must list rates >= 0 and --duration must be > 0")
    if os.geteuid() != 0:
        print("the flows benchmark needs root (netns, bpf)", file=sys.stderr)
        return 1
    clear_dead_runs_netns()
    started = time.perf_counter()
    try:
        out = run(args, rates)
    except (BenchError, cni.CniRunError, OSError, subprocess.SubprocessError) as exc:
        print(f"\nbenchmark failed: {exc}", file=sys.stderr)
        return 1
    head = (
        f"{'offered':>12} {'sent/s':>7} {'kernel':>8} {'agent':>7} {'received':>8} {'lost':>7} "
        f"{'ringbuf':>7} {'queue':>6} {'ring':>6} {'unrep':>6} {'deliv/s':>8} {'recv/kern':>9} "
        f"{'CPU agent/relay/cli s':>21} {'us/flow agent/relay/cli':>23}"
    )
    print()
    print(
        f"UDP to distinct ports, dropped by egressDeny (1 packet = 1 flow), {args.duration:g} s "
        f"per rate, {args.client} observe --follow -o {args.output} via {args.via}"
    )
    print(
        "kernel = drop events emitted (deny entry's counter); agent = Hubble seen_flows; lost = "
        "kernel - received, of which ringbuf = LostEvent PERF_EVENT_RING_BUFFER, queue = "
        "LostEvent OBSERVER_EVENTS_QUEUE, ring = LostEvent HUBBLE_RING_BUFFER, unrep = "
        "accounted for by no LostEvent"
    )
    print(head)
    print("-" * len(head))
    for r in out["rows"]:
        offered = f"{r['rate']}/s" if r["rate"] else f"max~{r['offered_per_s']:.0f}/s"
        cpu = f"{r['agent_cpu_s']:.1f}/{r['relay_cpu_s']:.1f}/{r['observe_cli_cpu_s']:.1f}"
        per = "/".join("-" if v is None else f"{v:.0f}" for v in r["cpu_us_per_flow"].values())
        print(
            f"{offered:>12} {r['offered_per_s']:>7.0f} {r['kernel_events']:>8} {r['agent_seen']:>7} {r['received']:>8} "
            f"{r['lost']:>7} {r['lost_bpf_ringbuf']:>7} {r['lost_agent_queue']:>6} "
            f"{r['lost_hubble_ring']:>6} {r['lost_unreported']:>6} {r['delivered_per_s']:>8.0f} "
            f"{r['received_over_kernel'] or 0:>8.3f}x {cpu:>21} {per:>23}"
        )
    report = {
        "benchmark": "flows",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": host_info(),
        "parameters": {
            k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()
        },
        "wall_seconds": round(time.perf_counter() - started, 1),
        **out,
    }
    path = write_results("flows", report, args.results_dir)
    print(f"\nwrote {rel(path)} ({report['wall_seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
