"""Supervised background tasks: named, spawned in one place, restarted with backoff.

A service's long-running loops (watch streams, reconcilers, replays) are spawned through one
:class:`Supervisor`. When a loop raises, the failure is logged once for that attempt and the
loop is started again after a delay that doubles from ``min_backoff`` up to ``max_backoff``
(:class:`cilia_common.backoff.Backoff`: capped exponential backoff, as upstream's controller
manager ``pkg/controller`` retries a failing controller; ``jitter`` spreads the restarts). An attempt that ran for at least ``max_backoff`` seconds counts as
healthy: the next failure starts from ``min_backoff`` again. A loop that returns normally is
finished and not restarted. :meth:`Supervisor.stop` cancels every loop (again, while one runs on) and waits
for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

from .backoff import Backoff

__all__ = ["Supervisor", "TaskState", "cancel_all"]

Factory = Callable[[], Coroutine[Any, Any, object]]


@dataclass
class TaskState:
    """What the supervisor knows of one named task.

    Attributes:
        name: the name given to :meth:`Supervisor.spawn`.
        attempts: attempts started so far (1 after the first start).
        failures: attempts that raised.
        last_error: ``repr`` of the last exception, "" if none.
        finished: the task returned normally (it is not restarted).
        next_delay: seconds the next restart would wait.
    """

    name: str
    attempts: int = 0
    failures: int = 0
    last_error: str = ""
    finished: bool = False
    next_delay: float = 0.0
    task: asyncio.Task[None] | None = field(default=None, repr=False)


class Supervisor:
    """Runs named long-running coroutines and restarts the ones that fail.

    Args:
        logger: where each failure is logged (ERROR, once per attempt, with ``task``,
            ``attempt``, ``retry_in_seconds`` and the traceback).
        clock: monotonic clock (seconds); tests may pass their own.
    """

    def __init__(
        self,
        logger: logging.Logger | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger or logging.getLogger("cilia_common.tasks")
        self._clock = clock
        self._tasks: dict[str, TaskState] = {}
        self._stopping = False

    def spawn(
        self,
        name: str,
        factory: Factory,
        *,
        min_backoff: float = 1.0,
        max_backoff: float = 30.0,
        jitter: float = 0.0,
    ) -> TaskState:
        """Start ``factory()`` as the task ``name``; restart it when it raises.

        Args:
            name: unique among this supervisor's tasks (logged with every failure).
            factory: returns a NEW coroutine for each attempt.
            min_backoff: seconds before the first restart, > 0.
            max_backoff: cap of the doubling delay, >= ``min_backoff``.
            jitter: fraction of each delay drawn at random (:class:`Backoff`), in [0, 1).

        Returns:
            the task's live :class:`TaskState`.

        Raises:
            ValueError: duplicate name, bad backoff, or the supervisor is stopping.
        """
        if self._stopping:
            raise ValueError(f"supervisor is stopping: cannot spawn {name!r}")
        if name in self._tasks and not self._tasks[name].finished:
            raise ValueError(f"task {name!r} is already running")
        if not 0 < min_backoff <= max_backoff:
            raise ValueError(
                f"task {name!r}: need 0 < min_backoff <= max_backoff, got "
                f"{min_backoff} and {max_backoff}"
            )
        try:
            backoff = Backoff(min_backoff, max_backoff, jitter)
        except ValueError as exc:
            raise ValueError(f"task {name!r}: {exc}") from None
        state = TaskState(name=name, next_delay=min_backoff)
        self._tasks[name] = state
        state.task = asyncio.get_running_loop().create_task(
            self._run(state, factory, backoff), name=name
        )
        return state

    async def _run(self, state: TaskState, factory: Factory, backoff: Backoff) -> None:
        failures_in_a_row = 0
        while True:
            state.attempts += 1
            started = self._clock()
            try:
                await factory()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self._clock() - started >= backoff.maximum:
                    failures_in_a_row = 0  # it ran healthy for a while: start over
                delay = backoff.delay(failures_in_a_row)
                failures_in_a_row += 1
                state.failures += 1
                state.last_error = repr(exc)
                state.next_delay = delay
                self._log.error(
                    "task failed; restarting",
                    exc_info=True,
                    extra={
                        "task": state.name,
                        "attempt": state.attempts,
                        "retry_in_seconds": delay,
                    },
                )
                await asyncio.sleep(delay)
            else:
                state.finished = True
                self._log.debug("task finished", extra={"task": state.name})
                return

    def state(self, name: str) -> TaskState:
        """The :class:`TaskState` of ``name``. Raises KeyError when never spawned."""
        return self._tasks[name]

    def names(self) -> list[str]:
        """Names of every spawned task, in spawn order."""
        return list(self._tasks)

    async def stop(self, *, rounds: int = 50, round_seconds: float = 0.1) -> None:
        """Cancel every task and wait until each has ended (:func:`cancel_all`); no spawn
        is accepted after. Safe to call twice."""
        self._stopping = True
        tasks = [s.task for s in self._tasks.values() if s.task is not None]
        await cancel_all(tasks, rounds=rounds, round_seconds=round_seconds, logger=self._log)


async def cancel_all(
    tasks: Sequence[asyncio.Task[Any]],
    *,
    rounds: int = 100,
    round_seconds: float = 0.05,
    logger: logging.Logger | None = None,
) -> None:
    """Cancel ``tasks`` and wait for them, cancelling again while they run on.

    On Python 3.11 ``asyncio.wait_for`` (used inside redis-py's send path) can lose a
    cancellation that races with its inner future completing; the task then carries on
    into its next await. A repeated ``cancel()`` every ``round_seconds`` lands on that next
    await, up to ``rounds`` times.

    A task still running after that is logged (WARNING ``"tasks did not stop"`` with their
    names) and left. The exceptions of tasks that failed are retrieved (so asyncio does not
    log them); callers that care read them with ``task.exception()``.
    """
    log = logger or logging.getLogger(__name__)
    pending = [t for t in tasks if not t.done()]
    for _ in range(rounds):
        if not pending:
            break
        for task in pending:
            task.cancel()
        _, still = await asyncio.wait(pending, timeout=round_seconds)
        pending = list(still)
    if pending:
        log.warning("tasks did not stop", extra={"tasks": [t.get_name() for t in pending]})
    for task in tasks:
        if task.done() and not task.cancelled():
            with contextlib.suppress(Exception):
                task.exception()
