"""Hubble failures a caller can act on (one type per actionable failure)."""

from __future__ import annotations


class HubbleError(Exception):
    """Base class of every error raised by :mod:`cilia_agent.hubble`."""


class EventDecodeError(HubbleError):
    """A ring-buffer record is not a ``struct flow_event`` (wrong size)."""

    def __init__(self, size: int, expected: int) -> None:
        self.size = size
        self.expected = expected
        super().__init__(
            f"flow event record has {size} bytes, struct flow_event has {expected} "
            "(bpf/lib/common.h and cilia_agent.hubble.events out of sync?)"
        )


class InvalidCapacity(HubbleError):
    """``--hubble-event-buffer-capacity`` is not 2^n-1 within 1..65535."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        super().__init__(
            f"invalid hubble-event-buffer-capacity {capacity}: must be 2^n-1 "
            "between 1 and 65535 (e.g. 1, 3, 7, ..., 4095, ..., 65535)"
        )


class InvalidFilter(HubbleError):
    """A ``flow.FlowFilter`` cannot be compiled (bad value or unsupported field).

    Served as gRPC ``INVALID_ARGUMENT``.
    """


class InvalidRequest(HubbleError):
    """A GetFlows request combines options upstream refuses (served as ``INVALID_ARGUMENT``)."""
