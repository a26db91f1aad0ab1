"""Which pool a new pod's address comes from, and how long an Add waits for addresses.

- ``--ipam multi-pool``: the requested pool (``AddRequest.pool``) when set; otherwise the
  operator decides (``IPAMService.ResolvePool`` with the pod's namespace, name, labels and
  annotations: pod annotation, namespace annotation, exactly one matching selector,
  default pool, reference: cilium-upstream.md §1). Nothing is cached, so pool edits apply
  to the next pod. Without an operator (``--operator ''``) the default pool is used.
- ``--ipam cluster-pool``: every pod gets its address from the node's podCIDRs (held as
  the default pool); a request naming another pool is refused.

A pool with no CIDR on this node yet (or, in multi-pool mode, with every address in use)
is not exhausted until the operator says so: the failed allocation already sent the grown
demand, so the Add waits up to ``--ipam-allocation-wait`` seconds for the operator's
allocation and tries again (upstream's agent also blocks the ADD on the operator's
allocation). Still nothing: :class:`PoolPending` (retry, CNI code 11).

The endpoint manager holds a :class:`PoolSelector` through its ``PoolSelection``
protocol; it does not know the IPAM mode.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Protocol

from cilia_agent.controlplane import PoolNotResolved, PoolResolver
from cilia_agent.ipam.allocator import IPAM, PoolExhausted, PoolPending
from cilia_agent.ipam.node import IPAMMode

log = logging.getLogger(__name__)


class PoolRefused(ValueError):
    """No pool can be chosen for the pod (field ``pool``; the message says why)."""


class DefaultPool(Protocol):
    """Where the current default pool name is read (the local node)."""

    @property
    def default_pool(self) -> str:
        """The default pool's name."""


class OperatorErrors(Protocol):
    """What the operator last reported about each pool (``NodePools``)."""

    def error_about(self, pool: str) -> str:
        """The operator's error about ``pool`` ("" when none)."""


class PoolSelector:
    """Chooses the pool of each Add and waits for the operator's allocation.

    Args:
        mode: ``cluster-pool`` or ``multi-pool``.
        node: read for the current default pool.
        ipam: the node allocator (free addresses while waiting).
        errors: the operator's last error per pool.
        resolver: the operator's ResolvePool client (None: no operator).
        allocation_wait: ``--ipam-allocation-wait`` (s); 0 = no waiting (no operator).
        poll_interval: seconds between checks for new addresses while waiting.
    """

    def __init__(
        self,
        mode: IPAMMode,
        node: DefaultPool,
        ipam: IPAM,
        errors: OperatorErrors,
        resolver: PoolResolver | None = None,
        *,
        allocation_wait: float = 0.0,
        poll_interval: float = 0.05,
    ) -> None:
        self.mode = mode
        self.node = node
        self.ipam = ipam
        self.errors = errors
        self.resolver = resolver
        self.allocation_wait = allocation_wait
        self.wait_when_full = mode == "multi-pool"
        self.poll_interval = poll_interval

    async def select(
        self,
        requested: str,
        namespace: str,
        name: str,
        labels: Mapping[str, str],
        annotations: Mapping[str, str],
    ) -> str:
        """The pool for a pod (``requested``: ``AddRequest.pool``, "" = not given).

        Raises:
            PoolRefused: cluster-pool mode and another pool was requested, or the
                operator refused to pick one (its reason included).
            OperatorUnavailable: the operator could not be asked (UNAVAILABLE to the CNI).
        """
        default = self.node.default_pool
        if self.mode in ("cluster-pool", "kubernetes"):
            if requested and requested != default:
                raise PoolRefused(
                    f"{requested!r} requested, but this agent runs --ipam {self.mode}: every "
                    f"pod gets its address from the node's podCIDRs (pool {default!r})"
                )
            return default
        if requested:
            return requested
        if self.resolver is None:
            return default
        try:
            pool, reason = await self.resolver.resolve(
                namespace, name, dict(labels), dict(annotations)
            )
        except PoolNotResolved as exc:
            raise PoolRefused(str(exc)) from exc
        log.info(
            "pool chosen by the operator",
            extra={"pod": f"{namespace}/{name}", "pool": pool, "reason": reason},
        )
        return pool

    async def wait_for_addresses(
        self, exc: PoolExhausted, container_id: str, deadline: float | None
    ) -> float:
        """After ``exc``: wait until the pool may have an address, and return the wait's
        deadline (event-loop time) for the next round; the caller then retries its Add.

        Raises:
            PoolExhausted: final — the operator reported an error about the pool (carried
                in the error, so the CNI error says why), or waiting does not apply.
            PoolPending: the operator's allocation did not come within the wait.
        """
        error = self.errors.error_about(exc.pool)
        if exc.operator_error:
            raise exc
        if error:
            raise PoolExhausted(exc.pool, exc.cidrs, exc.draining, error) from exc
        if self.allocation_wait <= 0 or (exc.cidrs and not self.wait_when_full):
            raise exc
        loop = asyncio.get_running_loop()
        if deadline is None:
            deadline = loop.time() + self.allocation_wait
            log.info(
                "waiting for the operator's allocation",
                extra={"pool": exc.pool, "container_id": container_id},
            )
        while loop.time() < deadline:
            await asyncio.sleep(min(self.poll_interval, max(0.0, deadline - loop.time())))
            if self.ipam.free(exc.pool) > 0 or self.errors.error_about(exc.pool):
                return deadline
        raise PoolPending(exc.pool, exc.cidrs, self.allocation_wait) from exc
