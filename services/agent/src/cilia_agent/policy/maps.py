"""The pinned ``cilia_policy`` LPM trie: ctypes layouts, entry diff, writer.

Layouts of ``struct policy_key`` / ``struct policy_value`` (bpf/lib/common.h) come from
the agent's one layout module, ``cilia_agent.datapath.layout`` (re-exported here):

    policy_key   {u32 prefixlen; u32 ep_id; u32 sec_label (0 = any); u8 egress;
                  u8 protocol (0 = any); be16 dport (0 = any)}       16 bytes
    policy_value {u8 flags (bit0 = deny); u8 pad[7]; u64 packets; u64 bytes}  24 bytes

Prefix length: 72 bits (ep_id, sec_label, egress) always; 80 with a protocol; 96 with a
protocol and a port; 80 + n for a block of 2**(16 - n) ports (an ``endPort`` range is
written as such aligned blocks, as upstream does). ``dport`` is stored in network byte
order. ICMP rules put 256 + the ICMP type in ``dport`` (``rules.ICMP_TYPE_BASE``; bpf_lxc.c
looks ICMP packets up the same way), so type 0 is not the wildcard port 0.

``diff(current, desired)`` computes the upserts and deletes that turn one endpoint's
current entries into the desired ones; ``PolicyMapWriter.apply`` writes exactly those, in
fail-closed order (new denies, removed allows, new allows, removed denies), so at no
point during an update is something allowed that neither the old nor the new policy
allows. Unchanged entries are not rewritten (their packet/byte counters survive).

Source: upstream ``pkg/maps/policymap/policymap.go`` (key layout, prefix lengths),
extended with ``ep_id`` (one map for all endpoints).
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from cilia_agent.datapath.layout import (
    POLICY_FLAG_DENY,
    POLICY_PREFIX_FULL,
    POLICY_PREFIX_PROTO,
    POLICY_PREFIX_STATIC,
    PolicyKey,
    PolicyValue,
    policy_key,
)
from cilia_agent.policy.compiler import PolicyEntry, Verdict

POLICY_MAP_MAX_DEFAULT = 16384
"""``CILIA_POLICY_MAX`` default of bpf/lib/common.h (upstream ``bpf-policy-map-max``)."""

__all__ = [
    "POLICY_FLAG_DENY",
    "POLICY_MAP_MAX_DEFAULT",
    "POLICY_PREFIX_FULL",
    "POLICY_PREFIX_PROTO",
    "POLICY_PREFIX_STATIC",
    "BpfTable",
    "PolicyDiff",
    "PolicyKey",
    "PolicyMapError",
    "PolicyMapFull",
    "PolicyMapWriter",
    "PolicyValue",
    "UnencodableEntry",
    "decode_key",
    "decode_value",
    "diff",
    "encode_key",
    "encode_value",
    "prefix_len",
]


class PolicyMapError(Exception):
    """Writing the policy map failed (kernel error); carries the endpoint and entry."""


class PolicyMapFull(PolicyMapError):
    """The update would exceed the map's capacity; nothing was written."""


class UnencodableEntry(ValueError):
    """An entry has a port without a protocol, or a field out of range."""


def prefix_len(entry: PolicyEntry) -> int:
    """LPM prefix length of an entry: 72, 80 (protocol) or 80 + ``port_bits`` (protocol +
    port or port block).

    Raises:
        UnencodableEntry: a port with protocol 0, out-of-range fields, or a port block not
            aligned on its size.
    """
    if entry.port and not entry.protocol:
        raise UnencodableEntry(f"{entry}: a port needs a protocol")
    if not (
        0 <= entry.peer < 1 << 32
        and entry.direction in (0, 1)
        and 0 <= entry.protocol < 256
        and 0 <= entry.port < 1 << 16
        and 1 <= entry.port_bits <= 16
    ):
        raise UnencodableEntry(f"{entry}: field out of range")
    if entry.port & ((1 << (16 - entry.port_bits)) - 1):
        raise UnencodableEntry(f"{entry}: port block not aligned on its size")
    if entry.port:
        return POLICY_PREFIX_PROTO + entry.port_bits
    return POLICY_PREFIX_PROTO if entry.protocol else POLICY_PREFIX_STATIC


def encode_key(ep_id: int, entry: PolicyEntry) -> PolicyKey:
    """Map key of ``entry`` for endpoint ``ep_id`` (port converted to network order).

    Raises:
        UnencodableEntry: a port with protocol 0, or out-of-range fields.
    """
    prefix_len(entry)  # validates first: UnencodableEntry, never policy_key's ValueError
    bits = entry.port_bits if entry.port else 16
    return policy_key(ep_id, entry.peer, entry.direction, entry.protocol, entry.port, bits)


def decode_key(key: Any) -> tuple[int, PolicyEntry]:
    """(ep_id, entry) of a map key (``PolicyKey``)."""
    port = socket.ntohs(int(key.dport))
    bits = int(key.prefixlen) - POLICY_PREFIX_PROTO if port else 16
    return int(key.ep_id), PolicyEntry(
        int(key.sec_label), int(key.egress), int(key.protocol), port, bits
    )


def encode_value(verdict: Verdict) -> PolicyValue:
    """Map value for a verdict (counters zero)."""
    return PolicyValue(flags=POLICY_FLAG_DENY if verdict is Verdict.DENY else 0)


