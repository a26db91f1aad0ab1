"""Fixtures of the cilia-cni suite: a contract-level agent peer (no cilia_agent: tests that
need a real agent live in tests/contract) and short tmp dirs for unix sockets."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
from cni_testlib import AgentServer


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
