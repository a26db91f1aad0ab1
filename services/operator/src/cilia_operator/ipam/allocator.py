"""Multi-pool CIDR allocation: pure logic, no I/O (property-tested).

Source: upstream ``pkg/ipam/allocator/multipool/pool_allocator.go`` behaviour
(reference: cilium-upstream.md §1, "Operator carving"): one allocator per pool CIDR
hands out ``maskSize`` children; every CIDR already recorded in any node's
``spec.ipam.pools.allocated`` is occupied before anything is handed out; per requested
pool, whole blocks are added until the usable addresses held cover ``needed``.

The allocator keeps one table of every held block (node, pool), including blocks of
pools that are unknown or no longer contain them ("orphans"): such blocks are never
handed out again while a node holds them.
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .pool import PoolSpec

IPv4Network = ipaddress.IPv4Network


class IPAMError(Exception):
    """Base class of allocation failures."""


class AllocatorNotReady(IPAMError):
    """Allocation attempted before every node's existing CIDRs were restored."""

    def __init__(self) -> None:
        super().__init__("allocator not ready: node allocations are still being restored")


@dataclass(frozen=True)
class Holding:
    """Who holds a block: ``node`` and the ``pool`` its record files it under."""

    node: str
    pool: str


def _span(block: IPv4Network) -> tuple[int, int]:
    """First and last address of ``block`` as ints."""
    start = int(block.network_address)
    return start, start + (1 << (32 - block.prefixlen)) - 1


class _Subnets:
    """One pool CIDR carved into ``mask_size`` children, lowest free first.

    Invariant: every child index below ``_hint`` is in use.
    """

    def __init__(self, cidr: IPv4Network, mask_size: int) -> None:
        self.cidr = cidr
        self.mask_size = mask_size
        self.step = 1 << (32 - mask_size)
        self.count = 1 << (mask_size - cidr.prefixlen)
        self.used: Counter[int] = Counter()
        self._hint = 0
        self._lo = int(cidr.network_address)
        self._hi = self._lo + cidr.num_addresses - 1

    def _indexes(self, span: tuple[int, int]) -> range:
        start, end = span
        if end < self._lo or start > self._hi:
            return range(0)
        lo, hi = max(start, self._lo), min(end, self._hi)
        return range((lo - self._lo) // self.step, (hi - self._lo) // self.step + 1)

    def mark(self, span: tuple[int, int]) -> None:
        """Count the children overlapping ``span`` (first, last address as ints) used."""
        for i in self._indexes(span):
            self.used[i] += 1

    def unmark(self, span: tuple[int, int]) -> None:
        """Undo :meth:`mark`."""
        for i in self._indexes(span):
            self.used[i] -= 1
            if self.used[i] <= 0:
                del self.used[i]
                self._hint = min(self._hint, i)

    def take(self) -> IPv4Network | None:
        """The lowest free child (not marked: the caller occupies it), or None."""
        i = self._hint
        while i < self.count and i in self.used:
            i += 1
        self._hint = i
        if i >= self.count:
            return None
        self._hint = i + 1
        return IPv4Network((self._lo + i * self.step, self.mask_size))

    @property
    def free(self) -> int:
        return self.count - len(self.used)


@dataclass
class NodeResult:
    """Outcome of reconciling one node.

    Attributes:
        allocated: pool -> blocks the node holds afterwards (sorted by pool, blocks
            sorted) -- the new ``spec.ipam.pools.allocated``.
        errors: one message per pool that could not be satisfied or block that could
            not be taken; empty when all is well (``status.ipam.operator-status.error``).
        added: blocks newly handed out by this reconcile.
        freed: blocks the node's record no longer lists that were freed.
        waiting: pools whose free blocks ran out before the node's demand was met: the
            node waits for one (the controller reconciles it again when the pool's
            capacity changes, see :mod:`.reconcile`).
    """

    allocated: dict[str, list[IPv4Network]]
    errors: list[str] = field(default_factory=list)
    added: list[tuple[str, IPv4Network]] = field(default_factory=list)
    freed: list[tuple[str, IPv4Network]] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)

    @property
    def error(self) -> str:
        """All errors joined into the one string CiliumNode status carries ("" = none)."""
        return "; ".join(self.errors)


