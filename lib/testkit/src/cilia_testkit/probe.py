"""Traffic from inside a pod: ``python -m cilia_testkit.probe serve|check|ping`` (standard
library only; run it in the pod's netns with ``ip netns exec POD``).

- ``serve --name N --port P [--port P …]``: a TCP and a UDP server per port. Each TCP
  connection gets the line ``hello from N port P``; then everything the client sends is read
  until it shuts its side down, and answered with ``received <bytes> <sha256 hex>``. Each
  UDP datagram is answered with the greeting line. Prints ``listening`` once every port is
  bound.
- ``check [--timeout S] [--payload BYTES] TARGET…``: one JSON line per target, in order:
  ``{"target": …, "ok": bool, "detail": …, "ms": float}``. ``icmp:IP`` sends up to
  :data:`ICMP_TRIES` echo requests (raw socket, root) and succeeds on the first reply;
  ``tcp:IP:PORT`` connects, reads the greeting, sends ``--payload`` bytes (0 by default) and
  checks the byte count and digest the server reports (so a success proves both directions
  and, with a full-size payload, that full-size segments pass); ``udp:IP:PORT`` sends one
  datagram and reports the greeting and the reply's source (``… (reply from IP:PORT)``).
- ``ping --interval S IP``: echo requests every ``S`` seconds until SIGTERM/SIGINT; then
  waits :data:`PING_DRAIN_SECONDS` for outstanding replies and prints one JSON line
  ``{"sent": n, "received": n, "lost": [seq, …]}``. Prints ``started`` after the first send.

Which helper the tests use is :func:`check_from`, :func:`start_server`, :func:`start_ping`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import queue
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from typing import IO, Any

#: ICMP echo requests sent by ``check`` per ``icmp:`` target before it counts as failed.
ICMP_TRIES = 3
#: Seconds ``ping`` waits for outstanding replies after it was told to stop.
PING_DRAIN_SECONDS = 1.0
#: Seconds a server may take to print ``listening`` (helpers here).
SERVER_START_SECONDS = 15.0
#: Bytes per ``send`` of a ``check`` payload.
CHUNK = 65536
ICMP_ECHO_REQUEST, ICMP_ECHO_REPLY = 8, 0


def greeting(name: str, port: int) -> str:
    """The line a ``serve --name name`` server sends on ``port``."""
    return f"hello from {name} port {port}"


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total: int = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return ~total & 0xFFFF


def _echo(ident: int, seq: int) -> bytes:
    payload = b"cilia-probe" + struct.pack("!d", time.time())
    header = struct.pack("!BBHHH", ICMP_ECHO_REQUEST, 0, 0, ident, seq)
    return (
        struct.pack("!BBHHH", ICMP_ECHO_REQUEST, 0, _checksum(header + payload), ident, seq)
        + payload
    )


def _reply_seq(packet: bytes, ident: int, source: str, want: str) -> int | None:
    """The sequence number of an echo reply to ``ident`` from ``want`` (raw IPv4 packet)."""
    if source != want or len(packet) < 20:
        return None
    ihl = (packet[0] & 0x0F) * 4
    if len(packet) < ihl + 8:
        return None
    kind, _, _, rid, seq = struct.unpack("!BBHHH", packet[ihl : ihl + 8])
    return seq if kind == ICMP_ECHO_REPLY and rid == ident else None


def icmp_check(address: str, timeout: float) -> tuple[bool, str]:
    """Echo ``address`` up to :data:`ICMP_TRIES` times within ``timeout`` s; (ok, detail)."""
    ident = (os.getpid() + threading.get_ident()) & 0xFFFF
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP) as sock:
        deadline = time.monotonic() + timeout
        gap = timeout / ICMP_TRIES
        for seq in range(1, ICMP_TRIES + 1):
            try:
                sock.sendto(_echo(ident, seq), (address, 0))
            except OSError as exc:
                return False, f"send: {exc}"
            until = min(deadline, time.monotonic() + gap)
            while (left := until - time.monotonic()) > 0:
                sock.settimeout(left)
                try:
                    packet, (source, _) = sock.recvfrom(65535)
                except TimeoutError:
                    break
                if _reply_seq(packet, ident, source, address) is not None:
                    return True, f"reply to echo {seq}"
        return False, f"no echo reply in {timeout:g}s ({ICMP_TRIES} requests)"


def tcp_check(address: str, port: int, timeout: float, payload: int) -> tuple[bool, str]:
    """Connect, read the greeting, send ``payload`` bytes, check the server's count and
    digest; (ok, detail)."""
    try:
        with socket.create_connection((address, port), timeout=timeout) as conn:
            conn.settimeout(timeout)
            reader = conn.makefile("rb")
            hello = reader.readline().decode().strip()
            if not hello.startswith("hello from"):
                return False, f"unexpected greeting {hello!r}"
            digest = hashlib.sha256()
            block = os.urandom(CHUNK)
            left = payload
            while left > 0:
                piece = block[: min(left, CHUNK)]
                conn.sendall(piece)
                digest.update(piece)
                left -= len(piece)
            conn.shutdown(socket.SHUT_WR)
            answer = reader.readline().decode().strip()
    except OSError as exc:
        return False, f"{type(exc).__name__}: {exc}"
    expected = f"received {payload} {digest.hexdigest()}"
    if answer != expected:
        return False, f"{hello}; server answered {answer!r}, expected {expected!r}"
    return True, hello


def udp_check(address: str, port: int, timeout: float) -> tuple[bool, str]:
    """Send one datagram and wait for the server's answer; (ok, ``"<greeting> (reply from
    IP:PORT)"``): the source of the reply as the socket saw it (with socket-level load
    balancing, the Service's VIP, not the backend)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.sendto(b"hello?", (address, port))
            data, (source, sport) = sock.recvfrom(65535)
        except OSError as exc:
            return False, f"{type(exc).__name__}: {exc}"
    hello = data.decode(errors="replace").strip()
    if not hello.startswith("hello from"):
        return False, f"unexpected answer {hello!r}"
    return True, f"{hello} (reply from {source}:{sport})"


