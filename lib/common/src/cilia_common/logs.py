"""Structured logging: one JSON object per line on stderr.

Every line carries ``time`` (RFC 3339, UTC), ``level``, ``component``,
``msg`` and any ``extra=`` fields given at the call site, so logs can be
grepped by field (``"container_id": "..."``) and parsed by collectors.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import sys
from typing import IO

_RESERVED = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
    "taskName",
}


class JSONFormatter(logging.Formatter):
    """Format a record as one JSON line with its ``extra`` fields inlined."""

    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": _dt.datetime.fromtimestamp(record.created, _dt.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "component": self.component,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _RESERVED and not key.startswith("_"):
                line[key] = value
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def setup_logging(component: str, level: str = "info", stream: IO[str] | None = None) -> None:
    """Send every log record of the process to ``stream`` (stderr) as JSON lines.

    Args:
        component: service name written in every line (``"cilia-agent"``).
        level: ``debug``, ``info``, ``warning`` or ``error``.
        stream: destination; stderr when None.

    Raises:
        ValueError: unknown level name.
    """
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}: use debug, info, warning or error")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JSONFormatter(component))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
