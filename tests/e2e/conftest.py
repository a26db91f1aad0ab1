"""Fixtures for the end-to-end tests: the real stack (:class:`cilia_testkit.stack.Stack`), real
pods.

The stack is started once per session (Redis on a unix socket, operator, agent, relay from
``.venv/bin``, every TCP listener bound by the server itself, a run dir, BPF pin dir, host
device and pool of its own) and stopped at the end, so a ``make up`` stack or a benchmark can
run beside it. Pods are netns ``cilia-e2e-<pid>-N`` driven through ``.venv/bin/cilia-cni`` by
:mod:`cilia_testkit.cni`, the emulation ``make demo`` and the benches use too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import support

from cilia_testkit import VENV_BIN, cni
from cilia_testkit.netns import NetnsRegistry
from cilia_testkit.stack import Stack, StackError

NETNS_PREFIX = "cilia-e2e-"
STACK_UP_TIMEOUT_SECONDS = int(os.environ.get("CILIA_E2E_UP_TIMEOUT", "90"))


def _require_privileges() -> None:
    if os.geteuid() != 0:
        pytest.skip("e2e needs root: network namespaces, veth, iptables")
    for tool in ("ip", "ping", "iptables", "redis-server"):
        if shutil.which(tool) is None:
            pytest.skip(f"e2e needs {tool!r} on PATH (scripts/setup.sh installs it)")
    for binary in ("cilia-operator", "cilia-agent", "cilia-cni", "cilia-relay"):
        if not (VENV_BIN / binary).exists():
            pytest.fail(f"{VENV_BIN / binary} missing: run scripts/setup.sh (make setup)")


@pytest.fixture(scope="session")
def pods_registry() -> Iterator[NetnsRegistry]:
    """This session's pod namespaces (``cilia-e2e-<pid>-…``); a killed run's are removed."""
    registry = NetnsRegistry(NETNS_PREFIX)
    registry.remove_stale()
    try:
        yield registry
    finally:
        registry.cleanup()


@pytest.fixture(scope="session")
def stack(pods_registry: NetnsRegistry) -> Iterator[Stack]:
    """The real stack, started fresh for this session and stopped afterwards."""
    _require_privileges()
    s = Stack("e2e", pool_cidr=str(support.POD_CIDR), ready_seconds=STACK_UP_TIMEOUT_SECONDS)
    try:
        s.start()
    except StackError as exc:
        pytest.fail(f"the e2e stack did not start:\n{exc}")
    support.use_stack(s)
    try:
        yield s
    finally:
        support.use_stack(None)
        s.stop()


@pytest.fixture
def conflist(stack: Stack) -> dict[str, Any]:
    """The conflist the agent wrote (re-read each test: the agent may have been restarted)."""
    return stack.agent.conflist()


@pytest.fixture
def make_pod(stack: Stack, pods_registry: NetnsRegistry) -> Iterator[Callable[..., cni.Pod]]:
    """Factory: ``make_pod(labels=...)`` creates netns ``cilia-e2e-<pid>-N``, returns its Pod.

    At teardown every pod made gets a DEL (errors ignored) and its netns is deleted.
    """
    made: list[cni.Pod] = []

    def make(**kw: Any) -> cni.Pod:
        pod = cni.Pod(name=pods_registry.name(), **kw)
        pod.create_netns()
        pods_registry.adopt(pod.name)
        made.append(pod)
        return pod

    yield make
    conf = stack.agent.conflist() if stack.agent.conflist_path.exists() else None
    for pod in made:
        if conf is not None:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                pod.delete(conf, timeout=30)
        pod.destroy_netns()
