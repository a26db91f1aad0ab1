"""The operator's responsiveness while it is busy (issue 31): GetStatus latency while a
1,000-pool apply runs and while a 10,000-policy listing streams.

``python -m bench operator_busy [--pools 1000] [--policies 10000] [--interval 0.01]``

Black box: a private ``redis-server`` and ``cilia-operator serve`` as their own processes
(in a process group stopped at exit, also after a failure); everything over gRPC, as a
user or an agent would.

Phases, each sampling ``IPAMService.GetStatus`` every ``--interval`` seconds from a client
of its own (a fresh call each time, 10 s deadline):

* **idle**: nothing else runs (the baseline);
* **apply**: ``ResourceService.Apply`` of one manifest of ``--pools`` CiliumPodIPPools
  (disjoint /24s, mask 26), sampled from its start to its answer;
* **listing**: ``--policies`` CiliumNetworkPolicies of ~5 KB are stored first (applied in
  manifests of 500), then ``PolicyService.WatchPolicies`` is read to ``synced`` by a client
  with grpcio's default limits, sampled from its start to ``synced``.

Reported per phase: samples, p50, p99 and max in ms (a call past its 10 s deadline counts
at that length, and the number of those is reported), the phase's own duration, and p99
over the idle p99 (goal: p99 ≤ 100 ms while busy). JSON in ``--results-dir``
(``operator_busy-<UTC time>.json``, ``operator_busy-latest.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable
from typing import Any

import grpc

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia.controlplane.v1 import controlplane_pb2_grpc as pb_grpc
from cilia_testkit import ROOT, procs
from cilia_testkit.redis import RedisServer

GOAL_P99_MS = 100.0
DEADLINE_S = 10.0  # of each GetStatus; one past it counts as a sample of this length


def pools_manifest(count: int) -> str:
    """``count`` CiliumPodIPPools, each one /24 of 10.64.0.0/10 carved into /26 blocks."""
    docs = []
    for i in range(count):
        cidr = f"10.{64 + i // 256}.{i % 256}.0/24"
        docs.append(
            "apiVersion: cilium.io/v2alpha1\nkind: CiliumPodIPPool\n"
            f"metadata: {{name: bench-{i:04d}}}\n"
            f"spec: {{ipv4: {{cidrs: [{cidr}], maskSize: 26}}}}\n"
        )
    return "---\n".join(docs)


def policy(i: int) -> dict[str, Any]:
    """A CiliumNetworkPolicy of about 5 KB as stored JSON."""
    rules = [
        {
            "fromEndpoints": [
                {"matchLabels": {f"app.example.com/tier-{j}": f"frontend-{i}-{j}-" + "x" * 40}}
            ],
            "toPorts": [{"ports": [{"port": str(8000 + j), "protocol": "TCP"}]}],
        }
        for j in range(27)
    ]
    return {
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumNetworkPolicy",
        "metadata": {"name": f"bench-{i:05d}", "namespace": "default"},
        "spec": {"endpointSelector": {"matchLabels": {"app": f"backend-{i}"}}, "ingress": rules},
    }


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def sample_status(address: str, busy: Awaitable[Any], interval: float) -> dict[str, Any]:
    """GetStatus latencies (ms) every ``interval`` s until ``busy`` is done; its duration."""
    latencies: list[float] = []
    failed = 0
    started = time.monotonic()
    task = asyncio.ensure_future(busy)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.IPAMServiceStub(channel)  # type: ignore[no-untyped-call]
        await stub.GetStatus(pb.IPAMServiceGetStatusRequest(), timeout=10)  # connected
        while not task.done():
            t0 = time.monotonic()
            try:
                await stub.GetStatus(pb.IPAMServiceGetStatusRequest(), timeout=DEADLINE_S)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
                failed += 1  # counted at the deadline: the sample is at least that slow
            latencies.append((time.monotonic() - t0) * 1000)
            await asyncio.sleep(interval)
    await task  # its failure is the bench's failure
    return {
        "samples": len(latencies),
        "p50_ms": round(statistics.median(latencies), 2) if latencies else None,
        "p99_ms": round(percentile(latencies, 0.99), 2) if latencies else None,
        "max_ms": round(max(latencies), 2) if latencies else None,
        "phase_s": round(time.monotonic() - started, 2),
        "deadline_exceeded": failed,
    }


async def phases(address: str, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with grpc.aio.insecure_channel(address) as channel:
        resources = pb_grpc.ResourceServiceStub(channel)  # type: ignore[no-untyped-call]
        out["idle"] = await sample_status(address, asyncio.sleep(args.idle), args.interval)

        apply = resources.Apply(pb.ApplyRequest(manifest=pools_manifest(args.pools)), timeout=600)
        out["apply"] = await sample_status(address, apply, args.interval)

        for start in range(0, args.policies, 500):
            chunk = [json.dumps(policy(i)) for i in range(start, min(args.policies, start + 500))]
            await resources.Apply(pb.ApplyRequest(manifest="\n---\n".join(chunk)), timeout=600)

        async def listing() -> int:
            async with grpc.aio.insecure_channel(address) as watcher:  # grpcio's defaults
                stub = pb_grpc.PolicyServiceStub(watcher)  # type: ignore[no-untyped-call]
                stream = stub.WatchPolicies(pb.WatchPoliciesRequest())
                events = 0
                async for response in stream:
                    events += len(response.events)
                    if response.synced:
                        stream.cancel()
                        return events
            raise RuntimeError("WatchPolicies ended before synced")

        out["listing"] = await sample_status(address, listing(), args.interval)
    idle = out["idle"]["p99_ms"] or 1.0
    for name in ("apply", "listing"):
        p99 = out[name]["p99_ms"] or 0.0
        out[name]["p99_over_idle"] = round(p99 / idle, 1)
        out[name]["goal_met"] = p99 <= GOAL_P99_MS
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    binary = pathlib.Path(sys.executable).with_name("cilia-operator")
    with RedisServer() as redis_server, tempfile.TemporaryDirectory(prefix="bench-op-") as tmp:
        log = pathlib.Path(tmp) / "operator.log"
        with log.open("wb") as sink:
            proc = procs.spawn(
                [str(binary), "serve", "--store", redis_server.url, "--listen", "127.0.0.1:0",
                 "--prometheus-serve-addr", "", "--identity-gc-interval", "0"],
                stdout=sink, stderr=sink, new_session=True,
            )  # fmt: skip
        try:
            line = procs.wait_for_file_line(
                log, lambda text: (procs.listening(text) or ("", ""))[0] == "grpc",
                timeout=60, proc=proc,
            )  # fmt: skip
            found = procs.listening(line)
            assert found is not None
            result = asyncio.run(phases(found[1], args))
        finally:
            procs.stop(proc, group=True)
    result["pools"], result["policies"] = args.pools, args.policies
    return result


def main(argv: list[str]) -> int:
    """CLI entry (``python -m bench operator_busy``)."""
    parser = argparse.ArgumentParser(prog="python -m bench operator_busy", description=__doc__)
    parser.add_argument("--pools", type=int, default=1000, help="pools in the apply (1000)")
    parser.add_argument("--policies", type=int, default=10000, help="policies listed (10000)")
    parser.add_argument("--interval", type=float, default=0.01, help="s between GetStatus")
    parser.add_argument("--idle", type=float, default=3.0, help="s of idle baseline (3)")
    parser.add_argument(
        "--results-dir", type=pathlib.Path, default=ROOT / "bench" / "results", help="JSON out"
    )
    args = parser.parse_args(argv)
    result = run(args)
    print(f"{'phase':<8} {'samples':>7} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} "
          f"{'phase s':>8} {'p99/idle':>8} {'>10 s':>6}")  # fmt: skip
    for name in ("idle", "apply", "listing"):
        r = result[name]
        print(f"{name:<8} {r['samples']:>7} {r['p50_ms']:>8} {r['p99_ms']:>8} {r['max_ms']:>8} "
              f"{r['phase_s']:>8} {r.get('p99_over_idle', 1.0):>8} "
              f"{r['deadline_exceeded']:>6}")  # fmt: skip
    print(f"goal p99 <= {GOAL_P99_MS:g} ms while busy: apply "
          f"{'met' if result['apply']['goal_met'] else 'NOT met'}, listing "
          f"{'met' if result['listing']['goal_met'] else 'NOT met'}")  # fmt: skip
    args.results_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    text = json.dumps(result, indent=2)
    (args.results_dir / f"operator_busy-{stamp}.json").write_text(text)
    (args.results_dir / "operator_busy-latest.json").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
