"""PolicyEngine: the one object the agent wires in (identities + policies + endpoints → map).

Usage by the agent (all calls from its event loop)::

    engine = PolicyEngine(PolicyMapWriter(bpf["cilia_policy"], capacity), on_enforce=cb)
    engine.restore()                                  # adopt the pinned map's entries
    engine.set_endpoint(ep_id, identity_labels, ns)   # endpoint created / relabelled
    engine.on_identities(watch_identities_response)   # each IdentityService message
    engine.on_policies(watch_policies_response)       # each PolicyService message
    engine.remove_endpoint(ep_id)                     # endpoint deleted

Each call recompiles only the affected endpoints and writes only the changed map entries
(fail-closed order, see ``maps``); then ``on_enforce(ep_id, EndpointPolicy)`` is called
for every recompiled endpoint so the datapath can set ``enforce_ingress``/``enforce_egress``
in ``cilia_endpoints`` (entries are in place before enforcement turns on).

CIDR identities: the engine owns the node-local CIDR identity allocator
(``identity.cidr``). When a policy naming prefixes (``toCIDR``, ``ipBlock``, their
excepts…) arrives, each newly named prefix gets its identity in the identity cache and its
ipcache entry (``prefixes``: the ipcache, through :class:`PrefixSink`) *before* the
endpoints are recompiled; a prefix no policy names any more loses them *after* (so the map
never refers to an identity the ipcache cannot produce, and an address never falls back
to world while a rule still expects its CIDR identity). Prefixes are refcounted by the
policies naming them (upstream: ipcache metadata refcounted by resource). After a
restart, :meth:`PolicyEngine.restore_prefixes` adopts the CIDR identities found in the
pinned ipcache (same numbers for prefixes named again); those no synced policy names are
removed before the first compilation.

Nothing is compiled before both streams have delivered their initial listing
(``ready``): compiling against half the identities or policies would delete restored
entries of running pods after an agent restart. Endpoints set or affected meanwhile are
compiled when the second ``synced`` arrives (``on_identities``/``on_policies`` then
return them too).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from cilia_agent.identity.cache import IdentityCache, IdentityChange, WatchIdentitiesResponseLike
from cilia_agent.identity.cidr import (
    CIDRDelta,
    CIDRError,
    CIDRIdentityAllocator,
    cidr_labels,
    is_local_identity,
    parse_ipv4_prefix,
)
from cilia_agent.identity.labels import Label, LabelSet
from cilia_agent.policy.compiler import EndpointPolicy, EndpointSubject, PolicyEntry, Verdict
from cilia_agent.policy.maps import PolicyDiff, PolicyMapError, PolicyMapWriter, diff
from cilia_agent.policy.repository import (
    BatchResult,
    PolicyRepository,
    PolicyUpdate,
    WatchPoliciesResponseLike,
)

log = logging.getLogger(__name__)

EnforceCallback = Callable[[int, EndpointPolicy], None]


class PrefixSink(Protocol):
    """Where policy prefixes and their CIDR identities go (``ipcache.IPCache``)."""

    def upsert_cidr(self, cidr: str, identity: int) -> None:
        """``cidr`` (``"10.0.0.0/8"``) is now named by ``identity``."""

    def delete_cidr(self, cidr: str) -> None:
        """No policy names ``cidr`` any more."""


class PolicyEngine:
    """Keeps every local endpoint's policy-map entries in line with policies and identities.

    ``writer``: the map writer (None = compute only, nothing written);
    ``on_enforce``: called with (ep_id, compiled policy) after each recompilation;
    ``prefixes``: told of every policy prefix and its CIDR identity (None: nobody, e.g.
    tests of the map alone); ``cidr_identities``: the local CIDR identity allocator.
    """

    def __init__(
        self,
        writer: PolicyMapWriter | None = None,
        on_enforce: EnforceCallback | None = None,
        identities: IdentityCache | None = None,
        repository: PolicyRepository | None = None,
        prefixes: PrefixSink | None = None,
        cidr_identities: CIDRIdentityAllocator | None = None,
    ) -> None:
        self.writer = writer
        self.on_enforce = on_enforce
        self.identities = identities if identities is not None else IdentityCache()
        self.repository = repository if repository is not None else PolicyRepository()
        self.prefixes = prefixes
        self.cidr_identities = (
            cidr_identities if cidr_identities is not None else CIDRIdentityAllocator()
        )
        self._restored_prefixes = False
        self.endpoints: dict[int, EndpointSubject] = {}
        self.compiled: dict[int, EndpointPolicy] = {}
        self._written: dict[int, Mapping[PolicyEntry, Verdict]] = {}
        self._pending: set[int] = set()
        #: ``(namespace, pod name) → {(port name, protocol): port}``: the pods' named
        #: container ports (Kubernetes mode: ``k8s.PodCache.named_ports``), or None.
        self.named_ports: Callable[[str, str], Mapping[tuple[str, str], int]] | None = None

    @property
    def ready(self) -> bool:
        """True once both the identity and the policy stream are synced."""
        return self.identities.synced and self.repository.synced

    def restore(self) -> dict[int, Mapping[PolicyEntry, Verdict]]:
        """Adopt the entries already in the pinned map (after an agent restart), so the
        first recompilation writes only differences. Returns them by endpoint id."""
        if self.writer is None:
            return {}
        self._written = dict(self.writer.read())
        return dict(self._written)

    def restore_prefixes(self, pinned: Mapping[str, int]) -> None:
        """Adopt the CIDR identities of a previous run (``prefix → identity`` read from the
        pinned ipcache; other identities are ignored): their numbers are kept for the
        prefixes policies name again, the rest are removed once both streams have synced.
        """
        for prefix, identity in sorted(pinned.items()):
            if not is_local_identity(identity):
                continue
            self.cidr_identities.restore(prefix, identity)
            self.identities.upsert_local(identity, cidr_labels(parse_ipv4_prefix(prefix)))
            if self.prefixes is not None:
                self.prefixes.upsert_cidr(prefix, identity)
            self._restored_prefixes = True

    def set_endpoint(
        self,
        ep_id: int,
        labels: Iterable[str | Label] | LabelSet,
        namespace: str,
        pod_name: str = "",
    ) -> EndpointPolicy | None:
        """Add or relabel a local endpoint and bring its entries up to date.

        ``labels``: the endpoint's identity labels (``identity.labels.pod_identity_labels``);
        ``pod_name``: its pod, whose named container ports (:attr:`named_ports`) a policy's
        named ports resolve to ("" or no source: none).
        Returns its compiled policy, or None while the engine is not ``ready`` (compiled
        later, see the module docstring).

        Raises:
            cilia_agent.identity.labels.LabelError: a malformed label.
            cilia_agent.policy.maps.PolicyMapError: writing the map failed.
        """
        ports = self.named_ports(namespace, pod_name) if self.named_ports and pod_name else None
        self.endpoints[ep_id] = EndpointSubject.of(labels, namespace, ports)
        return self.regenerate([ep_id]).get(ep_id)

    def remove_endpoint(self, ep_id: int) -> PolicyDiff:
        """Forget an endpoint and delete its map entries (including restored ones)."""
        self.endpoints.pop(ep_id, None)
        self.compiled.pop(ep_id, None)
        self._pending.discard(ep_id)
        current = self._written.pop(ep_id, {})
        change = diff(current, {})
        if self.writer is not None and change:
            self.writer.apply(ep_id, change)
        return change

    def prune(self) -> list[int]:
        """Delete the entries of restored endpoints that were not set again; returns their ids.

        Call once the agent has restored all its endpoints after a restart.
        """
        stale = [ep for ep in self._written if ep not in self.endpoints]
        for ep_id in stale:
            self.remove_endpoint(ep_id)
        return stale

    def on_identities(self, response: WatchIdentitiesResponseLike) -> set[int]:
        """Apply an identity stream message; returns the recompiled endpoint ids."""
        changes = self.identities.apply(response)
        affected = self.repository.affected_by_identities(changes, self.endpoints)
        return set(self.regenerate(affected))

    def on_policies(self, response: WatchPoliciesResponseLike) -> tuple[BatchResult, set[int]]:
        """Apply a policy stream message; returns the result and the recompiled endpoint ids.

        New CIDR identities and ipcache prefixes come first, released ones last (see the
        module docstring).
        """
        result = self.repository.apply(response)
        delta = self._update_prefixes(result.updates)
        added = self._add_cidrs(delta)
        affected = self.repository.affected_by_policies(result.updates, self.endpoints)
        affected |= self.repository.affected_by_identities(added, self.endpoints)
        done = set(self.regenerate(affected))
        removed = self._remove_cidrs(delta)
        done |= set(
            self.regenerate(self.repository.affected_by_identities(removed, self.endpoints))
        )
        return result, done

    def _update_prefixes(self, updates: Iterable[PolicyUpdate]) -> CIDRDelta:
        """Hand each updated policy's prefixes to the allocator; the merged delta."""
        merged = CIDRDelta()
        for update in updates:
            prefixes = update.new.prefixes() if update.new is not None else frozenset()
            try:
                delta = self.cidr_identities.update(update.ref, prefixes)
            except CIDRError:
                log.exception("policy %s: no CIDR identities for its prefixes", update.ref)
                continue
            merged.added += delta.added
            merged.removed += delta.removed
        return merged

    def _add_cidrs(self, delta: CIDRDelta) -> list[IdentityChange]:
        changes = []
        for ident in delta.added:
            change = self.identities.upsert_local(ident.identity, ident.labels)
            if change is not None:
                changes.append(change)
            if self.prefixes is not None:
                self.prefixes.upsert_cidr(ident.prefix, ident.identity)
            log.debug("CIDR identity %d for %s", ident.identity, ident.prefix)
        return changes

    def _remove_cidrs(self, delta: CIDRDelta) -> list[IdentityChange]:
        """Release what ``delta`` removed, except what the same batch took again (a prefix
        one policy dropped and a later one in the batch named: its ipcache entry stays,
        its old number goes unless it was handed out again)."""
        readded = {a.prefix for a in delta.added}
        in_use = {a.identity for a in delta.added}
        changes = []
        for ident in delta.removed:
            if self.prefixes is not None and ident.prefix not in readded:
                self.prefixes.delete_cidr(ident.prefix)
            current = self.identities.get(ident.identity)
            if ident.identity not in in_use and current == ident.labels:
                change = self.identities.delete(ident.identity)
                if change is not None:
                    changes.append(change)
            log.debug("CIDR identity %d for %s released", ident.identity, ident.prefix)
        return changes

    def regenerate(self, ep_ids: Iterable[int]) -> dict[int, EndpointPolicy]:
        """Recompile the given endpoints and write their changed entries; returns the
        compiled ones (none while not ``ready``: they are kept pending).

        Raises:
            cilia_agent.policy.maps.PolicyMapError: writing the map failed (the endpoints
                before it are written; call again to converge).
        """
        out: dict[int, EndpointPolicy] = {}
        if not self.ready:
            self._pending.update(ep_ids)
            return out
        if self._restored_prefixes:
            self._restored_prefixes = False
            stale = CIDRDelta(removed=self.cidr_identities.drop_restored())
            self._remove_cidrs(stale)  # before compiling: no entry may select them
        todo = sorted(set(ep_ids) | self._pending)
        self._pending.clear()
        for i, ep_id in enumerate(todo):
            subject = self.endpoints.get(ep_id)
            if subject is None:
                continue
            policy = self.repository.compile(subject, self.identities)
            current = self._written.get(ep_id, {})
            change = diff(current, policy.entries)
            if self.writer is not None and change:
                try:
                    self.writer.apply(ep_id, change)
                except PolicyMapError:
                    self._pending.update(todo[i:])  # retried on the next call
                    self._written[ep_id] = self._reread(ep_id)
                    raise
            self._written[ep_id] = dict(policy.entries)
            self.compiled[ep_id] = policy
            out[ep_id] = policy
            if change:
                log.info(
                    "endpoint %d policy: %d upserts, %d deletes, revision %d",
                    ep_id,
                    len(change.upserts),
                    len(change.deletes),
                    self.repository.revision,
                )
            if self.on_enforce is not None:
                self.on_enforce(ep_id, policy)
        return out

    def _reread(self, ep_id: int) -> Mapping[PolicyEntry, Verdict]:
        """What the map holds for ``ep_id`` after a partial write (empty if unreadable)."""
        assert self.writer is not None
        try:
            return self.writer.read().get(ep_id, {})
        except Exception:  # the map itself is failing: diff against nothing next time
            log.exception("re-reading the policy map for endpoint %d failed", ep_id)
            return {}
