"""The ipcache owner: one effective entry per prefix, chosen from four sources.

Precedence (upstream: local knowledge beats what other nodes announce):

1. a local endpoint's ``/32`` (its identity, no host IP) — written when the endpoint is
   created, removed when it is deleted;
2. this node's own addresses and router IP (identity 1, ``reserved:host``);
3. the operator's stream (``IPCacheEntry``: identity, host IP of the node holding the
   prefix, owner ``namespace/name``). A stream entry for a locally owned prefix is kept
   aside and takes over when the local owner goes (an address moved to another node);
4. the prefixes policies name (``toCIDR``/``fromCIDR``/``ipBlock`` and their excepts),
   each with its node-local CIDR identity (``identity.cidr``), written and removed by the
   policy engine (:meth:`IPCache.upsert_cidr`/:meth:`IPCache.delete_cidr`). Lowest
   precedence, as upstream's generated CIDR entries: a pod or node owning the same
   prefix keeps its identity. The datapath (and :meth:`IPCache.lookup`) take the
   longest matching prefix, so a CIDR entry names only addresses no longer prefix
   covers — pod ``/32``s and node addresses inside a policy's CIDR keep their
   identities, i.e. CIDR rules select addresses outside the cluster's endpoints.

Every change of a prefix's effective entry is passed to the listeners
(:class:`Listener`: the BPF ``cilia_ipcache`` writer); Hubble reads :meth:`IPCache.lookup`.

Not thread-safe: every call runs on the agent's event loop.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from cilia_common.reserved_identities import HOST as IDENTITY_HOST

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Entry:
    """What the ipcache knows of a prefix.

    Attributes:
        identity: security identity.
        host_ip: IPv4 of the node holding the prefix ("" for this node).
        owner: ``namespace/name`` of the pod, "" for non-pods.
    """

    identity: int
    host_ip: str = ""
    owner: str = ""


class Listener(Protocol):
    """Sees every change of a prefix's effective entry (``prefix``: ``"10.0.0.2/32"``)."""

    def upsert(self, prefix: str, entry: Entry) -> None:
        """The effective entry of ``prefix`` is now ``entry``."""

    def delete(self, prefix: str) -> None:
        """``prefix`` has no entry any more."""


def prefix_of(cidr: str) -> str:
    """Canonical ``a.b.c.d/len`` of ``cidr`` (a bare address is ``/32``).

    Raises:
        ValueError: not an IPv4 prefix.
    """
    return str(ipaddress.IPv4Network(cidr, strict=False))


