"""Stopping background tasks reliably: :func:`cilia_common.tasks.cancel_all` (cancel, then
cancel again while a task runs on; Python 3.11's ``asyncio.wait_for`` can lose a
cancellation inside redis-py's send path)."""

from __future__ import annotations

from cilia_common.tasks import cancel_all

__all__ = ["cancel_all"]
