"""The agent's non-flow Hubble events: agent events and datapath debug events, and the
namespaces seen in flows.

Upstream Hubble's local observer keeps agent events (``AGENT_STARTED``, policy and endpoint
notifications of the monitor) and debug events (datapath ``DBG_*`` messages, only with the
datapath's debug mode on) in its event ring and serves them through ``GetAgentEvents`` and
``GetDebugEvents`` with the same window rules as ``GetFlows`` (the option checks are one
function for all three, :func:`request_window`):

- ``first`` with ``follow``, or ``number`` with ``since``/``until``: INVALID_ARGUMENT
  (:class:`~cilia_agent.hubble.errors.InvalidRequest`).
- ``since``: start at the oldest event not older than ``since``; else ``first``: start at the
  oldest event; else ``follow`` with ``number`` 0: only events written after the call; else
  the newest ``number`` events (0: every event held), oldest first.
- ``number`` caps what is sent (not with ``follow``); ``until`` ends the stream at the first
  event newer than it; without ``follow`` the stream ends at the newest event present when the
  call started.

Each kind has a ring of its own of :data:`EVENT_LOG_CAPACITY` entries, so a flood of flows
never pushes the agent's start event out. Cilia's datapath emits no debug events: the debug
log stays empty and ``GetDebugEvents`` answers an empty stream, as an upstream agent does with
debug mode off.

:class:`NamespaceTracker` answers ``GetNamespaces``: namespaces of a flow's source or
destination seen within :data:`NAMESPACE_TTL_NS` (upstream: one hour), sorted by cluster, then
namespace.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from cilia.hubble.flow import flow_pb2
from cilia.hubble.observer import observer_pb2
from cilia_agent.hubble.errors import InvalidRequest
from cilia_agent.hubble.parser import timestamp
from cilia_agent.hubble.ring import Ring

#: Entries each event log keeps (2^n-1, like every Hubble ring).
EVENT_LOG_CAPACITY = 255
#: A namespace is listed by GetNamespaces while it had a flow within this window (1 h).
NAMESPACE_TTL_NS = 3600 * 1_000_000_000

P = TypeVar("P")


class WindowRequest(Protocol):
    """The window fields GetFlowsRequest, GetAgentEventsRequest and GetDebugEventsRequest
    share."""

    @property
    def number(self) -> int: ...

    @property
    def first(self) -> bool: ...

    @property
    def follow(self) -> bool: ...

    def HasField(self, field_name: str) -> bool: ...  # noqa: N802 - protobuf API


def request_window(request: WindowRequest) -> tuple[int | None, int | None]:
    """``(since_ns, until_ns)`` of a GetFlows / GetAgentEvents / GetDebugEvents request
    (None where the field is absent), after upstream's checks of the window options.

    Raises:
        InvalidRequest: ``first`` with ``follow``; ``number`` with ``since``/``until``; a
            timestamp whose nanos are outside 0..999,999,999.
    """
    if request.first and request.follow:
        raise InvalidRequest("first cannot be specified with follow")
    has = {name: request.HasField(name) for name in ("since", "until")}
    if request.number and any(has.values()):
        raise InvalidRequest("number is incompatible with since/until")
    out: list[int | None] = []
    for name in ("since", "until"):
        ts = getattr(request, name) if has[name] else None
        if ts is not None and not 0 <= ts.nanos < 1_000_000_000:
            raise InvalidRequest(f"{name}: invalid timestamp")
        out.append(None if ts is None else int(ts.seconds) * 1_000_000_000 + int(ts.nanos))
    return out[0], out[1]


@dataclass(frozen=True, slots=True)
class _Entry(Generic[P]):
    time_ns: int
    payload: P


class EventLog(Generic[P]):
    """A ring of timestamped events served with GetFlows' window rules (module docstring).

    Confined to one asyncio event loop.

    Args:
        capacity: entries kept (2^n-1 in 1..65535).

    Raises:
        InvalidCapacity: bad capacity.
    """

    def __init__(self, capacity: int = EVENT_LOG_CAPACITY) -> None:
        self.ring: Ring[_Entry[P]] = Ring(capacity, time_of=lambda e: e.time_ns)

    def add(self, payload: P, time_ns: int) -> None:
        """Append an event observed at wall-clock ``time_ns``; wakes followers."""
        self.ring.write(_Entry(time_ns, payload))

    def __len__(self) -> int:
        return len(self.ring)

    def stream(self, request: WindowRequest) -> AsyncIterator[tuple[int, P]]:
        """``(time_ns, payload)`` of the events ``request`` selects, oldest first.

        Raises:
            InvalidRequest: first with follow, number with since/until, or a bad timestamp
                (raised here, before anything is sent).
        """
        since_ns, until_ns = request_window(request)
        return self._stream(request, since_ns, until_ns)

    def _start(self, request: WindowRequest, since_ns: int | None) -> int:
        ring = self.ring
        if since_ns is not None:
            for seq in range(ring.oldest, ring.next_seq):
                if ring.get(seq).time_ns >= since_ns:
                    return seq
            return ring.next_seq
        if request.first:
            return ring.oldest
        if request.follow and request.number == 0:
            return ring.next_seq
        if request.number == 0:
            return ring.oldest
        return max(ring.oldest, ring.next_seq - int(request.number))

    async def _stream(
        self, request: WindowRequest, since_ns: int | None, until_ns: int | None
    ) -> AsyncIterator[tuple[int, P]]:
        ring = self.ring
        seq = self._start(request, since_ns)
        end = ring.next_seq
        limit = 0 if request.follow else int(request.number)
        sent = 0
        while True:
            seq = max(seq, ring.oldest)  # overwritten entries are skipped
            if seq >= (ring.next_seq if request.follow else end):
                if not request.follow:
                    return
                await ring.wait_beyond(seq)
                continue
            entry = ring.get(seq)
            seq += 1
            if until_ns is not None and entry.time_ns > until_ns:
                return
            yield entry.time_ns, entry.payload
            sent += 1
            if limit and sent >= limit:
                return


def agent_started_event(start_ns: int) -> flow_pb2.AgentEvent:
    """The ``AGENT_STARTED`` agent event of an agent started at wall-clock ``start_ns``."""
    return flow_pb2.AgentEvent(
        type=flow_pb2.AGENT_STARTED,
        agent_start=flow_pb2.TimeNotification(time=timestamp(start_ns)),
    )


class NamespaceTracker:
    """Namespaces seen in flows, for GetNamespaces (upstream's namespace manager).

    Args:
        ttl_ns: how long a namespace stays listed after its last flow (default 1 h).
        wall_clock_ns: wall clock (tests inject a fake one).
    """

    def __init__(
        self,
        ttl_ns: int = NAMESPACE_TTL_NS,
        wall_clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self.ttl_ns = ttl_ns
        self._wall = wall_clock_ns
        self._last_seen: dict[tuple[str, str], int] = {}

    def observe(self, flow: flow_pb2.Flow) -> None:
        """Record the namespaces of ``flow``'s source and destination (empty ones skipped)."""
        now = self._wall()
        for endpoint in (flow.source, flow.destination):
            if endpoint.namespace:
                self._last_seen[("", endpoint.namespace)] = now

    def observe_names(self, namespaces: tuple[str, ...]) -> None:
        """Record namespaces seen now (non-empty names, e.g. a flow shape's)."""
        now = self._wall()
        for namespace in namespaces:
            self._last_seen[("", namespace)] = now

    def namespaces(self) -> list[observer_pb2.Namespace]:
        """Namespaces seen within the TTL, sorted by (cluster, namespace); expired ones are
        forgotten."""
        cutoff = self._wall() - self.ttl_ns
        for key in [k for k, seen in self._last_seen.items() if seen < cutoff]:
            del self._last_seen[key]
        return [
            observer_pb2.Namespace(cluster=cluster, namespace=namespace)
            for cluster, namespace in sorted(self._last_seen)
        ]
