"""``make demo``: the standalone stack end to end, as a container runtime would drive it.

Steps (each under a heading; any failure exits 1 after cleaning up):
  1. start the stack: a private :class:`cilia_testkit.stack.Stack` (own run dir, sockets,
     pins, pool, ports the servers bind), stopped at the end; a ``make up`` stack already
     running is reused and left up; with ``KEEP=1`` the ``make up`` stack (``scripts/stack.sh
     up``) is started and left running;
  2. create ``--pods`` pods as netns ``cilia-demo-<pid>-N`` by exec'ing ``.venv/bin/cilia-cni`` ADD
     with the conflist the agent wrote (see ``cilia_testkit.cni``);
  3. ping pod↔pod and pod↔node;
  4. show ``cilia-agent endpoint list``;
  5. DEL every pod, show ``cilia-agent status`` and check the addresses were released;
  6. stop the stack it started, unless ``KEEP=1`` (or ``--keep``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from cilia_testkit import ROOT, VENV_BIN, cni, host, netns
from cilia_testkit.bpfmaps import DEFAULT_PIN_DIR
from cilia_testkit.netns import NetnsRegistry
from cilia_testkit.stack import (
    SHARED_AGENT_SOCKET,
    SHARED_CONFLIST,
    SHARED_OPERATOR,
    SHARED_RELAY,
    SHARED_RUN,
    Stack,
    StackError,
    stack_sh,
)

DEFAULT_PODS = 3
DEFAULT_PING_COUNT = 2
DEFAULT_UP_TIMEOUT_SECONDS = 90

USE_COLOR = sys.stdout.isatty() and os.environ.get("NO_COLOR") is None


def _c(code: str, text: str) -> str:
    return f"\033[{code}m{text}\033[0m" if USE_COLOR else text


# Pod n gets app=ROLES[n-1] (then "other"): the policy step needs all three.
ROLES = ("frontend", "backend", "other")
POLICY = pathlib.Path(__file__).resolve().parents[1] / "deploy/examples/backend-allow-frontend.yaml"
BACKEND_PORT = 8080
CONNECT_TIMEOUT_SECONDS = 2
POLICY_WAIT_SECONDS = 15
FLOWS_WAIT_SECONDS = 10
ECHO_SERVER = """
import socket, sys
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", int(sys.argv[1]))); srv.listen(16)
print("listening", flush=True)
while True:
    conn, _ = srv.accept()
    conn.sendall(b"hello from backend\\n"); conn.close()
"""
CONNECT = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
print(s.recv(64).decode().strip())
"""


class DemoError(Exception):
    """A demo step did not produce the expected outcome (message says what and why)."""


