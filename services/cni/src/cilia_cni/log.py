"""Optional JSON-line log (netconf ``log-file``), one line per event, each with the
container id. Logging never fails an operation: a log file that cannot be written is
reported once on stderr and then ignored.
"""

from __future__ import annotations

import os
import sys
import time

from cilia_cni import jsonio

#: Permissions of a newly created log file.
LOG_FILE_MODE = 0o600


class EventLog:
    """Appends JSON lines to ``path`` (nothing when ``path`` is ``""``).

    Every line: ``{"time": RFC 3339 UTC with ms, "level", "component": "cilia-cni",
    "command", "containerID", "ifname", "msg", ...fields}``. Each line is written with a
    single ``write(2)`` on an ``O_APPEND`` descriptor, so concurrent plugin runs do not
    interleave lines. The file is opened ``O_NONBLOCK``: a FIFO with no reader (or a full
    one) is a log failure (reported once on stderr), never a hang.
    """

    __slots__ = ("_base", "_failed", "_path")

    def __init__(self, path: str, command: str, container_id: str, ifname: str) -> None:
        self._path = path
        self._failed = not path
        self._base = {"command": command, "containerID": container_id, "ifname": ifname}

    def write(self, level: str, msg: str, **fields: object) -> None:
        """Append one line; ``fields`` must be JSON-serialisable (others are ``str()``'d)."""
        if self._failed:
            return
        now = time.time()
        stamp = (
            time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"
        )
        record: dict[str, object] = {"time": stamp, "level": level, "component": "cilia-cni"}
        record.update(self._base)
        record["msg"] = msg
        record.update(fields)
        line = jsonio.dumps(record, default=str) + "\n"
        try:
            # O_NONBLOCK: a log-file that is a FIFO without a reader fails at once (ENXIO)
            # instead of blocking the plugin forever; no effect on a regular file.
            fd = os.open(
                self._path,
                os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK,
                LOG_FILE_MODE,
            )
            try:
                os.write(fd, line.encode("utf-8", "backslashreplace"))
            finally:
                os.close(fd)
        except OSError as exc:
            self._failed = True
            try:  # noqa: SIM105 - contextlib is not worth its import time here
                sys.stderr.write(
                    f"cilia-cni: cannot write log-file {self._path!r}: {exc.strerror}\n"
                )
            except (OSError, ValueError):
                pass
