"""``make demo``: a two-node Cilia cluster on this host, end to end.

Steps (each under a heading; any failure exits 1 after tearing everything down):
  1. start a :class:`cilia_testkit.cluster.Cluster` of ``--nodes`` nodes (each a network
     namespace with its own cilia-agent, joined by a LAN bridge; Redis, operator and relay in
     the host namespace) with ``--routing native|tunnel``;
  2. create pods through the real ``cilia-cni`` of their node: ``frontend`` and ``other`` on
     the first node, ``backend`` on the second;
  3. ping across nodes (frontend <-> backend) and show each node's routes to the other's pods;
  4. apply ``deploy/examples/backend-allow-frontend.yaml`` with ``cilia-operator apply``:
     frontend -> backend TCP 8080 connects, other -> backend is dropped by the backend's node;
  5. print the flows of both nodes through the relay (``cilia-relay observe``): FORWARDED
     and ``Policy denied`` DROPPED, with node names;
  6. delete the pods and stop the cluster.

The single-node demo on the ``make up`` stack is ``scripts/demo.py`` (``NODES=1 make demo``,
and ``KEEP=1`` keeps that stack); a long-running cluster is ``make cluster-up``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from cilia_testkit import ROOT, VENV_BIN, probe
from cilia_testkit.cluster import ROUTING_MODES, Cluster
from cilia_testkit.host import wait_for

POLICY = ROOT / "deploy/examples/backend-allow-frontend.yaml"
NAMESPACE = "demo"  # the example policy's namespace
BACKEND_PORT = 8080
#: Seconds a connect may take before it counts as dropped (a dropped SYN is resent at 1 s).
CONNECT_TIMEOUT_SECONDS = 1.5
POLICY_WAIT_SECONDS = 15.0
FLOWS_WAIT_SECONDS = 15.0
FLOWS_SHOWN = 8

USE_COLOR = sys.stdout.isatty() and os.environ.get("NO_COLOR") is None


class DemoError(RuntimeError):
    """A step did not show what it should."""


def _c(code: str, text: str) -> str:
    return f"\033[{code}m{text}\033[0m" if USE_COLOR else text


def heading(title: str) -> None:
    print(f"\n{_c('1;34', '==> ' + title)}", flush=True)


def ok(text: str) -> None:
    print(f"  {_c('32', 'ok')}  {text}", flush=True)


def indent(text: str) -> str:
    return "\n".join("    " + line for line in text.rstrip().splitlines())


def connects(src: str, address: str) -> bool:
    """A TCP connect from pod netns ``src`` to ``address``:8080 gets the server's greeting."""
    result = probe.check_from(src, f"tcp:{address}:{BACKEND_PORT}", timeout=CONNECT_TIMEOUT_SECONDS)
    return result[0].ok


