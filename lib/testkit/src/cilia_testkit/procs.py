"""Child processes for tests, benches and the stack, started without ``preexec_fn``.

``preexec_fn`` runs Python code in the child between ``fork`` and ``exec``; in a process
with live threads (gRPC's, asyncio's executor) the child can die in Python's after-fork
hooks (``Fatal Python error: Segmentation fault`` in ``threading._after_fork``) before it
execs: CPython documents it as unsafe with threads. Here only ``subprocess`` options that
run in C are used (``start_new_session``, ``process_group``), and what a child needs set
up before it runs is done by a tiny exec wrapper:

- ``default_signals=True`` execs the command through coreutils' ``env
  --default-signal=INT,TERM``: a test run started in the background (``cmd &``) inherits
  SIGINT *ignored*, and an ignored disposition survives ``exec``; Python then never
  installs its KeyboardInterrupt handler and the child ignores Ctrl-C/``SIGINT``.

Also here: waiting for a log line (a file or an asyncio stream), reading the
``"listening"`` lines services log per listener after binding (how a port 0 is read back:
``cilia_common.runtime.announce_listening``), and kill + reap that waits until the process
is really gone (every thread exited, so its sockets are closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import IO, Any

#: Signals the exec wrapper resets to their default disposition.
DEFAULT_SIGNALS = ("INT", "TERM")


class ProcessExited(RuntimeError):
    """The child exited while we waited for it; ``returncode`` is its exit status."""

    def __init__(self, returncode: int | None, what: str = "process") -> None:
        super().__init__(f"{what} exited with status {returncode}")
        self.returncode = returncode


def wrap_default_signals(
    argv: Sequence[str], signals: Sequence[str] = DEFAULT_SIGNALS
) -> list[str]:
    """``argv`` run through ``env --default-signal=SIG,…`` (coreutils ≥ 8.31).

    Raises:
        FileNotFoundError: ``env`` is not on PATH.
    """
    env = shutil.which("env")
    if env is None:
        raise FileNotFoundError("env (coreutils) is not on PATH")
    return [env, f"--default-signal={','.join(signals)}", "--", *argv]


def spawn(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    stdin: int | IO[Any] | None = subprocess.DEVNULL,
    stdout: int | IO[Any] | None = None,
    stderr: int | IO[Any] | None = None,
    new_session: bool = False,
    default_signals: bool = False,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` (bytes pipes) with no Python code run in the child.

    Args:
        new_session: ``start_new_session=True`` (own session and process group: a Ctrl-C
            on the terminal does not reach it; :func:`kill` signals the whole group).
        default_signals: exec through :func:`wrap_default_signals`.

    Raises:
        OSError: the command cannot be executed.
    """
    command = wrap_default_signals(argv) if default_signals else list(argv)
    return subprocess.Popen(
        command,
        env=dict(env) if env is not None else None,
        cwd=cwd,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        start_new_session=new_session,
    )


async def spawn_async(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    stdin: int | None = subprocess.DEVNULL,
    stdout: int | None = None,
    stderr: int | None = None,
    new_session: bool = False,
    default_signals: bool = False,
) -> asyncio.subprocess.Process:
    """:func:`spawn` for asyncio (``asyncio.create_subprocess_exec``), same options.

    Raises:
        OSError: the command cannot be executed.
    """
    command = wrap_default_signals(argv) if default_signals else list(argv)
    return await asyncio.create_subprocess_exec(
        *command,
        env=dict(env) if env is not None else None,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        start_new_session=new_session,
    )