@dataclass(frozen=True)
class PoolStats:
    """Per-pool counters for metrics: blocks held and blocks still free."""

    allocated: int
    available: int


class MultiPoolAllocator:
    """Every pool's block allocators plus the table of held blocks.

    Typical use: :meth:`upsert_pool` for each known pool, :meth:`restore` with every
    node's recorded allocation (this marks the allocator ready), then
    :meth:`reconcile` per node whenever its record changes.
    """

    def __init__(self) -> None:
        self._pools: dict[str, PoolSpec] = {}
        self._subnets: dict[str, list[_Subnets]] = {}
        self._held: dict[IPv4Network, Holding] = {}
        self._by_node: dict[str, set[IPv4Network]] = {}
        self._lens: Counter[int] = Counter()  # prefix lengths present in _held
        self._excluded: dict[IPv4Network, str] = {}
        self.ready = False

    # -- pools ---------------------------------------------------------------------

    @property
    def pools(self) -> Mapping[str, PoolSpec]:
        """Known pools by name (read-only view)."""
        return self._pools

    def upsert_pool(self, spec: PoolSpec) -> None:
        """Add or replace a pool; blocks already held inside its CIDRs stay occupied."""
        if self._pools.get(spec.name) == spec:
            return
        subnets = [_Subnets(cidr, spec.mask_size) for cidr in spec.cidrs]
        for block in [*self._held, *self._excluded]:
            span = _span(block)
            for s in subnets:
                s.mark(span)
        self._pools[spec.name] = spec
        self._subnets[spec.name] = subnets

    def set_excluded(self, networks: Mapping[IPv4Network, str]) -> None:
        """Networks no new block may overlap, each with why (e.g. ``node 'n1' interface
        eth1 subnet 10.1.0.0/24``): a node's attached network -- its addresses would be
        answered by the pod network. Replaces the previous set; blocks already held are
        not touched (their nodes keep them), and a network dropped from the set is free
        again.
        """
        for net in set(self._excluded) - set(networks):
            span = _span(net)
            for subnets in self._subnets.values():
                for s in subnets:
                    s.unmark(span)
        for net in set(networks) - set(self._excluded):
            span = _span(net)
            for subnets in self._subnets.values():
                for s in subnets:
                    s.mark(span)
        self._excluded = dict(networks)

    @property
    def excluded(self) -> Mapping[IPv4Network, str]:
        """The networks of :meth:`set_excluded` with their reasons (read-only view)."""
        return self._excluded

    def remove_pool(self, name: str) -> None:
        """Forget a pool. Nodes keep the blocks they hold (orphans), never re-handed."""
        self._pools.pop(name, None)
        self._subnets.pop(name, None)

    # -- holdings ------------------------------------------------------------------

    def _occupy(self, block: IPv4Network, holding: Holding) -> None:
        self._held[block] = holding
        self._by_node.setdefault(holding.node, set()).add(block)
        self._lens[block.prefixlen] += 1
        span = _span(block)
        for subnets in self._subnets.values():
            for s in subnets:
                s.mark(span)

    def _free(self, block: IPv4Network) -> None:
        holding = self._held.pop(block, None)
        if holding is None:
            return
        self._by_node[holding.node].discard(block)
        if not self._by_node[holding.node]:
            del self._by_node[holding.node]
        self._lens[block.prefixlen] -= 1
        span = _span(block)
        for subnets in self._subnets.values():
            for s in subnets:
                s.unmark(span)

    def _conflict(self, block: IPv4Network, node: str) -> Holding | None:
        """The holding of another node that ``block`` overlaps, if any."""
        for plen in range(block.prefixlen, -1, -1):  # held blocks containing ``block``
            if self._lens[plen]:
                holding = self._held.get(block.supernet(new_prefix=plen))
                if holding is not None and holding.node != node:
                    return holding
        if any(self._lens[p] for p in range(block.prefixlen + 1, 33)):  # inside ``block``
            for held, holding in self._held.items():
                inside = held.prefixlen > block.prefixlen and held.subnet_of(block)
                if holding.node != node and inside:
                    return holding
        return None

    def holdings(self, node: str) -> dict[IPv4Network, str]:
        """Blocks ``node`` holds, with their pool."""
        return {b: self._held[b].pool for b in self._by_node.get(node, ())}

    def pool_holders(self, pool: str) -> list[str]:
        """Names of the nodes holding blocks filed under ``pool``, sorted."""
        return sorted({h.node for h in self._held.values() if h.pool == pool})

    def holder(self, block: IPv4Network) -> Holding | None:
        """Who holds exactly ``block``, if anyone."""
        return self._held.get(block)

    def restore(
        self, nodes: Iterable[tuple[str, Mapping[str, Sequence[IPv4Network]]]]
    ) -> list[str]:
        """Occupy every block recorded in every node's allocation, then mark ready.

        Args:
            nodes: ``(node name, {pool: [blocks]})`` for every existing node.

        Returns:
            warnings, one per block recorded by two nodes (the first keeps it).
        """
        warnings = []
        for node, allocated in nodes:
            for pool, blocks in allocated.items():
                for block in blocks:
                    other = self._conflict(block, node)
                    if other is not None:
                        warnings.append(
                            f"CIDR {block} of node {node!r} (pool {pool!r}) is already held "
                            f"by node {other.node!r} (pool {other.pool!r})"
                        )
                        continue
                    self._occupy(block, Holding(node, pool))
        self.ready = True
        return warnings

    def occupy(self, block: IPv4Network, holding: Holding) -> Holding | None:
        """Record that ``holding`` holds ``block`` (e.g. a claim found in the store).

        Moves the block when the allocator had it for another node (the store's claim
        wins). Returns the holding of another node that overlaps without being the same
        block (then nothing is recorded), else None.
        """
        current = self._held.get(block)
        if current == holding:
            return None
        if current is not None:
            self._free(block)
        other = self._conflict(block, holding.node)
        if other is not None:
            return other
        self._occupy(block, holding)
        return None

    def release(self, node: str, block: IPv4Network) -> bool:
        """Free ``block`` if ``node`` holds it; returns whether it was freed."""
        holding = self._held.get(block)
        if holding is None or holding.node != node:
            return False
        self._free(block)
        return True

    def node_blocks(self, node: str) -> list[IPv4Network]:
        """Every block ``node`` holds, sorted."""
        return sorted(self._by_node.get(node, ()))

    def release_node(self, node: str) -> list[IPv4Network]:
        """Free every block of ``node`` (node deleted); returns them."""
        blocks = sorted(self._by_node.get(node, ()))
        for block in blocks:
            self._free(block)
        return blocks

    # -- allocation ----------------------------------------------------------------

    def _take(self, pool: str, node: str) -> IPv4Network | None:
        for s in self._subnets.get(pool, []):
            block = s.take()
            if block is not None:
                self._occupy(block, Holding(node, pool))  # marks it in every pool
                return block
        return None

    def reconcile(
        self,
        node: str,
        requested: Mapping[str, int],
        allocated: Mapping[str, Sequence[IPv4Network]],
        reserved: Collection[IPv4Network] = (),
    ) -> NodeResult:
        """Bring ``node`` to its demand, starting from its recorded allocation.

        1. The record is the truth for what the node holds: blocks the allocator has
           for it but the record lacks were released and are freed; recorded blocks
           are occupied (a block another node holds is reported and left alone).
        2. For each requested pool, in name order: while the usable addresses held
           (:meth:`PoolSpec.usable`) are fewer than ``needed``, hand out a whole block.
           Only blocks inside the pool's live CIDRs count as capacity: a block in a
           draining CIDR (or outside the pool) counts 0, because its addresses go away
           once the agent moves its pods out. ``needed`` already includes the addresses
           the node still uses inside draining blocks, so the live blocks alone must
           cover it (conservative: the operator cannot see per-block use; upstream
           likewise excludes draining CIDRs from available capacity).

        Args:
            node: node name.
            requested: pool -> addresses needed (``spec.ipam.pools.requested``).
            allocated: pool -> blocks held (``spec.ipam.pools.allocated``).
            reserved: blocks the allocator holds for ``node`` that its record lacks but
                that stay the node's (claimed in the store, the record write was lost):
                they are kept and handed to the node first when it needs blocks of
                their pool.

        Returns:
            the node's new allocation, errors (unknown pool, exhausted pool, conflicts)
            and the blocks added.

        Raises:
            AllocatorNotReady: :meth:`restore` has not run yet.
        """
        if not self.ready:
            raise AllocatorNotReady()
        recorded = {block: pool for pool, blocks in allocated.items() for block in blocks}
        spare: dict[str, list[IPv4Network]] = {}
        freed: list[tuple[str, IPv4Network]] = []
        for block, pool in sorted(self.holdings(node).items()):
            if block in recorded:
                continue
            if block in reserved:
                spare.setdefault(pool, []).append(block)
            else:
                self._free(block)
                freed.append((pool, block))
        result = NodeResult(allocated={}, freed=freed)
        for block, pool in recorded.items():
            holding = self._held.get(block)
            if holding is None or holding.node != node:
                other = self._conflict(block, node)
                if other is not None:
                    result.errors.append(
                        f"CIDR {block} (pool {pool!r}) is also held by node {other.node!r}"
                    )
                else:
                    self._occupy(block, Holding(node, pool))
            result.allocated.setdefault(pool, []).append(block)
        for pool, needed in sorted(requested.items()):
            if needed <= 0:
                continue
            spec = self._pools.get(pool)
            if spec is None:
                result.errors.append(f"pool {pool!r} not found")
                continue
            blocks = result.allocated.setdefault(pool, [])
            have = sum(spec.usable(b) for b in blocks if spec.contains(b))
            while have < needed:
                kept = spare.get(pool)
                new = kept.pop(0) if kept else self._take(pool, node)
                if new is not None and not spec.contains(new):
                    # a reserved block in a draining CIDR: keep it, it adds no capacity
                    blocks.append(new)
                    continue
                if new is None:
                    result.errors.append(
                        f"pool {pool!r} exhausted: no free /{spec.mask_size} block left in "
                        f"{', '.join(str(c) for c in spec.cidrs) or 'no CIDRs'} "
                        f"(needed {needed} addresses, node holds {have}); waiting: retried, "
                        "oldest first, when a block of the pool is released, a node deleted "
                        "or the pool extended"
                    )
                    result.waiting.append(pool)
                    break
                blocks.append(new)
                result.added.append((pool, new))
                have += spec.usable(new)
        result.allocated = {
            pool: sorted(blocks) for pool, blocks in sorted(result.allocated.items()) if blocks
        }
        return result

    def stats(self) -> dict[str, PoolStats]:
        """Blocks held and free per known pool."""
        held: Counter[str] = Counter(h.pool for h in self._held.values())
        return {
            name: PoolStats(held[name], sum(s.free for s in self._subnets[name]))
            for name in self._pools
        }

    def held(self) -> Mapping[IPv4Network, Holding]:
        """Every held block and its holder (read-only view)."""
        return self._held

    def held_in(self, cidr: IPv4Network) -> list[tuple[IPv4Network, Holding]]:
        """Held blocks inside (or overlapping) ``cidr``, sorted."""
        return sorted((b, h) for b, h in self._held.items() if b.overlaps(cidr))
