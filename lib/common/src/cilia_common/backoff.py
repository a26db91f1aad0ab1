"""The one backoff policy of Cilia's background work: how long to wait before retry number N.

:class:`Backoff` is capped exponential backoff with optional jitter: attempt ``n`` (0-based)
waits ``min(maximum, minimum * 2**n)`` seconds, and with ``jitter = j > 0`` a delay drawn
uniformly from ``[d * (1 - j), d]`` instead, so that many clients that failed together (every
agent when the operator restarts) do not retry together. ``minimum == maximum`` is a fixed
delay (upstream hubble-relay's ``--retry-timeout``). The same policy is handed to tenacity
(the retry library the services use) through :meth:`Backoff.wait`, so a tenacity loop and a
hand-driven watch loop wait alike.

Source: capped exponential backoff as upstream's controller manager (``pkg/controller``) and
gRPC's connection backoff describe it (base delay, multiplier 2, cap, jitter).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import tenacity

__all__ = ["Backoff"]


@dataclass(frozen=True)
class Backoff:
    """Capped exponential backoff with jitter.

    Attributes:
        minimum: seconds before the first retry, > 0.
        maximum: cap of the doubling delay (seconds), >= ``minimum``.
        jitter: fraction in [0, 1): each delay is drawn from ``[d * (1 - jitter), d]``;
            0 gives the exact doubling sequence.
        rand: source of uniform numbers in [0, 1) (tests pass their own).

    Raises (constructor):
        ValueError: ``minimum <= 0``, ``maximum < minimum`` or ``jitter`` outside [0, 1).
    """

    minimum: float
    maximum: float
    jitter: float = 0.0
    rand: Callable[[], float] = field(default=random.random, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0 < self.minimum <= self.maximum:
            raise ValueError(
                f"backoff: need 0 < minimum <= maximum, got {self.minimum} and {self.maximum}"
            )
        if not 0 <= self.jitter < 1:
            raise ValueError(f"backoff: jitter must be in [0, 1), got {self.jitter}")

    @classmethod
    def fixed(cls, seconds: float) -> Backoff:
        """The same delay before every retry (``seconds`` > 0), no jitter."""
        return cls(seconds, seconds)

    def ceiling(self, attempt: int) -> float:
        """The delay before retry ``attempt`` (0-based) without jitter:
        ``min(maximum, minimum * 2**attempt)``; 1, 2, 4, 8, 16, 30, 30, ... for (1, 30)."""
        if attempt >= 63:
            return self.maximum
        return float(min(self.maximum, self.minimum * (2 ** max(0, attempt))))

    def delay(self, attempt: int) -> float:
        """The delay before retry ``attempt`` (0-based), jitter applied (seconds)."""
        ceiling = self.ceiling(attempt)
        if not self.jitter:
            return ceiling
        return ceiling * (1 - self.jitter * self.rand())

    def wait(self) -> tenacity.wait.wait_base:
        """This policy as a tenacity ``wait`` strategy (tenacity's first retry is attempt 0)."""
        return _TenacityWait(self)


class _TenacityWait(tenacity.wait.wait_base):
    """Adapts :class:`Backoff` to tenacity: ``retry_state.attempt_number`` is 1 after the
    first failed attempt, so the first wait is ``Backoff.delay(0)``."""

    def __init__(self, backoff: Backoff) -> None:
        self.backoff = backoff

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        return self.backoff.delay(retry_state.attempt_number - 1)
