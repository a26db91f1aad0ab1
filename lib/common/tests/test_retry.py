"""The background-work runtime: Backoff's delays (doubling, cap, jitter bounds, tenacity
adapter), retry_call until success / giving up / not retrying the unexpected, RetryQueue,
run_watch's reconnects and reset on delivery, run_periodic surviving a failing tick, and the
one health client against a real gRPC server."""

from __future__ import annotations

import asyncio
import itertools
import logging
import pathlib
from collections.abc import AsyncIterator

import pytest

from cilia_common import health
from cilia_common.backoff import Backoff
from cilia_common.grpcserver import set_serving, start_server
from cilia_common.retry import RetryQueue, retry_call, run_periodic, run_watch


def test_backoff_doubles_to_its_cap_and_jitter_stays_within_its_fraction() -> None:
    exact = Backoff(1, 30)
    assert [exact.delay(n) for n in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert exact.delay(500) == 30  # no overflow on a long outage
    assert Backoff.fixed(2.5).delay(9) == 2.5
    lowest = Backoff(1, 30, jitter=0.5, rand=lambda: 0.999999)
    highest = Backoff(1, 30, jitter=0.5, rand=lambda: 0.0)
    for n in range(7):
        assert exact.delay(n) * 0.5 <= lowest.delay(n) < highest.delay(n) == exact.delay(n)


@pytest.mark.parametrize(
    ("minimum", "maximum", "jitter"), [(0, 1, 0), (2, 1, 0), (1, 2, 1.0), (1, 2, -0.1)]
)
def test_a_bad_backoff_is_refused(minimum: float, maximum: float, jitter: float) -> None:
    with pytest.raises(ValueError, match="backoff"):
        Backoff(minimum, maximum, jitter)


def test_retry_call_retries_with_the_backoff_then_returns(caplog: pytest.LogCaptureFixture) -> None:
    times: list[float] = []

    async def scenario() -> str:
        loop = asyncio.get_running_loop()

        async def flaky() -> str:
            times.append(loop.time())
            if len(times) < 4:
                raise ConnectionError(f"refused #{len(times)}")
            return "done"

        return await retry_call(
            "DeleteEndpoint", flaky, Backoff(0.02, 0.05), logger=logging.getLogger("t.retry")
        )

    with caplog.at_level(logging.INFO, logger="t.retry"):
        assert asyncio.run(scenario()) == "done"
    gaps = [b - a for a, b in itertools.pairwise(times)]
    for gap, wanted in zip(gaps, [0.02, 0.04, 0.05], strict=True):
        assert wanted * 0.9 <= gap < wanted + 0.5
    failed = [r for r in caplog.records if r.getMessage() == "call failed, retrying"]
    assert [r.retry_in_s for r in failed] == [0.02, 0.04, 0.05]  # type: ignore[attr-defined]
    assert failed[0].reason == "refused #1"  # type: ignore[attr-defined]
    assert any(r.getMessage() == "call succeeded after retries" for r in caplog.records)


def test_retry_call_gives_up_after_its_deadline_and_never_retries_the_unexpected() -> None:
    calls = 0

    async def always_down() -> None:
        nonlocal calls
        calls += 1
        raise ConnectionError("down")

    async def broken() -> None:
        nonlocal calls
        calls += 1
        raise KeyError("bug")

    with pytest.raises(ConnectionError, match="down"):
        asyncio.run(retry_call("x", always_down, Backoff.fixed(0.01), stop_after_s=0.1))
    assert 2 <= calls < 50
    calls = 0
    with pytest.raises(KeyError):
        asyncio.run(retry_call("y", broken, Backoff.fixed(0.01), retry_on=(ConnectionError,)))
    assert calls == 1


def test_retry_queue_runs_each_call_until_it_succeeds_and_close_drops_the_rest() -> None:
    async def scenario() -> tuple[list[str], int]:
        done: list[str] = []
        tries = {"a": 0}

        async def a() -> None:
            tries["a"] += 1
            if tries["a"] < 3:
                raise ConnectionError("not yet")
            done.append("a")

        async def never() -> None:
            raise ConnectionError("never")

        queue = RetryQueue(Backoff.fixed(0.01))
        queue.submit("a", a)
        queue.submit("never", never)
        for _ in range(200):
            if done:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.02)
        pending_before_close = queue.pending
        await queue.close()
        return done, pending_before_close * 10 + queue.pending

    done, pending = asyncio.run(scenario())
    assert done == ["a"]
    assert pending == 10  # "never" still pending before close, nothing after


