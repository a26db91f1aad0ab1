"""CNI ADD/DEL latency and throughput: ``cilia-cni`` through a real stack vs the reference
plugins, in the same run.

For each plugin set and each ``--concurrency`` level (default 1 and 10), ``--pods`` pods
(netns ``cilia-bench-cni-N``, created before the clock starts) are added by C parallel
workers, then deleted the same way; each exec is timed from fork to exit, exactly as the
runtime sees it (``cilia_testkit.cni`` builds the environment and stdin as libcni does,
DEL gets the cached ADD result as ``prevResult``), and pods/s is pods / wall time of the
phase. ``--warmup`` extra pods per set are run first and not counted.

Baseline: Debian's reference ``bridge`` + ``host-local`` plugins from ``--reference-dir``
(``/usr/lib/cni``, package containernetworking-plugins), on bridge ``cbench0`` and subnet
``--reference-subnet``. Also measured: ``cilia-cni`` VERSION of each set (wall, and CPU
per exec: interpreter start + imports, no agent round trip), the floor under any ADD.

Plugin sets, all against the same stack in the same run:

- ``cilia-cni``: the venv launcher (``.venv/bin/cilia-cni``: sh + the venv's python3);
- ``frozen``: the self-contained build (services/cni/freeze: PyInstaller-collected onedir
  bundle started by its own launcher, no Python needed on the host), installed by ``deploy/images/cni-install.sh`` into a temporary
  ``/opt/cni``-like tree and exec'd through the wrapper it writes, as a host runs it
  (``--frozen-cni PATH`` to measure another executable, ``--no-frozen`` to skip it);
- ``static``: the static executable the image ships as ``cilia-cni`` (services/cni/shim,
  ``make cni-shim``; ``--static-cni PATH`` for another, ``--no-static`` to skip it) with
  ``cilia-cni serve`` (the plugin logic, forking a warm child per call) started beside the
  stack's agent socket for this set; the server's CPU (its reaped children's included) is
  reported as ``cni-server``;
- ``--compare-cni PATH``: another build of cilia-cni (e.g. an older checkout's, through a
  small launcher), so a change is measured before/after under the same load.

The cilia stack is private by default (redis, operator, agent, relay of this checkout on
free ports, pods from ``--pool-cidr``; see ``bench.datapath.private_stack``).

Output: a table of p50/p90/p99/mean ms and pods/s per (plugin, op, concurrency), the ratios
cilia/reference, the CPU per pod (user + system ms) of the plugin execs and, for cilia, of
the stack's agent, operator and redis over each timed phase — on a shared 2-core host CPU
per pod is steadier than wall time, and it bounds pods/s at concurrency — and JSON in ``--results-dir`` (``cni_latency-<UTC time>.json`` and
``cni_latency-latest.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import pathlib
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench import datapath
from cilia_testkit import ROOT, VENV_BIN, cni, host

DEFAULT_PODS = 50
DEFAULT_WARMUP = 3
DEFAULT_VERSION_RUNS = 20
DEFAULT_REFERENCE_DIR = pathlib.Path("/usr/lib/cni")
DEFAULT_REFERENCE_SUBNET = "10.252.0.0/24"
DEFAULT_RESULTS_DIR = ROOT / "bench" / "results"
DEFAULT_CONCURRENCY = "1,10"
#: Pod CIDR of the private stack (the datapath/flows benches use 10.253.0.0/16).
DEFAULT_POOL_CIDR = "10.237.0.0/16"
REFERENCE_BRIDGE = "cbench0"
STATIC_CNI = ROOT / "build" / "cni" / "cilia-cni"
#: Seconds the CNI server may take to listen.
SERVER_START_SECONDS = 30.0
#: Seconds to wait after a phase so the server has reaped (and accounted) its children: its
#: accept loop reaps them at least once a second (``serve_forever(poll_interval=1.0)``).
SERVER_REAP_WAIT_SECONDS = 1.2
FREEZE_BUILDER = ROOT / "services" / "cni" / "freeze" / "build.py"
CNI_INSTALLER = ROOT / "deploy" / "images" / "cni-install.sh"
NETNS_PREFIX = "cilia-bench-cni-"
#: Stack processes whose CPU per pod is reported beside the plugin's.
STACK_PROCESSES = ("agent", "operator", "redis")


class BenchError(RuntimeError):
    """A benchmark could not run (missing plugin, stack failed, an exec failed)."""


def percentile(samples: list[float], pct: float) -> float:
    """Nearest-rank percentile of ``samples`` (``pct`` in 0..100); p99 of 50 samples = max."""
    ordered = sorted(samples)
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[rank - 1]


def summarize(seconds: list[float]) -> dict[str, float]:
    """p50, p90, p99, mean, min, max in milliseconds, plus the sample count."""
    ms = [s * 1000 for s in seconds]
    return {
        "n": len(ms),
        "p50_ms": round(percentile(ms, 50), 2),
        "p90_ms": round(percentile(ms, 90), 2),
        "p99_ms": round(percentile(ms, 99), 2),
        "mean_ms": round(statistics.fmean(ms), 2),
        "min_ms": round(min(ms), 2),
        "max_ms": round(max(ms), 2),
    }


def children_cpu_seconds() -> float:
    """User + system CPU seconds of this process's finished (waited-for) children: in a
    timed phase only plugin execs finish, so a phase's delta over its pods is the plugin's
    CPU per pod (a delegated IPAM plugin's included: the reference ``host-local``)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _timed_phase(
    pods: list[cni.Pod], op: Any, concurrency: int
) -> tuple[list[cni.CniOutcome], float]:
    """Run ``op(pod)`` for every pod on ``concurrency`` workers; outcomes and wall seconds."""
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        outcomes = list(pool.map(op, pods))
    return outcomes, time.perf_counter() - start


