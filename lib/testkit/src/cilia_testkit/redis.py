"""``redis-server`` for tests, benches and the stack: the one place that starts it.

:class:`RedisServer` starts a private ``redis-server`` (Debian ``redis-server``) in its own
directory and stops it on exit:

- by default on a **unix socket** in that directory (``unix:///…/redis.sock?db=0``): no TCP
  port at all, so any number run side by side;
- with ``tcp=True`` on ``127.0.0.1``: redis treats ``--port 0`` as "no TCP listener", so it
  cannot bind port 0 and report it. The server is told a random port of
  :data:`TCP_PORT_RANGE` (below Linux's ephemeral range, so never an outgoing connection's)
  and the port counts as ours only once *our* process logged that it accepts connections;
  a port another process holds makes redis exit with "Address already in use" and the next
  random port is tried. The server owns its port from the start: nothing is picked, closed
  and reused.

Readiness is read from redis' own log (``Ready to accept connections``), not from a PING
that another server on the same port could answer.
"""

from __future__ import annotations

import pathlib
import random
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from types import TracebackType

from cilia_testkit import procs

#: Ports tried by ``tcp=True`` (below ``net.ipv4.ip_local_port_range``'s default 32768).
TCP_PORT_RANGE = (20000, 32000)
#: Distinct random ports tried before giving up on ``tcp=True``.
TCP_ATTEMPTS = 20
READY = "ready to accept connections"  # "Ready … tcp", "now ready … at <socket>"
IN_USE = "Address already in use"


class RedisStartError(RuntimeError):
    """redis-server is not installed, exited, or did not become ready in time.

    The message carries the tail of its log.
    """


def server_argv(
    binary: str,
    listen: list[str],
    directory: pathlib.Path,
    *,
    appendonly: bool,
    logfile: pathlib.Path | None = None,
) -> list[str]:
    """The one redis-server command line of tests, benches and stacks: ``listen`` flags
    (``["--port", "0", "--unixsocket", PATH]`` or a TCP port), no RDB snapshots, append-only
    persistence as asked, data in ``directory``, in the foreground, logging to ``logfile``
    (stdout when None)."""
    argv = [binary, *listen, "--save", "", "--appendonly", "yes" if appendonly else "no"]
    argv += ["--dir", str(directory), "--daemonize", "no"]
    if logfile is not None:
        argv += ["--logfile", str(logfile)]
    return argv


class RedisServer:
    """A private ``redis-server``; a context manager (started on enter, stopped on exit).

    Args:
        directory: data, socket and log directory; a fresh ``/tmp/cilia-redis-*`` (removed
            by :meth:`stop`) when None. Kept short: a unix socket path is limited to 107 bytes.
        tcp: listen on ``127.0.0.1:<port>`` instead of a unix socket (see the module doc).
        appendonly: ``--appendonly yes`` (persistence like production); RDB snapshots are
            always off (``--save ""``).
        args: more server flags, e.g. ``("--requirepass", "secret")``.
        start_timeout: seconds to wait for readiness.

    Attributes (after :meth:`start`):
        url: ``unix:///dir/redis.sock?db=0`` or ``redis://127.0.0.1:PORT/0``.
        port: the TCP port (``tcp=True``) or None.
        socket: the unix socket path (default) or None.
        log: redis' log file.
    """

    def __init__(
        self,
        directory: pathlib.Path | str | None = None,
        *,
        tcp: bool = False,
        appendonly: bool = False,
        args: Sequence[str] = (),
        start_timeout: float = 10.0,
    ) -> None:
        self._own_dir = directory is None
        self.directory = pathlib.Path(
            tempfile.mkdtemp(prefix="cilia-redis-", dir="/tmp") if directory is None else directory
        )
        self.tcp = tcp
        self.appendonly = appendonly
        self.args = tuple(args)
        self.start_timeout = start_timeout
        self.log = self.directory / "redis.log"
        self.socket: pathlib.Path | None = None
        self.port: int | None = None
        self.url = ""
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        """Start the server and wait until it accepts connections; returns self.

        Raises:
            RedisStartError: redis-server is not on PATH, exited (every port of
                ``TCP_ATTEMPTS`` in use with ``tcp=True``), or was not ready within
                ``start_timeout`` seconds.
        """
        binary = shutil.which("redis-server")
        if binary is None:
            raise RedisStartError("redis-server is not installed (apt-get install redis-server)")
        self.directory.mkdir(parents=True, exist_ok=True)
        if not self.tcp:
            self.socket = self.directory / "redis.sock"
            self._launch(binary, ["--port", "0", "--unixsocket", str(self.socket)])
            self.url = f"unix://{self.socket}?db=0"
            return self
        tried: list[int] = []
        for port in random.sample(range(*TCP_PORT_RANGE), TCP_ATTEMPTS):
            tried.append(port)
            if self._launch(binary, ["--port", str(port), "--bind", "127.0.0.1"], retry=True):
                self.port = port
                self.url = f"redis://127.0.0.1:{port}/0"
                return self
        raise RedisStartError(f"redis-server: every port tried was in use: {tried}")

    def _launch(self, binary: str, listen: list[str], *, retry: bool = False) -> bool:
        """Start one server; True once ready, False when its port is taken and ``retry``."""
        self.log.write_bytes(b"")
        argv = server_argv(
            binary, listen, self.directory, appendonly=self.appendonly, logfile=self.log
        )
        argv += self.args
        self.proc = procs.spawn(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            procs.wait_for_file_line(
                self.log,
                lambda line: READY in line.lower(),
                timeout=self.start_timeout,
                proc=self.proc,
            )
        except procs.ProcessExited as exc:
            self.proc = None
            text = self.log.read_text(errors="replace")
            if retry and IN_USE in text:
                return False
            raise RedisStartError(f"redis-server exited ({exc}): {text[-2000:]}") from None
        except TimeoutError:
            self.stop()
            raise RedisStartError(
                f"redis-server not ready within {self.start_timeout:g}s: "
                f"{self.log.read_text(errors='replace')[-2000:]}"
            ) from None
        return True

    def stop(self) -> None:
        """SIGTERM the server (SIGKILL after 10 s), reap it; remove its own temp directory."""
        if self.proc is not None:
            procs.stop(self.proc, timeout=10)
            self.proc = None
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
