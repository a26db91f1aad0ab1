"""Measure cilia-cni start-up: wall time per invocation and import time per path.

Run from the repo root: ``.venv/bin/python services/cni/tests/integration/measure_startup.py [-n 30]``.
Prints a Markdown table (median/p90 wall ms and median CPU ms — user + system of the
child, steadier than wall time on a loaded host — over N execs of the real binary) and the
``python -X importtime`` cumulative cost of the top-level imports on the VERSION and ADD
paths. ADD/DEL talk to the contract-level agent peer of the tests (no datapath work),
so their numbers are the plugin's own overhead.

A/B: ``--binary A --binary B`` execs A and B alternately (one of each per round, so both
see the same host load) and prints a row per binary; e.g. an older checkout's plugin
against this one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from cni_testlib import AgentServer, cni_binary, cni_env, netconf


def _wall_ms(
    binaries: list[str], env: dict[str, str], stdin: bytes, n: int, before: Callable[[], None]
) -> list[tuple[float, float, float]]:
    """Per binary: (median wall ms, p90 wall ms, median CPU ms) of ``n`` execs, the
    binaries taking turns."""
    full = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env}
    samples: list[list[float]] = [[] for _ in binaries]
    cpu: list[list[float]] = [[] for _ in binaries]
    for _ in range(n):
        for i, binary in enumerate(binaries):
            before()  # forget earlier attachments so every ADD succeeds
            start = time.perf_counter()
            proc = subprocess.Popen(
                [binary],
                env=full,
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            assert proc.stdin is not None
            proc.stdin.write(stdin)
            proc.stdin.close()
            _, _, usage = os.wait4(proc.pid, 0)
            proc.returncode = 0  # reaped by wait4
            samples[i].append((time.perf_counter() - start) * 1000)
            cpu[i].append((usage.ru_utime + usage.ru_stime) * 1000)
    out = []
    for wall, used in zip(samples, cpu, strict=True):
        wall.sort()
        out.append(
            (statistics.median(wall), wall[int(len(wall) * 0.9) - 1], statistics.median(used))
        )
    return out


def _importtime(env: dict[str, str], stdin: bytes) -> list[tuple[str, float]]:
    full = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env}
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", cni_binary()],
        input=stdin,
        env=full,
        capture_output=True,
        check=False,
    )
    top = []
    for line in proc.stderr.decode().splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        _, cumulative, name = (part.strip() for part in line.split(":", 1)[1].split("|"))
        if cumulative.isdigit() and not name.startswith(" ") and name == name.lstrip():
            raw_name = line.split("|")[2]
            if raw_name.startswith(" ") and not raw_name.startswith("  "):
                top.append((name, int(cumulative) / 1000))
    return sorted(top, key=lambda item: -item[1])[:8]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-n", type=int, default=30, help="execs per scenario (default 30)")
    parser.add_argument(
        "--binary",
        action="append",
        help="plugin to exec (repeat for an interleaved A/B; default: the installed cilia-cni)",
    )
    args = parser.parse_args()
    binaries = args.binary or [cni_binary()]
    server = AgentServer().start()
    absent = os.path.join(server.dir, "absent.sock")
    try:
        good = json.dumps(netconf(server.socket)).encode()
        no_name = netconf(server.socket)
        del no_name["name"]
        scenarios = [
            ("VERSION", {"CNI_COMMAND": "VERSION"}, b'{"cniVersion":"1.0.0"}'),
            ("error: missing `name` (7)", cni_env("ADD"), json.dumps(no_name).encode()),
            (
                "error: ADD, agent socket absent (11)",
                cni_env("ADD"),
                json.dumps(netconf(absent)).encode(),
            ),
            ("ADD via agent peer (result)", cni_env("ADD"), good),
            ("DEL via agent peer", cni_env("DEL"), good),
        ]
        print(
            f"| path (n={args.n}) | binary | median ms | p90 ms | median CPU ms |\n"
            "|---|---|---|---|---|"
        )
        for label, env, stdin in scenarios:
            rows = _wall_ms(binaries, env, stdin, args.n, server.servicer.reset)
            for binary, (med, p90, cpu) in zip(binaries, rows, strict=True):
                print(f"| {label} | {binary} | {med:.1f} | {p90:.1f} | {cpu:.1f} |")
        print(f"\n| python baseline (`python -c pass`, n={args.n}) | ", end="")
        samples = []
        for _ in range(args.n):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", "pass"], check=False)
            samples.append((time.perf_counter() - start) * 1000)
        print(f"{statistics.median(samples):.1f} ms median |")
        for label, env, stdin in (scenarios[0], scenarios[3]):
            server.servicer.reset()
            print(f"\n-X importtime, {label}: top-level imports (cumulative ms)")
            for name, ms in _importtime(env, stdin):
                print(f"  {name:40s} {ms:7.1f}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
