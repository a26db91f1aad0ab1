"""The command line of ``make cluster-up`` / ``make cluster-down`` (``scripts/cluster.sh``):
``python -m cilia_testkit.clusterctl up|down|status``.

``up`` starts a supervisor (this module's ``supervise`` command) in a session of its own,
which holds the :class:`~cilia_testkit.cluster.Cluster` (its stack slot, processes, LAN and
namespaces) until it gets SIGTERM/SIGINT, then stops it all. ``up`` waits until the supervisor
wrote :data:`DESCRIBE` (how to reach each node) and prints it, or prints the supervisor's log
tail when it failed. ``down`` sends SIGTERM to the supervisor (pid in :data:`PIDFILE`) and
waits until it is gone. Everything lives under ``.run/cluster/`` (the components' logs in
``.run/cluster/stack/``); the cluster is independent of the ``make up`` stack.

    up     [--nodes N] [--routing native|tunnel] [--timeout S]
    down   [--stop-timeout S]
    status

Environment defaults: ``CILIA_CLUSTER_TIMEOUT`` (180 s for ``up``),
``CILIA_CLUSTER_STOP_TIMEOUT`` (60 s for ``down``). Exit status: 0 ok, 1 failed,
2 usage, 3 (``status``) not running.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence

from cilia_testkit import ROOT
from cilia_testkit.cluster import ROUTING_MODES, Cluster, RoutingMode
from cilia_testkit.host import tail, wait_for
from cilia_testkit.procs import exited, spawn
from cilia_testkit.stack import StackError

RUN = ROOT / ".run" / "cluster"
PIDFILE = RUN / "supervisor.pid"
LOG = RUN / "supervisor.log"
DESCRIBE = RUN / "cluster.txt"
#: Log lines shown when ``up`` fails.
LOG_LINES = 40


def _say(text: str) -> None:
    print(f"[cluster] {text}", file=sys.stderr, flush=True)


def supervisor_pid() -> int | None:
    """The running supervisor's pid (from :data:`PIDFILE`, checked in /proc), else None."""
    try:
        pid = int(PIDFILE.read_text().strip())
        cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    if b"cilia_testkit.clusterctl" not in cmdline or exited(pid):
        return None
    return pid


def supervise(nodes: int, routing: RoutingMode) -> int:
    """Start the cluster, describe it, wait for SIGTERM/SIGINT, stop it (the ``supervise``
    command; run by ``up``). 1 when the cluster failed to start."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    shutil.rmtree(RUN / "stack", ignore_errors=True)  # a fresh cluster: no state of a past one
    cluster = Cluster(nodes, routing=routing, name="cluster-up", run_dir=RUN / "stack")
    try:
        cluster.start()
    except StackError as exc:
        print(f"cluster failed to start: {exc}", flush=True)
        cluster.stop()
        return 1
    try:
        DESCRIBE.write_text(cluster.describe() + "\n")
        print("cluster up", flush=True)
        stop.wait()
    finally:
        DESCRIBE.unlink(missing_ok=True)
        cluster.stop()
        print("cluster stopped", flush=True)
    return 0


def up(nodes: int, routing: RoutingMode, timeout: float) -> int:
    """Start the supervisor and wait until the cluster is described (or it failed)."""
    if os.geteuid() != 0:
        _say("a cluster needs root (netns, veth, bridge, iptables, eBPF): run as root")
        return 1
    pid = supervisor_pid()
    if pid is not None:
        _say(f"already running (supervisor pid {pid}); scripts/cluster.sh down stops it")
        print(DESCRIBE.read_text() if DESCRIBE.exists() else "(still starting)")
        return 0
    RUN.mkdir(parents=True, exist_ok=True)
    DESCRIBE.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "cilia_testkit.clusterctl", "supervise"]
    argv += ["--nodes", str(nodes), "--routing", routing]
    with LOG.open("ab") as log:
        proc = spawn(argv, stdout=log, stderr=subprocess.STDOUT, new_session=True)
    PIDFILE.write_text(f"{proc.pid}\n")
    _say(f"starting {nodes} nodes ({routing} routing), supervisor pid {proc.pid}, log {LOG}")
    if not wait_for(lambda: DESCRIBE.exists() or proc.poll() is not None, timeout, 0.2):
        _say(f"not up after {timeout:g}s; scripts/cluster.sh down stops what started")
        print(tail(LOG, LOG_LINES), file=sys.stderr)
        return 1
    if proc.poll() is not None:
        _say(f"the supervisor exited with status {proc.returncode}:")
        print(tail(LOG, LOG_LINES), file=sys.stderr)
        PIDFILE.unlink(missing_ok=True)
        return 1
    print(DESCRIBE.read_text(), end="")
    _say("up; scripts/cluster.sh down (make cluster-down) stops it")
    return 0


def down(stop_timeout: float) -> int:
    """SIGTERM the supervisor and wait until it is gone (SIGKILL after ``stop_timeout``)."""
    pid = supervisor_pid()
    if pid is None:
        _say("not running")
        PIDFILE.unlink(missing_ok=True)
        return 0
    os.kill(pid, signal.SIGTERM)
    if not wait_for(lambda: exited(pid), stop_timeout, 0.2):
        _say(f"supervisor {pid} still running {stop_timeout:g}s after SIGTERM: SIGKILL")
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: exited(pid), 10, 0.1)
    PIDFILE.unlink(missing_ok=True)
    _say(f"stopped (was supervisor pid {pid})")
    return 0


def status() -> int:
    """Print the description of a running cluster; 3 when none runs."""
    pid = supervisor_pid()
    if pid is None:
        print("cluster   stopped")
        return 3
    print(f"cluster   running  supervisor pid {pid}, log {LOG}")
    print(DESCRIBE.read_text() if DESCRIBE.exists() else "(still starting)", end="")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the command; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="scripts/cluster.sh",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", choices=("up", "down", "status", "supervise"))
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--routing", choices=ROUTING_MODES, default="native")
    parser.add_argument(
        "--timeout", type=float, default=float(os.environ.get("CILIA_CLUSTER_TIMEOUT", "180"))
    )
    parser.add_argument(
        "--stop-timeout",
        type=float,
        default=float(os.environ.get("CILIA_CLUSTER_STOP_TIMEOUT", "60")),
    )
    args = parser.parse_args(argv)
    if not 1 <= args.nodes <= 6:
        parser.error("--nodes must be 1..6 (a stack slot runs at most 8 agents)")
    if args.command == "up":
        return up(args.nodes, args.routing, args.timeout)
    if args.command == "down":
        return down(args.stop_timeout)
    if args.command == "status":
        return status()
    return supervise(args.nodes, args.routing)


if __name__ == "__main__":
    sys.exit(main())
