"""The node's view of the operator's allocation, in ``--ipam cluster-pool`` or ``multi-pool``.

:class:`NodePools` turns each ``NodeAllocation`` into the CIDRs :class:`~cilia_agent.ipam.IPAM`
allocates from, and computes what the node tells the operator back
(``UpdateDemandRequest``: demand per pool and the CIDRs it hands back).

Modes (upstream ``ipam`` flag, reference: cilium-upstream.md §1-§3):

- ``cluster-pool``: the node's CIDRs are ``spec.ipam.podCIDRs`` (``NodeAllocation.pod_cidrs``);
  they are held as the default pool (``ipam-default-ip-pool``) so the migration to
  multi-pool, which adopts them into that pool with the same mask, changes nothing on the
  node. No demand is sent, nothing is handed back.
- ``multi-pool``: the CIDRs are ``spec.ipam.pools.allocated``; demand per pool
  (pre-allocation), empty CIDRs not needed to cover it and empty draining CIDRs are handed
  back.

In both modes the union of ``pod_cidrs`` and the default pool's allocated CIDRs is held as
the default pool, so an agent keeps its addresses whichever of operator and agent is
switched first during a migration (mixed nodes keep connectivity).

A CIDR handed back is remembered until an allocation no longer lists it: allocations that
still list it (sent before the operator processed the release) never bring it back. The
``resource_version`` the operator answered the last release with is kept too: an allocation
older than it that lists a CIDR of that release (e.g. replayed after a reconnect, once the
CIDR had already left the remembered set) is ignored as stale.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from cilia_agent.ipam.allocator import IPAM

log = logging.getLogger(__name__)

Net4 = ipaddress.IPv4Network
IPAMMode = Literal["cluster-pool", "multi-pool", "kubernetes"]
MODES: tuple[IPAMMode, ...] = ("cluster-pool", "multi-pool", "kubernetes")
NODE_CIDR_MODES: tuple[IPAMMode, ...] = ("cluster-pool", "kubernetes")
"""Modes where the node's addresses come from its podCIDRs only (no pools, no demand)."""


@dataclass(frozen=True)
class Demand:
    """What the node sends with ``UpdateDemand``.

    Attributes:
        needed: ``pool -> addresses needed`` (``needed_ip_ceil`` of in-use + pending).
        released: ``pool -> [cidr, ...]`` the node hands back (sorted strings).
    """

    needed: dict[str, int]
    released: dict[str, list[str]] = field(default_factory=dict)
    handed_back_now: bool = field(default=False, compare=False)
    """True when this call removed CIDRs from IPAM (persist the node state)."""


@dataclass
class AllocationChange:
    """What :meth:`NodePools.apply` changed: CIDRs added/dropped per pool, pools draining."""

    added: dict[str, list[str]] = field(default_factory=dict)
    dropped: dict[str, list[str]] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    draining: dict[str, list[str]] = field(default_factory=dict)
    stale: bool = False
    """True when the allocation was ignored (older than the last release, lists its CIDRs)."""


def _version(resource_version: str) -> int | None:
    """``resource_version`` as an integer, None when empty or not numeric (not comparable)."""
    try:
        return int(resource_version)
    except ValueError:
        return None


