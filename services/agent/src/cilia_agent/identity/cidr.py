"""CIDR identities: node-local security identities for the prefixes policies name.

A CIDR policy peer (``toCIDR``, ``toCIDRSet``, ``fromCIDR``, ``fromCIDRSet``, a
NetworkPolicy ``ipBlock``) is enforced the way upstream Cilium does it:

- every prefix a policy names, its ``except`` prefixes included, gets an identity of the
  **local scope**: numbers ``LOCAL_SCOPE | n`` with ``n`` in 1 … 2**24 - 1, i.e.
  16777217 … 33554431 (upstream ``pkg/identity/numericidentity.go``:
  ``IdentityScopeLocal = 1 << 24``, the local allocator hands out 1 …
  ``MaxAllocatorLocalIdentity`` and ORs the scope in). These numbers are this agent's
  alone: they are never sent to the operator and mean nothing on another node. Here the
  lowest free ``n`` is used, so a number is reused once its prefix is gone.
- the identity's labels are ``cidr:<p>`` for the prefix itself and for every shorter
  prefix containing it, down to ``cidr:0.0.0.0/0``, plus ``reserved:world`` (upstream
  ``pkg/labels/cidr.go`` ``GetCIDRLabels``): 10.0.0.0/8 carries ``cidr:10.0.0.0/8``,
  ``cidr:10.0.0.0/7``, ``cidr:8.0.0.0/6`` … ``cidr:0.0.0.0/0``. So a selector on
  ``cidr:X`` selects every CIDR identity whose prefix lies inside X, whichever policy
  allocated it.
- ``0.0.0.0/0`` gets no identity of its own: upstream labels it ``reserved:world`` only,
  i.e. it *is* the world identity (2), which is what the datapath already gives an
  address the ipcache does not know.
- after an agent restart the numbers found in the pinned ipcache are kept
  (:meth:`CIDRIdentityAllocator.restore`, as upstream restores its CIDR identities from the
  ipcache map): a prefix named again gets its old number, so the pinned policy entries stay
  right; :meth:`CIDRIdentityAllocator.drop_restored` hands back the ones no policy named.
- each prefix is refcounted by its users (the policies naming it); its identity goes when
  the last user does (:meth:`CIDRIdentityAllocator.update` returns what to add to and
  remove from the identity cache and the ipcache).

IPv4 only, as the datapath: :func:`parse_ipv4_prefix` refuses IPv6 with a clear message.

Not thread-safe: call it from the agent's event loop.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Final

from cilia_agent.identity.labels import SOURCE_RESERVED, Label, LabelSet
from cilia_common import reserved_identities as reserved

SOURCE_CIDR: Final = "cidr"
"""Label source of CIDR labels (upstream ``LabelSourceCIDR``)."""
LOCAL_SCOPE: Final = 1 << 24
"""Scope bit of node-local identities (upstream ``IdentityScopeLocal``)."""
MIN_LOCAL_INDEX: Final = 1
MAX_LOCAL_INDEX: Final = (1 << 24) - 1
"""The allocator's range inside the scope (upstream Min/MaxAllocatorLocalIdentity)."""
WORLD_PREFIX: Final = "0.0.0.0/0"


class CIDRError(ValueError):
    """A CIDR is malformed, IPv6, or the local identity space is exhausted."""


class LocalIdentitiesExhausted(CIDRError):
    """All 2**24 - 1 local identities are in use."""


def is_local_identity(identity: int) -> bool:
    """True for a node-local (CIDR) identity: ``LOCAL_SCOPE | n``, 1 ≤ n < 2**24."""
    return (identity >> 24) == 1 and identity & MAX_LOCAL_INDEX >= MIN_LOCAL_INDEX


def parse_ipv4_prefix(text: str) -> ipaddress.IPv4Network:
    """``"10.0.0.0/8"`` → the network; host bits are cleared (``10.1.2.3/8`` → 10.0.0.0/8,
    as upstream masks the prefix); a bare address is a ``/32``.

    Raises:
        CIDRError: not text, an IPv6 prefix ("IPv6 CIDR … not supported by Cilia: the
            datapath is IPv4-only"), or not a CIDR at all.
    """
    if not isinstance(text, str):
        raise CIDRError(f"CIDR must be a string, got {type(text).__name__}")
    try:
        net = ipaddress.ip_network(text.strip(), strict=False)
    except ValueError:
        raise CIDRError(f"{text!r} is not a valid CIDR (expected a.b.c.d/n)") from None
    if net.version != 4:
        raise CIDRError(f"IPv6 CIDR {text!r} not supported by Cilia: the datapath is IPv4-only")
    assert isinstance(net, ipaddress.IPv4Network)
    return net


def cidr_label(net: ipaddress.IPv4Network) -> Label:
    """``cidr:<network>/<len>`` of one prefix (upstream ``IPStringToLabel``)."""
    return Label(SOURCE_CIDR, str(net))


def cidr_labels(net: ipaddress.IPv4Network) -> LabelSet:
    """Labels of a prefix's identity: ``cidr:`` of the prefix and of each shorter prefix
    containing it (down to /0), plus ``reserved:world``. ``0.0.0.0/0`` → ``reserved:world``
    only (upstream ``GetCIDRLabels``)."""
    labels = [Label(SOURCE_RESERVED, reserved.NAMES[reserved.WORLD])]
    if net.prefixlen:
        labels += [cidr_label(net.supernet(new_prefix=n)) for n in range(net.prefixlen + 1)]
    return LabelSet.of(labels)


