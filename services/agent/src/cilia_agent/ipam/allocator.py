"""Address allocation inside the per-node CIDRs of each pool.

One :class:`IPAM` per agent holds every pool's CIDRs and the addresses handed
out from them. All methods are serialised by one ``threading.Lock``: they are
short, never block on I/O, and may be called from the event loop or from
worker threads alike (concurrent Adds never get the same address).
"""

from __future__ import annotations

import ipaddress
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from cilia_agent.ipam.ceil import needed_ip_ceil

IPv4 = ipaddress.IPv4Address
Net4 = ipaddress.IPv4Network


class AllocationError(Exception):
    """Base class of IPAM failures a caller can act on."""


class PoolExhausted(AllocationError):
    """No free address is left in ``pool`` (all of its open node CIDRs are used).

    ``cidrs``: the open CIDRs; ``draining``: CIDRs no new address comes from;
    ``operator_error``: what the operator reported about the node's allocation of this
    pool (e.g. the pool itself is exhausted, or unknown), "" when nothing.
    """

    def __init__(
        self,
        pool: str,
        cidrs: list[str],
        draining: list[str] | None = None,
        operator_error: str = "",
    ) -> None:
        self.pool = pool
        self.cidrs = cidrs
        self.draining = draining or []
        self.operator_error = operator_error
        where = ", ".join(cidrs) if cidrs else "no CIDR allocated to this node yet"
        if self.draining:
            where += f"; draining, no new addresses: {', '.join(self.draining)}"
        text = f"no free IPv4 address in pool {pool!r} ({where})"
        if operator_error:
            text += f"; operator: {operator_error}"
        super().__init__(text)


class PoolPending(AllocationError):
    """``pool`` has no free address yet, but the operator has not called it exhausted: the
    demand was sent and no (further) CIDR arrived within ``waited`` seconds
    (``--ipam-allocation-wait``). Transient: the caller should retry (gRPC UNAVAILABLE,
    CNI code 11). ``cidrs``: the pool's open CIDRs on this node (all in use).
    """

    def __init__(self, pool: str, cidrs: list[str], waited: float) -> None:
        self.pool = pool
        self.cidrs = cidrs
        self.waited = waited
        if cidrs:
            what = f"all addresses of {', '.join(cidrs)} in use, waiting for the operator to "
            what += "allocate another CIDR to this node"
        else:
            what = "waiting for the operator to allocate a CIDR to this node"
        super().__init__(f"pool {pool!r}: {what} (waited {waited:g} s); retry")


class AddressInUse(AllocationError):
    """``address`` is already held by ``owner``."""

    def __init__(self, address: IPv4, owner: str) -> None:
        self.address = address
        self.owner = owner
        super().__init__(f"address {address} is already in use by {owner}")


def usable_hosts(
    cidr: Net4, allow_first: bool = False, allow_last: bool = False
) -> tuple[int, int]:
    """Return the first and last usable address of ``cidr`` as integers.

    The network (first) address is skipped unless ``allow_first``, the broadcast
    (last) address unless ``allow_last`` (the pool's ``allowFirstIP``/``allowLastIP``,
    upstream default false); /31 and /32 always use every address (reference:
    cilium-upstream.md §1). A /30 gives 2 addresses with both false, 4 with both true.
    """
    first = int(cidr.network_address)
    last = int(cidr.broadcast_address)
    if cidr.prefixlen <= 30:
        return first + (0 if allow_first else 1), last - (0 if allow_last else 1)
    return first, last


@dataclass
class _Pool:
    name: str
    cidrs: list[Net4] = field(default_factory=list)
    # Next-fit cursor per CIDR index: a released address is not handed out again
    # before the rest of the CIDR has been tried.
    cursor: dict[Net4, int] = field(default_factory=dict)
    # CIDRs removed from their pool by the operator while in use: no new allocations.
    draining: set[Net4] = field(default_factory=set)
    # The pool's allowFirstIP / allowLastIP (from the operator's allocation).
    allow_first: bool = False
    allow_last: bool = False

    def hosts(self, net: Net4) -> tuple[int, int]:
        """First and last usable address of ``net`` under this pool's reservation."""
        return usable_hosts(net, self.allow_first, self.allow_last)

    def size(self, net: Net4) -> int:
        lo, hi = self.hosts(net)
        return hi - lo + 1

    def capacity(self) -> int:
        return sum(self.size(c) for c in self.cidrs)

    def open_capacity(self) -> int:
        """Usable addresses of the CIDRs new allocations may come from (not draining)."""
        return sum(self.size(c) for c in self.cidrs if c not in self.draining)

    def usable_open(self, addr: IPv4) -> bool:
        """True when ``addr`` is a usable address of an open (non-draining) CIDR."""
        for net in self.cidrs:
            if addr in net:
                lo, hi = self.hosts(net)
                return net not in self.draining and lo <= int(addr) <= hi
        return False


