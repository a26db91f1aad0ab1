"""The operator in Kubernetes mode at scale, against a real kube-apiserver (issue 12).

``python -m bench k8s_operator [--nodes 500] [--pods 5000] [--apps 50]``

Set-up: etcd + kube-apiserver (:class:`cilia_testkit.kubeapi.KubeAPI`, built by ``make
setup``) with the CRDs of ``deploy/helm/cilia/files/crds``; ``cilia-operator serve --store
kubernetes --enable-cilium-endpoint-slice`` as its own process (RSS measurable). ``--nodes``
simulated agents register over gRPC and each holds a ``PodService.WatchPods`` stream;
``--pods`` Pods (``--apps`` distinct ``app`` labels, spread round-robin over the nodes) are
created through the API server.

Measured:

* **pods delivered**: seconds from the first Pod create until every simulated agent's stream
  holds all of its node's Pods with their labels (what an agent builds identities from);
  baseline in the same run: the same number of Pods seen by ONE plain watch of the API
  server (``kubernetes`` client, list + watch) — the ratio says what the operator's per-node
  fan-out costs over the API server's own delivery;
* **identities + endpoints**: each agent allocates its Pods' identities
  (``IdentityService.Allocate``) and records their endpoints (``UpsertEndpoint``), 32 calls
  in flight: seconds until done, and calls/s;
* **CES**: seconds until the CiliumEndpointSlices hold every endpoint, their number, the
  operator's slice writes (``cilium_operator_ces_sync_total``) and writes/s;
* **operator RSS** (``VmRSS``) after all of it.

Output: a table and JSON in ``--results-dir`` (``k8s_operator-<UTC time>.json`` and
``k8s_operator-latest.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import pathlib
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any

from cilia_testkit import ROOT

NAMESPACE = "bench"


def _rss_kib(pid: int) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _metric(address: str, name: str, labels: str = "") -> float:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (not labels or labels in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _create_pods(kube: Any, nodes: list[str], pods: int, apps: int) -> float:
    """Create the Pods (8 threads); returns the monotonic time of the first create."""
    from kubernetes import client

    api_client = kube.client()
    core: Any = client.CoreV1Api(api_client)

    def body(i: int) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"pod-{i}", "labels": {"app": f"app-{i % apps}"}},
            "spec": {
                "nodeName": nodes[i % len(nodes)],
                "automountServiceAccountToken": False,
                "containers": [{"name": "main", "image": "registry.invalid/none:1"}],
            },
        }

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: core.create_namespaced_pod(NAMESPACE, body(i)), range(pods)))
    api_client.close()
    return started


def _plain_watch(kube: Any, pods: int, done: threading.Event, out: dict[str, float]) -> None:
    """One list + watch of the namespace's Pods; records when ``pods`` are seen."""
    from kubernetes import client, watch

    api_client = kube.client()
    core: Any = client.CoreV1Api(api_client)
    listed: Any = core.list_namespaced_pod(NAMESPACE)
    seen = {p.metadata.name for p in listed.items}
    w: Any = watch.Watch()  # type: ignore[no-untyped-call]
    for event in w.stream(
        core.list_namespaced_pod,
        NAMESPACE,
        resource_version=listed.metadata.resource_version,
        timeout_seconds=600,
    ):
        seen.add(event["object"].metadata.name)
        if len(seen) >= pods:
            out["plain_watch_done"] = time.monotonic()
            break
    w.stop()
    api_client.close()
    done.set()


