"""CNI ADD/DEL latency: ``cilia-cni`` through the real stack vs the reference plugins.

For each plugin set, ``--pods`` pods (netns ``cilia-bench-cni-N``) are added one after the other,
then deleted one after the other; each exec is timed from fork to exit, exactly as the
runtime sees it (``scripts/cnirun.py`` builds the environment and stdin as libcni does,
DEL gets the cached ADD result as ``prevResult``). ``--warmup`` extra pods per set are run
first and not counted (page cache, first bridge creation, the agent's first allocation).

Baseline: Debian's reference ``bridge`` + ``host-local`` plugins from ``--reference-dir``
(``/usr/lib/cni``, package containernetworking-plugins), on bridge ``cbench0`` and subnet
``--reference-subnet``. Also measured: ``cilia-cni`` VERSION (interpreter start + imports,
no agent round trip), which bounds how fast any ADD can be.

Output: a table of p50/p99/mean in milliseconds, the ratio cilia/reference, and JSON in
``--results-dir`` (``cni_latency-<UTC time>.json`` and ``cni_latency-latest.json``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import pathlib
import platform
import shutil
import statistics
import sys
import tempfile
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import cnirun  # noqa: E402

DEFAULT_PODS = 50
DEFAULT_WARMUP = 3
DEFAULT_VERSION_RUNS = 20
DEFAULT_REFERENCE_DIR = pathlib.Path("/usr/lib/cni")
DEFAULT_REFERENCE_SUBNET = "10.252.0.0/24"
DEFAULT_RESULTS_DIR = ROOT / "bench" / "results"
DEFAULT_UP_TIMEOUT_SECONDS = 90
REFERENCE_BRIDGE = "cbench0"
NETNS_PREFIX = "cilia-bench-cni-"


class BenchError(RuntimeError):
    """A benchmark could not run (missing plugin, stack failed, an exec failed)."""


def percentile(samples: list[float], pct: float) -> float:
    """Nearest-rank percentile of ``samples`` (``pct`` in 0..100); p99 of 50 samples = max."""
    ordered = sorted(samples)
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[rank - 1]


def summarize(seconds: list[float]) -> dict[str, float]:
    """p50, p99, mean, min, max in milliseconds, plus the sample count."""
    ms = [s * 1000 for s in seconds]
    return {
        "n": len(ms),
        "p50_ms": round(percentile(ms, 50), 2),
        "p99_ms": round(percentile(ms, 99), 2),
        "mean_ms": round(statistics.fmean(ms), 2),
        "min_ms": round(min(ms), 2),
        "max_ms": round(max(ms), 2),
    }


def run_pods(
    label: str,
    conflist: dict[str, Any],
    plugin: pathlib.Path,
    cni_path: str,
    pods: int,
    warmup: int,
) -> dict[str, list[float]]:
    """ADD ``warmup + pods`` pods sequentially, then DEL them; return timed samples.

    Raises:
        BenchError: an ADD or DEL failed (its CNI error is included).
    """
    created = [cnirun.Pod(name=f"{NETNS_PREFIX}{i}") for i in range(warmup + pods)]
    add: list[float] = []
    delete: list[float] = []
    try:
        for i, pod in enumerate(created):
            pod.create_netns()
            out = pod.add(conflist, plugin=plugin, cni_path=cni_path)
            if out.returncode != 0:
                raise BenchError(f"{label} ADD {pod.name} exited {out.returncode}: {out.stdout}")
            if i >= warmup:
                add.append(out.seconds)
        for i, pod in enumerate(created):
            out = pod.delete(conflist, plugin=plugin, cni_path=cni_path)
            if out.returncode != 0:
                raise BenchError(f"{label} DEL {pod.name} exited {out.returncode}: {out.stdout}")
            pod.result = None
            if i >= warmup:
                delete.append(out.seconds)
    finally:
        for pod in created:
            if pod.result is not None:
                pod.delete(conflist, plugin=plugin, cni_path=cni_path)
            pod.destroy_netns()
    return {"add": add, "del": delete}


def bench_reference(args: argparse.Namespace) -> dict[str, list[float]]:
    """Reference bridge + host-local, state in a temporary dir, bridge removed afterwards."""
    for name in ("bridge", "host-local"):
        if not (args.reference_dir / name).exists():
            raise BenchError(
                f"{args.reference_dir / name} missing: apt-get install containernetworking-plugins"
            )
    with tempfile.TemporaryDirectory(prefix="cilia-bench-") as state:
        conflist = {
            "cniVersion": "1.0.0",
            "name": "cilia-bench-reference",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": REFERENCE_BRIDGE,
                    "isGateway": True,
                    "ipMasq": False,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": args.reference_subnet}]],
                        "dataDir": state,
                    },
                }
            ],
        }
        try:
            return run_pods(
                "reference",
                conflist,
                args.reference_dir / "bridge",
                str(args.reference_dir),
                args.pods,
                args.warmup,
            )
        finally:
            cnirun.sh("ip", "link", "del", REFERENCE_BRIDGE, check=False)


def bench_cilia(args: argparse.Namespace) -> dict[str, list[float]]:
    """cilia-cni through the stack (started here unless already running, then stopped)."""
    started = False
    if cnirun.stack("status", check=False).returncode != 0:
        cnirun.stack("down")
        up = cnirun.stack("up", "--fresh", "--timeout", str(args.up_timeout), check=False)
        if up.returncode != 0:
            raise BenchError(f"scripts/stack.sh up failed:\n{up.stderr}")
        started = True
    try:
        conflist = cnirun.load_conflist()
        samples = run_pods(
            "cilia", conflist, cnirun.CILIA_CNI, str(cnirun.VENV_BIN), args.pods, args.warmup
        )
        version: list[float] = []
        for _ in range(args.version_runs):
            out = cnirun.invoke(
                "VERSION",
                stdin=json.dumps({"cniVersion": "1.0.0"}),
                container_id=None,
                netns=None,
                ifname=None,
            )
            if out.returncode != 0:
                raise BenchError(f"cilia-cni VERSION exited {out.returncode}: {out.stdout}")
            version.append(out.seconds)
        samples["version"] = version
        return samples
    finally:
        if started and not args.keep_stack:
            cnirun.stack("down", check=False)


def table(rows: list[tuple[str, str, dict[str, float]]]) -> str:
    """Render ``(plugin, op, summary)`` rows as a fixed-width table."""
    head = f"{'plugin':<28} {'op':<8} {'n':>4} {'p50 ms':>9} {'p99 ms':>9} {'mean ms':>9}"
    lines = [head, "-" * len(head)]
    for plugin, op, s in rows:
        lines.append(
            f"{plugin:<28} {op:<8} {int(s['n']):>4} {s['p50_ms']:>9.1f} "
            f"{s['p99_ms']:>9.1f} {s['mean_ms']:>9.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return 0 on success, 1 when it could not run."""
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--pods",
        type=int,
        default=DEFAULT_PODS,
        help=f"timed pods per plugin set (default {DEFAULT_PODS})",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=DEFAULT_WARMUP,
        help=f"untimed pods first (default {DEFAULT_WARMUP})",
    )
    parser.add_argument(
        "--version-runs",
        type=int,
        default=DEFAULT_VERSION_RUNS,
        help=f"timed cilia-cni VERSION execs (default {DEFAULT_VERSION_RUNS})",
    )
    parser.add_argument(
        "--reference-dir",
        type=pathlib.Path,
        default=DEFAULT_REFERENCE_DIR,
        help=f"reference plugins (default {DEFAULT_REFERENCE_DIR})",
    )
    parser.add_argument(
        "--reference-subnet",
        default=DEFAULT_REFERENCE_SUBNET,
        help=f"host-local subnet (default {DEFAULT_REFERENCE_SUBNET})",
    )
    parser.add_argument(
        "--results-dir",
        type=pathlib.Path,
        default=DEFAULT_RESULTS_DIR,
        help="where the JSON goes (default bench/results)",
    )
    parser.add_argument(
        "--up-timeout",
        type=int,
        default=DEFAULT_UP_TIMEOUT_SECONDS,
        help=f"seconds for the stack to start (default {DEFAULT_UP_TIMEOUT_SECONDS})",
    )
    parser.add_argument(
        "--keep-stack", action="store_true", help="leave a stack started by the benchmark running"
    )
    args = parser.parse_args(argv)
    if args.pods < 1 or args.warmup < 0:
        parser.error("--pods must be >= 1 and --warmup >= 0")
    if os.geteuid() != 0:
        print("the CNI benchmark needs root (netns, veth, bridges)", file=sys.stderr)
        return 1
    for stale in cnirun.list_netns(NETNS_PREFIX):
        cnirun.delete_netns(stale)
    try:
        print(
            f"reference bridge + host-local: {args.pods} pods (+{args.warmup} warm-up) ...",
            flush=True,
        )
        ref = bench_reference(args)
        print(f"cilia-cni via the stack: {args.pods} pods (+{args.warmup} warm-up) ...", flush=True)
        cil = bench_cilia(args)
    except (BenchError, cnirun.CniRunError, OSError) as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1

    summary = {
        "reference": {op: summarize(v) for op, v in ref.items()},
        "cilia": {op: summarize(v) for op, v in cil.items()},
    }
    ratio = {
        f"{op}_{q}": round(summary["cilia"][op][f"{q}_ms"] / summary["reference"][op][f"{q}_ms"], 2)
        for op in ("add", "del")
        for q in ("p50", "p99")
    }
    rows = [
        ("reference bridge+host-local", "ADD", summary["reference"]["add"]),
        ("reference bridge+host-local", "DEL", summary["reference"]["del"]),
        ("cilia-cni (stack)", "ADD", summary["cilia"]["add"]),
        ("cilia-cni (stack)", "DEL", summary["cilia"]["del"]),
        ("cilia-cni", "VERSION", summary["cilia"]["version"]),
    ]
    print()
    print(table(rows))
    print()
    print("ratio cilia / reference (lower is better, 1.0 = parity):")
    for op in ("add", "del"):
        print(
            f"  {op.upper():<4} p50 {ratio[f'{op}_p50']:>6.2f}x   p99 {ratio[f'{op}_p99']:>6.2f}x"
        )

    now = dt.datetime.now(dt.UTC)
    report = {
        "benchmark": "cni_latency",
        "time": now.isoformat(timespec="seconds"),
        "host": {
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "parameters": {
            "pods": args.pods,
            "warmup": args.warmup,
            "reference_dir": str(args.reference_dir),
            "reference_subnet": args.reference_subnet,
            "sequential": True,
        },
        "summary": summary,
        "ratio_cilia_over_reference": ratio,
        "samples_ms": {
            name: {op: [round(s * 1000, 3) for s in v] for op, v in data.items()}
            for name, data in (("reference", ref), ("cilia", cil))
        },
    }
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / f"cni_latency-{now.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    shutil.copy(path, args.results_dir / "cni_latency-latest.json")
    print(f"\nwrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return 0