@dataclass(frozen=True)
class PoolStatus:
    """Snapshot of one pool: CIDRs (strings), used and usable address counts.

    ``draining`` lists the CIDRs (a subset of ``cidrs``) no new address comes from.
    """

    pool: str
    cidrs: list[str]
    used: int
    capacity: int
    draining: list[str] = field(default_factory=list)


class IPAM:
    """Node-local IPv4 allocator for every pool the node holds CIDRs of.

    Args:
        pre_allocation: ``pool -> N`` of ``ipam-multi-pool-pre-allocation``; pools not
            listed use 0 (upstream default ``default=8``).
        pending_ttl: seconds an unsatisfied request keeps counting in the demand
            (upstream ``pendingAllocationTTL``, 5 min).
        clock: monotonic clock in seconds (tests may pass a fake one).
        on_pending: called (outside the lock, on the caller's thread) after a failed
            :meth:`allocate` added a pending request, so the caller can send the grown
            demand at once.

    Source: upstream ``pkg/ipam/multipool.go`` (reference: cilium-upstream.md §1).
    """

    def __init__(
        self,
        pre_allocation: Mapping[str, int] | None = None,
        *,
        pending_ttl: float = 300.0,
        clock: Callable[[], float] | None = None,
        on_pending: Callable[[], None] | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self.on_pending = on_pending
        self._pools: dict[str, _Pool] = {}
        self._owners: dict[IPv4, tuple[str, str]] = {}  # address -> (pool, owner)
        self._pending: dict[tuple[str, str], float] = {}  # (pool, owner) -> expiry
        self._pre_allocation = dict(pre_allocation or {})
        self._pending_ttl = pending_ttl
        self._clock = clock or time.monotonic

    # --- CIDRs -----------------------------------------------------------------
    def add_cidrs(self, pool: str, cidrs: Iterable[str | Net4]) -> list[Net4]:
        """Add node CIDRs to ``pool``; CIDRs already held are ignored.

        Returns the CIDRs that were new. Addresses occupied before their CIDR was
        known (restored endpoints) stay occupied.

        Raises:
            ValueError: a CIDR is not a valid IPv4 network, or overlaps a CIDR
                already held (in any pool).
        """
        nets = [c if isinstance(c, Net4) else ipaddress.IPv4Network(c) for c in cidrs]
        added: list[Net4] = []
        with self._lock:
            entry = self._pools.setdefault(pool, _Pool(pool))
            for net in nets:
                if net in entry.cidrs:
                    continue
                for other in self._pools.values():
                    for held in other.cidrs:
                        if held.overlaps(net):
                            raise ValueError(
                                f"CIDR {net} of pool {pool!r} overlaps {held} of pool {other.name!r}"
                            )
                entry.cidrs.append(net)
                entry.cursor[net] = entry.hosts(net)[0]
                added.append(net)
                for addr, (held_pool, owner) in list(self._owners.items()):
                    if not held_pool and addr in net:
                        self._owners[addr] = (pool, owner)
        return added

    def remove_unused_cidrs(self, pool: str, keep: Iterable[str | Net4]) -> list[Net4]:
        """Drop CIDRs of ``pool`` not in ``keep`` and holding no address.

        CIDRs still holding an address are kept (upstream: nothing is reclaimed
        while in use). Returns the CIDRs dropped.
        """
        keep_nets = {c if isinstance(c, Net4) else ipaddress.IPv4Network(c) for c in keep}
        dropped: list[Net4] = []
        with self._lock:
            entry = self._pools.get(pool)
            if entry is None:
                return []
            for net in list(entry.cidrs):
                if net in keep_nets:
                    continue
                if any(addr in net for addr in self._owners):
                    continue
                self._drop_locked(entry, net)
                dropped.append(net)
        return dropped

    def _drop_locked(self, entry: _Pool, net: Net4) -> None:
        entry.cidrs.remove(net)
        entry.cursor.pop(net, None)
        entry.draining.discard(net)

    def set_draining(self, pool: str, cidrs: Iterable[str | Net4]) -> None:
        """Mark exactly ``cidrs`` of ``pool`` as draining (others of the pool are open).

        A draining CIDR keeps the addresses already handed out but gives out no new
        one; :meth:`take_unneeded` hands it back once it is empty. CIDRs the pool does
        not hold are ignored.
        """
        nets = {c if isinstance(c, Net4) else ipaddress.IPv4Network(c) for c in cidrs}
        with self._lock:
            entry = self._pools.get(pool)
            if entry is not None:
                entry.draining = {n for n in entry.cidrs if n in nets}

    def set_reservation(self, pool: str, allow_first: bool, allow_last: bool) -> None:
        """Set ``pool``'s ``allowFirstIP`` / ``allowLastIP`` (CiliumPodIPPool spec).

        False (the default, upstream too) keeps the first / last address of each CIDR
        of the pool (/30 and larger) out of allocation; /31 and /32 are always fully
        usable. Affects capacity, free counts, hand-back math and new allocations;
        addresses already held stay held. Creates the pool entry when unknown.
        """
        with self._lock:
            entry = self._pools.setdefault(pool, _Pool(pool))
            entry.allow_first = allow_first
            entry.allow_last = allow_last

    def first_usable(self, cidr: str | Net4) -> IPv4:
        """First usable address of ``cidr`` under its pool's reservation (router IP).

        A CIDR no pool holds uses the default reservation (first and last kept).
        """
        net = cidr if isinstance(cidr, Net4) else ipaddress.IPv4Network(cidr)
        with self._lock:
            for entry in self._pools.values():
                if net in entry.cidrs:
                    return IPv4(entry.hosts(net)[0])
        return IPv4(usable_hosts(net)[0])

    def take_unneeded(
        self, demand: Mapping[str, int], keep: Iterable[Net4] = ()
    ) -> dict[str, list[Net4]]:
        """Remove and return the CIDRs this node can hand back to the operator.

        A CIDR is handed back when no address in it is held and either it is draining,
        or the pool's other open CIDRs still hold ``demand[pool]`` usable addresses
        (the operator would not need to allocate anything to replace it; pools missing
        from ``demand`` need 0). Later-added CIDRs go first. The CIDRs are removed from
        the pool under the lock, so no concurrent :meth:`allocate` can use them.
        CIDRs in ``keep`` are never handed back.

        Returns ``pool -> [cidr, ...]`` (only pools with something to hand back).
        """
        out: dict[str, list[Net4]] = {}
        kept = set(keep)
        with self._lock:
            held = list(self._owners)
            for name, entry in self._pools.items():
                needed = demand.get(name, 0)
                capacity = entry.open_capacity()
                for net in reversed(list(entry.cidrs)):
                    if net in kept or any(a in net for a in held):
                        continue
                    if net in entry.draining:
                        self._drop_locked(entry, net)
                        out.setdefault(name, []).append(net)
                    elif capacity - entry.size(net) >= needed:
                        capacity -= entry.size(net)
                        self._drop_locked(entry, net)
                        out.setdefault(name, []).append(net)
        return out

    def open_cidr(self, preferred: str) -> Net4 | None:
        """The first CIDR that gives out addresses (not draining): ``preferred`` pool's
        first, else the first of the other pools by name; None when there is none."""
        with self._lock:
            names = [preferred, *sorted(n for n in self._pools if n != preferred)]
            for name in names:
                entry = self._pools.get(name)
                if entry is None:
                    continue
                for net in entry.cidrs:
                    if net not in entry.draining:
                        return net
        return None

    def is_draining(self, address: IPv4 | str) -> bool:
        """True when ``address`` lies in a CIDR that is draining."""
        addr = ipaddress.IPv4Address(address)
        with self._lock:
            return any(addr in net for entry in self._pools.values() for net in entry.draining)

    def cidrs(self) -> dict[str, list[str]]:
        """Return ``pool -> [cidr, ...]`` in the order the CIDRs were added."""
        with self._lock:
            return {name: [str(c) for c in p.cidrs] for name, p in self._pools.items()}

    def _pool_of_locked(self, address: IPv4) -> str | None:
        for p in self._pools.values():
            for net in p.cidrs:
                if address in net:
                    return p.name
        return None

    # --- addresses ---------------------------------------------------------------
    def allocate(self, pool: str, owner: str) -> IPv4:
        """Hand out the next free address of ``pool`` to ``owner``.

        Addresses are taken next-fit (a released address is reused only after
        the rest of its CIDR). A failed request is remembered as pending for
        ``pending_ttl`` seconds so the demand grows (upstream behaviour).

        Raises:
            PoolExhausted: ``pool`` has no open (non-draining) CIDR or no free address.
        """
        with self._lock:
            entry = self._pools.get(pool)
            if entry is not None:
                for net in entry.cidrs:
                    if net in entry.draining:
                        continue
                    addr = self._next_free_locked(entry, net)
                    if addr is not None:
                        self._owners[addr] = (pool, owner)
                        self._pending.pop((pool, owner), None)
                        return addr
            self._pending[(pool, owner)] = self._clock() + self._pending_ttl
            cidrs = [str(c) for c in entry.cidrs if c not in entry.draining] if entry else []
            draining = sorted(str(c) for c in entry.draining) if entry else []
        if self.on_pending is not None:
            self.on_pending()
        raise PoolExhausted(pool, cidrs, draining)

    def _next_free_locked(self, entry: _Pool, net: Net4) -> IPv4 | None:
        lo, hi = entry.hosts(net)
        start = min(max(entry.cursor.get(net, lo), lo), hi)
        size = hi - lo + 1
        for i in range(size):
            candidate = lo + (start - lo + i) % size
            addr = IPv4(candidate)
            if addr not in self._owners:
                entry.cursor[net] = lo + (candidate - lo + 1) % size
                return addr
        return None

    def occupy(self, address: IPv4 | str, owner: str, pool: str | None = None) -> None:
        """Mark ``address`` as held by ``owner`` (restore, router IP).

        The address may lie outside every known CIDR (restored before the
        allocation was known); it is then held under ``pool`` (or ``""``).
        Occupying an address again for the same owner is a no-op.

        Raises:
            AddressInUse: another owner holds ``address``.
        """
        addr = IPv4(address)
        with self._lock:
            held = self._owners.get(addr)
            if held is not None:
                if held[1] == owner:
                    return
                raise AddressInUse(addr, held[1])
            self._owners[addr] = (pool or self._pool_of_locked(addr) or "", owner)

    def release(self, address: IPv4 | str) -> bool:
        """Free ``address``; returns False when it was not held."""
        with self._lock:
            return self._owners.pop(IPv4(address), None) is not None

    def forget_pending(self, owner: str) -> bool:
        """Drop ``owner``'s pending requests (its attachment was deleted: a DEL after a
        failed ADD), so they stop counting in the demand before ``pending_ttl`` ends and a
        pool with no other use is handed back at once. Returns True when one was dropped
        (the caller then sends the smaller demand)."""
        with self._lock:
            keys = [k for k in self._pending if k[1] == owner]
            for key in keys:
                del self._pending[key]
            return bool(keys)

    def allocated(self) -> dict[IPv4, str]:
        """Return ``address -> owner`` of every held address."""
        with self._lock:
            return {a: o for a, (_, o) in self._owners.items()}

    def free(self, pool: str) -> int:
        """Free usable addresses of ``pool``'s open (non-draining) CIDRs (0 if unknown)."""
        with self._lock:
            return self._free_locked(pool)

    def _used_locked(self, entry: _Pool) -> int:
        """Held addresses inside ``entry``'s CIDRs."""
        return sum(1 for a in self._owners if any(a in n for n in entry.cidrs))

    def _free_locked(self, pool: str) -> int:
        entry = self._pools.get(pool)
        if entry is None:
            return 0
        used = sum(1 for a in self._owners if entry.usable_open(a))
        return entry.open_capacity() - used

    # --- reporting -----------------------------------------------------------------
    def status(self) -> list[PoolStatus]:
        """Return one :class:`PoolStatus` per pool, sorted by pool name."""
        with self._lock:
            out = []
            for name in sorted(self._pools):
                entry = self._pools[name]
                used = self._used_locked(entry)
                out.append(
                    PoolStatus(
                        name,
                        [str(c) for c in entry.cidrs],
                        used,
                        entry.capacity(),
                        sorted(str(c) for c in entry.draining),
                    )
                )
            return out

    def demand(self, extra_pools: Iterable[str] = ()) -> dict[str, int]:
        """Return ``pool -> needed`` addresses to request from the operator.

        ``needed = needed_ip_ceil(in_use + pending, pre_allocation[pool])`` for
        every pool that is pre-allocated, has addresses in use, has pending
        requests, or is named in ``extra_pools``. Expired pending entries are
        dropped first.

        Source: upstream ``pkg/ipam/multipool.go`` (reference: cilium-upstream.md §1).
        """
        with self._lock:
            now = self._clock()
            for key, expiry in list(self._pending.items()):
                if expiry <= now:
                    del self._pending[key]
            counts: dict[str, int] = {}
            for pool in [*self._pre_allocation, *extra_pools]:
                counts.setdefault(pool, 0)
            for pool, _ in self._owners.values():
                if pool:
                    counts[pool] = counts.get(pool, 0) + 1
            for pool, _ in self._pending:
                counts[pool] = counts.get(pool, 0) + 1
            return {
                pool: needed_ip_ceil(n, self._pre_allocation.get(pool, 0))
                for pool, n in sorted(counts.items())
            }

    def __iter__(self) -> Iterator[str]:
        with self._lock:
            return iter(list(self._pools))
