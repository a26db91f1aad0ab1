"""Background processes of a :class:`cilia_testkit.stack.Stack`: start in a session of their
own (``start_new_session``; no ``preexec_fn``, which is unsafe in threaded callers), log to a
file, wait until ready, stop (SIGTERM, then SIGKILL) and kill (wait until every thread is
gone, so the ports are free again), optionally through a pid file from another command.

Interim and private: the team's ``cilia_testkit.procs`` ("suites") is the one process helper;
this module is what the stack needs until both are merged.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import time
from collections.abc import Callable, Sequence

from cilia_testkit.host import tail, wait_for
from cilia_testkit.procs import exited

#: Seconds a component may take to stop after SIGTERM before SIGKILL.
STOP_SECONDS = 10.0


class StackError(RuntimeError):
    """A component did not start, was not ready in time, or a listener was not reported.
    The message carries the component's log tail."""


class Process:
    """One background process logging (stdout+stderr) to ``log``, in its own session.

    With ``pidfile`` its pid is also written there, and a process started by another
    command (``scripts/stack.sh up`` in an earlier shell) is found again from it: ``pid``,
    ``running``, ``stop`` and ``kill`` then work by pid, checked against ``binary`` in
    ``/proc/PID/cmdline`` (pid reuse).
    """

    def __init__(
        self, name: str, log: pathlib.Path, *, pidfile: pathlib.Path | None = None, binary: str = ""
    ) -> None:
        self.name = name
        self.log = log
        self.pidfile = pidfile
        self.binary = binary
        self.proc: subprocess.Popen[bytes] | None = None
        self.argv: list[str] = []
        #: byte offset of this start's header in ``log`` (read_listeners reads from here)
        self.offset = 0

    def start(self, argv: Sequence[str], env: dict[str, str] | None = None) -> None:
        """Start ``argv`` (appending to the log after a ``# <UTC time> <argv>`` header).

        Raises:
            StackError: it is already running.
        """
        if self.running():
            raise StackError(f"{self.name} is already running (pid {self.pid})")
        self.argv = list(argv)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.offset = out.tell()
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            out.write(f"# {stamp} {' '.join(self.argv)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env=env,
                start_new_session=True,
            )
        if self.pidfile is not None:
            self.pidfile.write_text(f"{self.proc.pid}\n")

    @property
    def pid(self) -> int | None:
        """The pid while running, else None."""
        if self.proc is not None:
            return self.proc.pid if self.proc.poll() is None else None
        return self._adopted_pid()

    def _adopted_pid(self) -> int | None:
        """The pid in ``pidfile`` when that process runs ``binary`` and is no zombie."""
        if self.pidfile is None:
            return None
        try:
            pid = int(self.pidfile.read_text().strip())
            cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            return None
        if not cmdline or self.binary.encode() not in cmdline or exited(pid):
            return None
        return pid

    def running(self) -> bool:
        """True while the process has not exited."""
        if self.proc is not None:
            return self.proc.poll() is None
        return self._adopted_pid() is not None

    def wait_ready(self, ready: Callable[[], object], timeout: float) -> None:
        """Poll ``ready()`` until true.

        Raises:
            StackError: the process exited first, or ``timeout`` s passed (it is then stopped).
        """
        if not wait_for(lambda: not self.running() or ready(), timeout, interval=0.1):
            self.stop()
            raise StackError(f"{self.name} not ready after {timeout:g}s:\n{self.tail()}")
        if not self.running():
            code = self.proc.returncode if self.proc is not None else None
            raise StackError(f"{self.name} exited with status {code} on start:\n{self.tail()}")

    def stop(self, timeout: float = STOP_SECONDS) -> tuple[int | None, bool]:
        """SIGTERM, SIGKILL after ``timeout`` s; reaped (or, for a process found through the
        pidfile, waited for until gone). Idempotent; the pidfile is removed.

        Returns:
            ``(pid, killed)``: the pid that was stopped (None when nothing ran) and whether
            SIGKILL was needed.
        """
        pid, killed = None, False
        if self.proc is not None:
            if self.proc.poll() is None:
                pid = self.proc.pid
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    killed = True
                    self.proc.kill()
                    self.proc.wait(timeout=30)
        else:
            pid = self._adopted_pid()
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
                if not wait_for(lambda: exited(pid), timeout, interval=0.1):
                    killed = True
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    wait_for(lambda: exited(pid), 30, interval=0.1)
        if self.pidfile is not None:
            self.pidfile.unlink(missing_ok=True)
        return pid, killed

    def kill(self, timeout: float = 10.0) -> int:
        """SIGKILL and wait until every thread is gone (ports released); returns the pid.

        Raises:
            StackError: it is not running, or still alive after ``timeout`` s.
        """
        pid = self.pid
        if pid is None:
            raise StackError(f"{self.name} is not running")
        os.kill(pid, signal.SIGKILL)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                raise StackError(
                    f"{self.name} (pid {pid}) alive {timeout:g}s after SIGKILL"
                ) from None
        if not wait_for(lambda: exited(pid), timeout, interval=0.05):
            raise StackError(f"{self.name} (pid {pid}) threads alive {timeout:g}s after SIGKILL")
        return pid

    def tail(self, lines: int = 30) -> str:
        """The last ``lines`` log lines of this start (:func:`cilia_testkit.host.tail`)."""
        return f"--- {self.log} ---\n{tail(self.log, lines)}"
