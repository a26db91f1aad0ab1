"""CPU per flow of the agent's Hubble path in one process: records → flow ring → batches.

No root, no kernel: ``--flows`` records of ``struct flow_event`` like the ``flows`` bench's (UDP
from one pod to another's many ports, dropped by a deny rule) go through two paths in the same
run, each ``--rounds`` times (medians reported):

* baseline, the object path (the agent's path before wire-first flows, kept for flows added
  as objects): ``events.decode`` each record, ``Parser.parse`` it into a ``flow.Flow`` (from
  a template), ``FlowStore.add_flow`` (which now serializes the response once, at ingest,
  where the old path serialized it for each batch reader; filters run on each Flow);
* eager wire-first (the reader's path until 2026-12-02): ``Parser.shape_of`` +
  ``FlowStore.add_shape`` each record, its response serialized at once (``entry.wire``);
* lazy wire-first, the reader's path: the records as one ring-buffer block
  (``events.BLOCK_KEYED``), ``EventReader._process`` (``Parser.shaper`` +
  ``FlowStore.add_shape_net``: the response is serialized when first read, so its cost moves
  from ingest to the batches row, and a flow never read never pays it).

Then, for each store, ``FlowBatchService``'s stream of the whole ring with the ``flows``
bench's filter (``--from-pod``; ``number`` = the ring) is read and each batch serialized as
gRPC would. CPU is ``time.process_time`` of this process; the table gives microseconds per
flow and wire-first / baseline. The ring-buffer read itself (libbpf callback vs direct reads)
is not in it (see ``bench.flows`` for the whole path with a kernel).

Output: a table, and JSON in ``--results-dir`` (``hubble_agent-<UTC time>.json`` and
``hubble_agent-latest.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import socket
import statistics
import time
from collections import deque
from typing import Any

from bench.datapath import host_info, rel, write_results
from cilia.hubble.flow import flow_pb2
from cilia.hubble.observer import observer_pb2
from cilia_agent.hubble import events
from cilia_agent.hubble.enrich import MemoryResolver
from cilia_agent.hubble.flowstore import FlowStore
from cilia_agent.hubble.parser import BootClock, Parser
from cilia_agent.hubble.reader import EventReader
from cilia_testkit import ROOT

DEFAULT_FLOWS = 4095
DEFAULT_ROUNDS = 5
DEFAULT_RESULTS_DIR = ROOT / "bench" / "results"
NODE = "bench-node"
CLIENT, SERVER = ("10.253.0.2", 1, 1001, "cilia-bench-fl-client"), ("10.253.0.3", 2, 1002, "srv")


def resolver() -> MemoryResolver:
    """The client and server pods of namespace ``bench`` with their identities."""
    r = MemoryResolver(kernel_interface_names=False)
    for ip, ep, identity, name in (CLIENT, SERVER):
        labels = [f"k8s:app={name}", "k8s:io.kubernetes.pod.namespace=bench"]
        r.set_endpoint(
            ep, ipv4=ip, identity=identity, namespace="bench", pod_name=name, labels=labels
        )
        r.set_identity(identity, labels)
        r.set_interface(100 + ep, f"lxc{ep:011d}")
    return r


def records(n: int) -> list[bytes]:
    """``n`` drops (POLICY_DENY) of UDP from the client to ports 1024.. of the server."""
    return [
        events.FlowEvent(
            ts_ns=1_000_000_000 + i * 50_000, saddr=CLIENT[0], daddr=SERVER[0], sport=40000,
            dport=1024 + i % 64000, proto=events.IPPROTO_UDP, event_type=events.EVENT_DROP,
            verdict=events.VERDICT_DROPPED, drop_reason=events.DROP_POLICY_DENY,
            src_identity=CLIENT[2], dst_identity=SERVER[2], ep_id=CLIENT[1], ifindex=101,
            length=60, direction=events.DIR_EGRESS, is_reply=False, tcp_flags=0,
        ).pack()
        for i in range(n)
    ]  # fmt: skip


def stream_request(n: int) -> observer_pb2.GetFlowsRequest:
    """The ``flows`` bench's observe filter over the last ``n`` flows."""
    return observer_pb2.GetFlowsRequest(
        number=n, whitelist=[flow_pb2.FlowFilter(source_pod=[f"bench/{CLIENT[3]}"])]
    )