@dataclass(frozen=True)
class CIDRIdentity:
    """One allocated prefix: ``prefix`` (``"10.0.0.0/8"``), ``identity``, ``labels``."""

    prefix: str
    identity: int
    labels: LabelSet


@dataclass
class CIDRDelta:
    """What :meth:`CIDRIdentityAllocator.update` changed: prefixes that gained their first
    user (``added``) and lost their last (``removed``), in prefix order."""

    added: list[CIDRIdentity] = field(default_factory=list)
    removed: list[CIDRIdentity] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.added or self.removed)


class CIDRIdentityAllocator:
    """Prefix → local identity, refcounted by users (see the module docstring).

    Args:
        max_index: highest ``n`` handed out (default: the whole local scope; tests lower it).
    """

    def __init__(self, max_index: int = MAX_LOCAL_INDEX) -> None:
        self._max = max_index
        self._by_prefix: dict[str, CIDRIdentity] = {}
        self._users: dict[str, set[Hashable]] = {}
        self._by_user: dict[Hashable, frozenset[str]] = {}
        self._free: list[int] = []  # released indices, reused lowest first
        self._next = MIN_LOCAL_INDEX
        self._restored: dict[str, int] = {}  # prefix → index kept from before a restart

    def __len__(self) -> int:
        return len(self._by_prefix)

    def get(self, prefix: str) -> CIDRIdentity | None:
        """The allocation of a canonical prefix, None when no user names it."""
        return self._by_prefix.get(prefix)

    def allocations(self) -> list[CIDRIdentity]:
        """Every allocation, by prefix."""
        return [self._by_prefix[p] for p in sorted(self._by_prefix)]

    def users(self, prefix: str) -> int:
        """How many users hold ``prefix``."""
        return len(self._users.get(prefix, ()))

    def restore(self, prefix: str, identity: int) -> None:
        """Keep ``identity`` for ``prefix`` (found in the pinned ipcache after a restart)
        until :meth:`drop_restored`; ignored when not a local identity or already taken."""
        index = identity & MAX_LOCAL_INDEX
        if not is_local_identity(identity) or index > self._max:
            return
        prefix = str(parse_ipv4_prefix(prefix))
        taken = index in self._restored.values() or (index < self._next and index not in self._free)
        if taken or prefix in self._by_prefix or prefix in self._restored:
            return
        self._restored[prefix] = index
        while self._next <= index:
            if self._next not in self._restored.values():
                self._free.append(self._next)
            self._next += 1
        if index in self._free:
            self._free.remove(index)

    def drop_restored(self) -> list[CIDRIdentity]:
        """Forget the restored numbers no user took again; returns them (their pinned
        entries are stale)."""
        stale = [
            CIDRIdentity(p, LOCAL_SCOPE | i, cidr_labels(parse_ipv4_prefix(p)))
            for p, i in sorted(self._restored.items())
        ]
        for ident in stale:
            self._give_back(ident.identity & MAX_LOCAL_INDEX)
        self._restored.clear()
        return stale

    def update(self, user: Hashable, prefixes: Iterable[str]) -> CIDRDelta:
        """Make ``prefixes`` the set ``user`` holds (empty = release everything it held).

        ``/0`` is skipped (it is the world identity). Returns the prefixes allocated and
        released by this call; on error nothing is changed.

        Raises:
            CIDRError: a prefix is malformed or IPv6.
            LocalIdentitiesExhausted: no local identity left.
        """
        wanted = frozenset(str(parse_ipv4_prefix(p)) for p in prefixes) - {WORLD_PREFIX}
        held = self._by_user.get(user, frozenset())
        new = sorted(p for p in wanted - held if p not in self._by_prefix)
        fresh = [p for p in new if p not in self._restored]
        if len(fresh) > len(self._free) + (self._max - self._next + 1):
            raise LocalIdentitiesExhausted(
                f"{len(new)} CIDR identities needed, local identity space exhausted"
            )
        delta = CIDRDelta()
        for prefix in sorted(wanted - held):
            if prefix not in self._by_prefix:
                ident = CIDRIdentity(
                    prefix,
                    LOCAL_SCOPE | self._take(prefix),
                    cidr_labels(parse_ipv4_prefix(prefix)),
                )
                self._by_prefix[prefix] = ident
                delta.added.append(ident)
            self._users.setdefault(prefix, set()).add(user)
        for prefix in sorted(held - wanted):
            users = self._users[prefix]
            users.discard(user)
            if not users:
                del self._users[prefix]
                gone = self._by_prefix.pop(prefix)
                self._give_back(gone.identity & MAX_LOCAL_INDEX)
                delta.removed.append(gone)
        if wanted:
            self._by_user[user] = wanted
        else:
            self._by_user.pop(user, None)
        return delta

    def _take(self, prefix: str) -> int:
        restored = self._restored.pop(prefix, None)
        if restored is not None:
            return restored
        if self._free:
            self._free.sort()
            return self._free.pop(0)
        index = self._next
        self._next += 1
        return index

    def _give_back(self, index: int) -> None:
        self._free.append(index)