class Demo:
    """State of one demo run: the conflist, the pods, the step counter."""

    def __init__(self, pods: int, ping_count: int, up_timeout: int, keep: bool) -> None:
        self.keep = keep
        self.pod_count = pods
        self.ping_count = ping_count
        self.up_timeout = up_timeout
        self.pods: list[cni.Pod] = []
        self.conflist: dict[str, Any] = {}
        self.step_no = 0
        self.started_stack = False
        self.private: Stack | None = None
        self.registry = NetnsRegistry("cilia-demo-")
        # where the stack answers: the ``make up`` stack's fixed addresses unless private
        self.conflist_path = SHARED_CONFLIST
        self.agent_socket = SHARED_AGENT_SOCKET
        self.operator = SHARED_OPERATOR
        self.relay = SHARED_RELAY
        self.logs_dir = SHARED_RUN
        self.pin_dir = DEFAULT_PIN_DIR

    def heading(self, title: str) -> None:
        self.step_no += 1
        print()
        print(_c("1;34", f"== {self.step_no}. {title} =="))

    def ok(self, text: str) -> None:
        print(f"  {_c('32', 'ok')}   {text}")

    def bad(self, text: str) -> None:
        print(f"  {_c('31', 'FAIL')} {text}")

    @staticmethod
    def indent(text: str) -> str:
        return "\n".join(f"    {line}" for line in text.rstrip().splitlines())

    # -- steps ---------------------------------------------------------------------------

    def start_stack(self) -> None:
        self.heading("Start the stack (redis, cilia-operator, cilia-agent, cilia-relay)")
        status = stack_sh("status", check=False)
        if status.returncode == 0:
            print("  `make up` stack already running: reusing it")
        elif self.keep:
            stack_sh("down")
            out = stack_sh("up", "--fresh", "--timeout", str(self.up_timeout), check=False)
            print(self.indent(out.stderr))
            if out.returncode != 0:
                raise DemoError("scripts/stack.sh up failed (log tail above)")
            self.started_stack = True
        else:
            self.private = Stack("demo", ready_seconds=self.up_timeout)
            try:
                self.private.start()
            except StackError as exc:
                raise DemoError(f"the stack did not start: {exc}") from None
            self.started_stack = True
            self.conflist_path = self.private.agent.conflist_path
            self.agent_socket = self.private.agent.socket
            self.operator = self.private.operator_address
            self.relay = self.private.relay_address
            self.logs_dir = self.private.run_dir
            self.pin_dir = self.private.agent.pin_dir
            print(self.indent(self.private.describe()))
        self.conflist = cni.load_conflist(self.conflist_path)
        shown = self.conflist_path
        self.ok(f"agent wrote {shown.relative_to(ROOT) if shown.is_relative_to(ROOT) else shown}:")
        print(self.indent(json.dumps(self.conflist, indent=2)))

    def create_pods(self) -> None:
        self.heading(f"Create {self.pod_count} pods through the real cilia-cni binary (CNI ADD)")
        self.registry.remove_stale()
        for n in range(1, self.pod_count + 1):
            role = ROLES[n - 1] if n <= len(ROLES) else "other"
            pod = cni.Pod(name=self.registry.name(), namespace="demo", labels={"app": role})
            pod.create_netns()
            self.registry.adopt(pod.name)
            self.pods.append(pod)
            outcome = pod.add(self.conflist)
            if n == 1:
                print("  what the runtime execs for the first pod:")
                print(
                    self.indent(
                        f"CNI_COMMAND=ADD CNI_CONTAINERID={pod.container_id[:12]}… "
                        f"CNI_NETNS={pod.netns} CNI_IFNAME={pod.ifname} "
                        f"CNI_PATH={VENV_BIN}\n"
                        f"CNI_ARGS={cni.cni_args(pod.namespace, pod.name, pod.container_id)}\n"
                        f"stdin: {json.dumps(cni.plugin_netconf(self.conflist, labels=pod.labels))}"
                    )
                )
            if outcome.returncode != 0:
                raise DemoError(
                    f"ADD {pod.name} exited {outcome.returncode}: {outcome.stdout.strip()}"
                )
            host_if = outcome.json.get("interfaces", [{}])[0].get("name", "?")
            self.ok(
                f"{pod.name:<14} ip {pod.ip:<15} host veth {host_if:<16} "
                f"labels app={pod.labels['app']}  ({outcome.seconds * 1000:.0f} ms)"
            )
        first = self.pods[0].name
        print(f"  inside the first pod (ip -n {first} addr show eth0; ip route):")
        print(self.indent(host.sh("ip", "-n", first, "-br", "addr", "show", "eth0").stdout))
        print(self.indent(host.sh("ip", "-n", first, "route").stdout))

    def connectivity(self) -> None:
        self.heading("Connectivity: pod <-> pod and pod <-> node")
        failures = 0

        def check(label: str, where: str, address: str) -> None:
            nonlocal failures
            if netns.ping(where, address, count=self.ping_count):
                self.ok(f"{label:<44} ping {address}")
            else:
                failures += 1
                self.bad(f"{label:<44} ping {address}")

        for a, b in itertools.permutations(self.pods, 2):
            check(f"{a.name} -> {b.name}", a.name, b.ip)
        assert self.pods[0].result is not None
        gateway = str(self.pods[0].result["ips"][0].get("gateway", ""))
        for pod in self.pods:
            check(f"{pod.name} -> node (router {gateway})", pod.name, gateway)
            check(f"node -> {pod.name}", "", pod.ip)
        if failures:
            raise DemoError(f"{failures} ping check(s) failed")

    def endpoints(self) -> None:
        self.heading("Endpoints the agent holds (cilia-agent endpoint list)")
        out = self.agent_cli("endpoint", "list", "--bpf-pin-dir", str(self.pin_dir))
        print(self.indent(out.stdout or out.stderr))
        if out.returncode != 0:
            raise DemoError(f"cilia-agent endpoint list exited {out.returncode}")
        missing = [p.name for p in self.pods if p.ip not in out.stdout]
        if missing:
            raise DemoError(f"endpoint list does not show pods {missing}")
        self.ok(f"all {len(self.pods)} pods listed")

    def connect(self, pod: cni.Pod, address: str) -> bool:
        """A real TCP connect from ``pod`` to ``address:8080`` that reads the greeting."""
        out = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                pod.name,
                sys.executable,
                "-c",
                CONNECT,
                address,
                str(BACKEND_PORT),
                str(CONNECT_TIMEOUT_SECONDS),
            ],
            capture_output=True,
            text=True,
            timeout=CONNECT_TIMEOUT_SECONDS + 10,
        )
        return out.returncode == 0 and "hello" in out.stdout

    def policy(self) -> None:
        self.heading("Policy: only app=frontend may reach app=backend on TCP 8080")
        frontend, backend, other = self.pods[0], self.pods[1], self.pods[2]
        server = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                backend.name,
                sys.executable,
                "-c",
                ECHO_SERVER,
                str(BACKEND_PORT),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            assert server.stdout is not None
            server.stdout.readline()
            print(f"  backend {backend.ip} serves TCP {BACKEND_PORT}; before any policy:")
            for pod in (frontend, other):
                if not self.connect(pod, backend.ip):
                    raise DemoError(f"{pod.name} cannot reach the backend before any policy")
                self.ok(f"{pod.labels['app']:<8} -> backend:{BACKEND_PORT}  connected")
            print(f"  cilia-operator apply -f {POLICY.relative_to(ROOT)}:")
            print(self.indent(POLICY.read_text()))
            print(self.indent(self.operator_cli("apply", "-f", str(POLICY)).stdout))
            if not host.wait_for(lambda: not self.connect(other, backend.ip), POLICY_WAIT_SECONDS):
                raise DemoError("the policy did not take effect: app=other still connects")
            self.ok(f"other    -> backend:{BACKEND_PORT}  refused by the datapath (dropped)")
            if not self.connect(frontend, backend.ip):
                raise DemoError("app=frontend can no longer reach the backend")
            self.ok(f"frontend -> backend:{BACKEND_PORT}  connected")
        finally:
            server.kill()
            server.wait()
        argv = [
            str(VENV_BIN / "cilia-relay"),
            "observe",
            "--server",
            self.relay,
            "--to-pod",
            f"demo/{backend.name}",
            "--last",
            "50",
        ]
        print("  " + " ".join(["cilia-relay", *argv[1:]]) + ":")
        lines: list[str] = []
        forwarded: list[str] = []
        dropped: list[str] = []

        def both_flows_seen() -> bool:
            # The agent reads the kernel's events asynchronously: poll until both are in.
            nonlocal lines, forwarded, dropped
            flows = subprocess.run(argv, capture_output=True, text=True, timeout=30)
            lines = [ln for ln in flows.stdout.splitlines() if f":{BACKEND_PORT} " in ln]
            forwarded = [ln for ln in lines if frontend.name in ln and "FORWARDED" in ln]
            dropped = [
                ln for ln in lines if other.name in ln and "DROPPED" in ln and "Policy denied" in ln
            ]
            return bool(forwarded and dropped)

        host.wait_for(both_flows_seen, FLOWS_WAIT_SECONDS, interval=0.5)
        print(self.indent("\n".join(lines[-8:])))
        if not forwarded or not dropped:
            raise DemoError(
                "cilia-relay observe did not show both the FORWARDED and the DROPPED flow"
            )
        self.ok("relay shows frontend FORWARDED and other DROPPED (Policy denied)")
        self.operator_cli("delete", "cnp", "backend-allow-frontend", "-n", "demo")

    def delete_pods(self) -> None:
        self.heading("Delete the pods (CNI DEL) and check their addresses are released")
        before = self.agent_cli("status")
        print("  cilia-agent status before DEL:")
        print(self.indent(before.stdout or before.stderr))
        for pod in self.pods:
            outcome = pod.delete(self.conflist)
            if outcome.returncode != 0:
                raise DemoError(f"DEL {pod.name} exited {outcome.returncode}: {outcome.stdout}")
            pod.destroy_netns()
            self.ok(f"DEL {pod.name:<14} released {pod.ip}  ({outcome.seconds * 1000:.0f} ms)")
        after = self.agent_cli("status")
        print("  cilia-agent status after DEL:")
        print(self.indent(after.stdout or after.stderr))
        listed = self.agent_cli(
            "endpoint", "list", "-o", "json", "--bpf-pin-dir", str(self.pin_dir)
        )
        if listed.returncode != 0:
            raise DemoError(f"cilia-agent endpoint list -o json exited {listed.returncode}")
        still = [p.ip for p in self.pods if f'"{p.ip}' in listed.stdout]
        if still:
            raise DemoError(f"addresses still held after DEL: {still}")
        leftovers = [p.name for p in self.pods if p.name in netns.list_netns(self.registry.prefix)]
        if leftovers:
            raise DemoError(f"netns left behind: {leftovers}")
        self.ok("no endpoint holds a demo address any more")
        self.pods = []

    # -- the stack's clients and logs ---------------------------------------------------------

    def agent_cli(self, *argv: str) -> subprocess.CompletedProcess[str]:
        """``cilia-agent ARGV --socket <the agent's socket>``; never raises on exit status."""
        return subprocess.run(
            [str(VENV_BIN / "cilia-agent"), *argv, "--socket", str(self.agent_socket)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )

    def operator_cli(self, *argv: str) -> subprocess.CompletedProcess[str]:
        """``cilia-operator ARGV --server <the operator>``; never raises on exit status."""
        return subprocess.run(
            [str(VENV_BIN / "cilia-operator"), *argv, "--server", self.operator],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )

    def show_logs(self) -> None:
        for name in ("agent", "operator"):
            path = self.logs_dir / f"{name}.log"
            print(_c("33", f"  --- last lines of {path} ---"))
            print(self.indent(host.tail(path, 25)))

    # -- cleanup ---------------------------------------------------------------------------

    def cleanup_pods(self) -> None:
        """Best effort after a failure: DEL every pod we created, delete its netns."""
        for pod in self.pods:
            try:
                pod.delete(self.conflist)
            except (OSError, subprocess.SubprocessError) as exc:
                print(f"  cleanup: DEL {pod.name} failed: {exc}")
            pod.destroy_netns()
        self.pods = []

    def teardown(self) -> None:
        self.heading("Tear down")
        self.registry.cleanup()
        if self.private is not None:
            self.private.stop()
            self.ok("stack stopped")
            return
        if self.keep:
            print("  KEEP=1: the stack keeps running (scripts/stack.sh status | make down)")
            return
        if not self.started_stack:
            print("  the stack was running before the demo: left running (make down stops it)")
            return
        out = stack_sh("down", check=False)
        if out.stderr.strip():
            print(self.indent(out.stderr))
        self.ok("stack stopped")


def main(argv: list[str] | None = None) -> int:
    """Run the demo; return 0 when every step succeeded, 1 otherwise."""
    parser = argparse.ArgumentParser(
        prog="make demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--pods",
        type=int,
        default=DEFAULT_PODS,
        help=f"pods to create, at least 3 (default {DEFAULT_PODS})",
    )
    parser.add_argument(
        "--ping-count",
        type=int,
        default=DEFAULT_PING_COUNT,
        help=f"pings per connectivity check (default {DEFAULT_PING_COUNT})",
    )
    parser.add_argument(
        "--up-timeout",
        type=int,
        default=DEFAULT_UP_TIMEOUT_SECONDS,
        help=f"seconds the stack may take to become ready (default {DEFAULT_UP_TIMEOUT_SECONDS})",
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        default=os.environ.get("KEEP") == "1",
        help="keep the stack running afterwards (also KEEP=1)",
    )
    args = parser.parse_args(argv)
    if args.pods < 3:
        parser.error("--pods must be at least 3")
    if os.geteuid() != 0:
        print("make demo needs root (network namespaces, veth, iptables)", file=sys.stderr)
        return 1
    demo = Demo(args.pods, args.ping_count, args.up_timeout, args.keep)
    started = time.monotonic()
    steps: list[Callable[[], None]] = [
        demo.start_stack,
        demo.create_pods,
        demo.connectivity,
        demo.endpoints,
        demo.policy,
        demo.delete_pods,
    ]
    failed: str | None = None
    try:
        for step in steps:
            step()
    except (DemoError, cni.CniRunError, OSError, ValueError, subprocess.SubprocessError) as exc:
        failed = str(exc)
        demo.bad(failed)
        demo.show_logs()
        demo.cleanup_pods()
    finally:
        demo.teardown()
    elapsed = time.monotonic() - started
    print()
    if failed:
        print(_c("1;31", f"demo FAILED after {elapsed:.1f}s: {failed}"))
        return 1
    print(_c("1;32", f"demo passed in {elapsed:.1f}s"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
