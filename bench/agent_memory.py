"""The agent's memory: resident set size at 0 and at N endpoints, and where it goes.

Issue 15 item 5 sets the goal "<= 120 MB RSS with 100 endpoints". Measured in one run, on a
private stack (``bench.datapath.private_stack``: redis, operator, agent with eBPF, relay):

* ``python``: a bare interpreter of the project's venv (``python -c pass``): the floor any
  Python agent pays, measured in this run as the baseline;
* ``imports``: an interpreter that imports what the agent imports (``cilia_agent.app``) and
  nothing more;
* ``agent idle``: the running agent with no endpoint, after ``--settle`` seconds;
* ``agent N endpoints``: after ``--pods`` ADDs through the agent's ``AttachmentService``
  (real netns, veths, BPF programs), kept until the measurement, then deleted.

RSS is ``VmRSS`` of ``/proc/<pid>/status``; "where it goes" sums ``Rss`` of
``/proc/<pid>/smaps`` per mapping (a shared library by its file name, ``[heap]``, and
anonymous memory), largest first.

Output: a table with each figure as a ratio of the bare interpreter, the top mappings, and
JSON in ``--results-dir`` (``agent_memory-<UTC time>.json`` and ``agent_memory-latest.json``).
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import os
import pathlib
import platform
import secrets
import subprocess
import sys
import time
from typing import Any

from bench import datapath
from cilia_testkit import ROOT, VENV_BIN, netns

DEFAULT_PODS = 100
DEFAULT_SETTLE_SECONDS = 3.0
DEFAULT_TOP = 12
DEFAULT_RESULTS_DIR = ROOT / "bench" / "results"
DEFAULT_RPC_TIMEOUT_SECONDS = 30.0
#: Pod CIDR of the private stack (agent_add uses 10.238.0.0/16).
DEFAULT_POOL_CIDR = "10.241.0.0/16"
NETNS_PREFIX = "cilia-bench-mem-"
GOAL_MB = 120.0


class BenchError(RuntimeError):
    """The benchmark could not run (stack, an RPC, or a process to measure)."""


def rss_mb(pid: int) -> float:
    """``VmRSS`` of ``pid`` in MB (10^6 bytes).

    Raises:
        BenchError: the process is gone.
    """
    try:
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
    except OSError as exc:
        raise BenchError(f"cannot read /proc/{pid}/status: {exc}") from exc
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / 1e6
    raise BenchError(f"no VmRSS in /proc/{pid}/status")


def rss_by_mapping(pid: int) -> dict[str, float]:
    """Resident MB per mapping name of ``pid`` (``/proc/<pid>/smaps`` ``Rss`` summed by the
    mapped file's base name, ``[heap]``/``[stack]``, or ``[anon]`` for nameless ones)."""
    sizes: dict[str, float] = collections.defaultdict(float)
    name = "[anon]"
    for line in pathlib.Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):
            path = fields[5] if len(fields) > 5 else ""
            name = os.path.basename(path) if path.startswith("/") else (path or "[anon]")
        elif fields and fields[0] == "Rss:":
            sizes[name] += int(fields[1]) * 1024 / 1e6
    return dict(sizes)


