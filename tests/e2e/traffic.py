"""Real traffic and real flows for the policy and relay e2e tests (standard library only).

- :func:`start_servers` runs a TCP greeter inside a pod's netns (one thread per port; each
  accepted connection gets ``hello from <name> port <port>``);
- :func:`connect` is a real TCP connect from inside a pod that reads that greeting, so a
  success proves both directions (the SYN-ACK and the data are replies);
- :func:`apply` feeds a manifest to ``cilia-operator apply -f -``;
- :func:`observe` runs ``cilia-relay observe -o json`` against the stack's relay and splits
  its output into flows (stdout) and node status events (stderr).
"""

from __future__ import annotations

import calendar
import contextlib
import dataclasses
import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from support import current_stack

from cilia_testkit import VENV_BIN, cni, host

# A connect that gets no SYN-ACK within this many seconds counts as blocked (a dropped SYN
# is retransmitted after 1 s, so an allowed connect never needs this long on one host).
CONNECT_TIMEOUT_SECONDS = 1.5
OBSERVE_TIMEOUT_SECONDS = 30.0
SERVER_START_SECONDS = 10.0

GREETER = """
import socket, sys, threading
name, ports = sys.argv[1], [int(p) for p in sys.argv[2:]]
def serve(srv, port):
    while True:
        conn, _ = srv.accept()
        try:
            conn.sendall(f"hello from {name} port {port}\\n".encode())
        finally:
            conn.close()
for port in ports:
    srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port)); srv.listen(64)
    threading.Thread(target=serve, args=(srv, port), daemon=True).start()
print("listening", flush=True)
threading.Event().wait()
"""

CONNECT = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
s.settimeout(float(sys.argv[3]))
print(s.recv(128).decode().strip())
"""


def greeting(name: str, port: int) -> str:
    """What the greeter in pod ``name`` sends on ``port``."""
    return f"hello from {name} port {port}"


def start_servers(pod: cni.Pod, ports: Iterable[int]) -> subprocess.Popen[str]:
    """Start the greeter in ``pod``'s netns on ``ports``; returns once it listens.

    Raises:
        RuntimeError: the greeter did not report listening within SERVER_START_SECONDS.
    """
    proc = subprocess.Popen(
        ["ip", "netns", "exec", pod.name, sys.executable, "-c", GREETER, pod.name]
        + [str(p) for p in ports],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = _reader(proc.stdout)
    try:
        line = lines.get(timeout=SERVER_START_SECONDS)
    except queue.Empty:
        line = None
    if line is None or "listening" not in line:
        proc.kill()
        _, err = proc.communicate()
        raise RuntimeError(f"greeter in {pod.name} did not start: {err.strip()}")
    return proc


def stop(proc: subprocess.Popen[str]) -> None:
    """Kill a process started here and reap it."""
    if proc.poll() is None:
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.communicate(timeout=5)


def connect(
    pod: cni.Pod, address: str, port: int, *, timeout: float = CONNECT_TIMEOUT_SECONDS
) -> str | None:
    """TCP connect from inside ``pod`` to ``address:port``; the greeting read, or None."""
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
            str(port),
            str(timeout),
        ],
        capture_output=True,
        text=True,
        timeout=timeout + 15,
        check=False,
    )
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def apply(*documents: Mapping[str, Any]) -> subprocess.CompletedProcess[str]:
    """``cilia-operator apply -f - --server <the session stack's operator>`` with
    ``documents`` as one multi-document stream."""
    text = "\n---\n".join(json.dumps(doc) for doc in documents) + "\n"
    return subprocess.run(
        [
            str(VENV_BIN / "cilia-operator"),
            "apply",
            "-f",
            "-",
            "--server",
            current_stack().operator_address,
        ],
        input=text,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def cnp(name: str, namespace: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    """A CiliumNetworkPolicy document."""
    return {
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumNetworkPolicy",
        "metadata": {"name": name, "namespace": namespace},
        "spec": dict(spec),
    }


def backend_from_frontend(name: str, namespace: str, port: int) -> dict[str, Any]:
    """The CiliumNetworkPolicy the e2e suites enforce: ``app=backend`` admits only
    ``app=frontend``, on TCP ``port``."""
    return cnp(
        name,
        namespace,
        {
            "endpointSelector": {"matchLabels": {"app": "backend"}},
            "ingress": [
                {
                    "fromEndpoints": [{"matchLabels": {"app": "frontend"}}],
                    "toPorts": [{"ports": [{"port": str(port), "protocol": "TCP"}]}],
                }
            ],
        },
    )


@dataclasses.dataclass
class Observed:
    """One ``cilia-relay observe -o json`` run.

    Attributes:
        returncode: exit status.
        flows: the ``flow`` objects of stdout lines, in the order printed.
        responses: every stdout line as parsed JSON (flows carry ``node_name`` and ``time``).
        node_events: the ``node_status`` objects of stderr JSON lines.
        stderr: raw stderr.
    """

    returncode: int
    flows: list[dict[str, Any]]
    responses: list[dict[str, Any]]
    node_events: list[dict[str, Any]]
    stderr: str


def _parse_lines(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def _relay(server: str | None) -> str:
    """``server``, or the session stack's relay address when None."""
    return server if server is not None else current_stack().relay_address


