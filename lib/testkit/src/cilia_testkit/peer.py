"""A TCP server that tells each client the address it saw, for masquerade tests.

:func:`start` runs it inside a network namespace (standard library only): every accepted
connection gets one line ``peer <ip> <port>`` (the source address:port of the SYN as the
server's kernel saw it, after any translation) and the same line is printed to the
server's stdout, so a test can also read back every peer it ever saw (:func:`seen`).
:func:`ask` connects from inside another namespace, reads that line and times the connect.

Processes run in a session of their own; :func:`stop` ends that process group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass

#: Seconds the server may take to print "listening".
START_SECONDS = 10.0

SERVER = r"""
import socket, sys, threading
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", int(sys.argv[1]))); srv.listen(256)
print("listening", flush=True)
while True:
    conn, (ip, port) = srv.accept()
    line = f"peer {ip} {port}"
    print(line, flush=True)
    try:
        conn.sendall((line + "\n").encode())
    finally:
        conn.close()
"""

CLIENT = r"""
import socket, sys, time
addr, port, timeout, rounds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
for _ in range(rounds):
    t0 = time.perf_counter()
    try:
        s = socket.create_connection((addr, port), timeout=timeout)
    except OSError as exc:
        print(f"fail {type(exc).__name__}", flush=True); continue
    took = time.perf_counter() - t0
    s.settimeout(timeout)
    data = b""
    try:
        while not data.endswith(b"\n"):
            chunk = s.recv(128)
            if not chunk: break
            data += chunk
    except OSError as exc:
        print(f"fail {type(exc).__name__}", flush=True); continue
    finally:
        s.close()
    print(f"{data.decode().strip()} {took:.6f}", flush=True)
"""


@dataclass(frozen=True)
class Answer:
    """One connect: the server's view of the client (``ip``, ``port``) and the seconds
    ``connect()`` took (SYN to SYN-ACK)."""

    ip: str
    port: int
    seconds: float


class Server:
    """A running peer server (:func:`start`); ``lines`` collects its stdout."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.strip()
            if line == "listening":
                self._ready.set()
            else:
                self.lines.append(line)
        self._ready.set()

    def seen(self) -> list[str]:
        """Every client address the server saw so far, in order."""
        return [line.split()[1] for line in list(self.lines) if line.startswith("peer ")]


def start(netns: str, port: int) -> Server:
    """Start the server in ``netns`` on TCP ``port``; returns once it listens.

    Raises:
        RuntimeError: it did not listen within :data:`START_SECONDS` (its stderr attached).
    """
    proc = subprocess.Popen(
        ["ip", "netns", "exec", netns, sys.executable, "-c", SERVER, str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    server = Server(proc)
    if not server._ready.wait(START_SECONDS) or proc.poll() is not None:
        stop(server)
        err = proc.stderr.read() if proc.stderr else ""
        raise RuntimeError(f"peer server in {netns} did not start: {err.strip()}")
    return server


def stop(server: Server) -> None:
    """End the server's process group and reap it (idempotent)."""
    proc = server.proc
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.communicate(timeout=5)


def ask(
    netns: str, address: str, port: int, *, timeout: float = 2.0, rounds: int = 1
) -> list[Answer | None]:
    """``rounds`` connects in a row from inside ``netns`` to the server at ``address:port``;
    per connect the :class:`Answer`, or None when it failed (no answer within ``timeout``)."""
    proc = subprocess.run(
        [
            "ip",
            "netns",
            "exec",
            netns,
            sys.executable,
            "-c",
            CLIENT,
            address,
            str(port),
            str(timeout),
            str(rounds),
        ],
        capture_output=True,
        text=True,
        timeout=rounds * (timeout + 1) + 15,
        check=False,
    )
    out: list[Answer | None] = []
    for line in proc.stdout.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == "peer":
            out.append(Answer(parts[1], int(parts[2]), float(parts[3])))
        else:
            out.append(None)
    return out + [None] * (rounds - len(out))
