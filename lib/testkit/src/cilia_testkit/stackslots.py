"""A stack's place on the host: the fixed addresses of the shared ``make up`` stack
(:data:`SHARED_RUN` …), the ``flock``-held slot that numbers what must be unique per host
(:func:`_slot`, :data:`SLOTS`, :data:`SLOT_PORT_BASE`), the reaping of what an earlier holder
of a slot left running (:func:`_kill_orphans`), and how listeners bound on port 0 are found
from the services' ``"listening"`` log lines (:func:`read_listeners`, :func:`_listen_spec`)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import shutil
import signal
import tempfile
from collections.abc import Iterator

from cilia_testkit import ROOT
from cilia_testkit._process import StackError
from cilia_testkit.host import wait_for
from cilia_testkit.procs import exited

#: The ``make up`` stack (``Stack(shared=True)``, ``scripts/stack.sh``): run dir ``.run/``
#: and its documented fixed addresses (README "The local stack").
SHARED_RUN = ROOT / ".run"
SHARED_CONFLIST = SHARED_RUN / "cni" / "net.d" / "05-cilia.conflist"
SHARED_AGENT_SOCKET = SHARED_RUN / "cilia.sock"
SHARED_REDIS_PORT = 6390
SHARED_OPERATOR = "127.0.0.1:4250"
SHARED_RELAY = "127.0.0.1:4245"
SHARED_RELAY_HEALTH = "127.0.0.1:4222"
SHARED_POOL = "10.200.0.0/16"

#: Where stack slots are locked (one file per slot, held with ``flock`` while a Stack runs).
SLOT_DIR = pathlib.Path(tempfile.gettempdir()) / "cilia-testkit-slots"
SLOTS = 20
#: Interim fixed ports of slot N: ``SLOT_PORT_BASE + N * 8 + agent index`` (the agents' Hubble
#: TCP servers; see :func:`_listen_spec`). Below Linux's ephemeral range (32768-60999 by
#: default): a port in it can be taken meanwhile as the source port of any outgoing
#: connection (CI run 9a: "127.0.0.1:42400: Address already in use"), one below it only by a
#: listener.
SLOT_PORT_BASE = 24400
MAX_AGENTS = 8
#: Seconds a component may take to get ready.
READY_SECONDS = 90.0

#: Listeners bound on port 0 and read back from the service's ``"listening"`` lines
#: (``cilia_common.runtime.announce_listening``), as ``(component, listener)``. The agent's
#: ``hubble-tcp`` keeps a slot port: the agent advertises ``<node IP>:<configured port>`` to
#: the relay, so a port 0 would be advertised as 0.
ANNOUNCED: frozenset[tuple[str, str]] = frozenset(
    {
        ("operator", "grpc"),
        ("operator", "metrics"),
        ("relay", "observer"),
        ("relay", "health"),
    }
)


def read_listeners(log: pathlib.Path, offset: int = 0) -> dict[str, str]:
    """Listener name → bound address, from the JSON log lines at or after byte ``offset``.

    Reads ``{"msg": "listening", "listener": L, "address": A}`` lines (the later wins), and
    the operator's ``{"msg": "operator serving", "listen": A, "metrics": PORT}`` line
    (``grpc``, and ``metrics`` as ``127.0.0.1:PORT``). Non-JSON lines are skipped.
    """
    out: dict[str, str] = {}
    try:
        with log.open("rb") as f:
            f.seek(offset)
            data = f.read().decode(errors="replace")
    except FileNotFoundError:
        return out
    for line in data.splitlines():
        if not line.startswith("{"):
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict):
            continue
        msg = rec.get("msg", rec.get("message"))
        if msg == "listening" and isinstance(rec.get("listener"), str):
            out[rec["listener"]] = str(rec.get("address", ""))
        elif msg == "operator serving":
            out.setdefault("grpc", str(rec.get("listen", "")))
            if rec.get("metrics"):
                out.setdefault("metrics", f"127.0.0.1:{rec['metrics']}")
    return out


def _logged(log: pathlib.Path, offset: int, message: str) -> bool:
    """True when a JSON log line with ``msg == message`` was written at/after ``offset``."""
    try:
        with log.open("rb") as f:
            f.seek(offset)
            data = f.read().decode(errors="replace")
    except FileNotFoundError:
        return False
    return f'"msg": "{message}"' in data


@contextlib.contextmanager
def _slot() -> Iterator[int]:
    """Hold the first free slot (``flock`` on ``SLOT_DIR/<n>.lock``) for the block.

    Raises:
        StackError: all :data:`SLOTS` slots are held.
    """
    SLOT_DIR.mkdir(parents=True, exist_ok=True)
    for n in range(SLOTS):
        fd = os.open(SLOT_DIR / f"{n}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            yield n
        finally:
            os.close(fd)
        return
    raise StackError(f"all {SLOTS} stack slots under {SLOT_DIR} are in use")


def _kill_orphans(slot: int) -> list[int]:
    """SIGKILL what an earlier holder of ``slot`` started and left running (its test process
    was killed before :meth:`Stack.stop`); returns their pids.

    The slot's record holds ``<pid> <run dir>`` lines; a pid counts only while its
    ``/proc/PID/cmdline`` still names that run dir (pid reuse). The record is then emptied
    and the earlier run dir removed when it is a temporary one of the kit.
    """
    record = SLOT_DIR / f"{slot}.pids"
    killed: list[int] = []
    try:
        lines = record.read_text().splitlines()
    except FileNotFoundError:
        return killed
    stale_dirs = set()
    for line in lines:
        pid_text, _, run_dir = line.partition(" ")
        if not pid_text.isdigit() or not run_dir:
            continue
        stale_dirs.add(run_dir)
        try:
            cmdline = pathlib.Path(f"/proc/{pid_text}/cmdline").read_bytes()
        except OSError:
            continue
        if run_dir.encode() in cmdline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_text), signal.SIGKILL)
            wait_for(lambda p=int(pid_text): exited(p), 10, interval=0.05)
            killed.append(int(pid_text))
    record.write_text("")
    for run_dir in stale_dirs:
        path = pathlib.Path(run_dir)
        if path.parent == pathlib.Path(tempfile.gettempdir()) and path.name.startswith("cilia-"):
            shutil.rmtree(path, ignore_errors=True)
    return killed


def _listen_spec(
    component: str,
    listener: str,
    slot: int,
    unix_path: pathlib.Path,
    index: int = 0,
    host: str = "127.0.0.1",
) -> str:
    """The listen flag value for ``listener`` of ``component``: ``<host>:0`` when the
    service logs the bound address (:data:`ANNOUNCED`), else the interim choice: a unix
    socket (relay ``observer``/``health``) or the slot's port for agent ``index``
    (agent ``hubble-tcp``).

    This is the one switch to flip once the services announce every listener.
    """
    if (component, listener) in ANNOUNCED:
        return f"{host}:0"
    if component == "relay":
        return f"unix:{unix_path}"
    return f"127.0.0.1:{SLOT_PORT_BASE + slot * MAX_AGENTS + index}"
