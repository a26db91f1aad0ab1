"""Entry point of the ``cilia-cni`` console script (exec'd by the container runtime)."""

from __future__ import annotations

import os
import sys


def main() -> int:
    """Run one CNI invocation from ``os.environ`` and stdin; print the JSON to stdout.

    Returns the exit status (0 success, 1 CNI error). Nothing but the JSON is printed and
    no traceback ever reaches stdout or stderr.
    """
    try:
        from cilia_cni.plugin import run

        status, out = run(os.environ, _read_stdin, os.path.basename(sys.argv[0] or "cilia-cni"))
    except BaseException as exc:  # the last boundary: a broken install
        status = 1
        msg = f"cilia-cni internal error: {type(exc).__name__}: {exc}".replace("\\", "\\\\")
        msg = msg.replace('"', '\\"').replace("\n", " ")
        out = '{"cniVersion": "1.1.0", "code": 999, "msg": "' + msg + '", "details": ""}\n'
    try:
        sys.stdout.write(out)
        sys.stdout.flush()
    except (OSError, ValueError, AttributeError):
        # stdout closed or a broken pipe: nothing left to tell; keep the exit quiet.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
        except OSError:
            pass
    return status


def _read_stdin() -> bytes:
    if sys.stdin is None:
        return b""
    return sys.stdin.buffer.read()


if __name__ == "__main__":
    sys.exit(main())