def _serve_udp(srv: socket.socket, name: str, port: int) -> None:
    while True:
        _, peer = srv.recvfrom(65535)
        with contextlib.suppress(OSError):
            srv.sendto(f"{greeting(name, port)}\n".encode(), peer)


def _serve_one(conn: socket.socket, name: str, port: int) -> None:
    with conn:
        conn.sendall(f"{greeting(name, port)}\n".encode())
        digest = hashlib.sha256()
        count = 0
        while chunk := conn.recv(CHUNK):
            digest.update(chunk)
            count += len(chunk)
        conn.sendall(f"received {count} {digest.hexdigest()}\n".encode())


def serve(name: str, ports: Sequence[int]) -> None:
    """Run the servers forever (see the module docstring)."""

    def accept(srv: socket.socket, port: int) -> None:
        while True:
            conn, _ = srv.accept()
            threading.Thread(target=_serve_one, args=(conn, name, port), daemon=True).start()

    for port in ports:
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("0.0.0.0", port))
        srv.listen(128)
        threading.Thread(target=accept, args=(srv, port), daemon=True).start()
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.bind(("0.0.0.0", port))
        threading.Thread(target=_serve_udp, args=(udp, name, port), daemon=True).start()
    print("listening", flush=True)
    threading.Event().wait()


def ping(address: str, interval: float) -> dict[str, Any]:
    """Echo ``address`` every ``interval`` s until SIGTERM/SIGINT (module docstring)."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    ident = os.getpid() & 0xFFFF
    answered: set[int] = set()
    sent = 0
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP) as sock:
        sock.settimeout(0.05)

        def receive(until: float) -> None:
            while time.monotonic() < until:
                try:
                    packet, (source, _) = sock.recvfrom(65535)
                except TimeoutError:
                    continue
                seq = _reply_seq(packet, ident, source, address)
                if seq is not None:
                    answered.add(seq)

        next_send = time.monotonic()
        while not stop.is_set():
            sent += 1
            with contextlib.suppress(OSError):  # a send error counts as a loss
                sock.sendto(_echo(ident, sent & 0xFFFF), (address, 0))
            if sent == 1:
                print("started", flush=True)
            next_send += interval
            receive(next_send)
        receive(time.monotonic() + PING_DRAIN_SECONDS)
    lost = [seq for seq in range(1, sent + 1) if (seq & 0xFFFF) not in answered]
    return {"sent": sent, "received": sent - len(lost), "lost": lost}


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (module docstring); exit 0 unless the arguments are wrong."""
    parser = argparse.ArgumentParser(prog="python -m cilia_testkit.probe")
    sub = parser.add_subparsers(dest="command", required=True)
    p_serve = sub.add_parser("serve")
    p_serve.add_argument("--name", required=True)
    p_serve.add_argument("--port", type=int, action="append", required=True)
    p_check = sub.add_parser("check")
    p_check.add_argument("--timeout", type=float, default=2.0)
    p_check.add_argument("--payload", type=int, default=0)
    p_check.add_argument("targets", nargs="+")
    p_ping = sub.add_parser("ping")
    p_ping.add_argument("--interval", type=float, default=0.01)
    p_ping.add_argument("address")
    args = parser.parse_args(argv)
    if args.command == "serve":
        serve(args.name, args.port)
        return 0
    if args.command == "ping":
        print(json.dumps(ping(args.address, args.interval)), flush=True)
        return 0
    for target in args.targets:
        kind, _, rest = target.partition(":")
        host, _, port = rest.rpartition(":")
        if kind not in ("icmp", "tcp", "udp") or (
            kind != "icmp" and not (host and port.isdigit() and 0 < int(port) < 65536)
        ):
            parser.error(f"target {target!r}: not icmp:IP, tcp:IP:PORT or udp:IP:PORT")
        start = time.monotonic()
        if kind == "icmp":
            ok, detail = icmp_check(rest, args.timeout)
        elif kind == "tcp":
            ok, detail = tcp_check(host, int(port), args.timeout, args.payload)
        else:
            ok, detail = udp_check(host, int(port), args.timeout)
        ms = round((time.monotonic() - start) * 1000, 1)
        print(json.dumps({"target": target, "ok": ok, "detail": detail, "ms": ms}), flush=True)
    return 0