def python_rss_mb(code: str) -> float:
    """RSS in MB of the venv's interpreter once it has run ``code`` (then it waits to be
    measured on stdin).

    Raises:
        BenchError: the interpreter failed.
    """
    script = f"{code}\nimport sys\nprint('ready', flush=True)\nsys.stdin.readline()\n"
    proc = subprocess.Popen(
        [str(VENV_BIN / "python"), "-c", script],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdin is not None
        if proc.stdout.readline().strip() != "ready":
            raise BenchError(f"python -c {code!r} failed (exit {proc.wait()})")
        return rss_mb(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def run(args: argparse.Namespace, stack: datapath.Stack) -> dict[str, Any]:
    """Measure the agent at 0 and at ``args.pods`` endpoints; return the figures (MB).

    Raises:
        BenchError: an RPC failed or the agent is not known.
    """
    import grpc

    from cilia.agent.v1 import agent_pb2, agent_pb2_grpc

    pid = stack.pid("agent")
    if pid is None or stack.agent_socket is None:
        raise BenchError("the stack does not say which process and socket the agent has")
    time.sleep(args.settle)
    out: dict[str, Any] = {"agent_idle_mb": rss_mb(pid), "idle_top": rss_by_mapping(pid)}
    tag = secrets.token_hex(3)
    names = [f"{NETNS_PREFIX}{i}" for i in range(args.pods)]
    channel = grpc.insecure_channel(f"unix:{stack.agent_socket}")
    stub = agent_pb2_grpc.AttachmentServiceStub(channel)  # type: ignore[no-untyped-call]
    added: list[tuple[str, str]] = []
    try:
        for i, name in enumerate(names):
            ns_path = netns.create_netns(name)
            container_id = f"bench-mem-{tag}-{i}"
            try:
                stub.Add(
                    agent_pb2.AddRequest(
                        container_id=container_id, ifname="eth0", netns=ns_path,
                        labels={"app": f"mem-{i % 5}"}, pod_namespace="bench",
                        pod_name=f"mem-{i}",
                    ),
                    timeout=args.rpc_timeout,
                )  # fmt: skip
            except grpc.RpcError as exc:
                raise BenchError(f"Add of {name} failed: {exc}") from exc
            added.append((container_id, ns_path))
        time.sleep(args.settle)
        datapath.check_same_agent(stack, pid)
        out["agent_endpoints_mb"] = rss_mb(pid)
        out["endpoints_top"] = rss_by_mapping(pid)
    finally:
        for container_id, ns_path in added:
            try:
                stub.Del(
                    agent_pb2.DelRequest(container_id=container_id, ifname="eth0", netns=ns_path),
                    timeout=args.rpc_timeout,
                )
            except grpc.RpcError as exc:
                print(f"warning: Del of {container_id} failed: {exc}", file=sys.stderr)
        channel.close()
        for name in names:
            netns.delete_netns(name)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return 0 on success, 1 when it could not run."""
    parser = argparse.ArgumentParser(
        prog="python -m bench agent_memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--pods", type=int, default=DEFAULT_PODS,
                        help=f"endpoints added before the second measurement (default {DEFAULT_PODS})")  # fmt: skip
    parser.add_argument("--settle", type=float, default=DEFAULT_SETTLE_SECONDS,
                        help=f"seconds waited before each measurement (default {DEFAULT_SETTLE_SECONDS:g})")  # fmt: skip
    parser.add_argument("--top", type=int, default=DEFAULT_TOP,
                        help=f"mappings listed (default {DEFAULT_TOP})")  # fmt: skip
    parser.add_argument("--rpc-timeout", type=float, default=DEFAULT_RPC_TIMEOUT_SECONDS,
                        help=f"deadline of each Add/Del in seconds (default {DEFAULT_RPC_TIMEOUT_SECONDS:g})")  # fmt: skip
    parser.add_argument("--results-dir", type=pathlib.Path, default=DEFAULT_RESULTS_DIR,
                        help="where the JSON goes (default bench/results)")  # fmt: skip
    datapath.add_stack_flags(parser)
    parser.set_defaults(pool_cidr=DEFAULT_POOL_CIDR)
    args = parser.parse_args(argv)
    if args.pods < 1 or args.settle < 0 or args.top < 1 or args.rpc_timeout <= 0:
        parser.error("--pods >= 1, --settle >= 0, --top >= 1, --rpc-timeout > 0")
    if args.stack != "private":
        parser.error("--stack private only: the agent's socket of a shared stack is not known")
    if os.geteuid() != 0:
        print("the agent benchmark needs root (netns, veth, BPF)", file=sys.stderr)
        return 1
    datapath.clear_stale_netns(NETNS_PREFIX)
    try:
        bare = python_rss_mb("pass")
        imports = python_rss_mb("import cilia_agent.app")
        with datapath.stack_running(args) as stack:
            print(f"stack: {datapath.describe(stack)}", flush=True)
            data = run(args, stack)
    except (BenchError, datapath.BenchError) as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    rows = [
        ("python (bare interpreter)", bare),
        ("imports of cilia_agent.app", imports),
        ("agent idle, 0 endpoints", data["agent_idle_mb"]),
        (f"agent, {args.pods} endpoints", data["agent_endpoints_mb"]),
    ]
    print(f"{'process':<32} {'RSS MB':>8}  ratio to bare python")
    for label, mb in rows:
        print(f"{label:<32} {mb:>8.1f}  x{mb / bare:.1f}")
    per_ep = (data["agent_endpoints_mb"] - data["agent_idle_mb"]) / args.pods
    print(f"per endpoint: {per_ep * 1000:.0f} kB; goal {GOAL_MB:g} MB at 100 endpoints")
    print(f"largest mappings at {args.pods} endpoints (MB):")
    top = sorted(data["endpoints_top"].items(), key=lambda kv: -kv[1])[: args.top]
    for name, mb in top:
        print(f"  {mb:>7.1f}  {name}")
    report = {
        "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load_avg": os.getloadavg(),
        "pods": args.pods,
        "python_mb": bare,
        "imports_mb": imports,
        "agent_idle_mb": data["agent_idle_mb"],
        "agent_endpoints_mb": data["agent_endpoints_mb"],
        "per_endpoint_kb": per_ep * 1000,
        "endpoints_top_mb": dict(top),
    }
    print(f"results: {datapath.write_results('agent_memory', report, args.results_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
