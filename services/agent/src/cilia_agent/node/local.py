"""The owner of the local node's state while the agent runs.

Start: the persisted :class:`~cilia_agent.node.state.NodeState` is loaded; its allocation
goes back into IPAM (:meth:`LocalNode.restore`) and its router IP is occupied again, or a
router IP is chosen from the first open CIDR (the default pool's first, else any pool's).

When the router IP's CIDR starts draining (removed from its pool) and an open CIDR exists,
the router IP moves there (:meth:`LocalNode.router_ip_changed`): the observers add the new
address, repoint every pod's default route and remove the old one, so the old CIDR holds
nothing of the agent's and is handed back as soon as its pods are gone (issue: drains that
finish).

Readiness (:meth:`LocalNode.check_ready`): registered with the operator (now, or in an
earlier run whose allocation was persisted), a router IP, and at least one free address in
the default pool. The first time it holds, the ``on_ready`` observers run once (the CNI
config manager writes the conflist); it is never withdrawn while the agent runs.

Every change is persisted (:meth:`LocalNode.persist`): router IP, default pool, the
allocation IPAM holds. Not thread-safe: called from the agent's event loop.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Protocol

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent.ipam import IPAM
from cilia_agent.node.state import NodeState

log = logging.getLogger(__name__)

ROUTER_OWNER = "router"
"""IPAM owner of the router IP."""


class NodeStore(Protocol):
    """Where the node's state is kept (``cilia_agent.endpoint.state.StateStore``)."""

    def load_node(self) -> NodeState:
        """The persisted state (a fresh one when none)."""

    def write_node(self, state: NodeState) -> None:
        """Persist ``state``."""


