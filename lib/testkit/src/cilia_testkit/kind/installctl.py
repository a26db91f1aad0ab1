"""Command line of Cilia's install on a kind-style cluster (``make k8s-up`` /
``make k8s-install`` / ``make k8s-uninstall``)::

    python -m cilia_testkit.kind.installctl images   [--name cilia]  # build, load into nodes
    python -m cilia_testkit.kind.installctl values   [--name cilia]  # the helm --set flags
    python -m cilia_testkit.kind.installctl install  [--name cilia]  # images + helm install + Ready
    python -m cilia_testkit.kind.installctl uninstall [--name cilia] # helm uninstall + node cleanup

``images`` is what ``make k8s-up`` runs after the cluster is up, so that the chart installs
with no hand step: ``helm install cilia deploy/helm/cilia -n kube-system`` plus the flags
``values`` prints (the API server's address: there is no kube-proxy).

Exit status: 0 done, 1 a step failed (the reason on stderr), 2 no such cluster.
"""

from __future__ import annotations

import argparse
import sys

from cilia_testkit.kind.api import KindError
from cilia_testkit.kind.cluster import KindCluster
from cilia_testkit.kind.docker import DockerError
from cilia_testkit.kind.install import (
    CHART,
    cluster_values,
    ensure_cilia_images,
    install,
    uninstall,
)


def set_flags(cluster: KindCluster) -> str:
    """``--set k=v ...`` of :func:`cluster_values` (what a user adds to ``helm install``)."""
    return " ".join(f"--set {k}={str(v).lower() if isinstance(v, bool) else v}"
                    for k, v in cluster_values(cluster).items())  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Entry point; see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m cilia_testkit.kind.installctl")
    parser.add_argument("command", choices=["images", "values", "install", "uninstall"])
    parser.add_argument("--name", default="cilia", help="cluster name (default: cilia)")
    args = parser.parse_args(argv)
    try:
        cluster = KindCluster.load(args.name)
    except (KindError, FileNotFoundError) as exc:
        print(f"no cluster {args.name!r}: {exc} (make k8s-up first)", file=sys.stderr)
        return 2
    try:
        if args.command == "images":
            names = ensure_cilia_images()
            cluster.load_images(names)
            print(f"loaded into {len(cluster.nodes)} nodes: {' '.join(names)}")
            print(f"install: KUBECONFIG={cluster.kubeconfig} helm install cilia {CHART} "
                  f"-n kube-system {set_flags(cluster)}")  # fmt: skip
        elif args.command == "values":
            print(set_flags(cluster))
        elif args.command == "install":
            took = install(cluster)
            print(f"Cilia Ready on {len(cluster.nodes)} nodes {took:.1f} s after helm install")
        else:
            uninstall(cluster)
            print("Cilia uninstalled, every node cleaned")
    except (KindError, DockerError) as exc:
        print(f"{args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
