"""The life of a service process: announce each listener, run until a signal.

Every service logs one ``"listening"`` line per listener once it is bound
(:func:`announce_listening`); the test kit and operators read the bound address (and so the
port picked for port 0) from that line of the JSON log. :func:`run_until_signal` is the one
start / wait for SIGTERM or SIGINT / stop loop. :func:`run_bounded` runs a service's main
coroutine like ``asyncio.run`` but bounds the loop's end: tasks still running after the main
coroutine returned are cancelled and waited for at most a named number of seconds, then the
process goes on to exit (``asyncio.run`` would wait for them without bound).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, Literal, TypeVar

__all__ = ["LISTENING", "announce_listening", "run_bounded", "run_until_signal"]

T = TypeVar("T")

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


def run_bounded(
    main: Coroutine[Any, Any, T],
    *,
    teardown_timeout: float,
    logger: logging.Logger | None = None,
    flag: str = "--shutdown-timeout",
) -> T:
    """Run ``main`` on a new event loop and return its result, with a bounded end.

    ``asyncio.run`` cancels the tasks ``main`` left behind and then waits for every one of
    them without a bound; a task that swallows or never receives its cancellation (seen
    with redis-py's asyncio client: a read cancelled while its connection is being made
    may never return) keeps the process alive until it is killed. Here the leftovers are
    cancelled (again every 0.1 s, as :func:`cilia_common.tasks.cancel_all` does) for at most
    ``teardown_timeout`` seconds; those still pending are logged by name (WARNING ``"tasks
    did not stop; exiting without them"`` with ``tasks`` and ``flag``) and abandoned, and
    the loop is closed. Async generators and the default executor get the same bound.

    Args:
        main: the service's main coroutine (e.g. ``run(config)``).
        teardown_timeout: seconds (>= 0) the leftover tasks get once cancelled.
        logger: where the stuck tasks are reported (default: this module's).
        flag: the flag that sets ``teardown_timeout``, named in the warning.

    Returns:
        ``main``'s result; its exception propagates (after the bounded teardown).
    """
    log = logger or logging.getLogger(__name__)
    loop = asyncio.new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        try:
            stuck = loop.run_until_complete(_cancel_leftovers(teardown_timeout))
            if stuck:
                log.warning(
                    "tasks did not stop; exiting without them",
                    extra={"tasks": stuck, "flag": flag, "seconds": teardown_timeout},
                )
            for cleanup in (loop.shutdown_asyncgens(), loop.shutdown_default_executor()):
                task = loop.create_task(cleanup)
                loop.run_until_complete(asyncio.wait([task], timeout=max(teardown_timeout, 0.1)))
        finally:
            asyncio.set_event_loop(None)
            loop.close()


async def _cancel_leftovers(timeout: float, round_seconds: float = 0.1) -> list[str]:
    """Cancel every other task of the running loop, again each ``round_seconds``, until all
    ended or ``timeout`` seconds passed; the sorted names of those still pending."""
    loop = asyncio.get_running_loop()
    me = asyncio.current_task()
    leftovers = {t for t in asyncio.all_tasks() if t is not me}
    pending = set(leftovers)
    deadline = loop.time() + timeout
    while pending:
        for task in pending:
            task.cancel()
        left = deadline - loop.time()
        if left <= 0:
            break
        _, still = await asyncio.wait(pending, timeout=min(round_seconds, left))
        pending = set(still)
    for task in leftovers - pending:
        if not task.cancelled():
            task.exception()  # retrieved: asyncio does not log it at collection
    return sorted(t.get_name() for t in pending)