def run_pods(
    label: str,
    conflist: dict[str, Any],
    plugin: pathlib.Path,
    cni_path: str,
    pods: int,
    warmup: int,
    concurrency: int,
    processes: dict[str, int | None] | None = None,
    readers: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """ADD ``pods`` pods on ``concurrency`` workers, then DEL them (after ``warmup``
    untimed pods); return ``{"add": [s], "del": [s], "add_wall": s, "del_wall": s,
    "add_cpu_ms": {"plugin": ms per pod, <name>: ms per pod, ...}, "del_cpu_ms": {...},
    "add_loadavg": 1-minute load average before the phase, "del_loadavg": ...}``: the CPU
    per pod of the plugin execs and of each of ``processes`` (name → pid, e.g. the stack's
    agent, operator and redis) over the timed phase, and of each of ``readers`` (name → a
    function returning CPU seconds so far, e.g. the CNI server with its reaped children). The load average says how much else
    the (shared) host ran: sets measured at different loads compare badly.

    Raises:
        BenchError: an ADD or DEL failed (its CNI error is included).
    """
    created = [cni.Pod(name=f"{NETNS_PREFIX}{concurrency}-{i}") for i in range(warmup + pods)]
    out: dict[str, Any] = {}
    try:
        for pod in created:
            pod.create_netns()

        def add(pod: cni.Pod) -> cni.CniOutcome:
            return pod.add(conflist, plugin=plugin, cni_path=cni_path)

        def delete(pod: cni.Pod) -> cni.CniOutcome:
            outcome = pod.delete(conflist, plugin=plugin, cni_path=cni_path)
            if outcome.returncode == 0:
                pod.result = None
            return outcome

        for name, op in (("add", add), ("del", delete)):
            _timed_phase(created[:warmup], op, concurrency)
            out[f"{name}_loadavg"] = round(os.getloadavg()[0], 2)  # the host, before the phase
            before = {k: datapath.process_cpu_seconds(v) for k, v in (processes or {}).items()}
            if readers:
                time.sleep(SERVER_REAP_WAIT_SECONDS)
            read_before = {k: f() for k, f in (readers or {}).items()}
            plugin_before = children_cpu_seconds()
            outcomes, wall = _timed_phase(created[warmup:], op, concurrency)
            cpu = {"plugin": children_cpu_seconds() - plugin_before}
            for key, pid in (processes or {}).items():
                cpu[key] = datapath.process_cpu_seconds(pid) - before[key]
            if readers:
                time.sleep(SERVER_REAP_WAIT_SECONDS)
            for key, f in (readers or {}).items():
                cpu[key] = f() - read_before[key]
            out[f"{name}_cpu_ms"] = {k: round(v * 1000 / pods, 2) for k, v in cpu.items()}
            for pod, outcome in zip(created[warmup:], outcomes, strict=True):
                if outcome.returncode != 0:
                    raise BenchError(
                        f"{label} {name.upper()} {pod.name} exited {outcome.returncode}: "
                        f"{outcome.stdout}"
                    )
            out[name] = [o.seconds for o in outcomes]
            out[f"{name}_wall"] = wall
    finally:
        for pod in created:
            if pod.result is not None:
                pod.delete(conflist, plugin=plugin, cni_path=cni_path)
            pod.destroy_netns()
    return out


def bench_reference(args: argparse.Namespace, concurrency: int) -> dict[str, Any]:
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
                concurrency,
            )
        finally:
            host.sh("ip", "link", "del", REFERENCE_BRIDGE, check=False)


