"""Agent-side CNI ADD/DEL latency: ``AttachmentService.Add``/``Del`` of a real agent over its
unix socket, beside the plumbing floor measured in the same run.

What the plugin (``cilia-cni``) waits for after its own start-up: the agent's Add RPC —
ResolvePool at the operator, IP allocation, the ``creating`` state file, the veth pair and
its addresses/routes, identity allocation at the operator, policy and endpoint map entries,
both tc programs attached, UpsertEndpoint, the ``ready`` state file — and its Del RPC.

Set-up: a private stack (``bench.datapath.private_stack``: redis, operator, agent with eBPF,
relay of this checkout on free ports, pods from ``--pool-cidr``); ``--pods`` + ``--warmup``
network namespaces ``cilia-bench-agent-N`` created before the clock starts. Per pod, one
after the other (concurrency 1, the case of the issue's ADD p50 goal):

* ``agent Add`` / ``agent Del``: the RPC from a gRPC client in this process, timed from call
  to reply (labels ``app=bench-N%3``, namespace ``bench``);
* ``plumbing floor``: in the same namespace, right after the agent's Del, the very veth work
  of an Add and a Del done directly in this process with the agent's own
  ``LinuxDatapath.plumb``/``unplumb`` (same netlink requests, no RPC, IPAM, state files,
  operator, identity, BPF). It is what any veth-based plugin pays in the kernel and in
  pyroute2, so ``agent / floor`` is the cost of everything else the agent guarantees.

Interleaving agent and floor per pod spreads drift on a shared host over both. Also printed:
the agent's CPU time per Add+Del (``/proc/<pid>/stat`` utime+stime over the timed pods), split
into its event-loop thread and its other threads, user and system (``/proc/<pid>/task``).

Output: a table of p50/p99/mean ms with the ratios, and JSON in ``--results-dir``
(``agent_add-<UTC time>.json`` and ``agent_add-latest.json``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import pathlib
import platform
import secrets
import sys
import time
from typing import Any

from bench import datapath
from bench.cni_latency import summarize
from cilia_testkit import ROOT, netns

DEFAULT_PODS = 50
DEFAULT_WARMUP = 3
DEFAULT_RESULTS_DIR = ROOT / "bench" / "results"
DEFAULT_RPC_TIMEOUT_SECONDS = 30.0
#: Pod CIDR of the private stack (cni_latency uses 10.237.0.0/16, datapath/flows 10.253.0.0/16).
DEFAULT_POOL_CIDR = "10.238.0.0/16"
#: Addresses of the plumbing floor (never routed anywhere: /32 on the pod side, host /32 route).
FLOOR_POD_IP = ipaddress.IPv4Address("10.239.0.2")
FLOOR_ROUTER_IP = ipaddress.IPv4Address("10.239.0.1")
FLOOR_MTU = 1500
NETNS_PREFIX = "cilia-bench-agent-"


class BenchError(RuntimeError):
    """The benchmark could not run (stack, an RPC or the plumbing failed)."""


def agent_cpu_ms(stack: datapath.Stack, pid: int) -> float:
    """utime + stime of the stack's agent ``pid`` in ms (all threads), read with
    :func:`bench.datapath.process_cpu_seconds`.

    Raises:
        bench.datapath.BenchError: the agent is gone or was restarted (another pid).
    """
    datapath.check_same_agent(stack, pid)
    return datapath.process_cpu_seconds(pid) * 1000


#: The parts :func:`cpu_split` reports, in ms: the agent's main thread (the asyncio loop: gRPC,
#: the endpoint manager, regeneration, on-loop netlink) and its other threads (the datapath
#: worker pool: veth plumbing and deletion; gRPC's and the ring buffer's threads), each user and
#: system time.
CPU_PARTS = ("loop_user", "loop_system", "threads_user", "threads_system")


def cpu_split(pid: int) -> dict[str, float]:
    """CPU ms of process ``pid`` by :data:`CPU_PARTS`, from ``/proc/<pid>/task/*/stat``
    (threads that exited meanwhile are not counted; the total is :func:`agent_cpu_ms`).

    Raises:
        BenchError: the process is gone.
    """
    tick_ms = 1000 / os.sysconf("SC_CLK_TCK")
    out = dict.fromkeys(CPU_PARTS, 0.0)
    try:
        tasks = list(pathlib.Path(f"/proc/{pid}/task").iterdir())
    except OSError as exc:
        raise BenchError(f"agent {pid} is gone: {exc}") from exc
    for task in tasks:
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        part = "loop" if task.name == str(pid) else "threads"
        out[f"{part}_user"] += int(fields[11]) * tick_ms
        out[f"{part}_system"] += int(fields[12]) * tick_ms
    return out


def run(args: argparse.Namespace, stack: datapath.Stack) -> dict[str, Any]:
    """Time ``args.pods`` agent Add/Del pairs and as many floor plumb/unplumb pairs,
    interleaved; return ``{"add": [s], "del": [s], "floor_add": [s], "floor_del": [s],
    "agent_cpu_ms_per_pod": ms, "agent_cpu_split_ms_per_pod": {part: ms}}`` (parts:
    :data:`CPU_PARTS`).

    Raises:
        BenchError: an RPC or the floor's plumbing failed.
    """
    import grpc

    from cilia.agent.v1 import agent_pb2, agent_pb2_grpc
    from cilia_agent.datapath import LinuxDatapath, PlumbRequest

    if stack.agent_socket is None:
        raise BenchError("the stack does not say where the agent's socket is")
    agent_pid = stack.pid("agent")
    if agent_pid is None:
        raise BenchError("the stack does not say which process the agent is")
    floor = LinuxDatapath("unused", install_iptables_rules=False)  # plumb/unplumb only
    tag = secrets.token_hex(3)
    names = [f"{NETNS_PREFIX}{i}" for i in range(args.warmup + args.pods)]
    out: dict[str, Any] = {"add": [], "del": [], "floor_add": [], "floor_del": []}
    channel = grpc.insecure_channel(f"unix:{stack.agent_socket}")
    stub = agent_pb2_grpc.AttachmentServiceStub(channel)  # type: ignore[no-untyped-call]
    cpu_start = 0.0
    split_start = dict.fromkeys(CPU_PARTS, 0.0)
    try:
        paths = [netns.create_netns(name) for name in names]
        for i, ns_path in enumerate(paths):
            timed = i >= args.warmup
            if i == args.warmup:
                cpu_start = agent_cpu_ms(stack, agent_pid)
                split_start = cpu_split(agent_pid)
            container_id = f"bench-agent-{tag}-{i}"
            request = agent_pb2.AddRequest(
                container_id=container_id,
                ifname="eth0",
                netns=ns_path,
                labels={"app": f"bench-{i % 3}"},
                pod_namespace="bench",
                pod_name=f"agent-add-{i}",
            )
            try:
                start = time.perf_counter()
                stub.Add(request, timeout=args.rpc_timeout)
                added = time.perf_counter()
                stub.Del(
                    agent_pb2.DelRequest(container_id=container_id, ifname="eth0", netns=ns_path),
                    timeout=args.rpc_timeout,
                )
                deleted = time.perf_counter()
            except grpc.RpcError as exc:
                raise BenchError(f"agent RPC for {names[i]} failed: {exc}") from exc
            plumb = PlumbRequest(
                f"bench-floor-{tag}-{i}", "eth0", ns_path, FLOOR_POD_IP, FLOOR_ROUTER_IP, FLOOR_MTU
            )
            floor_start = time.perf_counter()
            result = floor.plumb(plumb)
            floor_added = time.perf_counter()
            floor.unplumb(result.host_ifname)
            floor_deleted = time.perf_counter()
            if timed:
                out["add"].append(added - start)
                out["del"].append(deleted - added)
                out["floor_add"].append(floor_added - floor_start)
                out["floor_del"].append(floor_deleted - floor_added)
        out["agent_cpu_ms_per_pod"] = round(
            (agent_cpu_ms(stack, agent_pid) - cpu_start) / args.pods, 1
        )
        split_end = cpu_split(agent_pid)
        out["agent_cpu_split_ms_per_pod"] = {
            part: round((split_end[part] - split_start[part]) / args.pods, 1) for part in CPU_PARTS
        }
    finally:
        channel.close()
        for name in names:
            netns.delete_netns(name)
    return out


def table(rows: list[tuple[str, dict[str, float], str]]) -> str:
    """Render ``(label, summary, ratio text)`` rows as a fixed-width table."""
    head = f"{'measurement':<34} {'n':>4} {'p50 ms':>9} {'p99 ms':>9} {'mean ms':>9}  ratio"
    lines = [head, "-" * len(head)]
    for label, s, ratio in rows:
        lines.append(
            f"{label:<34} {int(s['n']):>4} {s['p50_ms']:>9.1f} {s['p99_ms']:>9.1f} "
            f"{s['mean_ms']:>9.1f}  {ratio}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return 0 on success, 1 when it could not run."""
    parser = argparse.ArgumentParser(
        prog="python -m bench agent_add",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--pods",
        type=int,
        default=DEFAULT_PODS,
        help=f"timed Add/Del pairs (default {DEFAULT_PODS})",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=DEFAULT_WARMUP,
        help=f"untimed pairs first (default {DEFAULT_WARMUP})",
    )
    parser.add_argument(
        "--rpc-timeout",
        type=float,
        default=DEFAULT_RPC_TIMEOUT_SECONDS,
        help=f"deadline of each Add/Del RPC in seconds (default {DEFAULT_RPC_TIMEOUT_SECONDS:g})",
    )
    parser.add_argument(
        "--results-dir",
        type=pathlib.Path,
        default=DEFAULT_RESULTS_DIR,
        help="where the JSON goes (default bench/results)",
    )
    datapath.add_stack_flags(parser)
    parser.set_defaults(pool_cidr=DEFAULT_POOL_CIDR)
    args = parser.parse_args(argv)
    if args.pods < 1 or args.warmup < 0 or args.rpc_timeout <= 0:
        parser.error("--pods must be >= 1, --warmup >= 0, --rpc-timeout > 0")
    if args.stack != "private":
        parser.error("--stack private only: the agent's socket of a shared stack is not known")
    if os.geteuid() != 0:
        print("the agent benchmark needs root (netns, veth, BPF)", file=sys.stderr)
        return 1
    datapath.clear_stale_netns(NETNS_PREFIX)
    try:
        with datapath.stack_running(args) as stack:
            print(f"stack: {datapath.describe(stack)}", flush=True)
            print(f"{args.pods} agent Add/Del pairs + plumbing floor, interleaved ...", flush=True)
            data = run(args, stack)
    except (BenchError, datapath.BenchError) as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    summary = {key: summarize(data[key]) for key in ("add", "del", "floor_add", "floor_del")}

    def ratio(op: str) -> float:
        return round(summary[op]["p50_ms"] / summary[f"floor_{op}"]["p50_ms"], 2)

    print(
        table(
            [
                ("agent Add RPC", summary["add"], f"x{ratio('add')} of the floor's p50"),
                ("plumbing floor (plumb)", summary["floor_add"], "baseline"),
                ("agent Del RPC", summary["del"], f"x{ratio('del')} of the floor's p50"),
                ("plumbing floor (unplumb)", summary["floor_del"], "baseline"),
            ]
        )
    )
    split = data["agent_cpu_split_ms_per_pod"]
    print(
        f"agent CPU per Add+Del: {data['agent_cpu_ms_per_pod']} ms (event-loop thread: user "
        f"{split['loop_user']} + system {split['loop_system']}; other threads: user "
        f"{split['threads_user']} + system {split['threads_system']})"
    )
    report = {
        "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load_avg": os.getloadavg(),
        "pods": args.pods,
        "summary": summary,
        "ratio_p50": {"add": ratio("add"), "del": ratio("del")},
        "agent_cpu_ms_per_pod": data["agent_cpu_ms_per_pod"],
        "agent_cpu_split_ms_per_pod": split,
    }
    print(f"results: {datapath.write_results('agent_add', report, args.results_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
