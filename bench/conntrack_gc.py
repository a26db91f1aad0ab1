"""Cost of one conntrack GC pass over a full ``cilia_ct`` (the agent's ``conntrack.gc``).

Root and BPF: the agent's ``bpf_lxc.o`` is loaded with ``--entries`` conntrack entries (its
pins in a fresh bpffs directory, removed after), and the map is filled through the agent's
own typed handle with that many TCP entries, every ``--expired-every``-th one closed (FIN)
and idle for an hour, the others fresh. Each of ``--rounds`` rounds measures, back to back,
one ``conntrack.gc.collect`` pass at the present clock (read the map, then read each expired
entry again and delete it) in two ways, the deleted entries written back after each (not
timed):

* baseline, the map read one entry at a time (``PinnedMap.items()``:
  ``bpf_map_get_next_key`` + ``bpf_map_lookup_elem`` per entry, two syscalls);
* the agent's pass: the map read 4096 entries per ``BPF_MAP_LOOKUP_BATCH``
  (``PinnedMap.batch_items()``).
 Reported: milliseconds per pass,
microseconds per entry, pass / baseline, and what one pass costs as a share of one CPU at
upstream's shortest dynamic interval (10 s) and its starting one (5 min). CPU is
``time.process_time`` of this process (the syscalls' kernel time included).

Output: a table, and JSON in ``--results-dir`` (``conntrack_gc-<UTC time>.json`` and
``conntrack_gc-latest.json``).
"""

from __future__ import annotations

import argparse
import pathlib
import socket
import statistics
import struct
import time
import uuid
from collections.abc import Iterator
from typing import Any

from bench.datapath import host_info, rel, write_results
from cilia_agent.conntrack.gc import MIN_INTERVAL, STARTING_INTERVAL, Timeouts, collect
from cilia_agent.datapath.layout import CtKey, CtValue
from cilia_agent.datapath.libbpf import PinnedMap
from cilia_agent.datapath.loader import Datapath, DatapathConfig, remove_pins
from cilia_agent.datapath.objects import default_bpf_dir
from cilia_testkit import ROOT

DEFAULT_ENTRIES = 262144
DEFAULT_EXPIRED_EVERY = 4
DEFAULT_ROUNDS = 3
TH_SYN, TH_ACK, TH_FIN = 0x02, 0x10, 0x01


def entries(count: int, expired_every: int, now_ns: int) -> list[tuple[CtKey, CtValue]]:
    """``count`` TCP entries from 10.0.0.0/8 sources to one server port; every
    ``expired_every``-th closed (FIN) and idle for an hour, the others seen at ``now_ns``."""
    out = []
    server = struct.unpack("<I", socket.inet_aton("10.255.0.1"))[0]
    port = socket.htons(8080)
    for i in range(count):
        addr = struct.unpack(
            "<I", socket.inet_aton(f"10.{i >> 16 & 0xFF}.{i >> 8 & 0xFF}.{i & 0xFF}")
        )[0]
        key = CtKey(saddr=addr, daddr=server, sport=socket.htons(30000 + i % 30000), dport=port,
                    proto=6, dir=1)  # fmt: skip
        closed = i % expired_every == 0
        seen = now_ns - 3600 * 10**9 if closed else now_ns
        value = CtValue(created_ns=seen, last_seen_ns=seen, packets=3, reply_seen=1,
                        tcp_flags_seen=TH_SYN | TH_ACK | (TH_FIN if closed else 0))  # fmt: skip
        out.append((key, value))
    return out


class OneByOne:
    """The map as the pass would read it without batches (the baseline)."""

    def __init__(self, ct: PinnedMap[CtKey, CtValue]) -> None:
        self.ct = ct
        self.lookup, self.delete = ct.lookup, ct.delete

    def batch_items(self) -> Iterator[tuple[CtKey, CtValue]]:
        return self.ct.items()


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the process exit status."""
    ap = argparse.ArgumentParser(
        prog="python -m bench conntrack_gc",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--entries", type=int, default=DEFAULT_ENTRIES,
                    help=f"conntrack entries, the map's size too (default {DEFAULT_ENTRIES})")  # fmt: skip
    ap.add_argument("--expired-every", type=int, default=DEFAULT_EXPIRED_EVERY,
                    help=f"every N-th entry expired (default {DEFAULT_EXPIRED_EVERY})")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                    help=f"rounds, medians reported (default {DEFAULT_ROUNDS})")  # fmt: skip
    ap.add_argument("--results-dir", type=pathlib.Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    if args.entries < 1024 or args.expired_every < 1 or args.rounds < 1:
        ap.error("--entries >= 1024, --expired-every >= 1 and --rounds >= 1")

    pin_dir = pathlib.Path("/sys/fs/bpf") / f"cilia-bench-ct-{uuid.uuid4().hex[:8]}"
    config = DatapathConfig(bpf_dir=default_bpf_dir(), pin_dir=pin_dir, ct_max=args.entries)
    started = time.monotonic()
    base_ms: list[float] = []
    pass_ms: list[float] = []
    deleted: list[int] = []
    try:
        dp = Datapath.load(config)
        try:
            ct = dp.ct_map
            table = entries(args.entries, args.expired_every, time.monotonic_ns())
            for key, value in table:
                ct[key] = value
            expired = [(k, v) for k, v in table if v.tcp_flags_seen & TH_FIN]
            for rnd in range(1, args.rounds + 1):
                for way, times in ((OneByOne(ct), base_ms), (ct, pass_ms)):
                    t0 = time.process_time()
                    result = collect(way, time.monotonic_ns(), Timeouts())
                    times.append((time.process_time() - t0) * 1e3)
                    deleted.append(sum(result.deleted.values()))
                    for key, value in expired:
                        ct[key] = value
                print(f"  round {rnd}: one by one {base_ms[-1]:.0f} ms, batched "
                      f"{pass_ms[-1]:.0f} ms; {deleted[-1]} deleted", flush=True)  # fmt: skip
        finally:
            dp.close()
    finally:
        remove_pins(pin_dir)

    base, gc_pass = statistics.median(base_ms), statistics.median(pass_ms)
    n = args.entries
    print()
    print(f"conntrack GC over {n} entries, 1 in {args.expired_every} expired; median of "
          f"{args.rounds} round(s); CPU of this process")  # fmt: skip
    print(f"{'':24}{'ms/pass':>10}{'us/entry':>10}")
    print(f"{'one by one (baseline)':24}{base:>10.0f}{base * 1e3 / n:>10.2f}")
    print(f"{'batched (the agent)':24}{gc_pass:>10.0f}{gc_pass * 1e3 / n:>10.2f}")
    print(f"pass / baseline {gc_pass / base:.2f}x; one pass = {gc_pass / 10 / MIN_INTERVAL:.1f} % "
          f"of a CPU every {MIN_INTERVAL:.0f} s, {gc_pass / 10 / STARTING_INTERVAL:.2f} % every "
          f"{STARTING_INTERVAL / 60:.0f} min")  # fmt: skip
    data: dict[str, Any] = {
        "benchmark": "conntrack_gc",
        "host": host_info(),
        "parameters": vars(args) | {"results_dir": rel(args.results_dir)},
        "wall_seconds": round(time.monotonic() - started, 1),
        "one_by_one_ms": base_ms,
        "pass_ms": pass_ms,
        "deleted": deleted,
        "median": {"one_by_one_ms": base, "pass_ms": gc_pass, "ratio": gc_pass / base},
    }
    path = write_results("conntrack_gc", data, args.results_dir)
    print(f"wrote {rel(path)}")
    return 0
