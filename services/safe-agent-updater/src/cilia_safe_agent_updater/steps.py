"""One JSON log line, and optionally one Kubernetes Event, for every step of an update."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("cilia_safe_agent_updater")

EventSink = Callable[[str, str, bool, dict[str, Any] | None], None]
"""``sink(reason, message, warning, involved_object)``; must not raise."""


@dataclass
class Reporter:
    """Reports steps: a log line with ``step=<reason>`` and the fields, then each sink.

    ``involved`` is the object the next Events are about (a Pod or Node reference dict,
    ``{"kind", "name", "namespace"?, "uid"?}``); the Kubernetes mode points it at the agent pod
    once known. ``steps`` records ``(reason, message)`` in order (tests and the summary use it).
    """

    sinks: list[EventSink] = field(default_factory=list)
    involved: dict[str, Any] | None = None
    steps: list[tuple[str, str]] = field(default_factory=list)

    def step(self, reason: str, message: str, *, warning: bool = False, **fields: Any) -> None:
        """Log ``message`` with ``step=reason`` and ``fields``; emit it to every sink."""
        self.steps.append((reason, message))
        log.log(
            logging.WARNING if warning else logging.INFO, message, extra={"step": reason, **fields}
        )
        for sink in self.sinks:
            sink(reason, message, warning, self.involved)
