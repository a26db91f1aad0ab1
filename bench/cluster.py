"""Cross-node pod→pod cost of the eBPF programs, native routing and VXLAN (issue 11).

Set-up per routing mode: a 2-node :class:`cilia_testkit.cluster.Cluster` (each node a netns
with its own agent on a LAN bridge), a client pod on node A and a server pod on node B made
through the real ``cilia-cni``; ``iperf3 -s`` and the echo server of :mod:`bench.datapath`
run in the server pod. No policy: the programs run as for any pod (identity lookup, conntrack,
trace events).

Two configurations of the same pod pair, interleaved per round so drift on a shared host hits
both alike (``--rounds`` rounds, median reported):

* ``bpf``: the agents' programs attached as the agents attached them;
* ``no-bpf``: ``tc qdisc del dev lxc… clsact`` on both pods' host veths (inside node A's and
  node B's netns) — the same veths, routes, tunnel and iptables without BPF. Before that the
  programs are pinned by id (``bpftool prog pin id``) under ``/sys/fs/bpf/cilia-bench-cl-*``
  and afterwards attached again from those pins (``tc filter replace … bpf da
  object-pinned``); the ids are checked to be the agents' very programs.

Metrics, ``--duration`` seconds each: ``TCP stream`` (``iperf3 -c``, Gbit/s) and ``TCP RR``
(1-byte request/response on one connection, transactions/s).

Ratios: ``bpf / no-bpf`` per mode (goals, issue 11: stream ≥ 0.95, RR ≥ 0.90) and
``tunnel / native`` with BPF. Output: a table, and JSON in ``--results-dir``
(``cluster-<UTC time>.json`` and ``cluster-latest.json``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from bench import datapath
from cilia_testkit import ROOT, host, probe
from cilia_testkit.cluster import ROUTING_MODES, Cluster, Node, RoutingMode
from cilia_testkit.host import wait_for

IPERF_PORT = 5201
RR_PORT = 5202
PIN_PREFIX = "/sys/fs/bpf/cilia-bench-cl"
HOOKS = ("ingress", "egress")
#: Seconds the servers in the server pod may take to listen.
SERVER_START_SECONDS = 15.0
GOALS = {"stream": 0.95, "rr": 0.90}


class BenchError(RuntimeError):
    """A step of the benchmark failed (the message says which)."""


def prog_ids(node: Node, ifname: str) -> dict[str, int]:
    """Program id of the tc filter on each clsact hook of ``ifname`` in ``node``'s netns."""
    return datapath.attached_prog_ids(ifname, run=node.exec)


class Attachment:
    """The programs on one pod's host veth: pinned by id, detached and attached again."""

    def __init__(self, node: Node, ifname: str, tag: str) -> None:
        self.node = node
        self.ifname = ifname
        self.ids = prog_ids(node, ifname)
        if set(self.ids) != set(HOOKS):
            raise BenchError(
                f"{node.name} {ifname}: programs on {sorted(self.ids)}, not both hooks"
            )
        self.pins = {hook: f"{PIN_PREFIX}-{tag}-{hook}" for hook in HOOKS}
        for hook, prog_id in self.ids.items():
            pathlib.Path(self.pins[hook]).unlink(missing_ok=True)
            host.sh("bpftool", "prog", "pin", "id", str(prog_id), self.pins[hook])

    def detach(self) -> None:
        """Remove the clsact qdisc (both filters go with it)."""
        self.node.exec("tc", "qdisc", "del", "dev", self.ifname, "clsact")

    def attach(self) -> None:
        """Attach the pinned programs again and check the ids.

        Raises:
            BenchError: the attached ids differ from the agent's.
        """
        self.node.exec("tc", "qdisc", "replace", "dev", self.ifname, "clsact")
        for hook in HOOKS:
            self.node.exec(
                "tc", "filter", "replace", "dev", self.ifname, hook, "prio", "1", "handle", "1",
                "bpf", "da", "object-pinned", self.pins[hook],
            )  # fmt: skip
        if prog_ids(self.node, self.ifname) != self.ids:
            raise BenchError(f"{self.ifname}: reattached {prog_ids(self.node, self.ifname)}")

    def close(self) -> None:
        for pin in self.pins.values():
            pathlib.Path(pin).unlink(missing_ok=True)


def _wait_listening(netns: str, port: int) -> None:
    def up() -> bool:
        out = host.sh("ip", "netns", "exec", netns, "ss", "-Hltn", f"sport = :{port}", check=False)
        return bool(out.stdout.strip())

    if not wait_for(up, SERVER_START_SECONDS):
        raise BenchError(f"nothing listens on {port} in {netns}")


