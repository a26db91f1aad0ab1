"""Retried background work, written once for every service: a call retried until it succeeds
(:func:`retry_call`, and :class:`RetryQueue` for fire-and-forget calls), a watch stream followed
forever (:func:`run_watch`), and a periodic check (:func:`run_periodic`).

Every wait comes from one :class:`~cilia_common.backoff.Backoff` (capped exponential, optional
jitter); the retry-until-success loop is tenacity's ``AsyncRetrying``. Each failed attempt is
logged once (WARNING, with ``retry_in_s``); a failure that is not an expected one (anything
outside ``quiet``) is logged with its traceback. Cancellation always ends the loop at once
(``asyncio.CancelledError`` is never retried). Long-running loops are spawned through
:class:`cilia_common.tasks.Supervisor` or owned by the caller's task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterable, Awaitable, Callable
from typing import Any, TypeVar

import tenacity

from .backoff import Backoff

__all__ = ["RetryQueue", "retry_call", "run_periodic", "run_watch"]

T = TypeVar("T")
R = TypeVar("R")

_log = logging.getLogger(__name__)


async def retry_call(
    what: str,
    call: Callable[[], Awaitable[R]],
    backoff: Backoff,
    *,
    logger: logging.Logger | None = None,
    retry_on: tuple[type[BaseException], ...] = (Exception,),
    stop_after_s: float | None = None,
) -> R:
    """``await call()`` until it returns; after each failure wait ``backoff.delay(n)``.

    Args:
        what: names the call in log lines (``call`` field).
        call: makes and awaits one attempt (called anew per attempt).
        backoff: the waits between attempts.
        logger: where failures are logged (WARNING ``"call failed, retrying"`` with
            ``call``, ``reason``, ``retry_in_s``; INFO once it succeeds after failures).
        retry_on: exceptions that are retried; any other propagates at once.
        stop_after_s: give up after this many seconds in all (None: never).

    Returns:
        what the successful attempt returned.

    Raises:
        the last attempt's exception when ``stop_after_s`` passed; an exception outside
        ``retry_on`` at once; ``asyncio.CancelledError`` when cancelled.
    """
    log = logger or _log

    def before_sleep(state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        wait = state.next_action.sleep if state.next_action is not None else 0.0
        log.warning(
            "call failed, retrying",
            extra={"call": what, "reason": str(exc), "retry_in_s": round(wait, 3)},
        )

    retrying = tenacity.AsyncRetrying(
        retry=tenacity.retry_if_exception_type(retry_on),
        wait=backoff.wait(),
        stop=(
            tenacity.stop_after_delay(stop_after_s)
            if stop_after_s is not None
            else tenacity.stop_never
        ),
        before_sleep=before_sleep,
        reraise=True,
    )
    attempts = 0
    async for attempt in retrying:
        with attempt:
            attempts += 1
            result = await call()
    if attempts > 1:
        log.info("call succeeded after retries", extra={"call": what, "attempts": attempts})
    return result


class RetryQueue:
    """Best-effort calls retried in the background until they succeed (e.g. an agent's
    DeleteEndpoint after a CNI DEL): each submitted call runs now and is retried alone with
    :func:`retry_call`. Not persisted: calls pending at :meth:`close` are dropped (whoever
    owns the other side must garbage-collect what they would have done).

    Args:
        backoff: the waits between attempts of each call.
        logger: where failures are logged.
    """

    def __init__(self, backoff: Backoff, *, logger: logging.Logger | None = None) -> None:
        self.backoff = backoff
        self._log = logger or _log
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def pending(self) -> int:
        """Calls still being retried."""
        return len(self._tasks)

    def submit(self, what: str, call: Callable[[], Awaitable[object]]) -> None:
        """Run ``call`` now and again after failures (needs a running event loop)."""
        task = asyncio.get_running_loop().create_task(
            retry_call(what, call, self.backoff, logger=self._log), name=f"retry {what}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Cancel every pending retry and wait for them."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def run_watch(
    name: str,
    open_stream: Callable[[], AsyncIterable[T]],
    consume: Callable[[AsyncIterable[T]], Awaitable[bool]],
    backoff: Backoff,
    *,
    logger: logging.Logger | None = None,
    quiet: tuple[type[BaseException], ...] = (),
    fatal: tuple[type[BaseException], ...] = (),
    describe: Callable[[BaseException], str] = str,
    on_lost: Callable[[str, float], Awaitable[None]] | None = None,
) -> None:
    """Follow a watch stream until cancelled: open it, hand it to ``consume``, reopen.

    Args:
        name: names the watch in log lines (``watch`` field).
        open_stream: opens the stream (a gRPC call, an HTTP watch); called per attempt.
        consume: reads the stream; returns True when it delivered something, which resets
            the backoff to its first delay.
        backoff: waits between attempts.
        logger: WARNING ``"watch lost, reconnecting"`` per loss (``watch``, ``reason``,
            ``retry_in_s``); an exception outside ``quiet`` also with its traceback.
        quiet: expected failures (e.g. ``grpc.aio.AioRpcError``: the peer went away).
        fatal: failures that end the watch: re-raised at once, nothing retried (e.g. the
            peer refused the request itself).
        describe: how an exception reads in ``reason``.
        on_lost: awaited after each loss with ``(reason, retry_in_s)`` before the wait
            (e.g. to mark the peer unavailable).

    A stream with a ``cancel()`` method (a gRPC call) is cancelled when its attempt ends, so
    the channel is kept and the call released; an async generator is closed (``aclose``), so
    its ``finally`` (closing its channel) runs then, not at garbage collection.

    Raises:
        an exception of ``fatal``; ``asyncio.CancelledError`` when cancelled.
    """
    log = logger or _log
    attempt = 0
    while True:
        delivered = False
        stream: AsyncIterable[T] | None = None
        try:
            stream = open_stream()
            delivered = await consume(stream)
            reason = "stream ended"
        except asyncio.CancelledError:
            raise
        except fatal:
            raise
        except Exception as exc:  # a watch outlives whatever its peer does
            reason = describe(exc)
            if not isinstance(exc, quiet):
                log.exception("watch %s: failed", name)
        finally:
            await _release(stream)
        if delivered:
            attempt = 0
        delay = backoff.delay(attempt)
        attempt += 1
        log.warning(
            "watch lost, reconnecting",
            extra={"watch": name, "reason": reason, "retry_in_s": round(delay, 3)},
        )
        if on_lost is not None:
            await on_lost(reason, delay)
        await asyncio.sleep(delay)


async def _release(stream: object) -> None:
    """End an attempt's stream: ``cancel()`` a gRPC call, ``aclose()`` an async generator."""
    cancel = getattr(stream, "cancel", None)
    if cancel is not None:
        cancel()
        return
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()


async def run_periodic(
    name: str,
    interval: float,
    tick: Callable[[], Awaitable[None]],
    *,
    logger: logging.Logger | None = None,
) -> None:
    """Await ``tick()`` every ``interval`` seconds (the first after one interval) until
    cancelled; a tick that raises is logged (ERROR with traceback, ``task`` field) and the
    next one runs on schedule.

    Raises:
        ValueError: ``interval`` <= 0.
    """
    if interval <= 0:
        raise ValueError(f"{name}: interval must be > 0, got {interval}")
    log = logger or _log
    while True:
        await asyncio.sleep(interval)
        try:
            await tick()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("periodic task failed; next run in %gs", interval, extra={"task": name})
