"""Shared fixtures: coroutine tests run on a fresh event loop; a real redis-server."""

from __future__ import annotations

import asyncio
import inspect
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from cilia_testkit import skips
from cilia_testkit.redis import RedisServer

#: Seconds the loop's tasks left over after a test get to end once cancelled.
LEFTOVER_TASK_SECONDS = 5.0


def _run(coro: Any, timeout: float) -> None:
    """``asyncio.run`` with a bounded teardown: the test's result (or exception) counts; tasks
    it left behind are cancelled and given :data:`LEFTOVER_TASK_SECONDS`, then the loop
    closes. ``asyncio.run`` waits for them without a bound, and a redis-py read cancelled
    while its connection is being made can stay pending forever (seen in CI: the test had
    passed, its teardown hung until pytest-timeout). Such a task is reported as a warning."""
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(asyncio.wait_for(coro, timeout=timeout))
    finally:
        try:
            leftover = asyncio.all_tasks(loop)
            for task in leftover:
                task.cancel()
            if leftover:
                _, stuck = loop.run_until_complete(
                    asyncio.wait(leftover, timeout=LEFTOVER_TASK_SECONDS)
                )
                if stuck:
                    warnings.warn(
                        f"tasks still pending {LEFTOVER_TASK_SECONDS:g} s after cancellation: "
                        f"{sorted(t.get_name() for t in stuck)}",
                        stacklevel=1,
                    )
            loop.run_until_complete(
                asyncio.wait([loop.create_task(loop.shutdown_asyncgens())],
                             timeout=LEFTOVER_TASK_SECONDS)
            )  # fmt: skip
        finally:
            loop.close()


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run ``async def`` tests on a fresh event loop, 60 s at most unless the test is marked
    ``@pytest.mark.timeout(N)`` (cluster-size tests; pytest-timeout reads the same mark)."""
    if inspect.iscoroutinefunction(pyfuncitem.obj):
        names = pyfuncitem._fixtureinfo.argnames
        kwargs = {name: pyfuncitem.funcargs[name] for name in names}
        mark = pyfuncitem.get_closest_marker("timeout")
        _run(pyfuncitem.obj(**kwargs), timeout=float(mark.args[0]) if mark else 60)
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
