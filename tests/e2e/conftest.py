"""Fixtures for the end-to-end tests: the real stack (``scripts/stack.sh``), real pods.

The stack is started once per session with ``scripts/stack.sh up --fresh`` (Redis, operator,
agent, relay from ``.venv/bin``) and stopped at the end. Any stack already running from
``make up`` is stopped first: the addresses and ports are fixed (team brief). Pods are netns
``cilia-e2e-*`` driven through ``.venv/bin/cilia-cni`` by ``scripts/cnirun.py``, the helper
``make demo`` uses too.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pathlib
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import cnirun  # noqa: E402

NETNS_PREFIX = "cilia-e2e-"
STACK_UP_TIMEOUT_SECONDS = int(os.environ.get("CILIA_E2E_UP_TIMEOUT", "90"))

_counter = itertools.count(1)


def _require_privileges() -> None:
    if os.geteuid() != 0:
        pytest.skip("e2e needs root: network namespaces, veth, iptables")
    for tool in ("ip", "ping", "iptables", "redis-server"):
        if shutil.which(tool) is None:
            pytest.skip(f"e2e needs {tool!r} on PATH (scripts/setup.sh installs it)")
    for binary in ("cilia-operator", "cilia-agent", "cilia-cni", "cilia-relay"):
        if not (cnirun.VENV_BIN / binary).exists():
            pytest.fail(f"{cnirun.VENV_BIN / binary} missing: run scripts/setup.sh (make setup)")


def _remove_stale_pods() -> None:
    for name in cnirun.list_netns(NETNS_PREFIX):
        cnirun.delete_netns(name)


@pytest.fixture(scope="session")
def stack() -> Iterator[None]:
    """The real stack, started fresh for this session and stopped afterwards."""
    _require_privileges()
    cnirun.stack("down")
    _remove_stale_pods()
    up = cnirun.stack("up", "--fresh", "--timeout", str(STACK_UP_TIMEOUT_SECONDS), check=False)
    if up.returncode != 0:
        cnirun.stack("down", check=False)
        pytest.fail(f"scripts/stack.sh up failed:\n{up.stderr}")
    try:
        yield
    finally:
        _remove_stale_pods()
        cnirun.stack("down", check=False)


@pytest.fixture
def conflist(stack: None) -> dict[str, Any]:
    """The conflist the agent wrote (re-read each test: the agent may have been restarted)."""
    return cnirun.load_conflist()


@pytest.fixture
def make_pod(stack: None) -> Iterator[Callable[..., cnirun.Pod]]:
    """Factory: ``make_pod(labels=...)`` creates netns ``cilia-e2e-N`` and returns its Pod.

    At teardown every pod made gets a DEL (errors ignored) and its netns is deleted.
    """
    made: list[cnirun.Pod] = []

    def make(**kw: Any) -> cnirun.Pod:
        pod = cnirun.Pod(name=f"{NETNS_PREFIX}{os.getpid()}-{next(_counter)}", **kw)
        pod.create_netns()
        made.append(pod)
        return pod

    yield make
    conf = cnirun.load_conflist() if cnirun.CONFLIST.exists() else None
    for pod in made:
        if conf is not None:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                pod.delete(conf, timeout=30)
        pod.destroy_netns()
