"""Command line of the kind-style cluster (``make k8s-up`` / ``k8s-status`` / ``k8s-down``)::

    python -m cilia_testkit.kind up [--name cilia] [--nodes 3] [--cni reference] [--no-dns]
                                    [--pod-cidr 10.244.0.0/16] [--service-cidr 10.96.0.0/16]
    python -m cilia_testkit.kind status [--name cilia]
    python -m cilia_testkit.kind down [--name cilia]
    python -m cilia_testkit.kind add-node | restart-node NODE | delete-node NODE [--name cilia]
    python -m cilia_testkit.kind load IMAGE... [--name cilia]

State: ``.run/k8s/<name>/``. ``up`` removes what it made when it fails or gets SIGTERM/Ctrl-C.
Exit status: 0 done, 1 a step failed (the reason on stderr), 2 bad arguments or no such cluster.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

from cilia_testkit.kind.api import KindError
from cilia_testkit.kind.cluster import (
    DEFAULT_POD_CIDR,
    DEFAULT_SERVICE_CIDR,
    STATE_ROOT,
    KindCluster,
)
from cilia_testkit.kind.docker import DockerError, inspect


def _status(cluster: KindCluster) -> dict[str, object]:
    def state(cid: str) -> str:
        c = inspect("container", cid) if cid else None
        return str(((c or {}).get("State") or {}).get("Status", "missing"))

    ready: dict[str, str] = {}
    got = cluster.kubectl("get", "nodes", "-o", "json", check=False, timeout=15)
    if got.returncode == 0:
        for n in json.loads(got.stdout)["items"]:
            conds = {c["type"]: c["status"] for c in n.get("status", {}).get("conditions", [])}
            ready[n["metadata"]["name"]] = "Ready" if conds.get("Ready") == "True" else "NotReady"
    return {
        "name": cluster.name,
        "kubeconfig": str(cluster.kubeconfig),
        "api_server": cluster.api_server,
        "subnet": cluster.subnet,
        "pod_cidr": cluster.pod_cidr,
        "service_cidr": cluster.service_cidr,
        "cni": cluster.cni,
        "nodes": [{"name": n.name, "ip": n.ip, "role": n.role, "container": n.container_id[:12],
                   "container_state": state(n.container_id),
                   "node": ready.get(n.name, "unregistered")} for n in cluster.nodes],
        "outside": cluster.outside and {"name": cluster.outside.name, "ip": cluster.outside.ip,
                                        "container_state": state(cluster.outside.container_id)},
        "timings_s": cluster.timings,
    }  # fmt: skip


def _print_status(status: dict[str, object]) -> None:
    print(
        f"cluster     {status['name']}  (subnet {status['subnet']}, pods {status['pod_cidr']},"
        f" services {status['service_cidr']}, cni {status['cni'] or 'none'})"
    )
    print(f"kubeconfig  {status['kubeconfig']}")
    print(f"api server  {status['api_server']}")
    for n in status["nodes"]:  # type: ignore[attr-defined]
        print(
            f"node        {n['name']:<28} {n['ip']:<15} {n['role']:<14} {n['container']}"
            f" {n['container_state']}/{n['node']}"
        )
    o = status["outside"]
    if o:
        print(f"outside     {o['name']:<28} {o['ip']:<15} {o['container_state']}")  # type: ignore[index]


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; the exit status."""
    ap = argparse.ArgumentParser(
        prog="python -m cilia_testkit.kind",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "command",
        choices=["up", "down", "status", "add-node", "restart-node", "delete-node", "load"],
    )
    ap.add_argument("args", nargs="*", help="NODE (restart-node, delete-node) or IMAGE... (load)")
    ap.add_argument("--name", default="cilia", help="cluster name (default: cilia)")
    ap.add_argument("--nodes", type=int, default=3, help="nodes at up (default: 3)")
    ap.add_argument(
        "--cni",
        choices=["none", "reference"],
        default="none",
        help="CNI to install at up (default: none — nodes stay NotReady)",
    )
    ap.add_argument("--no-dns", action="store_true", help="do not deploy CoreDNS")
    ap.add_argument("--pod-cidr", default=DEFAULT_POD_CIDR)
    ap.add_argument("--service-cidr", default=DEFAULT_SERVICE_CIDR)
    ap.add_argument("--json", action="store_true", help="status as JSON")
    a = ap.parse_args(argv)
    try:
        if a.command == "up":
            cluster = KindCluster(
                a.name,
                a.nodes,
                pod_cidr=a.pod_cidr,
                service_cidr=a.service_cidr,
                cni=None if a.cni == "none" else a.cni,
                dns=not a.no_dns,
            )
            signal.signal(signal.SIGTERM, _exit_on_signal)  # up() removes what it made
            cluster.up()
            _print_status(_status(cluster))
            return 0
        try:
            cluster = KindCluster.load(a.name, STATE_ROOT)
        except FileNotFoundError:
            print(f"no cluster {a.name} ({STATE_ROOT / a.name}/state.json)", file=sys.stderr)
            return 0 if a.command == "down" else 2
        if a.command == "down":
            cluster.down()
            print(f"cluster {a.name} removed", file=sys.stderr)
        elif a.command == "status":
            status = _status(cluster)
            print(json.dumps(status, indent=2)) if a.json else _print_status(status)
        elif a.command == "add-node":
            node = cluster.add_node()
            print(f"{node.name} {node.ip}")
        elif a.command in ("restart-node", "delete-node"):
            if len(a.args) != 1:
                ap.error(f"{a.command} takes one NODE")
            (cluster.restart_node if a.command == "restart-node" else cluster.delete_node)(
                a.args[0]
            )
        elif a.command == "load":
            cluster.load_images(a.args)
        return 0
    except (KindError, DockerError, FileNotFoundError, KeyError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