def run(nodes: int, routing: str) -> None:
    """Every step of the module docstring.

    Raises:
        DemoError: a step failed (the cluster is stopped anyway).
        ClusterError / StackError: the cluster did not start.
    """
    heading(f"Start a {nodes}-node cluster ({routing} routing)")
    started = time.monotonic()
    cluster = Cluster(nodes=nodes, routing=routing, name="demo").start()  # type: ignore[arg-type]
    try:
        print(indent(cluster.describe()))
        ok(f"cluster up in {time.monotonic() - started:.1f} s")
        a, b = sorted(cluster.nodes)[:2]

        heading("Pods through each node's cilia-cni")
        frontend = cluster.add_pod(a, "frontend", {"app": "frontend"}, NAMESPACE)
        other = cluster.add_pod(a, "other", {"app": "other"}, NAMESPACE)
        backend = cluster.add_pod(b, "backend", {"app": "backend"}, NAMESPACE)
        for pod in (frontend, other, backend):
            ok(f"{pod.labels['app']:<8} {pod.ip:<15} on {cluster.pod_node[pod.name]}")

        heading("Across nodes")
        for src, dst in ((frontend, backend), (backend, frontend)):
            result = probe.check_from(src.name, f"icmp:{dst.ip}", timeout=2.0)[0]
            if not result.ok:
                raise DemoError(f"ping {src.labels['app']} -> {dst.labels['app']}: {result.detail}")
            ok(f"ping {src.labels['app']} ({cluster.pod_node[src.name]}) -> "
               f"{dst.labels['app']} ({cluster.pod_node[dst.name]})")  # fmt: skip
        for name in (a, b):
            routes = cluster.node(name).pod_routes()
            lines = [f"{cidr} via {r['gateway']} dev {r['dev']}" for cidr, r in routes.items()]
            print(f"  {name}'s routes to other nodes' pods:\n{indent(chr(10).join(lines))}")

        heading("Policy: only app=frontend may reach app=backend on TCP 8080")
        server = probe.start_server(backend.name, backend.name, (BACKEND_PORT,))
        try:
            for pod in (frontend, other):
                if not connects(pod.name, backend.ip):
                    raise DemoError(f"{pod.labels['app']} cannot reach the backend before a policy")
            ok("before any policy, frontend and other both connect")
            print(f"  cilia-operator apply -f {POLICY.relative_to(ROOT)}")
            applied = cluster.stack.operator_cli("apply", "-f", str(POLICY))
            if applied.returncode != 0:
                raise DemoError(f"apply failed: {applied.stderr.strip()}")
            print(indent(applied.stdout))
            if not wait_for(lambda: not connects(other.name, backend.ip), POLICY_WAIT_SECONDS):
                raise DemoError("the policy did not take effect: other still connects")
            ok(f"other    ({a}) -> backend ({b}):{BACKEND_PORT}  dropped at {b}")
            if not connects(frontend.name, backend.ip):
                raise DemoError("frontend can no longer reach the backend")
            ok(f"frontend ({a}) -> backend ({b}):{BACKEND_PORT}  connected")
        finally:
            probe.stop(server)

        heading("Flows of both nodes through the relay")
        argv = [
            str(VENV_BIN / "cilia-relay"), "observe", "--server", cluster.relay_address,
            "--port", str(BACKEND_PORT), "--last", "100", "-o", "json",
        ]  # fmt: skip
        print("  cilia-relay " + " ".join(argv[1:]))
        shown: list[str] = []

        def both_seen() -> bool:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
            flows = [json.loads(line).get("flow", {}) for line in out.stdout.splitlines() if line]
            shown[:] = [
                f"{f.get('time', '')[11:23]}  {f.get('node_name', ''):<12} "
                f"{f.get('source', {}).get('pod_name', '?'):<18} -> "
                f"{f.get('destination', {}).get('pod_name', '?'):<18} {f.get('verdict', '')}"
                + (f" ({f.get('drop_reason_desc', '')})" if f.get("verdict") == "DROPPED" else "")
                for f in flows
                if f
            ]
            nodes_seen = {line.split()[1] for line in shown}
            return (
                any("FORWARDED" in line for line in shown)
                and any("DROPPED" in line for line in shown)
                and {a, b} <= nodes_seen
            )

        seen = wait_for(both_seen, FLOWS_WAIT_SECONDS, interval=0.5)
        dropped = [line for line in shown if "DROPPED" in line][-FLOWS_SHOWN // 2 :]
        forwarded = [line for line in shown if "FORWARDED" in line][-FLOWS_SHOWN // 2 :]
        print(indent("\n".join(sorted(dropped + forwarded))))
        if not seen:
            raise DemoError("the relay did not show FORWARDED and DROPPED flows from both nodes")
        ok(f"flows from {a} and {b}: frontend FORWARDED, other DROPPED (policy denied)")

        heading("Delete the pods")
        cluster.delete_pods()
        ok("pods deleted")
    finally:
        heading("Stop the cluster")
        cluster.stop()
        ok(f"done in {time.monotonic() - started:.1f} s")


def main(argv: list[str] | None = None) -> int:
    """``scripts/demo_cluster.py [--nodes N] [--routing native|tunnel]``; exit 0 ok, 1 a step
    failed, 2 usage."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--nodes", type=int, default=2, help="nodes, 2..8 (default 2)")
    parser.add_argument("--routing", choices=ROUTING_MODES, default="native",
                        help="routing between nodes (default native)")  # fmt: skip
    args = parser.parse_args(argv)
    if not 2 <= args.nodes <= 8:
        parser.error("--nodes: 2..8")
    if os.geteuid() != 0:
        print("demo: needs root (network namespaces, veths, eBPF)", file=sys.stderr)
        return 2
    try:
        run(args.nodes, args.routing)
    except Exception as exc:  # one line, not a traceback
        print(_c("31", f"demo failed: {exc}"), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