async def read_batches(store: FlowStore, n: int) -> int:
    sent = 0
    async for batch in store.get_flow_batches(stream_request(n)):
        batch.SerializeToString()
        sent += len(batch.responses)
    return sent


def parser() -> Parser:
    return Parser(resolver(), NODE, BootClock(offset_ns=1_764_633_600 * 1_000_000_000))


async def one_round(raw: list[bytes]) -> dict[str, float]:
    """CPU µs per flow of each stage of both paths."""
    n = len(raw)
    cpu = time.process_time
    out: dict[str, float] = {}

    objects = FlowStore(n, node_name=NODE)
    p = parser()
    t0 = cpu()
    for record in raw:
        objects.add_flow(p.parse(events.decode(record)))
    out["baseline_ingest"] = (cpu() - t0) / n * 1e6
    t0 = cpu()
    assert await read_batches(objects, n) == n
    out["baseline_batches"] = (cpu() - t0) / n * 1e6

    eager = FlowStore(n, node_name=NODE)
    p = parser()
    tuples = [events.RECORD.unpack(record) for record in raw]
    t0 = cpu()
    for f in tuples:
        _ = eager.add_shape(*p.shape_of(f), socket.ntohs(f[3]), socket.ntohs(f[4])).wire
    out["eager_ingest"] = (cpu() - t0) / n * 1e6
    t0 = cpu()
    assert await read_batches(eager, n) == n
    out["eager_batches"] = (cpu() - t0) / n * 1e6

    wire = FlowStore(n, node_name=NODE)
    reader = EventReader(object(), parser(), wire, queue_size=n)  # type: ignore[arg-type]
    header = events.FLOW_EVENT_SIZE.to_bytes(4, "little") + bytes(4)
    block = b"".join(header + record for record in raw)
    t0 = cpu()
    await reader._process(deque([(block, n)]), 0)
    out["wire_ingest"] = (cpu() - t0) / n * 1e6
    t0 = cpu()
    assert await read_batches(wire, n) == n
    out["wire_batches"] = (cpu() - t0) / n * 1e6
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit status 0."""
    ap = argparse.ArgumentParser(prog="python -m bench hubble_agent", description=__doc__)
    ap.add_argument(
        "--flows",
        type=int,
        default=DEFAULT_FLOWS,
        help=f"flows per round, 2^n-1 (default {DEFAULT_FLOWS})",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=DEFAULT_ROUNDS,
        help=f"rounds, medians reported (default {DEFAULT_ROUNDS})",
    )
    ap.add_argument(
        "--results-dir", type=pathlib.Path, default=DEFAULT_RESULTS_DIR, help="where the JSON goes"
    )
    args = ap.parse_args(argv)  # fmt: skip
    raw = records(args.flows)
    rounds = [asyncio.run(one_round(raw)) for _ in range(args.rounds)]
    med = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    rows: list[dict[str, Any]] = []
    for stage in ("ingest", "batches"):
        base, eager, new = (med[f"{k}_{stage}"] for k in ("baseline", "eager", "wire"))
        rows.append({"stage": stage, "baseline_us": base, "eager_us": eager, "wire_us": new, "ratio": new / base})  # fmt: skip
    totals = {k: med[f"{k}_ingest"] + med[f"{k}_batches"] for k in ("baseline", "eager", "wire")}
    rows.append({"stage": "total", "baseline_us": totals["baseline"], "eager_us": totals["eager"], "wire_us": totals["wire"], "ratio": totals["wire"] / totals["baseline"]})  # fmt: skip
    print(f"{args.flows} flows per round, {args.rounds} rounds (medians), CPU of this process")
    print(f"{'stage':<10} {'baseline us/flow':>17} {'eager wire us/flow':>19} {'lazy wire us/flow':>18} {'lazy/baseline':>14}")  # fmt: skip
    for row in rows:
        print(
            f"{row['stage']:<10} {row['baseline_us']:>17.2f} {row['eager_us']:>19.2f} "
            f"{row['wire_us']:>18.2f} {row['ratio']:>13.2f}x"
        )
    report = {"host": host_info(), "flows": args.flows, "rounds": rounds, "medians": rows}
    path = write_results("hubble_agent", report, args.results_dir)
    print(f"wrote {rel(path)}")
    return 0
