"""The Docker engine, through the ``docker`` CLI (the testkit depends on nothing but the
standard library and pytest). One job: run a docker command and say clearly why it failed."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from typing import Any

#: Seconds one docker CLI call may take (an image build or ``docker save`` of a large image
#: takes longer: those calls pass their own timeout).
DOCKER_TIMEOUT = 120.0
#: Seconds an interrupted docker command is given to finish (see :func:`docker`).
INTERRUPTED_GRACE = 30.0


class DockerError(RuntimeError):
    """A docker command failed; the message has the command and the engine's stderr."""


def docker_missing() -> str | None:
    """Why the Docker engine cannot be used here (a skip reason), or None."""
    if shutil.which("docker") is None:
        return "the docker CLI is not installed (make test-setup installs docker.io)"
    got = subprocess.run(
        ["docker", "version", "--format", "{{.Server.Version}}"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    if got.returncode != 0:
        return f"the Docker engine does not answer (make test-setup starts dockerd): {got.stderr.strip()}"
    if os.geteuid() != 0:
        return "kind-style nodes need root"
    return None


def docker(
    *argv: str,
    check: bool = True,
    input: str | bytes | None = None,
    timeout: float = DOCKER_TIMEOUT,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``docker ARGV`` and return it (stdout/stderr as text).

    Raises:
        DockerError: non-zero exit with ``check`` (the command and stderr in the message).
        subprocess.TimeoutExpired: after ``timeout`` seconds.
    """
    data = input.encode() if isinstance(input, str) else input
    proc = subprocess.Popen(
        ["docker", *argv], stdin=subprocess.PIPE if data is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **(env or {})},
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(data, timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    except BaseException:
        # interrupted (SIGTERM/Ctrl-C unwinding the caller): let the CLI get the engine's
        # answer first, so a container or network it asked for exists before the caller's
        # cleanup looks for it (killing the CLI would not stop the engine making it)
        with contextlib.suppress(Exception):
            proc.communicate(timeout=INTERRUPTED_GRACE)
        raise
    out = subprocess.CompletedProcess(
        proc.args, proc.returncode or 0, stdout.decode(errors="replace"),
        stderr.decode(errors="replace"),
    )  # fmt: skip
    if check and out.returncode != 0:
        raise DockerError(f"docker {' '.join(argv)[:300]}: {out.stderr.strip()[-2000:]}")
    return out


def inspect(kind: str, ref: str) -> dict[str, Any] | None:
    """``docker <kind> inspect REF`` (kind: container, network, image, volume) parsed, or None
    when it does not exist."""
    got = docker(kind, "inspect", ref, check=False)
    if got.returncode != 0:
        return None
    items: list[dict[str, Any]] = json.loads(got.stdout or "[]")
    return items[0] if items else None