def bench_cilia(
    args: argparse.Namespace,
    stack: datapath.Stack,
    concurrency: int,
    plugin: pathlib.Path = cni.CILIA_CNI,
    readers: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """cilia-cni (``plugin``) through ``stack`` (its agent's conflist, plus a ``log-file`` of
    ours whose ``durationMs``/``clientImportMs``/``agentMs`` fields say where each ADD's time
    went)."""
    conflist = cni.load_conflist(stack.conflist)
    with tempfile.TemporaryDirectory(prefix="cilia-bench-cnilog-") as logdir:
        log_file = pathlib.Path(logdir) / "cni.log"
        plugins = [dict(conflist["plugins"][0], **{"log-file": str(log_file)})]
        data = run_pods(
            "cilia",
            dict(conflist, plugins=plugins),
            plugin,
            str(VENV_BIN),
            args.pods,
            args.warmup,
            concurrency,
            {name: stack.pid(name) for name in STACK_PROCESSES},
            readers,
        )
        records = [json.loads(line) for line in log_file.read_text().splitlines() if line]
        data["log"] = [r for r in records if str(r.get("msg", "")).endswith("succeeded")]
    return data


def breakdown(data: dict[str, Any]) -> dict[str, float]:
    """Median ms of an ADD's parts: exec wall, in-plugin run, agent-client import (HTTP/2
    client + generated messages), agent call, and the rest (interpreter start, plugin
    imports, exit = wall - run)."""
    adds = [r for r in data["log"] if r.get("command") == "ADD"][-len(data["add"]) :]

    def med(key: str) -> float:
        values = [float(r[key]) for r in adds if key in r]
        return round(statistics.median(values), 1) if values else 0.0

    wall = round(statistics.median(data["add"]) * 1000, 1)
    run = med("durationMs")
    return {
        "wall_ms": wall,
        "interpreter_start_imports_exit_ms": round(wall - run, 1),
        "run_ms": run,
        # grpcImportMs: the field's name before the grpcio-free client (--compare-cni)
        "client_import_ms": med("clientImportMs") or med("grpcImportMs"),
        "agent_call_ms": med("agentMs"),
    }


def install_frozen(dest: pathlib.Path) -> pathlib.Path:
    """Build (or take from the cache) the frozen bundle and install it under ``dest`` with
    ``cilia-cni-install`` as a host gets it; return the installed ``<dest>/bin/cilia-cni``.

    Raises:
        BenchError: the bundle could not be built or installed.
    """
    res = subprocess.run(
        [str(VENV_BIN / "python"), str(FREEZE_BUILDER)], capture_output=True, text=True
    )
    if res.returncode != 0:
        raise BenchError(f"the frozen cilia-cni could not be built: {res.stderr.strip()}")
    bundle = pathlib.Path(res.stdout.strip()).parent
    env = dict(
        os.environ,
        CILIA_CNI_BUNDLE=str(bundle),
        CILIA_CNI_BIN_DIR=str(dest / "bin"),
        CILIA_CNI_LIB_DIR=str(dest / "cilia"),
        CILIA_CNI_HOST_LIB_DIR=str(dest / "cilia"),
    )
    res = subprocess.run(["sh", str(CNI_INSTALLER)], env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise BenchError(f"cilia-cni-install failed: {res.stderr.strip()}")
    return dest / "bin" / "cilia-cni"


def tree_cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` and of its children it has waited for, seconds."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def cni_server(stack: datapath.Stack) -> Iterator[int]:
    """``cilia-cni serve`` on ``cilia-cni.sock`` beside the stack's agent socket (where the
    static executable looks), in its own process group, ended on exit; yields its pid.

    Raises:
        BenchError: the stack's agent socket is unknown or the server did not listen.
    """
    if stack.agent_socket is None:
        raise BenchError("the static cilia-cni needs a private stack (its agent socket)")
    path = stack.agent_socket.parent / "cilia-cni.sock"
    path.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [str(VENV_BIN / "python"), "-m", "cilia_cni", "serve", "--socket", str(path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        process_group=0,
    )
    try:
        deadline = time.monotonic() + SERVER_START_SECONDS
        while not path.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError("cilia-cni serve did not listen")
            time.sleep(0.02)
        yield proc.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
        path.unlink(missing_ok=True)


def bench_version(
    args: argparse.Namespace, plugin: pathlib.Path = cni.CILIA_CNI
) -> tuple[list[float], float]:
    """Timed ``plugin`` VERSION execs (no agent involved): the wall seconds of each and the
    mean CPU ms (user + system) per exec."""
    version: list[float] = []
    cpu_before = children_cpu_seconds()
    for _ in range(args.version_runs):
        out = cni.invoke(
            "VERSION",
            stdin=json.dumps({"cniVersion": "1.0.0"}),
            container_id=None,
            netns=None,
            ifname=None,
            plugin=plugin,
        )
        if out.returncode != 0:
            raise BenchError(f"cilia-cni VERSION exited {out.returncode}: {out.stdout}")
        version.append(out.seconds)
    return version, round((children_cpu_seconds() - cpu_before) * 1000 / len(version), 2)


def table(rows: list[tuple[str, str, int, dict[str, float]]]) -> str:
    """Render ``(plugin, op, concurrency, summary)`` rows as a fixed-width table."""
    head = (
        f"{'plugin':<28} {'op':<8} {'conc':>4} {'n':>4} {'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9} "
        f"{'mean ms':>9} {'pods/s':>8}"
    )
    lines = [head, "-" * len(head)]
    for plugin, op, conc, s in rows:
        rate = f"{s['pods_per_s']:>8.1f}" if "pods_per_s" in s else f"{'':>8}"
        lines.append(
            f"{plugin:<28} {op:<8} {conc or '':>4} {int(s['n']):>4} {s['p50_ms']:>9.1f} "
            f"{s['p90_ms']:>9.1f} "
            f"{s['p99_ms']:>9.1f} {s['mean_ms']:>9.1f} {rate}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return 0 on success, 1 when it could not run."""
    parser = argparse.ArgumentParser(
        prog="python -m bench cni_latency",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--pods",
        type=int,
        default=DEFAULT_PODS,
        help=f"timed pods per plugin set and concurrency (default {DEFAULT_PODS})",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=DEFAULT_WARMUP,
        help=f"untimed pods first (default {DEFAULT_WARMUP})",
    )
    parser.add_argument(
        "--concurrency",
        default=DEFAULT_CONCURRENCY,
        help=f"comma-separated parallel workers per run (default {DEFAULT_CONCURRENCY})",
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
        "--frozen-cni",
        type=pathlib.Path,
        help="the frozen cilia-cni to measure (default: services/cni/freeze's bundle, "
        "installed by cilia-cni-install into a temporary tree)",
    )
    parser.add_argument(
        "--no-frozen",
        action="store_true",
        help="do not measure the frozen cilia-cni",
    )
    parser.add_argument(
        "--static-cni",
        type=pathlib.Path,
        default=STATIC_CNI,
        help=f"the static cilia-cni to measure with cilia-cni serve (default {STATIC_CNI})",
    )
    parser.add_argument(
        "--no-static",
        action="store_true",
        help="do not measure the static cilia-cni",
    )
    parser.add_argument(
        "--compare-cni",
        type=pathlib.Path,
        help="another cilia-cni executable to measure in the same run (default: none)",
    )
    datapath.add_stack_flags(parser)
    parser.set_defaults(pool_cidr=DEFAULT_POOL_CIDR)
    args = parser.parse_args(argv)
    try:
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        parser.error(f"--concurrency must be comma-separated integers, got {args.concurrency!r}")
    if args.pods < 1 or args.warmup < 0 or not levels or min(levels) < 1:
        parser.error("--pods and every --concurrency must be >= 1, --warmup >= 0")
    if os.geteuid() != 0:
        print("the CNI benchmark needs root (netns, veth, bridges)", file=sys.stderr)
        return 1
    datapath.clear_stale_netns(NETNS_PREFIX)
    ref: dict[int, dict[str, Any]] = {}
    cil: dict[int, dict[str, Any]] = {}
    cmp: dict[int, dict[str, Any]] = {}
    frz: dict[int, dict[str, Any]] = {}
    stc: dict[int, dict[str, Any]] = {}
    static_version: list[float] = []
    frozen_version: list[float] = []
    compare_version: list[float] = []
    version_cpu: dict[str, float] = {}
    try:
        with (
            tempfile.TemporaryDirectory(prefix="cilia-bench-optcni-") as optcni,
            datapath.stack_running(args) as stack,
            contextlib.ExitStack() as servers,
        ):
            readers: dict[str, Any] = {}
            if not args.no_static:
                if not args.static_cni.exists():
                    raise BenchError(f"{args.static_cni} missing: make cni-shim")
                server_pid = servers.enter_context(cni_server(stack))
                readers["cni-server"] = lambda: tree_cpu_seconds(server_pid)
            frozen: pathlib.Path | None = None
            if not args.no_frozen:
                frozen = args.frozen_cni or install_frozen(pathlib.Path(optcni))
            print(f"stack: {datapath.describe(stack)}", flush=True)
            for conc in levels:
                print(f"reference bridge + host-local: {args.pods} pods, concurrency {conc} ...")
                ref[conc] = bench_reference(args, conc)
                print(f"cilia-cni: {args.pods} pods, concurrency {conc} ...", flush=True)
                cil[conc] = bench_cilia(args, stack, conc)
                if frozen is not None:
                    print(f"frozen {frozen}: {args.pods} pods, concurrency {conc} ...", flush=True)
                    frz[conc] = bench_cilia(args, stack, conc, frozen)
                if readers:
                    print(f"static {args.static_cni}: {args.pods} pods, concurrency {conc} ...")
                    stc[conc] = bench_cilia(args, stack, conc, args.static_cni, readers)
                if args.compare_cni:
                    print(f"{args.compare_cni}: {args.pods} pods, concurrency {conc} ...")
                    cmp[conc] = bench_cilia(args, stack, conc, args.compare_cni)
            version, version_cpu["cilia"] = bench_version(args)
            if frozen is not None:
                frozen_version, version_cpu["frozen"] = bench_version(args, frozen)
            if readers:
                static_version, version_cpu["static"] = bench_version(args, args.static_cni)
            if args.compare_cni:
                compare_version, version_cpu["compare"] = bench_version(args, args.compare_cni)
    except (BenchError, datapath.BenchError, cni.CniRunError, OSError) as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1

    def summary_of(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for op in ("add", "del"):
            s: dict[str, Any] = dict(summarize(data[op]))
            s["pods_per_s"] = round(len(data[op]) / data[f"{op}_wall"], 2)
            s["cpu_ms_per_pod"] = data[f"{op}_cpu_ms"]
            s["loadavg_1m_before"] = data[f"{op}_loadavg"]
            out[op] = s
        return out

    summary: dict[str, Any] = {
        "reference": {str(c): summary_of(ref[c]) for c in levels},
        "cilia": {str(c): summary_of(cil[c]) for c in levels},
        "cilia_version": summarize(version),
        "version_cpu_ms_per_exec": version_cpu,
        "cilia_add_breakdown_median": {str(c): breakdown(cil[c]) for c in levels},
    }
    if frz:
        summary["frozen"] = {str(c): summary_of(frz[c]) for c in levels}
        summary["frozen_version"] = summarize(frozen_version)
        summary["frozen_add_breakdown_median"] = {str(c): breakdown(frz[c]) for c in levels}
    if stc:
        summary["static"] = {str(c): summary_of(stc[c]) for c in levels}
        summary["static_version"] = summarize(static_version)
        summary["static_add_breakdown_median"] = {str(c): breakdown(stc[c]) for c in levels}
    if cmp:
        summary["compare"] = {str(c): summary_of(cmp[c]) for c in levels}
        summary["compare_add_breakdown_median"] = {str(c): breakdown(cmp[c]) for c in levels}
        summary["compare_plugin"] = str(args.compare_cni)
        summary["compare_version"] = summarize(compare_version)

    def ratios(key: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for conc in levels:
            r, c = summary["reference"][str(conc)], summary[key][str(conc)]
            for op in ("add", "del"):
                for q in ("p50", "p90", "p99"):
                    out[f"{op}_{q}_c{conc}"] = round(c[op][f"{q}_ms"] / r[op][f"{q}_ms"], 2)
                out[f"{op}_pods_per_s_c{conc}"] = round(
                    c[op]["pods_per_s"] / r[op]["pods_per_s"], 3
                )
        return out

    ratio = ratios("cilia")
    ratio_sets = [("cilia-cni (venv launcher)", ratio)]
    frozen_ratio = ratios("frozen") if frz else {}
    if frz:
        ratio_sets.append(("cilia-cni frozen", frozen_ratio))
    if stc:
        ratio_sets.append(("cilia-cni static", ratios("static")))

    def sets_of(conc: int) -> list[tuple[str, str]]:
        sets = [("reference bridge+host-local", "reference"), ("cilia-cni", "cilia")]
        if frz:
            sets.append(("cilia-cni frozen", "frozen"))
        if stc:
            sets.append(("cilia-cni static", "static"))
        if cmp:
            sets.append(("compare " + args.compare_cni.name, "compare"))
        return sets

    rows: list[tuple[str, str, int, dict[str, float]]] = []
    for conc in levels:
        for name, key in sets_of(conc):
            for op in ("add", "del"):
                rows.append((name, op.upper(), conc, summary[key][str(conc)][op]))
    rows.append(("cilia-cni", "VERSION", 0, summary["cilia_version"]))
    if frz:
        rows.append(("cilia-cni frozen", "VERSION", 0, summary["frozen_version"]))
    if stc:
        rows.append(("cilia-cni static", "VERSION", 0, summary["static_version"]))
    if cmp:
        rows.append(("compare " + args.compare_cni.name, "VERSION", 0, summary["compare_version"]))
    print()
    print(table(rows))
    for label, rset in ratio_sets:
        print()
        print(f"ratio {label} / reference (latency: lower is better; pods/s: higher is better):")
        for conc in levels:
            for op in ("add", "del"):
                print(
                    f"  {op.upper():<4} c={conc:<3} p50 {rset[f'{op}_p50_c{conc}']:>6.2f}x   "
                    f"p90 {rset[f'{op}_p90_c{conc}']:>6.2f}x   "
                    f"p99 {rset[f'{op}_p99_c{conc}']:>6.2f}x   "
                    f"pods/s {rset[f'{op}_pods_per_s_c{conc}']:>6.3f}x"
                )

    print(
        "\nCPU per VERSION exec, ms (user + system, mean): "
        + ", ".join(f"{k} {v:.1f}" for k, v in version_cpu.items())
    )
    print(
        "\nCPU per pod, ms (user + system; plugin: its execs; the stack's processes beside it;"
        " load: the host's 1-minute load average before the phase):"
    )
    for conc in levels:
        for name, key in sets_of(conc):
            for op in ("add", "del"):
                cpu = summary[key][str(conc)][op]["cpu_ms_per_pod"]
                parts = "  ".join(f"{k} {v:.1f}" for k, v in cpu.items())
                load = summary[key][str(conc)][op]["loadavg_1m_before"]
                print(
                    f"  {name:<28} {op.upper():<4} c={conc:<3} total {sum(cpu.values()):6.1f}  "
                    f"{parts}  (load {load:.1f})"
                )

    breakdowns = [("cilia-cni", "cilia_add_breakdown_median")]
    if frz:
        breakdowns.append(("cilia-cni frozen", "frozen_add_breakdown_median"))
    if stc:
        breakdowns.append(("cilia-cni static", "static_add_breakdown_median"))
    if cmp:
        breakdowns.append((str(args.compare_cni), "compare_add_breakdown_median"))
        print("ratio compare / cilia-cni (> 1: cilia-cni is faster):")
        for conc in levels:
            for op in ("add", "del"):
                new, old = summary["cilia"][str(conc)][op], summary["compare"][str(conc)][op]
                print(
                    f"  {op.upper():<4} c={conc:<3} p50 {old['p50_ms'] / new['p50_ms']:>6.2f}x   "
                    f"p99 {old['p99_ms'] / new['p99_ms']:>6.2f}x"
                )
    for label, key in breakdowns:
        print(f"\nwhere a {label} ADD's time goes (medians, ms):")
        for conc in levels:
            b = summary[key][str(conc)]
            print(
                f"  c={conc:<3} wall {b['wall_ms']:.1f} = interpreter start + imports + exit "
                f"{b['interpreter_start_imports_exit_ms']:.1f} + run {b['run_ms']:.1f} "
                f"(agent client import {b['client_import_ms']:.1f}, "
                f"agent call {b['agent_call_ms']:.1f})"
            )

    now = dt.datetime.now(dt.UTC)
    report = {
        "benchmark": "cni_latency",
        "time": now.isoformat(timespec="seconds"),
        "host": {
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_1m": round(os.getloadavg()[0], 2),
        },
        "parameters": {
            "pods": args.pods,
            "warmup": args.warmup,
            "concurrency": levels,
            "reference_dir": str(args.reference_dir),
            "reference_subnet": args.reference_subnet,
            "stack": args.stack,
        },
        "summary": summary,
        "ratio_cilia_over_reference": ratio,
        "ratio_frozen_over_reference": frozen_ratio,
        "samples_ms": {
            name: {
                str(c): {op: [round(s * 1000, 3) for s in data[c][op]] for op in ("add", "del")}
                for c in levels
            }
            for name, data in (("reference", ref), ("cilia", cil), ("frozen", frz))
            if data
        },
    }
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / f"cni_latency-{now.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    shutil.copy(path, args.results_dir / "cni_latency-latest.json")
    print(f"\nwrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return 0
