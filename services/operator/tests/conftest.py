"""Shared fixtures: coroutine tests run on a fresh event loop; a real redis-server."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Iterator

import pytest
import redis

from cilia_testkit import skips
from cilia_testkit.redis import RedisServer


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run ``async def`` tests with ``asyncio.run`` (no plugin needed)."""
    if inspect.iscoroutinefunction(pyfuncitem.obj):
        names = pyfuncitem._fixtureinfo.argnames
        kwargs = {name: pyfuncitem.funcargs[name] for name in names}
        asyncio.run(asyncio.wait_for(pyfuncitem.obj(**kwargs), timeout=60))
        return True
    return None


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server on a unix socket (persistence on, like production); its URL."""
    skips.require_binary("redis-server")
    with RedisServer(tmp_path_factory.mktemp("redis"), appendonly=True) as server:
        yield server.url


@pytest.fixture
def redis_url(redis_server: str) -> str:
    """The test Redis, emptied before the test."""
    redis.Redis.from_url(redis_server).flushall()
    return redis_server