class IPCache:
    """Prefix → :class:`Entry` for the node (see the module docstring for precedence).

    Args:
        listeners: told of every effective change, in order (more: :meth:`add_listener`).
    """

    def __init__(self, listeners: Sequence[Listener] = ()) -> None:
        self._listeners: list[Listener] = list(listeners)
        self._local: dict[str, tuple[int, int]] = {}  # prefix → (ep_id, identity)
        self._host: set[str] = set()
        self._remote: dict[str, Entry] = {}
        self._cidr: dict[str, int] = {}  # prefix → CIDR identity

    def add_listener(self, listener: Listener) -> None:
        """Tell ``listener`` of every later change."""
        self._listeners.append(listener)

    # ------------------------------------------------------------------ effective view

    def _effective(self, prefix: str) -> Entry | None:
        local = self._local.get(prefix)
        if local is not None:
            return Entry(local[1])
        if prefix in self._host:
            return Entry(IDENTITY_HOST)
        remote = self._remote.get(prefix)
        if remote is not None:
            return remote
        cidr = self._cidr.get(prefix)
        return Entry(cidr) if cidr is not None else None

    def _publish(self, prefix: str, entry: Entry | None) -> None:
        for listener in self._listeners:
            if entry is None:
                listener.delete(prefix)
            else:
                listener.upsert(prefix, entry)

    def locally_owned(self, prefix: str) -> bool:
        """True when a local endpoint or this node's address holds ``prefix``."""
        return prefix in self._local or prefix in self._host

    def lookup(self, ip: str) -> Entry | None:
        """The longest-prefix match for ``ip`` among the effective entries (None: none or
        not an IPv4 address). Linear in the number of prefix lengths in use (≤ 33)."""
        try:
            addr = ipaddress.IPv4Address(ip)
        except ValueError:
            return None
        exact = f"{addr}/32"
        hit = self._effective(exact)
        if hit is not None:
            return hit
        best: tuple[int, str] | None = None
        for prefix in (*self._remote, *self._cidr):
            net = ipaddress.IPv4Network(prefix)
            if addr in net and (best is None or net.prefixlen > best[0]):
                best = (net.prefixlen, prefix)
        return self._effective(best[1]) if best else None

    def __len__(self) -> int:
        """Entries from all sources (a locally owned prefix also in the stream counts twice,
        as ``cilia-agent status`` always counted them; policy CIDRs count too)."""
        return len(self._local) + len(self._host) + len(self._remote) + len(self._cidr)

    # ------------------------------------------------------------------ local endpoints

    def upsert_endpoint(self, ip: str, identity: int, ep_id: int) -> None:
        """A local endpoint ``ep_id`` holds ``ip`` with ``identity``."""
        prefix = prefix_of(ip)
        self._local[prefix] = (ep_id, identity)
        self._publish(prefix, Entry(identity))

    def delete_endpoint(self, ip: str, ep_id: int) -> None:
        """Endpoint ``ep_id`` no longer holds ``ip``; the stream's entry for the address (it
        moved to another node) takes over, else the prefix goes. Another endpoint's address
        is left alone."""
        prefix = prefix_of(ip)
        held = self._local.get(prefix)
        if held is None or held[0] != ep_id:
            return
        del self._local[prefix]
        self._publish(prefix, self._effective(prefix))

    def purge(self, ip: str) -> None:
        """Remove a stale ``/32`` left by an endpoint that no longer exists (cleaned at
        restore) unless a live local endpoint holds it; listener errors are logged."""
        prefix = prefix_of(ip)
        if prefix in self._local:
            return
        try:
            self._publish(prefix, self._effective(prefix))
        except Exception as exc:
            log.warning(
                "cannot remove a stale ipcache entry", extra={"ipv4": ip, "reason": str(exc)}
            )

    # ------------------------------------------------------------------ this node

    def set_host_addresses(self, addresses: Iterable[str]) -> None:
        """This node's addresses (and router IP) → identity 1 (host); "" is skipped.

        Raises:
            ValueError: an address is not IPv4.
        """
        for address in addresses:
            if not address:
                continue
            prefix = f"{ipaddress.IPv4Address(address)}/32"
            self._host.add(prefix)
            if prefix not in self._local:
                self._publish(prefix, Entry(IDENTITY_HOST))

    def remove_host_address(self, address: str) -> None:
        """``address`` is no longer this node's (a moved router IP): the stream's entry for
        it, if any, takes over, else the prefix goes.

        Raises:
            ValueError: not IPv4.
        """
        prefix = f"{ipaddress.IPv4Address(address)}/32"
        if prefix in self._host:
            self._host.discard(prefix)
            if prefix not in self._local:
                self._publish(prefix, self._effective(prefix))

    async def host_address_moved(
        self, old: ipaddress.IPv4Address, new: ipaddress.IPv4Address
    ) -> bool:
        """The router IP moved (a ``LocalNode`` observer): ``new`` is this node's, ``old`` no
        longer. Always True."""
        self.set_host_addresses([str(new)])
        self.remove_host_address(str(old))
        return True

    # ------------------------------------------------------------------ the stream

    def remote_prefixes(self) -> list[str]:
        """Prefixes the stream has given (locally owned ones included)."""
        return list(self._remote)

    def upsert_remote(self, cidr: str, entry: Entry) -> None:
        """The stream's entry for ``cidr``; applied unless the prefix is locally owned.

        Raises:
            ValueError: ``cidr`` is not an IPv4 prefix.
        """
        prefix = prefix_of(cidr)
        self._remote[prefix] = entry
        if not self.locally_owned(prefix):
            self._publish(prefix, entry)

    def delete_remote(self, cidr: str) -> None:
        """The stream dropped ``cidr``; a locally owned prefix is unaffected.

        Raises:
            ValueError: ``cidr`` is not an IPv4 prefix.
        """
        prefix = prefix_of(cidr)
        if self._remote.pop(prefix, None) is None:
            return
        if not self.locally_owned(prefix):
            self._publish(prefix, self._effective(prefix))

    # ------------------------------------------------------------------ policy CIDRs

    def cidr_prefixes(self) -> dict[str, int]:
        """Policy prefixes and their CIDR identities."""
        return dict(self._cidr)

    def upsert_cidr(self, cidr: str, identity: int) -> None:
        """A policy names ``cidr``, selected through the CIDR ``identity``; applied unless
        another source holds the same prefix.

        Raises:
            ValueError: ``cidr`` is not an IPv4 prefix.
        """
        prefix = prefix_of(cidr)
        self._cidr[prefix] = identity
        if self.locally_owned(prefix) or prefix in self._remote:
            return
        self._publish(prefix, Entry(identity))

    def delete_cidr(self, cidr: str) -> None:
        """No policy names ``cidr`` any more; another source's entry for it is unaffected.

        Raises:
            ValueError: ``cidr`` is not an IPv4 prefix.
        """
        prefix = prefix_of(cidr)
        if self._cidr.pop(prefix, None) is None:
            return
        if not self.locally_owned(prefix) and prefix not in self._remote:
            self._publish(prefix, None)
