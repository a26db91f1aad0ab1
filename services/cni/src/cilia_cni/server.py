"""``cilia-cni serve``: the CNI plugin as a long-running server for the static executable.

The executable the runtime execs (``services/cni/shim/cilia-cni.c``, static, no libc
dependency) sends each invocation here over a unix socket; this process runs it through
the same :func:`cilia_cni.plugin.run` the Python executable runs and sends back the exit
status and stdout. The interpreter and every module of the plugin and its agent client are
loaded once, at start; each invocation runs in a child forked for it (``fork`` of a warm
process, ~1 ms), so invocations run in parallel on every core, never share state (the
plugin's per-run timings, its log file), and a crash ends one invocation only.

Wire format (integers 4-byte big-endian unsigned), one invocation per connection:

- request: ``b"CCN1"``, count, count times (length, ``NAME=VALUE`` of a ``CNI_*`` variable),
  length + plugin type (the name the executable was exec'd as), stdin state (0 read; 1 a
  directory; 2 unreadable, followed by its errno), length + stdin bytes;
- answer: exit status, length + stdout bytes.

A request that breaks the format (or exceeds a limit below) is answered with exit status 1
and the CNI error JSON, code 999, never a half answer.

Where it listens: ``--socket`` (default ``/var/run/cilia/cilia-cni.sock``); the executable
connects to ``cilia-cni.sock`` in the directory of the netconf's ``agent-socket``.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import socketserver
import struct
import sys

from cilia_cni import plugin

#: Default socket (the executable's rule: ``cilia-cni.sock`` beside the default agent socket).
DEFAULT_SOCKET = "/var/run/cilia/cilia-cni.sock"
#: Name of the server socket in the agent socket's directory (the executable's rule).
SOCKET_NAME = "cilia-cni.sock"
#: Default of ``--max-children``: invocations run at once; more wait for one to end.
DEFAULT_MAX_CHILDREN = 64
#: Most ``CNI_*`` variables in one request (the spec defines 6).
MAX_ENV_ENTRIES = 256
#: Largest ``NAME=VALUE`` of one variable, bytes (CNI_ARGS is the longest, ~1 KiB).
MAX_ENV_BYTES = 1024 * 1024
#: Largest plugin type name, bytes.
MAX_TYPE_BYTES = 4096
#: Mode of the socket: root only, like the agent's.
SOCKET_MODE = 0o600
MAGIC = b"CCN1"


class ProtocolError(ValueError):
    """A request that breaks the wire format or a limit (answered with code 999)."""


def _read_exact(rfile: object, n: int) -> bytes:
    data = rfile.read(n)  # type: ignore[attr-defined]
    if len(data) != n:
        raise ProtocolError(f"request ended early ({len(data)} of {n} bytes)")
    return bytes(data)


def _u32(rfile: object) -> int:
    return int(struct.unpack(">I", _read_exact(rfile, 4))[0])


def _field(rfile: object, limit: int, what: str) -> bytes:
    n = _u32(rfile)
    if n > limit:
        raise ProtocolError(f"{what} is {n} bytes, more than {limit}")
    return _read_exact(rfile, n)


def decode_request(rfile: object) -> tuple[dict[str, str], str, int, int, bytes]:
    """Read one request: ``(env, plugin type, stdin state, errno, stdin bytes)``.

    Strings are decoded as the interpreter decodes ``os.environ`` (UTF-8 with
    ``surrogateescape``), so the plugin sees what it would see when exec'd itself.

    Raises:
        ProtocolError: bad magic, a field over its limit, a truncated request.
    """
    if _read_exact(rfile, 4) != MAGIC:
        raise ProtocolError("not a cilia-cni request (bad magic)")
    count = _u32(rfile)
    if count > MAX_ENV_ENTRIES:
        raise ProtocolError(f"{count} variables, more than {MAX_ENV_ENTRIES}")
    env: dict[str, str] = {}
    for _ in range(count):
        item = _field(rfile, MAX_ENV_BYTES, "a variable").decode("utf-8", "surrogateescape")
        name, sep, value = item.partition("=")
        if not sep or not name.startswith("CNI_"):
            raise ProtocolError("a variable that is not CNI_NAME=VALUE")
        env[name] = value
    ptype = _field(rfile, MAX_TYPE_BYTES, "the plugin type").decode("utf-8", "surrogateescape")
    state = _u32(rfile)
    err = _u32(rfile) if state == 2 else 0
    if state not in (0, 1, 2):
        raise ProtocolError(f"unknown stdin state {state}")
    data = _field(rfile, plugin.MAX_STDIN_BYTES + 1, "stdin")
    return env, ptype or "cilia-cni", state, err, data


def encode_answer(status: int, out: str) -> bytes:
    """The answer frame for ``(exit status, stdout text)``."""
    body = out.encode("utf-8", "surrogateescape")
    return struct.pack(">II", status, len(body)) + body


def handle(rfile: object) -> bytes:
    """Run one invocation read from ``rfile``; return the answer frame. Never raises."""
    try:
        env, ptype, state, err, data = decode_request(rfile)
    except (ProtocolError, OSError) as exc:
        msg = f"cilia-cni server: bad request from the executable: {exc}"
        return encode_answer(
            1, plugin._dump({"cniVersion": "1.1.0", "code": 999, "msg": msg, "details": ""})
        )

    def read_stdin() -> bytes:
        if state == 1:
            raise IsADirectoryError(errno.EISDIR, "stdin is a directory")
        if state == 2:
            raise OSError(err, os.strerror(err) if err else "stdin is closed")
        return data

    status, out = plugin.run(env, read_stdin, ptype)
    return encode_answer(status, out)


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        answer = handle(self.rfile)
        try:
            self.wfile.write(answer)
            self.wfile.flush()
        except OSError:
            pass  # the executable is gone (killed by the runtime): nothing to deliver to


class Server(socketserver.ForkingMixIn, socketserver.UnixStreamServer):
    """Unix stream server forking one child per invocation (see the module docstring)."""

    def __init__(self, path: str, max_children: int) -> None:
        self.max_children = max_children
        self.block_on_close = False
        directory = os.path.dirname(path)
        if directory:
            os.makedirs(directory, mode=0o755, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a stale socket of an earlier run
        old = os.umask(0o177)
        try:
            super().__init__(path, _Handler)
        finally:
            os.umask(old)
        os.chmod(path, SOCKET_MODE)


def preload() -> None:
    """Import everything an invocation uses, so children fork warm."""
    import cilia_cni.agent
    import cilia_cni.delqueue
    import cilia_cni.result
    import cilia_cni.wire  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    """``cilia-cni serve [--socket PATH] [--max-children N]``: serve until killed."""
    parser = argparse.ArgumentParser(prog="cilia-cni serve", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--socket",
        default=DEFAULT_SOCKET,
        help=f"unix socket to listen on (default {DEFAULT_SOCKET}; the executable connects to "
        f"{SOCKET_NAME} in the directory of the netconf's agent-socket)",
    )
    parser.add_argument(
        "--max-children",
        type=int,
        default=DEFAULT_MAX_CHILDREN,
        help=f"invocations run at once; more wait (default {DEFAULT_MAX_CHILDREN})",
    )
    args = parser.parse_args(argv)
    if args.max_children < 1:
        parser.error("--max-children must be >= 1")
    if len(args.socket.encode()) > 107 or not os.path.isabs(args.socket):
        parser.error("--socket must be an absolute path of at most 107 bytes")
    preload()
    server = Server(args.socket, args.max_children)
    sys.stderr.write(f"cilia-cni serve: listening on {args.socket}\n")
    sys.stderr.flush()
    try:
        server.serve_forever(poll_interval=1.0)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
