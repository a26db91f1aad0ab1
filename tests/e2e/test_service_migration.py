"""Changing the Service range with no downtime (issue 13 item 4), on a real 2-node cluster.

Two Services select the ``web-*`` pods (one per node, TCP and UDP servers on
:data:`TARGET_PORT`): ``web`` (TCP :data:`TCP_PORT`) and ``dns``, a DNS-like UDP echo on
:data:`UDP_PORT` at ``10.96.0.10``, labelled ``k8s-app: kube-dns`` (the cluster DNS special
case). Client pods on both nodes send requests to both Services, never restarted:

1. by the old ClusterIPs, continuously, from before ``servicecidr migrate --to`` until the
   end (the TCP one stops once the new address is in use, as clients that re-read their
   config would);
2. by the new ClusterIPs as soon as every agent serves them;

and no request fails. Then, with the grace period short (:data:`GRACE`), the unused old TCP
VIP is released -- gone from every agent's maps and no longer answering -- while the old
DNS address, still in use, is kept and its old ServiceCIDR stays terminating. A Service made
after the move gets an address in the new range; once the old DNS address falls out of use
too, it is released and the old ServiceCIDR is deleted.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from typing import Any

import pytest

from cilia_testkit import VENV_BIN, probe
from cilia_testkit.cluster import Cluster
from cilia_testkit.host import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

TCP_PORT = 80
UDP_PORT = 53
TARGET_PORT = 8080
DNS_IP = "10.96.0.10"
TARGET = "10.112.0.0/16"  # beside the default 10.96.0.0/12, away from the pod pools
GRACE = "8s"
#: Seconds for a Service change to reach every agent's maps.
PROGRAMMED_WAIT_SECONDS = 20.0
#: Seconds the old TCP alias may take to be released once unused: the grace period, the
#: agents' report interval and the operator's check interval (1 s each here), with margin.
RELEASE_WAIT_SECONDS = 30.0
REQUEST_TIMEOUT_SECONDS = 2.0
#: Seconds both the old and the new addresses are used side by side after the move.
OVERLAP_SECONDS = 3.0
#: Seconds between two rounds of requests of one sender (the machine is shared: a round
#: starts a probe process per client pod).
ROUND_PAUSE_SECONDS = 0.5


def operator(c: Cluster, *argv: str, stdin: str | None = None) -> str:
    """``cilia-operator ARGV --server <operator>``'s stdout; fails the test on failure."""
    out = subprocess.run(
        [str(VENV_BIN / "cilia-operator"), *argv, "--server", c.operator_address],
        input=stdin, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, f"cilia-operator {argv}: {out.stderr}"
    return out.stdout


def answer(clients: list[str], targets: list[str], ok: bool = True) -> bool:
    """Whether every client gets an answer from every target (``ok=False``: from none).
    In this cluster every agent's socket load balancer sits on the one root cgroup, so a
    VIP answers while any agent serves it and stops only when none does."""
    results = probe.check_many([(c, tuple(targets)) for c in clients],
                               timeout=REQUEST_TIMEOUT_SECONDS)  # fmt: skip
    return all(r.ok == ok for r in results)


class Traffic(threading.Thread):
    """Sends the current ``targets`` from every client pod until stopped; keeps results."""

    def __init__(self, clients: list[str], targets: list[str]) -> None:
        super().__init__(daemon=True)
        self.clients, self.targets = clients, targets
        self.results: list[probe.CheckResult] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            batch = [(c, tuple(self.targets)) for c in self.clients]
            self.results += probe.check_many(batch, timeout=REQUEST_TIMEOUT_SECONDS)
            self.halt.wait(ROUND_PAUSE_SECONDS)

    def stop(self) -> list[probe.CheckResult]:
        self.halt.set()
        self.join(timeout=60)
        return self.results


def service(name: str, port: int, protocol: str, **extra: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": "default", **extra.pop("meta", {})},
            "spec": {"selector": {"app": "web"}, **extra, "ports": [
                {"protocol": protocol, "port": port, "targetPort": TARGET_PORT}]}}  # fmt: skip


def test_migration_keeps_old_and_new_addresses_working_and_releases_only_unused_aliases(
    cluster: Any,
) -> None:
    c: Cluster = cluster(
        nodes=2, routing="native", name="e2e-svc-migrate", relay=False,
        agent_args=("--alias-use-report-interval", "1"),
        operator_args=("--service-alias-check-interval", "1"),
    )  # fmt: skip
    servers: list[subprocess.Popen[str]] = []
    senders: list[Traffic] = []
    try:
        clients = []
        for node, short in (("node-a", "web-a"), ("node-a", "client-a"),
                            ("node-b", "web-b"), ("node-b", "client-b")):  # fmt: skip
            labels = {"app": "web"} if short.startswith("web") else {"app": "client"}
            pod = c.add_pod(node, f"mig-{short}", labels, namespace="default")
            if short.startswith("web"):
                servers.append(probe.start_server(pod.name, pod.name, (TARGET_PORT,)))
            else:
                clients.append(pod.name)
        manifest = [service("web", TCP_PORT, "TCP"),
                    service("dns", UDP_PORT, "UDP", clusterIP=DNS_IP,
                            meta={"labels": {"k8s-app": "kube-dns"}})]  # fmt: skip
        operator(c, "apply", "-f", "-", stdin="\n---\n".join(json.dumps(d) for d in manifest))
        old_web = json.loads(operator(c, "get", "svc", "web", "-o", "json"))["spec"]["clusterIP"]
        old = [f"tcp:{old_web}:{TCP_PORT}", f"udp:{DNS_IP}:{UDP_PORT}"]
        assert wait_for(lambda: answer(clients, old), PROGRAMMED_WAIT_SECONDS)

        by_old = Traffic(clients, list(old))
        senders.append(by_old)
        by_old.start()
        time.sleep(1.0)
        out = operator(c, "servicecidr", "migrate", "--to", TARGET, "--alias-grace-period", GRACE)
        assert "cluster DNS default/dns" in out, out  # the special case is named in the plan
        assert f"moved default/dns: {DNS_IP} -> 10.112.0.10" in out, out
        new_web = json.loads(operator(c, "get", "svc", "web", "-o", "json"))["spec"]["clusterIP"]
        assert new_web.startswith("10.112.")
        new = [f"tcp:{new_web}:{TCP_PORT}", f"udp:10.112.0.10:{UDP_PORT}"]
        assert wait_for(lambda: answer(clients, new), PROGRAMMED_WAIT_SECONDS)
        by_new = Traffic(clients, new)
        senders.append(by_new)
        by_new.start()
        time.sleep(OVERLAP_SECONDS)
        by_old.targets = [old[1]]  # the old TCP address falls out of use; old DNS stays
        stopped_tcp = len(by_old.results)

        def released(name: str) -> bool:
            status = json.loads(operator(c, "servicecidr", "status", "-o", "json"))
            return bool(status["migration"]["status"]["services"][f"default/{name}"]["released"])

        assert wait_for(lambda: released("web"), RELEASE_WAIT_SECONDS), operator(
            c, "servicecidr", "status"
        )
        # released: gone from every agent's maps, the old TCP VIP no longer answers
        assert wait_for(lambda: answer(clients, old[:1], ok=False), PROGRAMMED_WAIT_SECONDS)
        # the old DNS address, in use all along, is kept, and so is its old ServiceCIDR
        assert not released("dns")
        status = operator(c, "servicecidr", "status")
        assert "kubernetes" in status and "terminating, held by 1 Service(s): default/dns" in status
        results = by_old.stop() + by_new.stop()
        failed = [f"{r.source} -> {r.target}: {r.detail}" for r in results if not r.ok]
        assert not failed, failed[:20]
        counts = {t: sum(1 for r in results if r.target == t) for t in [*old, *new]}
        assert min(counts.values()) >= 10, counts
        assert len(by_old.results) > stopped_tcp

        # a Service made now gets its address from the new range
        operator(c, "apply", "-f", "-", stdin=json.dumps(service("web2", TCP_PORT, "TCP")))
        web2 = json.loads(operator(c, "get", "svc", "web2", "-o", "json"))["spec"]["clusterIP"]
        assert web2.startswith("10.112."), web2
        # with nobody on the old DNS address any more, it is released after the grace
        # period and the old range goes with it
        assert wait_for(lambda: released("dns"), RELEASE_WAIT_SECONDS), operator(
            c, "servicecidr", "status"
        )

        def ranges() -> list[str]:
            listing = json.loads(operator(c, "get", "servicecidrs", "-o", "json"))
            return sorted(i["metadata"]["name"] for i in listing["items"])

        assert wait_for(lambda: "kubernetes" not in ranges(), RELEASE_WAIT_SECONDS), ranges()
    finally:
        for sender in senders:
            sender.halt.set()
        for sender in senders:
            sender.join(timeout=60)
        for server in servers:
            probe.stop(server)