def test_run_watch_reconnects_and_a_delivering_stream_resets_the_backoff(
    caplog: pytest.LogCaptureFixture,
) -> None:
    opened: list[int] = []
    lost: list[tuple[str, float]] = []

    async def scenario() -> None:
        async def stream() -> AsyncIterator[int]:
            opened.append(len(opened))
            n = len(opened)
            if n in (1, 2, 4):  # fails before delivering anything
                raise ConnectionError(f"gone #{n}")
            yield n  # 3 delivers then ends; 5 delivers then stays open until cancelled
            if n == 5:
                await asyncio.Event().wait()

        async def consume(items: object) -> bool:
            got = [i async for i in items]  # type: ignore[attr-defined]
            return bool(got)

        async def on_lost(reason: str, delay: float) -> None:
            lost.append((reason, delay))

        task = asyncio.create_task(
            run_watch(
                "peers", stream, consume, Backoff(0.01, 0.08),
                logger=logging.getLogger("t.watch"), quiet=(ConnectionError,), on_lost=on_lost,
            )
        )  # fmt: skip
        while len(opened) < 5:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with caplog.at_level(logging.WARNING, logger="t.watch"):
        asyncio.run(scenario())
    # gone #1 -> 0.01, gone #2 -> 0.02, delivered (reset) -> 0.01, gone #4 -> 0.02
    assert lost == [("gone #1", 0.01), ("gone #2", 0.02), ("stream ended", 0.01), ("gone #4", 0.02)]
    assert not [r for r in caplog.records if r.exc_info]  # quiet: no tracebacks


def test_run_watch_ends_on_a_fatal_error_and_closes_each_generator() -> None:
    closed: list[int] = []

    async def scenario() -> None:
        async def stream() -> AsyncIterator[int]:
            n = len(closed) + 1
            try:
                yield n
                if n == 1:
                    raise ConnectionError("lost")
                raise PermissionError("refused")
            finally:
                closed.append(n)

        async def consume(items: AsyncIterator[int]) -> bool:
            async for _ in items:
                pass
            return True

        await run_watch(
            "w", stream, consume, Backoff.fixed(0.01), quiet=(ConnectionError,),
            fatal=(PermissionError,),
        )  # fmt: skip

    with pytest.raises(PermissionError):
        asyncio.run(scenario())
    assert closed == [1, 2]


def test_run_periodic_keeps_running_after_a_failing_tick(caplog: pytest.LogCaptureFixture) -> None:
    ticks: list[int] = []

    async def scenario() -> None:
        async def tick() -> None:
            ticks.append(len(ticks))
            if len(ticks) == 2:
                raise RuntimeError("one bad tick")

        task = asyncio.create_task(
            run_periodic("check", 0.01, tick, logger=logging.getLogger("t.periodic"))
        )
        while len(ticks) < 4:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with caplog.at_level(logging.ERROR, logger="t.periodic"):
        asyncio.run(scenario())
    assert len(ticks) >= 4
    assert [r.task for r in caplog.records] == ["check"]  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="interval"):
        asyncio.run(run_periodic("bad", 0, lambda: asyncio.sleep(0)))


def test_the_health_client_reads_serving_not_serving_and_no_server(tmp_path: pathlib.Path) -> None:
    sock = tmp_path / "h.sock"

    async def scenario() -> tuple[health.HealthAnswer, health.HealthAnswer, health.HealthAnswer]:
        server, servicer = await start_server([], [f"unix:{sock}"])
        try:
            before = await asyncio.to_thread(health.check, f"unix:{sock}", timeout=2)
            await set_serving(servicer, [])
            waited = await asyncio.to_thread(
                health.wait_serving, f"unix:{sock}", attempts=3, interval=0.05, timeout=2
            )
            unknown = await asyncio.to_thread(
                health.check, f"unix:{sock}", service="no.such.Service", timeout=2
            )
        finally:
            await server.stop(None)
        return before, waited, unknown

    before, waited, unknown = asyncio.run(scenario())
    assert (before.status, before.serving) == ("NOT_SERVING", False)
    assert waited.serving
    assert unknown.status == "" and unknown.error.startswith("NOT_FOUND")
    gone = health.wait_serving(f"unix:{sock}", attempts=2, interval=0.01, timeout=0.5)
    assert not gone.serving and gone.error.startswith(("UNAVAILABLE", "DEADLINE_EXCEEDED"))