async def _agents(address: str, nodes: list[str], per_node: dict[str, int]) -> dict[str, Any]:
    """Register every node, hold one WatchPods stream each; returns when every stream holds
    its node's Pods: ``{"done": monotonic time, "labels": {node: {pod: app}}}``."""
    import grpc

    from cilia.controlplane.v1 import controlplane_pb2 as pb
    from cilia.controlplane.v1 import controlplane_pb2_grpc as pb_grpc

    channel = grpc.aio.insecure_channel(address)
    node_stub: Any = pb_grpc.NodeServiceStub(channel)  # type: ignore[no-untyped-call]
    gate = asyncio.Semaphore(32)

    async def register(i: int, name: str) -> None:
        async with gate:
            await node_stub.Register(
                pb.RegisterRequest(node_name=name, addresses=[f"10.99.{i // 250}.{i % 250 + 1}"])
            )

    await asyncio.gather(*(register(i, n) for i, n in enumerate(nodes)))
    pods_stub: Any = pb_grpc.PodServiceStub(channel)  # type: ignore[no-untyped-call]
    held: dict[str, dict[str, str]] = {n: {} for n in nodes}
    complete = asyncio.Event()
    remaining = {n for n in nodes if per_node.get(n)}

    async def follow(name: str) -> None:
        stream = pods_stub.WatchPods(pb.WatchPodsRequest(node_name=name))
        async for response in stream:
            for event in response.events:
                if event.type == pb.EVENT_TYPE_UPSERT:
                    held[name][event.pod.name] = event.pod.labels.get("app", "")
            if len(held[name]) >= per_node.get(name, 0) and name in remaining:
                remaining.discard(name)
                if not remaining:
                    complete.set()

    tasks = [asyncio.create_task(follow(n)) for n in nodes]
    return {"channel": channel, "tasks": tasks, "complete": complete, "held": held}