# -- helpers for tests (run the command above inside a netns) ------------------------------


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """One target of :func:`check_from`.

    Attributes:
        source: the netns the probe ran in.
        target: ``icmp:IP`` or ``tcp:IP:PORT``.
        ok: it answered (see the module docstring).
        detail: the greeting, or why it failed.
        ms: milliseconds the check took.
    """

    source: str
    target: str
    ok: bool
    detail: str
    ms: float


def _in_netns(netns: str, *argv: str) -> list[str]:
    return ["ip", "netns", "exec", netns, sys.executable, "-m", "cilia_testkit.probe", *argv]


def check_many(
    jobs: Iterable[tuple[str, Sequence[str]]],
    *,
    timeout: float = 2.0,
    payload: int = 0,
    deadline: float = 120.0,
) -> list[CheckResult]:
    """Run ``check`` in several netns at once: ``jobs`` = ``(netns, targets)``; every result.

    Raises:
        subprocess.TimeoutExpired: a probe ran longer than ``deadline`` s.
        RuntimeError: a probe exited non-zero or printed something unparsable.
    """
    procs = [
        (
            netns,
            subprocess.Popen(
                _in_netns(
                    netns, "check", "--timeout", str(timeout), "--payload", str(payload), *targets
                ),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
        )
        for netns, targets in jobs
    ]
    results: list[CheckResult] = []
    for netns, proc in procs:
        out, err = proc.communicate(timeout=deadline)
        if proc.returncode != 0:
            raise RuntimeError(f"probe in {netns} exited {proc.returncode}: {err.strip()}")
        for line in out.splitlines():
            rec = json.loads(line)
            results.append(CheckResult(netns, rec["target"], rec["ok"], rec["detail"], rec["ms"]))
    return results


def check_from(
    netns: str, *targets: str, timeout: float = 2.0, payload: int = 0, deadline: float = 120.0
) -> list[CheckResult]:
    """:func:`check_many` for one netns."""
    return check_many([(netns, targets)], timeout=timeout, payload=payload, deadline=deadline)


def _first_line(stream: IO[str], timeout: float) -> str | None:
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(stream.readline()), daemon=True).start()
    try:
        return lines.get(timeout=timeout)
    except queue.Empty:
        return None


def start_server(netns: str, name: str, ports: Sequence[int]) -> subprocess.Popen[str]:
    """``serve`` in ``netns``; returns once it listens (stop it with :func:`stop`).

    Raises:
        RuntimeError: it did not print ``listening`` within :data:`SERVER_START_SECONDS`.
    """
    argv = _in_netns(
        netns, "serve", "--name", name, *[a for p in ports for a in ("--port", str(p))]
    )
    return _started(argv, "listening", f"probe server in {netns}")


def _started(argv: list[str], ready_line: str, what: str) -> subprocess.Popen[str]:
    """Start ``argv`` and wait (:data:`SERVER_START_SECONDS`) for its first stdout line to be
    ``ready_line``.

    Raises:
        RuntimeError: it printed something else, or nothing in time (its stderr included).
    """
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = _first_line(proc.stdout, SERVER_START_SECONDS)
    if line is None or line.strip() != ready_line:
        raise RuntimeError(f"{what} did not start: {_stop_stderr(proc)}")
    return proc


def start_ping(netns: str, address: str, interval: float = 0.01) -> subprocess.Popen[str]:
    """``ping`` from ``netns``; returns after the first echo was sent. Read the outcome with
    :func:`finish_ping`.

    Raises:
        RuntimeError: it did not start within :data:`SERVER_START_SECONDS`.
    """
    argv = _in_netns(netns, "ping", "--interval", str(interval), address)
    return _started(argv, "started", f"probe ping in {netns}")


def finish_ping(proc: subprocess.Popen[str], timeout: float = 10.0) -> dict[str, Any]:
    """SIGTERM a :func:`start_ping` probe; its ``{"sent", "received", "lost"}``.

    Raises:
        RuntimeError: it printed no summary.
    """
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=timeout)
    for line in out.splitlines():
        if line.startswith("{"):
            result: dict[str, Any] = json.loads(line)
            return result
    raise RuntimeError(f"ping probe printed no summary (exit {proc.returncode}): {err.strip()}")


def _stop_stderr(proc: subprocess.Popen[str]) -> str:
    """Kill ``proc`` and return its stderr."""
    if proc.poll() is None:
        proc.kill()
    try:
        _, err = proc.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        return "(no stderr: still running after SIGKILL)"
    return str(err).strip()


def stop(proc: subprocess.Popen[str]) -> None:
    """Kill a probe started here and reap it."""
    if proc.poll() is None:
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.communicate(timeout=5)


if __name__ == "__main__":
    sys.exit(main())