class NodePools:
    """Keeps :class:`IPAM`'s CIDRs in step with the operator's allocation.

    Args:
        ipam: the node allocator.
        mode: ``cluster-pool`` or ``multi-pool``.
        static: ``pool -> [cidr, ...]`` always held and never handed back (tests,
            single-host setups without an operator).

    Not thread-safe: call from the event loop (IPAM itself is locked).
    """

    def __init__(
        self,
        ipam: IPAM,
        mode: IPAMMode,
        static: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"ipam: {mode!r} is not one of {', '.join(MODES)}")
        self.ipam = ipam
        self.mode = mode
        self.static = {p: [Net4(c) for c in cidrs] for p, cidrs in (static or {}).items()}
        self.released: set[tuple[str, Net4]] = set()
        self.operator_error = ""
        # (resource_version, CIDRs) of the last release the operator acknowledged.
        self.last_release: tuple[int, frozenset[tuple[str, Net4]]] | None = None

    def release_acknowledged(
        self, released: Mapping[str, Iterable[str]], resource_version: str
    ) -> None:
        """Remember the ``UpdateDemandResponse.resource_version`` of a demand handing back
        ``released`` (``pool -> [cidr, ...]``); no-op when nothing was released or the
        version is not numeric."""
        version = _version(resource_version)
        cidrs = frozenset((pool, Net4(c)) for pool, nets in released.items() for c in nets)
        if version is not None and cidrs:
            self.last_release = (version, cidrs)

    def error_about(self, pool: str) -> str:
        """The operator's last error for this node when it names ``pool`` ("" otherwise)."""
        return self.operator_error if f"pool {pool!r}" in self.operator_error else ""

    def apply(
        self,
        default_pool: str,
        pools: Mapping[str, Iterable[str]],
        pod_cidrs: Iterable[str] = (),
        draining: Mapping[str, Iterable[str]] | None = None,
        error: str = "",
        reservation: Mapping[str, tuple[bool, bool]] | None = None,
        resource_version: str = "",
    ) -> AllocationChange:
        """Take one ``NodeAllocation`` (its ``pools``, ``pod_cidrs``, ``draining``, ``error``).

        ``reservation``: ``pool -> (allow_first_ip, allow_last_ip)`` of the allocation's
        ``PoolCIDRs``; pools not listed keep their current setting (default: first and
        last address of each CIDR reserved).

        ``resource_version``: the allocation's; when it is older than the last
        acknowledged release (:meth:`release_acknowledged`) and lists one of its CIDRs,
        the allocation is ignored (``stale`` set, nothing changed).

        New CIDRs are added; CIDRs no longer listed are dropped once no address in them
        is held; CIDRs handed back stay out while the allocation still lists them.
        Malformed or overlapping CIDRs of one pool are reported in ``rejected`` (that
        pool's other changes still apply).
        """
        change = AllocationChange()
        wanted: dict[str, list[Net4]] = {}
        for pool, cidrs in pools.items():
            if self.mode in NODE_CIDR_MODES and pool != default_pool:
                continue  # cluster-pool knows no pools; the default pool is the node's CIDRs
            try:
                wanted.setdefault(pool, []).extend(Net4(c) for c in cidrs)
            except ValueError as exc:
                change.rejected[pool] = str(exc)
                wanted.pop(pool, None)
        try:
            for cidr in pod_cidrs:
                net = Net4(cidr)
                if net not in wanted.setdefault(default_pool, []):
                    wanted[default_pool].append(net)
        except ValueError as exc:
            change.rejected["podCIDRs"] = str(exc)
        for pool, nets in self.static.items():
            wanted.setdefault(pool, []).extend(n for n in nets if n not in wanted[pool])
        listed = {(pool, net) for pool, nets in wanted.items() for net in nets}
        version = _version(resource_version)
        if (
            self.last_release is not None
            and version is not None
            and version < self.last_release[0]
            and listed & self.last_release[1]
        ):
            log.info(
                "ignoring an allocation older than the last release that still lists its CIDRs",
                extra={"resource_version": resource_version, "release": self.last_release[0]},
            )
            return AllocationChange(stale=True)
        self.operator_error = error
        self.released &= listed  # gone from the allocation: the operator took it back
        for pool, (allow_first, allow_last) in (reservation or {}).items():
            if pool in wanted:
                self.ipam.set_reservation(pool, allow_first, allow_last)
        for pool, nets in wanted.items():
            keep = [n for n in nets if (pool, n) not in self.released]
            try:
                added = self.ipam.add_cidrs(pool, keep)
            except ValueError as exc:
                change.rejected[pool] = str(exc)
                continue
            if added:
                change.added[pool] = [str(n) for n in added]
        for pool in list(self.ipam):
            keep = [n for n in wanted.get(pool, []) if (pool, n) not in self.released]
            dropped = self.ipam.remove_unused_cidrs(pool, keep)
            if dropped:
                change.dropped[pool] = [str(n) for n in dropped]
        for pool in list(self.ipam):
            gone = [str(c) for c in (draining or {}).get(pool, ())]
            self.ipam.set_draining(pool, gone if self.mode == "multi-pool" else ())
            if gone and self.mode == "multi-pool":
                change.draining[pool] = sorted(gone)
        return change

    def demand(self, default_pool: str) -> Demand | None:
        """The demand to send, handing back what is not needed; None in cluster-pool mode.

        CIDRs handed back leave IPAM here (no address is allocated from them afterwards)
        and are listed in every demand until an allocation no longer lists them.
        """
        if self.mode in NODE_CIDR_MODES:
            return None
        needed = self.ipam.demand([default_pool])
        static = {(p, n) for p, nets in self.static.items() for n in nets}
        taken = self.ipam.take_unneeded(needed, keep=[n for _, n in static])
        for pool, nets in taken.items():
            for net in nets:
                self.released.add((pool, net))
            log.info(
                "handing CIDRs back to the operator",
                extra={"pool": pool, "cidrs": [str(n) for n in nets]},
            )
        released: dict[str, list[str]] = {}
        for pool, net in sorted(self.released, key=lambda pn: (pn[0], pn[1])):
            released.setdefault(pool, []).append(str(net))
        return Demand(needed, released, handed_back_now=bool(taken))