def decode_value(value: Any) -> Verdict:
    """Verdict of a map value."""
    return Verdict.DENY if int(value.flags) & POLICY_FLAG_DENY else Verdict.ALLOW


@dataclass(frozen=True)
class PolicyDiff:
    """Changes for one endpoint.

    ``upserts``: entry → new verdict (new keys and changed verdicts); ``deletes``: entry →
    old verdict; ``replaced``: the upserted keys that already exist (verdict changes).
    """

    upserts: Mapping[PolicyEntry, Verdict] = field(default_factory=dict)
    deletes: Mapping[PolicyEntry, Verdict] = field(default_factory=dict)
    replaced: frozenset[PolicyEntry] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.upserts) or bool(self.deletes)

    def __len__(self) -> int:
        return len(self.upserts) + len(self.deletes)

    @property
    def growth(self) -> int:
        """Net change of the number of map entries."""
        return len(self.upserts) - len(self.replaced) - len(self.deletes)


def diff(
    current: Mapping[PolicyEntry, Verdict], desired: Mapping[PolicyEntry, Verdict]
) -> PolicyDiff:
    """Entries to write so ``current`` becomes ``desired``: new keys and changed verdicts
    are upserted, keys absent from ``desired`` deleted, identical entries left alone."""
    upserts = {k: v for k, v in desired.items() if current.get(k) is not v}
    deletes = {k: v for k, v in current.items() if k not in desired}
    return PolicyDiff(upserts, deletes, frozenset(k for k in upserts if k in current))


class BpfTable(Protocol):
    """What the writer uses of the map (``Datapath.policy_map``, a
    :class:`~cilia_agent.datapath.libbpf.PinnedMap`): ``del`` raises KeyError when absent."""

    def __setitem__(self, key: Any, value: Any) -> None: ...
    def __delitem__(self, key: Any) -> None: ...
    def items(self) -> Iterable[tuple[Any, Any]]: ...


class PolicyMapWriter:
    """Applies per-endpoint diffs to the ``cilia_policy`` LPM trie.

    ``table``: the pinned map (``Datapath.policy_map``); ``capacity``: its max_entries
    (``--bpf-policy-map-max``). The writer counts entries itself (read once
    from the map on first use), so it must be the map's only writer.
    """

    def __init__(self, table: BpfTable, capacity: int = POLICY_MAP_MAX_DEFAULT) -> None:
        self._table = table
        self.capacity = capacity
        self._count: int | None = None

    def read(self) -> dict[int, dict[PolicyEntry, Verdict]]:
        """Every entry in the map, by endpoint id (used after an agent restart)."""
        out: dict[int, dict[PolicyEntry, Verdict]] = {}
        for key, value in self._table.items():
            ep_id, entry = decode_key(key)
            out.setdefault(ep_id, {})[entry] = decode_value(value)
        self._count = sum(len(v) for v in out.values())
        return out

    @property
    def entry_count(self) -> int:
        """Entries currently in the map (as counted by this writer)."""
        if self._count is None:
            self.read()
        assert self._count is not None
        return self._count

    def apply(self, ep_id: int, change: PolicyDiff) -> None:
        """Write ``change`` for endpoint ``ep_id`` in fail-closed order.

        Raises:
            UnencodableEntry: an entry cannot be encoded (nothing written).
            PolicyMapFull: the map would exceed ``capacity`` (nothing written).
            PolicyMapError: the kernel refused an update or delete; entries before it
                were written (re-run the sync to converge).
        """
        keys = {entry: encode_key(ep_id, entry) for entry in (*change.upserts, *change.deletes)}
        before = self.entry_count
        if change.growth > 0 and before + change.growth > self.capacity:
            raise PolicyMapFull(
                f"endpoint {ep_id}: {before} entries + {change.growth} "
                f"exceeds the policy map capacity {self.capacity}"
            )
        ups = change.upserts
        dels = change.deletes
        try:
            self._upsert(ep_id, keys, {k: v for k, v in ups.items() if v is Verdict.DENY})
            self._delete(ep_id, keys, [k for k, v in dels.items() if v is Verdict.ALLOW])
            self._upsert(ep_id, keys, {k: v for k, v in ups.items() if v is Verdict.ALLOW})
            self._delete(ep_id, keys, [k for k, v in dels.items() if v is Verdict.DENY])
        except PolicyMapError:
            self._count = None  # recount from the map next time
            raise
        self._count = before + change.growth

    def _upsert(
        self,
        ep_id: int,
        keys: Mapping[PolicyEntry, PolicyKey],
        entries: Mapping[PolicyEntry, Verdict],
    ) -> None:
        for entry, verdict in entries.items():
            try:
                self._table[keys[entry]] = encode_value(verdict)
            except Exception as exc:  # LibbpfError (E2BIG when full) or another OSError
                raise PolicyMapError(f"endpoint {ep_id}: writing {entry}: {exc}") from exc

    def _delete(
        self, ep_id: int, keys: Mapping[PolicyEntry, PolicyKey], entries: Iterable[PolicyEntry]
    ) -> None:
        for entry in entries:
            try:
                del self._table[keys[entry]]
            except KeyError:
                pass  # already gone: the desired state holds
            except Exception as exc:
                raise PolicyMapError(f"endpoint {ep_id}: deleting {entry}: {exc}") from exc
