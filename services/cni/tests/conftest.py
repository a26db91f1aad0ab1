from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
from cni_testlib import AgentServer, Libcni, Netns, RealAgent, cni_binary

from cilia.agent.v1 import agent_pb2


@pytest.fixture(scope="session")
def agent_server() -> Iterator[AgentServer]:
    """One contract-level agent peer for the session (state reset per test by ``agent``)."""
    server = AgentServer().start()
    yield server
    server.stop()


@pytest.fixture
def agent(agent_server: AgentServer) -> AgentServer:
    agent_server.servicer.reset()
    return agent_server


@pytest.fixture
def short_tmp() -> Iterator[str]:
    """A short tmp dir (unix socket paths are limited to 107 bytes)."""
    path = tempfile.mkdtemp(prefix="cilia-cni-t", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def absent_socket(short_tmp: str) -> str:
    path = os.path.join(short_tmp, "absent.sock")
    assert not os.path.exists(path)
    return path


def _privileged_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs, a real cilia-agent)"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests using the real agent are privileged; without root they skip with the reason
    (CI runs them as root, where a skipped privileged test fails)."""
    reason = _privileged_skip_reason()
    for item in items:
        if "real_agent" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.privileged)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def real_agent_process() -> Iterator[RealAgent]:
    """One real cilia-agent process for the session (see :class:`cni_testlib.RealAgent`)."""
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


#: Debian's reference plugins (containernetworking-plugins), for chaining tests.
REFERENCE_PLUGINS = "/usr/lib/cni"


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