def observe(*argv: str, server: str | None = None) -> Observed:
    """Run ``cilia-relay observe --server SERVER -o json ARGV`` (not ``--follow``)."""
    proc = subprocess.run(
        [str(VENV_BIN / "cilia-relay"), "observe", "--server", _relay(server), "-o", "json", *argv],
        capture_output=True,
        text=True,
        timeout=OBSERVE_TIMEOUT_SECONDS,
        check=False,
    )
    responses = [r for r in _parse_lines(proc.stdout) if "flow" in r]
    return Observed(
        returncode=proc.returncode,
        flows=[r["flow"] for r in responses],
        responses=responses,
        node_events=[e["node_status"] for e in _parse_lines(proc.stderr) if "node_status" in e],
        stderr=proc.stderr,
    )


def time_ns(stamp: str) -> int:
    """Nanoseconds since the epoch of an RFC 3339 UTC time as protobuf JSON prints it.

    Protobuf JSON writes 0, 3, 6 or 9 fraction digits, so the strings do not sort as text.
    """
    date, _, frac = stamp.rstrip("Z").partition(".")
    seconds = calendar.timegm(time.strptime(date, "%Y-%m-%dT%H:%M:%S"))
    return seconds * 1_000_000_000 + int((frac + "000000000")[:9])


def dport(flow: Mapping[str, Any]) -> int:
    """TCP/UDP destination port of a JSON flow (0 for other protocols)."""
    l4 = flow.get("l4", {})
    for proto in ("TCP", "UDP"):
        if proto in l4:
            return int(l4[proto].get("destination_port", 0))
    return 0


def pod_of(flow: Mapping[str, Any], side: str) -> str:
    """``pod_name`` of the flow's ``source`` or ``destination`` ("" when unknown)."""
    return str(flow.get(side, {}).get("pod_name", ""))


def summary(flows: Iterable[Mapping[str, Any]]) -> str:
    """One line per flow, for assertion messages."""
    return "\n".join(
        f"{f.get('node_name')} {f.get('time')} {pod_of(f, 'source')}->{pod_of(f, 'destination')}"
        f":{dport(f)} {f.get('verdict')} {f.get('drop_reason_desc', '')}"
        f" {f.get('traffic_direction')} reply={f.get('is_reply', False)}"
        for f in flows
    )


def _reader(stream: Any) -> queue.Queue[str | None]:
    """Lines of ``stream`` pushed onto a queue by a daemon thread (None at EOF)."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in stream:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


class Follower:
    """``cilia-relay observe --follow -o json ARGV`` running in the background.

    Stdout lines (flows) and stderr lines (node events) are collected by threads;
    :meth:`wait_for` polls them.
    """

    def __init__(self, *argv: str, server: str | None = None) -> None:
        self.proc = subprocess.Popen(
            [
                str(VENV_BIN / "cilia-relay"),
                "observe",
                "--server",
                _relay(server),
                "-o",
                "json",
                "--follow",
                *argv,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.responses: list[dict[str, Any]] = []
        self.node_events: list[dict[str, Any]] = []
        self._out = _reader(self.proc.stdout)
        self._err = _reader(self.proc.stderr)

    def _drain(self) -> None:
        for q, sink, key in (
            (self._out, self.responses, "flow"),
            (self._err, self.node_events, "node_status"),
        ):
            while True:
                try:
                    line = q.get_nowait()
                except queue.Empty:
                    break
                if line is None:
                    continue
                for parsed in _parse_lines(line):
                    if key in parsed:
                        sink.append(parsed if key == "flow" else parsed[key])

    def wait_for(
        self,
        predicate: Any,
        timeout: float,
        *,
        poke: Callable[[], object] | None = None,
        poke_every: float = 1.5,
    ) -> bool:
        """Poll ``predicate(self)`` over what arrived so far until true or ``timeout`` s.

        ``poke`` (e.g. one ping) is called first and then every ``poke_every`` seconds:
        a follow stream only carries flows made after the relay subscribed to every agent,
        and the relay's sort buffer sends them once no flow came for its drain timeout
        (1 s), so the traffic has to keep coming with gaps.
        """
        next_poke = 0.0

        def check() -> bool:
            nonlocal next_poke
            if poke is not None and time.monotonic() >= next_poke:
                poke()
                next_poke = time.monotonic() + poke_every
            self._drain()
            return bool(predicate(self))

        return host.wait_for(check, timeout, interval=0.2)

    def close(self) -> None:
        """Stop the observe process."""
        stop(self.proc)


@contextlib.contextmanager
def following(*argv: str, server: str | None = None) -> Iterator[Follower]:
    """:class:`Follower` as a context manager (stopped on exit)."""
    follower = Follower(*argv, server=server)
    try:
        yield follower
    finally:
        follower.close()