def measure_mode(mode: RoutingMode, args: argparse.Namespace) -> dict[str, Any]:
    """Start a 2-node cluster in ``mode`` and measure both configurations."""
    cluster = Cluster(2, routing=mode, name=f"bench-cluster-{mode}").start()
    servers: list[subprocess.Popen[bytes]] = []
    attachments: list[Attachment] = []
    try:
        client = cluster.add_pod("node-a", "bench-client", {"app": "bench-client"})
        server = cluster.add_pod("node-b", "bench-server", {"app": "bench-server"})
        servers.append(subprocess.Popen(
            datapath.netns_argv(server.name, "iperf3", "-s", "-p", str(IPERF_PORT)),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ))  # fmt: skip
        servers.append(subprocess.Popen(
            datapath.netns_argv(server.name, sys.executable, "-c", datapath.ECHO_SERVER,
                                str(RR_PORT)),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ))  # fmt: skip
        _wait_listening(server.name, IPERF_PORT)
        _wait_listening(server.name, RR_PORT)
        check = probe.check_from(client.name, f"icmp:{server.ip}")[0]
        if not check.ok:
            raise BenchError(f"client cannot reach the server across nodes: {check.detail}")
        attachments = [
            Attachment(cluster.node("node-a"), client.host_veth, f"{mode}-client"),
            Attachment(cluster.node("node-b"), server.host_veth, f"{mode}-server"),
        ]
        bench_client = datapath.BenchPod(client)
        samples: dict[str, dict[str, list[float]]] = {
            c: {"stream": [], "rr": []} for c in ("bpf", "no-bpf")
        }
        for _ in range(args.rounds):
            for config in ("bpf", "no-bpf"):
                for a in attachments:
                    if config == "no-bpf":
                        a.detach()
                    else:
                        a.attach()
                stream = datapath.iperf_stream(bench_client, server.ip, IPERF_PORT, args.duration)
                samples[config]["stream"].append(stream["gbit_per_s"])
                rr = datapath.pingpong(bench_client, server.ip, RR_PORT, "rr", args.duration)
                samples[config]["rr"].append(rr)
        for a in attachments:
            a.attach()
        medians = {
            c: {m: round(statistics.median(v), 3) for m, v in per.items()}
            for c, per in samples.items()
        }
        ratios = {
            m: round(medians["bpf"][m] / medians["no-bpf"][m], 3) if medians["no-bpf"][m] else 0.0
            for m in ("stream", "rr")
        }
        link = host.sh("ip", "-n", client.name, "-j", "link", "show", "dev", client.ifname)
        return {
            "mode": mode,
            "pod_mtu": int(json.loads(link.stdout)[0]["mtu"]),
            "samples": samples,
            "median": medians,
            "bpf_over_no_bpf": ratios,
        }
    finally:
        for a in attachments:
            a.close()
        for proc in servers:
            proc.kill()
            proc.wait(timeout=10)
        cluster.stop()


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every selected mode, then the tunnel/native ratios."""
    modes: dict[str, Any] = {}
    for mode in args.modes:
        modes[mode] = measure_mode(mode, args)
    report: dict[str, Any] = {
        "bench": "cluster",
        "duration_s": args.duration,
        "rounds": args.rounds,
        "goals": GOALS,
        "modes": modes,
        "host": datapath.host_info(),
    }
    if {"native", "tunnel"} <= modes.keys():
        report["tunnel_over_native"] = {
            m: round(modes["tunnel"]["median"]["bpf"][m] / modes["native"]["median"]["bpf"][m], 3)
            for m in ("stream", "rr")
        }
    return report


def table(report: dict[str, Any]) -> str:
    """The report as text."""
    lines = [
        f"{'mode':<8} {'metric':<7} {'bpf':>10} {'no-bpf':>10} {'ratio':>7} {'goal':>6}",
    ]
    for mode, r in report["modes"].items():
        for metric, unit in (("stream", "Gbit/s"), ("rr", "tx/s")):
            lines.append(
                f"{mode:<8} {metric:<7} {r['median']['bpf'][metric]:>10} "
                f"{r['median']['no-bpf'][metric]:>10} {r['bpf_over_no_bpf'][metric]:>7} "
                f"{GOALS[metric]:>6}  ({unit}, pod MTU {r['pod_mtu']})"
            )
    if "tunnel_over_native" in report:
        t = report["tunnel_over_native"]
        lines.append(f"tunnel/native with BPF: stream {t['stream']}, rr {t['rr']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench cluster [--duration S] [--rounds N] [--modes native,tunnel]``."""
    parser = argparse.ArgumentParser(prog="python -m bench cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--duration", type=int, default=5, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per configuration")
    parser.add_argument(
        "--modes",
        type=lambda s: [m for m in s.split(",") if m],
        default=list(ROUTING_MODES),
        help="comma-separated routing modes (native,tunnel)",
    )
    parser.add_argument("--results-dir", type=pathlib.Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    bad = [m for m in args.modes if m not in ROUTING_MODES]
    if bad:
        parser.error(f"unknown routing mode {bad[0]!r}")
    try:
        report = run(args)
    except (BenchError, datapath.BenchError) as exc:
        print(f"bench cluster: {exc}", file=sys.stderr)
        return 1
    print(table(report))
    path = datapath.write_results("cluster", report, args.results_dir)
    print(f"results: {datapath.rel(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
