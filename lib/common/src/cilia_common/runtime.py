"""The life of a service process: announce each listener, run until a signal.

Every service logs one ``"listening"`` line per listener once it is bound
(:func:`announce_listening`); the test kit and operators read the bound address (and so the
port picked for port 0) from that line of the JSON log. :func:`run_until_signal` is the one
start / wait for SIGTERM or SIGINT / stop loop.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable
from typing import Literal

__all__ = ["LISTENING", "announce_listening", "run_until_signal"]

LISTENING = "listening"
"""The message of every listener announcement."""

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def announce_listening(logger: logging.Logger, listener: str, address: str) -> None:
    """Log that ``listener`` is bound at ``address``: one INFO record, message
    ``"listening"``, extra ``{"listener": listener, "address": address}``.

    Args:
        logger: the service's logger (its JSON formatter writes the extras as fields).
        listener: the listener's name within the service (``"grpc"``, ``"metrics"``,
            ``"api"``, ``"hubble"``, ``"observer"``, ``"health"``).
        address: the BOUND address: ``"127.0.0.1:41234"`` (never port 0) or
            ``"unix:/run/x.sock"``.
    """
    logger.info(LISTENING, extra={"listener": listener, "address": address})


async def run_until_signal(
    start: Callable[[], Awaitable[object]],
    stop: Callable[[], Awaitable[object]],
    *,
    until: Iterable[asyncio.Event] = (),
) -> signal.Signals | None:
    """``await start()``, wait for SIGTERM or SIGINT, then ``await stop()``.

    The handlers are installed before ``start()`` (a signal during start-up ends the wait
    at once) and removed after; ``stop()`` is awaited in every case -- also when
    ``start()`` raised or the wait was cancelled -- so it must cope with a partial start.

    Args:
        start: brings the service up; its exception propagates (after ``stop()``).
        stop: brings it down, in reverse order.
        until: events that also end the wait (e.g. "leadership lost").

    Returns:
        the signal received, or None when one of ``until`` was set first.
    """
    loop = asyncio.get_running_loop()
    received: list[signal.Signals] = []
    done = asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        received.append(sig)
        done.set()

    for sig in SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
    watchers: list[asyncio.Task[Literal[True]]] = []
    try:
        await start()
        waits = [asyncio.create_task(done.wait())]
        waits += [asyncio.create_task(event.wait()) for event in until]
        watchers = waits
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in watchers:
            task.cancel()
        for sig in SIGNALS:
            loop.remove_signal_handler(sig)
        await stop()
    return received[0] if received else None
