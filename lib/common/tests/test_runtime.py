"""announce_listening's one line, and run_until_signal's start / wait / stop."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import signal
import time

import pytest

from cilia_common.logs import JSONFormatter
from cilia_common.runtime import announce_listening, run_bounded, run_until_signal


def test_announce_listening_writes_one_json_line_with_listener_and_address() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JSONFormatter("cilia-test"))
    logger = logging.getLogger("cilia_test.announce")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        announce_listening(logger, "grpc", "127.0.0.1:41234")
    finally:
        logger.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    line = json.loads(lines[0])
    assert line["msg"] == "listening"
    assert (line["listener"], line["address"]) == ("grpc", "127.0.0.1:41234")
    assert line["component"] == "cilia-test" and line["level"] == "info"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_runs_until_a_signal_then_stops(sig: signal.Signals) -> None:
    events: list[str] = []

    async def start() -> None:
        events.append("start")
        asyncio.get_running_loop().call_later(0.05, os.kill, os.getpid(), sig)

    async def stop() -> None:
        events.append("stop")

    assert asyncio.run(run_until_signal(start, stop)) == sig
    assert events == ["start", "stop"]
    # the handlers are gone again: the default disposition is back
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_stop_is_awaited_when_start_fails() -> None:
    events: list[str] = []

    async def start() -> None:
        events.append("start")
        raise RuntimeError("port taken")

    async def stop() -> None:
        events.append("stop")

    with pytest.raises(RuntimeError, match="port taken"):
        asyncio.run(run_until_signal(start, stop))
    assert events == ["start", "stop"]


def test_an_until_event_also_ends_the_wait() -> None:
    lost = asyncio.Event()
    stopped: list[bool] = []

    async def start() -> None:
        asyncio.get_running_loop().call_later(0.05, lost.set)

    async def stop() -> None:
        stopped.append(True)

    assert asyncio.run(run_until_signal(start, stop, until=[lost])) is None
    assert stopped == [True]


def test_run_bounded_abandons_a_task_that_ignores_cancellation_and_names_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> int:
        async def stubborn() -> None:
            while True:
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(3600)

        async def polite() -> None:
            await asyncio.sleep(3600)

        asyncio.get_running_loop().create_task(stubborn(), name="stubborn")
        asyncio.get_running_loop().create_task(polite(), name="polite")
        await asyncio.sleep(0)
        return 7

    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="cilia_common.runtime"):
        assert run_bounded(main(), teardown_timeout=0.3) == 7
    assert time.monotonic() - started < 2
    [record] = [r for r in caplog.records if r.getMessage().startswith("tasks did not stop")]
    assert record.__dict__["tasks"] == ["stubborn"]
    assert record.__dict__["flag"] == "--shutdown-timeout"
