"""The pytest plugin (entry point ``pytest11``): fixtures every suite can use.

- ``netns_registry`` (session): a :class:`~cilia_testkit.netns.NetnsRegistry` whose prefix
  is the ini option ``testkit_netns_prefix`` (default ``cilia-test-``); stale namespaces of
  an earlier, killed run are removed first, and everything it made at the end.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cilia_testkit.netns import NetnsRegistry


def pytest_addoption(parser: pytest.Parser) -> None:
    """Register the ``testkit_netns_prefix`` ini option."""
    parser.addini(
        "testkit_netns_prefix",
        "prefix of the network namespaces the netns_registry fixture creates",
        default="cilia-test-",
    )


@pytest.fixture(scope="session")
def netns_registry(pytestconfig: pytest.Config) -> Iterator[NetnsRegistry]:
    """Network namespaces of this test session (see the module docstring)."""
    registry = NetnsRegistry(str(pytestconfig.getini("testkit_netns_prefix")))
    registry.remove_stale()
    try:
        yield registry
    finally:
        registry.cleanup()