async def _endpoints(
    address: str, held: dict[str, dict[str, str]], concurrency: int = 32
) -> tuple[float, int]:
    """Allocate each pod's identity and upsert its endpoint; (seconds, calls)."""
    import grpc

    from cilia.controlplane.v1 import controlplane_pb2 as pb
    from cilia.controlplane.v1 import controlplane_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        ids: Any = pb_grpc.IdentityServiceStub(channel)  # type: ignore[no-untyped-call]
        eps: Any = pb_grpc.EndpointServiceStub(channel)  # type: ignore[no-untyped-call]
        gate = asyncio.Semaphore(concurrency)
        calls = 0
        counter = iter(range(1, 1 << 30))

        async def one(node: str, pod: str, app: str) -> None:
            nonlocal calls
            n = next(counter)
            labels = [f"k8s:app={app}", f"k8s:io.kubernetes.pod.namespace={NAMESPACE}"]
            async with gate:
                identity = await ids.Allocate(pb.AllocateRequest(node_name=node, labels=labels))
                await eps.UpsertEndpoint(
                    pb.UpsertEndpointRequest(
                        endpoint=pb.EndpointRecord(
                            namespace=NAMESPACE,
                            name=pod,
                            node_name=node,
                            ipv4=f"10.{100 + n // 65025}.{n // 255 % 255}.{n % 255 + 1}",
                            identity=identity.identity.id,
                            labels=labels,
                            endpoint_id=n,
                        )
                    )
                )
                calls += 2

        started = time.monotonic()
        await asyncio.gather(
            *(one(node, pod, app) for node, pods in held.items() for pod, app in pods.items())
        )
        return time.monotonic() - started, calls


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole benchmark (see the module docstring)."""
    from cilia_testkit.kubeapi import KubeAPI
    from cilia_testkit.stack import Stack

    nodes = [f"node-{i:04d}" for i in range(args.nodes)]
    per_node = {n: 0 for n in nodes}
    for i in range(args.pods):
        per_node[nodes[i % len(nodes)]] += 1
    with (
        tempfile.TemporaryDirectory(prefix="cilia-bench-k8s-") as tmp,
        KubeAPI(pathlib.Path(tmp)) as kube,
    ):
        kube.install_crds(ROOT / "deploy" / "helm" / "cilia" / "files" / "crds")
        objects = {
            "apiVersion": "v1",
            "kind": "List",
            "items": [
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
                # no controller manager runs: the namespace's default ServiceAccount, which
                # Pod admission requires, is made here
                {"apiVersion": "v1", "kind": "ServiceAccount",
                 "metadata": {"name": "default", "namespace": NAMESPACE}},
            ],
        }  # fmt: skip
        kube.kubectl("apply", "-f", "-", input=json.dumps(objects))
        stack = Stack(
            "bench-k8s",
            agents=0,
            relay=False,
            auto_pool=False,
            operator_args=(
                "--store", "kubernetes", "--kubeconfig", str(kube.kubeconfig),
                "--enable-cilium-endpoint-slice", "--identity-gc-interval", "0",
            ),
        )  # fmt: skip
        stack.start()
        try:
            loop = asyncio.new_event_loop()
            agents = loop.run_until_complete(_agents(stack.operator_address, nodes, per_node))
            plain: dict[str, float] = {}
            plain_done = threading.Event()
            watcher = threading.Thread(
                target=_plain_watch, args=(kube, args.pods, plain_done, plain), daemon=True
            )
            watcher.start()
            time.sleep(1.0)  # the watch and the streams are open before the first Pod
            started = _create_pods(kube, nodes, args.pods, args.apps)
            created = time.monotonic()
            loop.run_until_complete(asyncio.wait_for(agents["complete"].wait(), args.timeout))
            delivered = time.monotonic()
            plain_done.wait(args.timeout)
            seconds, calls = loop.run_until_complete(
                _endpoints(stack.operator_address, agents["held"])
            )
            ces_started = time.monotonic()
            ces_count = ces_members = 0
            while time.monotonic() - ces_started < args.timeout:
                listed = kube.kubectl("get", "ciliumendpointslices", "-o", "json", check=False)
                items = json.loads(listed.stdout or '{"items": []}')["items"]
                ces_count = len(items)
                ces_members = sum(len(i.get("endpoints") or []) for i in items)
                if ces_members >= args.pods:
                    break
                time.sleep(1.0)
            ces_done = time.monotonic()
            metrics = stack.operator_metrics
            writes = _metric(metrics, "cilium_operator_ces_sync_total", 'outcome="success"')
            pid = stack.pid("operator")
            rss = _rss_kib(pid) if pid else 0
            for task in agents["tasks"]:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*agents["tasks"], return_exceptions=True))
            loop.run_until_complete(agents["channel"].close())
            loop.close()
        finally:
            stack.stop()
    pods_s = delivered - started
    plain_s = plain.get("plain_watch_done", float("nan")) - started
    ces_s = ces_done - started
    return {
        "nodes": args.nodes,
        "pods": args.pods,
        "apps": args.apps,
        "create_pods_s": round(created - started, 2),
        "pods_delivered_s": round(pods_s, 2),
        "plain_watch_s": round(plain_s, 2),
        "delivered_over_plain_watch": round(pods_s / plain_s, 3) if plain_s > 0 else None,
        "identities_and_endpoints_s": round(seconds, 2),
        "operator_calls_per_s": round(calls / seconds, 1) if seconds else None,
        "ces_complete_s_after_first_pod": round(ces_s, 2),
        "ces_slices": ces_count,
        "ces_members": ces_members,
        "ces_writes": int(writes),
        "ces_writes_per_s": round(writes / max(ces_done - ces_started + seconds, 1e-9), 1),
        "operator_rss_mib": round(rss / 1024, 1),
    }


def main(argv: list[str]) -> int:
    """CLI entry (``python -m bench k8s_operator``)."""
    parser = argparse.ArgumentParser(prog="python -m bench k8s_operator", description=__doc__)
    parser.add_argument("--nodes", type=int, default=500, help="simulated agents (default 500)")
    parser.add_argument("--pods", type=int, default=5000, help="Pods (default 5000)")
    parser.add_argument("--apps", type=int, default=50, help="distinct app labels (50)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per phase (600)")
    parser.add_argument(
        "--results-dir", type=pathlib.Path, default=ROOT / "bench" / "results", help="JSON out"
    )
    args = parser.parse_args(argv)
    result = run(args)
    for key, value in result.items():
        print(f"{key:<34} {value}")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    text = json.dumps(result, indent=2)
    (args.results_dir / f"k8s_operator-{stamp}.json").write_text(text)
    (args.results_dir / "k8s_operator-latest.json").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
