"""Fixtures of the cross-service contract suite: one real cilia-agent process, the runtime
side as libcni drives plugins, named network namespaces.

Every test here but the policy corpus (pure: ``test_policy_corpus.py``) needs root and
iproute2 (network namespaces, veth pairs, a real agent): it is marked privileged and skips
with the reason otherwise (fails in CI, ``cilia_testkit.skips``).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile
from collections.abc import Iterator

import pytest
from realagent import Libcni, Netns, RealAgent, cni_binary

from cilia.agent.v1 import agent_pb2
from cilia_testkit import skips

#: Debian's reference plugins (containernetworking-plugins), for chaining tests.
REFERENCE_PLUGINS = "/usr/lib/cni"


PURE = frozenset({"test_policy_corpus.py"})
"""Test files here that need no privilege (they start no process)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test under this directory is privileged, but those of :data:`PURE`."""
    here = pathlib.Path(__file__).parent
    for item in items:
        path = pathlib.Path(str(item.fspath))
        if path.is_relative_to(here) and path.name not in PURE:
            item.add_marker(pytest.mark.privileged)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Root and iproute2, or skip with the reason (fail in CI) before any fixture starts."""
    if pathlib.Path(str(item.fspath)).name not in PURE:
        skips.require_netns("network namespaces, veth pairs, a real cilia-agent")


@pytest.fixture
def short_tmp() -> Iterator[str]:
    """A short tmp dir (unix socket paths are limited to 107 bytes)."""
    path = tempfile.mkdtemp(prefix="cilia-cni-t", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def real_agent_process() -> Iterator[RealAgent]:
    """One real cilia-agent process for the session (see :class:`realagent.RealAgent`)."""
    agent = RealAgent()
    try:
        agent.start()
        yield agent
    finally:
        agent.cleanup()


@pytest.fixture
def real_agent(real_agent_process: RealAgent) -> Iterator[RealAgent]:
    """The session agent, started if a test stopped it; endpoints a test left are deleted
    afterwards so every test starts from an empty agent."""
    if real_agent_process.proc is None:
        real_agent_process.start()
    yield real_agent_process
    if real_agent_process.proc is None:
        real_agent_process.start()
    for cid, ifname, _ in real_agent_process.endpoints():
        real_agent_process.attach.Del(
            agent_pb2.DelRequest(container_id=cid, ifname=ifname), timeout=30
        )


@pytest.fixture
def netns() -> Iterator[Netns]:
    ns = Netns()
    yield ns
    ns.cleanup()


@pytest.fixture
def cni_path(short_tmp: str) -> list[str]:
    """CNI_PATH as a runtime has it: a bin dir holding ``cilia-cni``, then Debian's."""
    bindir = os.path.join(short_tmp, "bin")
    os.makedirs(bindir)
    os.symlink(cni_binary(), os.path.join(bindir, "cilia-cni"))
    return [bindir, REFERENCE_PLUGINS]


@pytest.fixture
def libcni(real_agent: RealAgent, cni_path: list[str], short_tmp: str) -> Libcni:
    """The runtime side, reading the conflist the real agent wrote."""
    return Libcni(real_agent.conflist(), cni_path, os.path.join(short_tmp, "cache"))