def wait_for_file_line(
    path: str | os.PathLike[str],
    predicate: Callable[[str], bool],
    *,
    timeout: float,
    proc: subprocess.Popen[Any] | None = None,
    interval: float = 0.05,
) -> str:
    """The first line of the (growing) file ``path`` for which ``predicate`` is true.

    Only whole lines (ending in a newline) are tested. A missing file counts as empty.

    Raises:
        ProcessExited: ``proc`` exited before such a line appeared (the file is read
            once more first, so a line written just before exiting still counts).
        TimeoutError: no such line within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    offset = 0
    pending = b""
    while True:
        exited = proc is not None and proc.poll() is not None
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
        except FileNotFoundError:
            chunk = b""
        offset += len(chunk)
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for raw in lines:
            line = raw.decode(errors="replace")
            if predicate(line):
                return line
        if exited:
            assert proc is not None
            raise ProcessExited(proc.returncode)
        if time.monotonic() > deadline:
            raise TimeoutError(f"no matching line in {path} within {timeout:g}s")
        time.sleep(interval)


async def read_until(
    stream: asyncio.StreamReader,
    predicate: Callable[[str], bool],
    *,
    timeout: float,
    seen: list[str] | None = None,
) -> str:
    """Read lines of ``stream`` until one satisfies ``predicate``; that line (no newline).

    Lines read before it are appended to ``seen`` when given (for an error message).

    Raises:
        EOFError: the stream ended first (the child closed it or exited).
        TimeoutError: no such line within ``timeout`` seconds.
    """
    async with asyncio.timeout(timeout):
        while True:
            raw = await stream.readline()
            if not raw:
                raise EOFError("stream ended before a matching line")
            line = raw.decode(errors="replace").rstrip("\n")
            if predicate(line):
                return line
            if seen is not None:
                seen.append(line)


def listening(line: str) -> tuple[str, str] | None:
    """``(listener, address)`` from one JSON log line ``{"msg": "listening", "listener":
    "grpc", "address": "127.0.0.1:41234"}`` (``cilia_common.runtime.announce_listening``),
    else None (other lines, non-JSON lines)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("msg") != "listening":
        return None
    listener, address = record.get("listener"), record.get("address")
    if isinstance(listener, str) and isinstance(address, str):
        return listener, address
    return None


async def read_listening(
    stream: asyncio.StreamReader,
    listeners: Iterable[str],
    *,
    timeout: float,
) -> dict[str, str]:
    """Read the JSON log ``stream`` until every name of ``listeners`` logged ``"listening"``.

    Returns ``{listener: bound address}`` (``"127.0.0.1:41234"``, ``"unix:/path"``).

    Raises:
        EOFError: the stream ended first (the message holds the lines read).
        TimeoutError: not all within ``timeout`` seconds.
    """
    wanted = set(listeners)
    found: dict[str, str] = {}
    seen: list[str] = []

    def match(line: str) -> bool:
        parsed = listening(line)
        if parsed is not None and parsed[0] in wanted:
            found[parsed[0]] = parsed[1]
        else:
            seen.append(line)
        return wanted <= found.keys()

    try:
        await read_until(stream, match, timeout=timeout)
    except EOFError:
        missing = sorted(wanted - found.keys())
        raise EOFError(f"log ended before {missing} listened: {seen[-20:]}") from None
    return found


def exited(pid: int) -> bool:
    """True once every thread of ``pid`` has finished exiting (gone, or a lone zombie).

    ``/proc/PID/cmdline`` empties as soon as the address space is dropped, but listening
    sockets close only when the last thread has released the file table; a thread leaves
    ``/proc/PID/task`` after that. Restarting earlier finds the ports still held.
    """
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True
    return state in ("Z", "X") and len(tasks) <= 1


def kill(proc: subprocess.Popen[Any], *, group: bool = False, timeout: float = 10.0) -> int:
    """SIGKILL ``proc`` (its whole process group with ``group``) and reap it; its status.

    Waits until the process is really gone (see :func:`exited`) before reaping.

    Raises:
        TimeoutError: still alive ``timeout`` seconds after SIGKILL.
    """
    if proc.poll() is not None:
        return proc.returncode  # already reaped: its pid may belong to another process now
    try:
        if group:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.send_signal(signal.SIGKILL)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + timeout
    while not exited(proc.pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"pid {proc.pid} still alive {timeout:g}s after SIGKILL")
        time.sleep(0.02)
    return proc.wait(timeout)


def stop(
    proc: subprocess.Popen[Any],
    *,
    sig: int = signal.SIGTERM,
    timeout: float = 10.0,
    group: bool = False,
) -> int:
    """Send ``sig`` (SIGTERM), wait ``timeout`` seconds, then :func:`kill`; its exit status.

    Raises:
        TimeoutError: still alive after SIGKILL (see :func:`kill`).
    """
    if proc.poll() is None:
        try:
            if group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
        except ProcessLookupError:
            pass
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    return kill(proc, group=group, timeout=timeout)


@contextlib.contextmanager
def refused_address(host: str = "127.0.0.1") -> Iterator[str]:
    """``host:port`` where a TCP connect is refused, for "server unreachable" tests.

    The port stays bound (never listening) by this process for the ``with`` block: the
    kernel answers a SYN with RST, and no other process can start listening there
    meanwhile (unlike a port picked, closed and hoped to stay free).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        yield f"{host}:{sock.getsockname()[1]}"
