"""Whether an apply that outlived its client's deadline wrote anything: exact, not a guess.

A client whose ``Apply`` deadline passed cannot tell from reading the store whether the
operator is still about to commit: its read-back can land between the operator's last
check and the write. Instead it sends the same ``request_id`` to ``ApplyOutcome``, which
fences the apply: one that has not begun writing (still parsing or validating, or not
yet arrived) is marked abandoned and will write nothing; one already writing is waited
for. Every apply also refuses to begin writing once its own gRPC deadline has passed.

The ordering is exact because the check happens on the event loop with no ``await``
between the last check and the start of the store transaction's commit
(:meth:`ApplyFences.begin_write`), and the commit itself runs to its end even when the
RPC is cancelled (the Apply handler shields it).

Outcomes of finished applies, and tombstones of ids asked about before their apply
arrived, are kept for ``--apply-outcome-retention`` (up to ``--apply-outcomes-max``
entries, oldest dropped first); applies in progress are always kept. Each replica knows
only the applies it served, which is why a client asks over the connection it applied on.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

from cachetools import TTLCache

from ..errors import FieldError
from ..manifests import DocumentError, InvalidManifest


class Outcome(enum.Enum):
    """What became of one apply (values match ``ApplyOutcomeResponse.Outcome``)."""

    UNKNOWN = 0
    WRITTEN = 1
    NOT_WRITTEN = 2


class ApplyAbandoned(Exception):
    """An apply refused to write: its client asked for its outcome first, or its deadline
    passed before the write began. Nothing was written."""


@dataclass(eq=False)
class Fence:
    """One apply in progress: ``writing`` once its commit has begun (then it is waited
    for, not abandoned); ``abandoned`` once an ``ApplyOutcome`` fenced it."""

    request_id: str
    deadline: float | None  # time.monotonic() seconds; None: no deadline
    writing: bool = False
    abandoned: bool = False
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: Outcome = Outcome.UNKNOWN
    detail: str = ""


class ApplyFences:
    """The fences of one operator replica, keyed by ``ApplyRequest.request_id``.

    Args:
        max_entries: finished outcomes and tombstones kept (``--apply-outcomes-max``).
        retention: seconds each is kept (``--apply-outcome-retention``).

    Raises:
        ValueError: ``max_entries < 1`` or ``retention <= 0``.
    """

    def __init__(self, max_entries: int = 10_000, retention: float = 600.0) -> None:
        if max_entries < 1 or retention <= 0:
            raise ValueError(
                f"max_entries must be >= 1 and retention > 0, got {max_entries}, {retention}"
            )
        self._running: dict[str, Fence] = {}
        self._done: TTLCache[str, Fence] = TTLCache(max_entries, retention, timer=time.monotonic)

    def start(self, request_id: str, time_remaining: float | None) -> Fence:
        """Register an apply arriving with ``request_id`` ("" = none: fenced by its
        deadline only) and ``time_remaining`` seconds before its deadline (None: none).

        Raises:
            ApplyAbandoned: its outcome was already asked for (a tombstone): it must not
                write now.
            InvalidManifest: ``request_id`` is in use or was used recently.
        """
        deadline = None if time_remaining is None else time.monotonic() + time_remaining
        fence = Fence(request_id, deadline)
        if not request_id:
            return fence
        earlier = self._running.get(request_id) or self._done.get(request_id)
        if earlier is not None and earlier.abandoned and not earlier.finished.is_set():
            raise ApplyAbandoned(
                f"apply {request_id} was abandoned: its outcome was asked for before it "
                "arrived, and it was answered 'not written'"
            )
        if earlier is not None:
            raise InvalidManifest([DocumentError(0, "", FieldError(
                "request_id", f"request_id {request_id!r} was already used; send a new one"
            ))])  # fmt: skip
        self._running[request_id] = fence
        return fence

    def begin_write(self, fence: Fence) -> None:
        """Called right before the store transaction commits, with no ``await`` between
        this call and the commit: from here the apply is waited for, not fenced.

        Raises:
            ApplyAbandoned: its outcome was asked for, or its deadline passed.
        """
        if fence.abandoned:
            raise ApplyAbandoned(
                f"apply {fence.request_id} was abandoned: its client asked for its outcome "
                "before it began writing"
            )
        if fence.deadline is not None and time.monotonic() >= fence.deadline:
            fence.abandoned = True
            raise ApplyAbandoned("the apply's deadline passed before it began writing")
        fence.writing = True

    def finish(self, fence: Fence, outcome: Outcome, detail: str = "") -> None:
        """Record how the apply ended and wake anyone waiting for it."""
        fence.outcome = outcome
        fence.detail = detail
        fence.finished.set()
        if fence.request_id and self._running.get(fence.request_id) is fence:
            del self._running[fence.request_id]
            self._done[fence.request_id] = fence

    async def outcome(self, request_id: str) -> tuple[Outcome, str]:
        """Fence ``request_id`` and say what became of it: an apply not yet writing (or
        not yet arrived: a tombstone is kept) writes nothing; one writing is awaited.

        Raises:
            InvalidManifest: empty ``request_id``.
        """
        if not request_id:
            raise InvalidManifest([DocumentError(0, "", FieldError(
                "request_id", "give the request_id the apply was sent with"
            ))])  # fmt: skip
        fence = self._running.get(request_id) or self._done.get(request_id)
        if fence is None:
            tombstone = Fence(request_id, None, abandoned=True)
            self._done[request_id] = tombstone
            return Outcome.NOT_WRITTEN, "no apply with this request_id had begun writing"
        if not fence.finished.is_set() and not fence.writing:
            fence.abandoned = True
            return Outcome.NOT_WRITTEN, "the apply had not begun writing; it will write nothing"
        await fence.finished.wait()
        if fence.abandoned and fence.outcome is Outcome.UNKNOWN:
            return Outcome.NOT_WRITTEN, fence.detail or "abandoned before writing"
        return fence.outcome, fence.detail
