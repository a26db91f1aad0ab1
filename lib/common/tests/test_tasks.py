"""Supervisor: a failing task is restarted with capped exponential backoff, logged once per
failed attempt; a finished task stays finished; stop cancels everything."""

from __future__ import annotations

import asyncio
import itertools
import logging

import pytest

from cilia_common.tasks import Supervisor


def test_a_failing_task_is_restarted_with_doubling_capped_backoff(
    caplog: pytest.LogCaptureFixture,
) -> None:
    starts: list[float] = []
    running = asyncio.Event

    async def scenario() -> tuple[list[float], int, int, str]:
        loop = asyncio.get_running_loop()
        up = running()

        async def flaky() -> None:
            starts.append(loop.time())
            if len(starts) <= 4:
                raise ConnectionError(f"operator unreachable #{len(starts)}")
            up.set()
            await asyncio.Event().wait()  # healthy: runs until cancelled

        supervisor = Supervisor(logging.getLogger("cilia_test.tasks"))
        state = supervisor.spawn("watch", flaky, min_backoff=0.05, max_backoff=0.1)
        await asyncio.wait_for(up.wait(), 5)
        assert state.task is not None and not state.task.done()
        await supervisor.stop()
        assert state.task.cancelled()
        return starts, state.attempts, state.failures, state.last_error

    with caplog.at_level(logging.ERROR, logger="cilia_test.tasks"):
        got, attempts, failures, last_error = asyncio.run(scenario())
    assert (attempts, failures) == (5, 4)
    assert "operator unreachable #4" in last_error
    gaps = [b - a for a, b in itertools.pairwise(got)]
    # 0.05, 0.1, then capped at 0.1
    for gap, wanted in zip(gaps, [0.05, 0.1, 0.1, 0.1], strict=True):
        assert wanted * 0.9 <= gap < wanted + 0.5
    failed = [r for r in caplog.records if r.getMessage() == "task failed; restarting"]
    assert [r.attempt for r in failed] == [1, 2, 3, 4]  # type: ignore[attr-defined]
    assert {r.task for r in failed} == {"watch"}  # type: ignore[attr-defined]
    assert [r.retry_in_seconds for r in failed] == [0.05, 0.1, 0.1, 0.1]  # type: ignore[attr-defined]


def test_a_task_that_returns_is_finished_and_not_restarted() -> None:
    async def scenario() -> tuple[int, bool]:
        calls = 0

        async def once() -> None:
            nonlocal calls
            calls += 1

        supervisor = Supervisor()
        state = supervisor.spawn("replay", once, min_backoff=0.01, max_backoff=0.01)
        await asyncio.sleep(0.1)
        await supervisor.stop()
        return calls, state.finished

    assert asyncio.run(scenario()) == (1, True)


def test_duplicate_names_bad_backoff_and_spawn_after_stop_are_refused() -> None:
    async def scenario() -> None:
        supervisor = Supervisor()

        async def forever() -> None:
            await asyncio.Event().wait()

        supervisor.spawn("a", forever)
        assert supervisor.names() == ["a"]
        with pytest.raises(ValueError, match="already running"):
            supervisor.spawn("a", forever)
        with pytest.raises(ValueError, match="min_backoff"):
            supervisor.spawn("b", forever, min_backoff=2, max_backoff=1)
        await supervisor.stop()
        await supervisor.stop()
        with pytest.raises(ValueError, match="stopping"):
            supervisor.spawn("c", forever)

    asyncio.run(scenario())


def test_stop_cancels_again_a_task_that_swallowed_a_cancellation() -> None:
    async def scenario() -> tuple[int, bool]:
        swallowed = 0

        async def stubborn() -> None:
            nonlocal swallowed
            while True:
                try:
                    await asyncio.Event().wait()
                except asyncio.CancelledError:
                    swallowed += 1
                    if swallowed > 1:
                        raise  # the second cancel lands

        supervisor = Supervisor()
        state = supervisor.spawn("stubborn", stubborn)
        await asyncio.sleep(0)
        await asyncio.wait_for(supervisor.stop(round_seconds=0.02), 5)
        assert state.task is not None
        return swallowed, state.task.cancelled()

    assert asyncio.run(scenario()) == (2, True)
