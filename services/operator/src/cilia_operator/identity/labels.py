"""Label sets of security identities (``source:key=value`` strings).

Source: upstream ``pkg/labels`` (reference: cilium-upstream.md §4): a label is
``source:key=value``; the identity belongs to the *sorted* set of (already filtered)
labels. Reserved identities (``pkg/identity/numericidentity.go``) are labelled
``reserved:<name>`` and never stored.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from cilia_common import reserved_identities as reserved

MINIMAL_NUMERIC_IDENTITY = reserved.MINIMAL_CLUSTER_IDENTITY
"""First cluster-allocated identity (upstream ``MinimalNumericIdentity``)."""

MAX_NUMERIC_IDENTITY = 65535
"""Last identity for cluster-id 0 (upstream ``(1 << ClusterIDShift) - 1``)."""

RESERVED_IDENTITIES: Mapping[str, int] = {reserved.NAMES[i]: i for i in reserved.LABELLED}
"""``reserved:<name>`` -> numeric identity (upstream reserved identities 1..8; ``reserved``)."""

REMOTE_NODE_IDENTITY = reserved.REMOTE_NODE

SOURCES = frozenset(
    {"k8s", "reserved", "container", "cni", "cidr", "cidrgroup", "node", "fqdn", "unspec", "gen",
     "directory"}
)  # fmt: skip
"""Upstream label sources (``pkg/labels``)."""


class InvalidLabels(ValueError):
    """A label set cannot identify anything (empty, malformed label, duplicate key)."""


@dataclass(frozen=True, order=True)
class Label:
    """One label: ``source``, ``key``, ``value`` (value may be empty)."""

    source: str
    key: str
    value: str

    def __str__(self) -> str:
        return f"{self.source}:{self.key}={self.value}"

    @property
    def source_key(self) -> str:
        """``source:key`` (the key of CiliumIdentity ``security-labels``)."""
        return f"{self.source}:{self.key}"


def parse_label(text: str) -> Label:
    """Parse ``source:key=value`` (``=value`` optional, meaning an empty value).

    Raises:
        InvalidLabels: no source, unknown source, or empty key.
    """
    source, sep, rest = text.partition(":")
    if not sep or not source:
        raise InvalidLabels(f"label {text!r}: expected source:key=value, e.g. k8s:app=web")
    if source not in SOURCES:
        raise InvalidLabels(f"label {text!r}: unknown source {source!r} (use one of "
                            f"{', '.join(sorted(SOURCES))})")  # fmt: skip
    key, _, value = rest.partition("=")
    if not key:
        raise InvalidLabels(f"label {text!r}: empty key")
    return Label(source, key, value)


@dataclass(frozen=True)
class LabelSet:
    """A sorted, duplicate-free set of labels: what an identity is allocated for."""

    labels: tuple[Label, ...]

    @classmethod
    def parse(cls, texts: Iterable[str]) -> LabelSet:
        """Parse and sort labels; the same label twice is accepted once.

        Raises:
            InvalidLabels: empty set, a malformed label, or one ``source:key`` with two
                different values.
        """
        seen: dict[str, Label] = {}
        for text in texts:
            label = parse_label(text)
            other = seen.get(label.source_key)
            if other is not None and other.value != label.value:
                raise InvalidLabels(
                    f"label {label.source_key!r} given twice with different values "
                    f"({other.value!r}, {label.value!r})"
                )
            seen[label.source_key] = label
        if not seen:
            raise InvalidLabels("empty label set: an identity needs at least one label")
        return cls(tuple(sorted(seen.values())))

    @classmethod
    def from_security_labels(cls, security_labels: Mapping[str, str]) -> LabelSet:
        """From a CiliumIdentity ``security-labels`` map (``source:key`` -> value).

        Raises:
            InvalidLabels: the map is empty or a key is malformed.
        """
        return cls.parse(f"{k}={v}" for k, v in security_labels.items())

    def strings(self) -> list[str]:
        """Sorted ``source:key=value`` strings."""
        return [str(label) for label in self.labels]

    def security_labels(self) -> dict[str, str]:
        """The ``security-labels`` map of the CiliumIdentity record."""
        return {label.source_key: label.value for label in self.labels}

    def digest(self) -> str:
        """SHA-256 (hex) of the canonical form: the store key of the label set."""
        canonical = "\n".join(self.strings())
        return hashlib.sha256(canonical.encode()).hexdigest()

    def reserved_identity(self) -> int | None:
        """The reserved identity when the set is only ``reserved:`` labels naming exactly
        one reserved identity (``kube-apiserver`` may also carry ``remote-node``), else None.

        Raises:
            InvalidLabels: reserved labels mixed with others, or an unknown reserved name.
        """
        reserved = [label for label in self.labels if label.source == "reserved"]
        if not reserved:
            return None
        if len(reserved) != len(self.labels):
            raise InvalidLabels("reserved:* labels cannot be mixed with other labels")
        names = {label.key for label in reserved}
        unknown = sorted(names - set(RESERVED_IDENTITIES))
        if unknown:
            raise InvalidLabels(f"unknown reserved identity {unknown[0]!r} (known: "
                                f"{', '.join(RESERVED_IDENTITIES)})")  # fmt: skip
        if names == {"kube-apiserver", "remote-node"}:
            return RESERVED_IDENTITIES["kube-apiserver"]
        if len(names) != 1:
            raise InvalidLabels(f"reserved labels {sorted(names)} name several identities")
        return RESERVED_IDENTITIES[names.pop()]
