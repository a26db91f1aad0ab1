"""Entry point of the ``cilia-cni`` console script (exec'd by the container runtime)."""

from __future__ import annotations

import os
import sys

# typing is not imported at run time (start-up cost); mypy honours this constant.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import NoReturn


def main() -> NoReturn:
    """Run one CNI invocation from ``os.environ`` and stdin; print the JSON to stdout.

    Exits with status 0 (success) or 1 (CNI error, spec error JSON on stdout; also when
    stdout cannot be written, e.g. ``>/dev/full`` or closed: a result the runtime never
    read must not count as success, the runtime then DELs). A closed stdin (``<&-``) is
    "stdin cannot be read", code 5; so is stdin being a directory (``cilia-cni < /``),
    which the launcher (services/cni/launcher/cilia-cni) reports with the argument
    ``--stdin-is-a-directory``, since CPython cannot start with such a stdin. Nothing but
    the JSON is printed and no traceback ever reaches stdout or stderr. The process ends
    with ``os._exit`` once stdout is flushed: the interpreter teardown has nothing left to
    do (every agent connection is closed and the log file is written with unbuffered
    ``write(2)`` calls).
    """
    if sys.argv[1:2] == [SERVE]:  # the server for the static executable (cilia_cni.server)
        from cilia_cni import server

        sys.exit(server.main(sys.argv[2:]))
    try:
        from cilia_cni.plugin import run

        status, out = run(os.environ, _read_stdin, os.path.basename(sys.argv[0] or "cilia-cni"))
    except BaseException as exc:  # the last boundary: e.g. a broken install
        status = 1
        msg = f"cilia-cni internal error: {type(exc).__name__}: {exc}".replace("\\", "\\\\")
        msg = msg.replace('"', '\\"').replace("\n", " ")
        out = '{"cniVersion": "1.1.0", "code": 999, "msg": "' + msg + '", "details": ""}\n'
    try:
        sys.stdout.write(out)
        sys.stdout.flush()
    except (OSError, ValueError, AttributeError):
        status = 1  # stdout full, closed or a broken pipe: the result was not delivered
    try:  # noqa: SIM105 - contextlib is not worth its import time here
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        pass
    os._exit(status)


#: First argument that runs the server instead of one invocation (no runtime passes any).
SERVE = "serve"
#: Argument of the launcher: stdin is a directory (the interpreter got a closed stdin).
STDIN_IS_A_DIRECTORY = "--stdin-is-a-directory"


def _read_stdin() -> bytes:
    if sys.argv[1:] == [STDIN_IS_A_DIRECTORY]:
        raise IsADirectoryError(21, "stdin is a directory")  # EISDIR
    if sys.stdin is None:  # fd 0 was closed when the process started
        raise OSError("stdin is closed")
    from cilia_cni.plugin import MAX_STDIN_BYTES  # imported already by main()

    return sys.stdin.buffer.read(MAX_STDIN_BYTES + 1)  # one more: "too large" is seen


if __name__ == "__main__":
    main()
