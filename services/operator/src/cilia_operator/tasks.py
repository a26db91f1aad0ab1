"""Stopping background tasks reliably."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

log = logging.getLogger(__name__)


async def cancel_all(tasks: Sequence[asyncio.Task[None]], attempts: int = 100) -> None:
    """Cancel ``tasks`` and wait for them, cancelling again while they run on.

    On Python 3.11 ``asyncio.wait_for`` (used inside redis-py's send path) can lose a
    cancellation that races with its inner future completing; the task then carries on
    into its next store call. A repeated ``cancel()`` lands on that next await.

    A task still running after ``attempts`` rounds is logged and left. The exceptions of
    tasks that failed are retrieved (so asyncio does not log them); callers that care
    read them with ``task.exception()``.
    """
    pending = [t for t in tasks if not t.done()]
    for _ in range(attempts):
        if not pending:
            break
        for task in pending:
            task.cancel()
        _, still = await asyncio.wait(pending, timeout=0.05)
        pending = list(still)
    if pending:
        log.warning("tasks did not stop", extra={"tasks": [t.get_name() for t in pending]})
    for task in tasks:
        if task.done() and not task.cancelled():
            with contextlib.suppress(Exception):
                task.exception()