class LocalNode:
    """Router IP, default pool, addresses and readiness of this node.

    Args:
        ipam: the node allocator (router IP occupied there; free addresses for readiness).
        store: the node state file.
        executor: where the state file is written.
        default_pool: ``--ipam-default-ip-pool`` until the operator or the persisted
            state names another.
        ipam_mode: ``--ipam`` (compared with the operator's at registration).
    """

    def __init__(
        self, ipam: IPAM, store: NodeStore, executor: Executor, default_pool: str, ipam_mode: str
    ) -> None:
        self.ipam_mode = ipam_mode
        self.ipam = ipam
        self.store = store
        self.executor = executor
        self.state = NodeState()
        self.addresses: list[str] = []
        self._default_pool = default_pool
        self._router_ip: ipaddress.IPv4Address | None = None
        self._reason: str | None = "starting"
        self._on_ready: list[Callable[[], Awaitable[None]]] = []
        self._on_router: list[Callable[[ipaddress.IPv4Address], Awaitable[None]]] = []
        self._on_move: list[
            Callable[[ipaddress.IPv4Address, ipaddress.IPv4Address], Awaitable[bool]]
        ] = []
        self._lock = asyncio.Lock()

    # ------------------------------------------------------------------ the NodeView

    @property
    def router_ip(self) -> ipaddress.IPv4Address | None:
        """The pods' gateway (None until the first CIDR arrived)."""
        return self._router_ip

    @property
    def default_pool(self) -> str:
        """The pool of a pod that names none."""
        return self._default_pool

    @property
    def not_ready_reason(self) -> str | None:
        """None once ready, else why not."""
        return self._reason

    @property
    def ready(self) -> bool:
        """True once :meth:`check_ready` found the node ready."""
        return self._reason is None

    def pod_cidrs(self) -> list[str]:
        """Every CIDR this node holds, all pools (never routed to another node)."""
        return [cidr for cidrs in self.ipam.cidrs().values() for cidr in cidrs]

    @property
    def lock(self) -> asyncio.Lock:
        """Held while an allocation is applied (and the state written)."""
        return self._lock

    # ------------------------------------------------------------------ observers

    def on_ready(self, callback: Callable[[], Awaitable[None]]) -> None:
        """Await ``callback`` once, when the node first becomes ready."""
        self._on_ready.append(callback)

    def on_router_ip(self, callback: Callable[[ipaddress.IPv4Address], Awaitable[None]]) -> None:
        """Await ``callback`` with the router IP when one is chosen after start."""
        self._on_router.append(callback)

    # ------------------------------------------------------------------ start

    def restore(self, static_allocation: Mapping[str, Sequence[str]]) -> None:
        """Load the persisted state into IPAM; ``static_allocation`` is added as if the
        operator had given it (and the node counts as registered).

        Raises:
            StateError: the state file is unreadable.
        """
        self.state = self.store.load_node()
        if self.state.default_pool:
            self._default_pool = self.state.default_pool
        for pool, cidrs in self.state.allocation.items():
            self.ipam.add_cidrs(pool, cidrs)
        for pool, static in static_allocation.items():
            self.ipam.add_cidrs(pool, list(static))
        if static_allocation:
            self.state = self.state.model_copy(update={"registered": True})
        if self.state.router_ip:
            self._router_ip = ipaddress.IPv4Address(self.state.router_ip)
            self.ipam.occupy(self._router_ip, ROUTER_OWNER)
        else:
            self.choose_router_ip()

    def choose_router_ip(self) -> bool:
        """Choose the router IP from the first open CIDR (the default pool's first, else
        another pool's) when none is set; True when chosen now."""
        if self._router_ip is not None:
            return False
        first = self.ipam.open_cidr(self._default_pool)
        if first is None:
            return False
        router = self.ipam.first_usable(first)
        self.ipam.occupy(router, ROUTER_OWNER)
        self._router_ip = router
        log.info("router IP chosen", extra={"router_ip": str(router), "cidr": str(first)})
        return True

    async def router_ip_changed(self) -> None:
        """After an allocation: choose the router IP if none yet, or move it out of a CIDR
        that started draining (so that CIDR can be handed back once its pods are gone), and
        tell the observers. A move happens only when an open CIDR exists."""
        if self.choose_router_ip() and self._router_ip is not None:
            for callback in self._on_router:
                await callback(self._router_ip)
            return
        old = self._router_ip
        if old is None or not self.ipam.is_draining(old):
            return
        target = self.ipam.open_cidr(self._default_pool)
        if target is None:
            return
        new = self.ipam.first_usable(target)
        self.ipam.occupy(new, ROUTER_OWNER)
        log.info(
            "router IP moving out of a draining CIDR",
            extra={"old_router_ip": str(old), "router_ip": str(new), "cidr": str(target)},
        )
        self._router_ip = new  # Adds from now on use the new gateway
        for move in self._on_move:
            if not await move(old, new):
                # some pod still routes via the old one: keep it, try at the next allocation
                self._router_ip = old
                self.ipam.release(new)
                return
        self.ipam.release(old)

    def on_router_moved(
        self, callback: Callable[[ipaddress.IPv4Address, ipaddress.IPv4Address], Awaitable[bool]]
    ) -> None:
        """Await ``callback(old, new)`` when the router IP moves; it returns False when the
        move could not be completed (the old router IP is then kept)."""
        self._on_move.append(callback)

    # ------------------------------------------------------------------ changes

    async def registered(self, resp: cp.RegisterResponse) -> None:
        """The operator accepted the node: its default pool ("" keeps the current one) is
        taken, the state persisted and readiness re-checked. An operator running another
        IPAM mode (a migration in progress) is logged: the node keeps its CIDRs."""
        if resp.ipam_mode and resp.ipam_mode != self.ipam_mode:
            log.warning(
                "the operator's IPAM mode differs from this agent's --ipam: the node keeps "
                "its CIDRs (podCIDRs and the default pool's are both honoured); restart the "
                f"agent with --ipam {resp.ipam_mode} once the operator's migration is done",
                extra={"operator_ipam_mode": resp.ipam_mode, "agent_ipam_mode": self.ipam_mode},
            )
        if resp.default_pool:
            self._default_pool = resp.default_pool
        self.state = self.state.model_copy(
            update={"registered": True, "default_pool": self._default_pool}
        )
        await self.persist()
        await self.check_ready()

    async def persist(self) -> None:
        """Write router IP, default pool and IPAM's CIDRs to the state file.

        Raises:
            StateError: the file could not be written.
        """
        self.state = self.state.model_copy(
            update={
                "router_ip": str(self._router_ip) if self._router_ip else "",
                "default_pool": self._default_pool,
                "allocation": self.ipam.cidrs(),
            }
        )
        await asyncio.get_running_loop().run_in_executor(
            self.executor, self.store.write_node, self.state
        )

    async def check_ready(self) -> None:
        """Re-evaluate readiness; the first time it holds, run the ``on_ready`` observers."""
        if self._reason is None:
            return
        if not self.state.registered:
            self._reason = "not registered with the operator yet"
        elif self._router_ip is None:
            self._reason = "no CIDR allocated to this node yet"
        elif self.ipam.free(self._default_pool) < 1:
            self._reason = f"no free address in default pool {self._default_pool!r} yet"
        else:
            self._reason = None
            for callback in self._on_ready:
                await callback()
