"""Which pool a new pod's address comes from.

- ``--ipam multi-pool``: ``AddRequest.pool`` when set; otherwise the operator decides
  (``IPAMService.ResolvePool`` with the pod's namespace, name, labels and annotations:
  pod annotation, namespace annotation, exactly one matching selector, default pool,
  reference: cilium-upstream.md §1). Nothing is cached, so pool edits apply to the next
  pod. Without an operator (``--operator ''``) the default pool is used.
- ``--ipam cluster-pool``: every pod gets its address from the node's podCIDRs (held as
  the default pool); a request naming another pool is refused.

:class:`PoolSelectingEndpointManager` runs the selection before the Add proper, so the
endpoint manager itself stays unaware of the IPAM mode.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from cilia_agent.controlplane import PoolNotResolved, PoolResolver
from cilia_agent.endpoint import AddParams, EndpointManager, EndpointRecord, InvalidRequest
from cilia_agent.endpoint.manager import validate_add
from cilia_agent.ipam.allocator import PoolExhausted, PoolPending
from cilia_agent.ipam.node import IPAMMode

log = logging.getLogger(__name__)


class PoolSelector:
    """Chooses the pool of each Add.

    Args:
        mode: ``cluster-pool`` or ``multi-pool``.
        default_pool: returns the current default pool name.
        resolver: the operator's ResolvePool client (None: no operator; may be set later,
            once the event loop runs).
    """

    def __init__(
        self,
        mode: IPAMMode,
        default_pool: Callable[[], str],
        resolver: PoolResolver | None = None,
    ) -> None:
        self.mode = mode
        self.default_pool = default_pool
        self.resolver = resolver

    async def select(self, p: AddParams) -> str:
        """The pool for ``p``.

        Raises:
            InvalidRequest: field ``pool``: cluster-pool mode and another pool was
                requested, or the operator refused to pick one (its reason included).
            OperatorUnavailable: the operator could not be asked (UNAVAILABLE to the CNI).
        """
        default = self.default_pool()
        if self.mode == "cluster-pool":
            if p.pool and p.pool != default:
                raise InvalidRequest(
                    "pool",
                    f"{p.pool!r} requested, but this agent runs --ipam cluster-pool: every "
                    f"pod gets its address from the node's podCIDRs (pool {default!r})",
                )
            return default
        if p.pool:
            return p.pool
        if self.resolver is None:
            return default
        try:
            pool, reason = await self.resolver.resolve(
                p.pod_namespace, p.pod_name, dict(p.labels), dict(p.annotations)
            )
        except PoolNotResolved as exc:
            raise InvalidRequest("pool", str(exc)) from exc
        log.info(
            "pool chosen by the operator",
            extra={"pod": f"{p.pod_namespace}/{p.pod_name}", "pool": pool, "reason": reason},
        )
        return pool


class PoolSelectingEndpointManager(EndpointManager):
    """:class:`EndpointManager` whose Adds first get their pool from a :class:`PoolSelector`.

    Chained Adds (``prev_result``: the address belongs to the previous plugin) and
    repeated Adds of an existing attachment skip the selection.

    An exhausted pool's error carries what the operator reported about that pool for this
    node (e.g. the pool itself has no free block left), so the CNI error says why.

    A pool with no CIDR on this node yet (or, with ``wait_when_full``, with every address
    in use) is not exhausted until the operator says so: the failed allocation already
    sent the grown demand, so the Add waits up to ``allocation_wait`` seconds for the
    operator's allocation and tries again (upstream's agent also blocks the ADD on the
    operator's allocation). Still nothing: :class:`PoolPending` (retry, CNI code 11).

    Args:
        selector: the pool selector.
        operator_error: returns the operator's last error about a pool ("" when none).
        allocation_wait: seconds an Add waits for the operator's allocation
            (``--ipam-allocation-wait``); 0 = fail at once with :class:`PoolExhausted`
            (no operator).
        wait_when_full: also wait when the pool has CIDRs but all are in use (multi-pool:
            the operator adds blocks on demand; cluster-pool: a full podCIDR is final).
        poll_interval: seconds between checks for new addresses while waiting.
        Every other argument as :class:`EndpointManager`.
    """

    def __init__(
        self,
        *,
        selector: PoolSelector,
        operator_error: Callable[[str], str] = lambda _pool: "",
        allocation_wait: float = 0.0,
        wait_when_full: bool = False,
        poll_interval: float = 0.05,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.selector = selector
        self._operator_error = operator_error
        self.allocation_wait = allocation_wait
        self.wait_when_full = wait_when_full
        self.poll_interval = poll_interval

    async def add(self, p: AddParams) -> EndpointRecord:
        """Select the pool, then :meth:`EndpointManager.add` (same errors, plus those of
        :meth:`PoolSelector.select`)."""
        if not p.prev_result and self.get(p.container_id, p.ifname) is None:
            validate_add(p)  # bad input is refused before the operator is asked
            p = dataclasses.replace(p, pool=await self.selector.select(p))
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        while True:
            try:
                return await super().add(p)
            except PoolExhausted as exc:
                error = self._operator_error(exc.pool)
                if exc.operator_error:
                    raise
                if error:
                    raise PoolExhausted(exc.pool, exc.cidrs, exc.draining, error) from exc
                if self.allocation_wait <= 0 or (exc.cidrs and not self.wait_when_full):
                    raise
                if deadline is None:
                    deadline = loop.time() + self.allocation_wait
                    log.info(
                        "waiting for the operator's allocation",
                        extra={"pool": exc.pool, "container_id": p.container_id},
                    )
                if not await self._wait_for_addresses(exc.pool, deadline):
                    raise PoolPending(exc.pool, exc.cidrs, self.allocation_wait) from exc

    async def _wait_for_addresses(self, pool: str, deadline: float) -> bool:
        """True once ``pool`` has a free address or the operator reported an error about
        it (try again); False at ``deadline`` (event-loop time)."""
        loop = asyncio.get_running_loop()
        while loop.time() < deadline:
            await asyncio.sleep(min(self.poll_interval, max(0.0, deadline - loop.time())))
            if self.ipam.free(pool) > 0 or self._operator_error(pool):
                return True
        return False
