"""Labels ("source:key=value"), the upstream default label filter, reserved identities.

A *label* has a source (``k8s``, ``reserved``, ``container`` …), a key and a value
and is written ``source:key=value`` (``source:key`` when the value is empty, e.g.
``reserved:host``). A *label set* is the immutable set of labels an identity stands
for; its canonical form is the sorted list of label strings (the form the operator
allocates identities for, see ``controlplane.proto`` ``Identity.labels``).

Source: upstream ``pkg/labels`` (parsing, string form), ``pkg/labelsfilter/filter.go``
(default filter), ``pkg/identity/numericidentity.go`` (reserved identities);
reference: cilium-upstream.md §4.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from cilia_common import reserved_identities as reserved

# Label sources (upstream pkg/labels).
SOURCE_K8S = "k8s"
SOURCE_RESERVED = "reserved"
SOURCE_UNSPEC = "unspec"
SOURCE_ANY = "any"
KNOWN_SOURCES = frozenset(
    {
        "k8s",
        "reserved",
        "container",
        "cni",
        "cidr",
        "cidrgroup",
        "node",
        "fqdn",
        "unspec",
        "gen",
        "directory",
        "any",
    }
)

POD_NAMESPACE_KEY = "io.kubernetes.pod.namespace"
"""Key of the label every pod gets with its namespace (``k8s:`` source)."""
NAMESPACE_LABELS_PREFIX = "io.cilium.k8s.namespace.labels."
"""Key prefix upstream uses for namespace labels copied onto pods."""

MINIMAL_CLUSTER_IDENTITY = reserved.MINIMAL_CLUSTER_IDENTITY
"""First identity the operator allocates for label sets (upstream MinimalNumericIdentity)."""


class LabelError(ValueError):
    """A label string or label key is malformed (empty key, empty source)."""


@dataclass(frozen=True, order=True)
class Label:
    """One label: ``source``, ``key``, ``value`` (value may be empty)."""

    source: str
    key: str
    value: str = ""

    def __str__(self) -> str:
        if self.value:
            return f"{self.source}:{self.key}={self.value}"
        return f"{self.source}:{self.key}"

    @classmethod
    def parse(cls, text: str, default_source: str = SOURCE_UNSPEC) -> Label:
        """Parse ``source:key=value`` / ``source:key`` / ``key=value`` (source = ``default_source``).

        The source is the text before the first ``:`` when that ``:`` comes before
        any ``=``; a leading ``$`` means the ``reserved`` source (``$host``).

        Raises:
            LabelError: empty key or empty source (``":app=x"``).
        """
        source, rest = split_source(text)
        if source is None:
            source = default_source
        key, sep, value = rest.partition("=")
        if not source:
            raise LabelError(f"label {text!r}: empty source before ':'")
        if not key:
            raise LabelError(f"label {text!r}: empty key")
        return cls(source, key, value if sep else "")


def split_source(text: str) -> tuple[str | None, str]:
    """Split ``source:rest`` → (source, rest); (None, text) when there is no source.

    ``$name`` is shorthand for ``reserved:name``. A ``:`` after the first ``=`` belongs
    to the value. Source: upstream ``pkg/labels`` ``parseSource``.
    """
    if text.startswith("$"):
        return SOURCE_RESERVED, text[1:]
    colon = text.find(":")
    equals = text.find("=")
    if colon < 0 or (0 <= equals < colon):
        return None, text
    return text[:colon], text[colon + 1 :]


@dataclass(frozen=True)
class LabelSet:
    """An immutable set of labels (hashable), indexed by key for selector matching."""

    labels: frozenset[Label]
    _by_key: Mapping[str, tuple[Label, ...]] = field(
        default_factory=dict, compare=False, hash=False, repr=False
    )

    def __post_init__(self) -> None:
        index: dict[str, list[Label]] = {}
        for label in self.labels:
            index.setdefault(label.key, []).append(label)
        object.__setattr__(self, "_by_key", {k: tuple(sorted(v)) for k, v in index.items()})

    @classmethod
    def of(cls, labels: Iterable[str | Label], default_source: str = SOURCE_UNSPEC) -> LabelSet:
        """Build from label strings (``"k8s:app=web"``) and/or ``Label`` objects.

        Raises:
            LabelError: a string is malformed.
        """
        return cls(
            frozenset(
                lb if isinstance(lb, Label) else Label.parse(lb, default_source) for lb in labels
            )
        )

    def by_key(self, key: str) -> tuple[Label, ...]:
        """Labels with this key, from any source (sorted)."""
        return tuple(self._by_key.get(key, ()))

    def strings(self) -> tuple[str, ...]:
        """Canonical form: the sorted ``source:key=value`` strings."""
        return tuple(sorted(str(lb) for lb in self.labels))

    def with_labels(self, extra: Iterable[Label]) -> LabelSet:
        """A new set with ``extra`` added."""
        return LabelSet(self.labels | frozenset(extra))

    def __iter__(self) -> Iterator[Label]:
        return iter(sorted(self.labels))

    def __len__(self) -> int:
        return len(self.labels)

    def __contains__(self, item: object) -> bool:
        return item in self.labels


# --------------------------------------------------------------------------- label filter


@dataclass(frozen=True)
class LabelPrefix:
    """One filter expression: an anchored regex on the key, optionally limited to a source."""

    pattern: str
    source: str | None = None
    ignore: bool = False
    _regex: re.Pattern[str] = field(init=False, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "_regex", re.compile(self.pattern))
        except re.error as exc:
            raise LabelError(f"label filter expression {self.pattern!r}: {exc}") from exc

    @classmethod
    def parse(cls, expression: str) -> LabelPrefix:
        """Parse ``[source:][!]regex`` (``!`` = ignore). Source: upstream ``parseLabelPrefix``.

        Raises:
            LabelError: empty expression or invalid regex.
        """
        source: str | None = None
        rest = expression
        colon = expression.find(":")
        if colon >= 0:
            source, rest = expression[:colon], expression[colon + 1 :]
        ignore = rest.startswith("!")
        if ignore:
            rest = rest[1:]
        if not rest:
            raise LabelError(f"label filter expression {expression!r}: empty prefix")
        return cls(pattern=rest, source=source or None, ignore=ignore)

    def match_length(self, label: Label) -> int:
        """Length of the match anchored at the start of the key; 0 when it does not match.

        An empty match (e.g. ``.*`` on an empty key) counts as length 0 = no match, as
        upstream compares lengths and treats 0 as "not matched".
        """
        if self.source is not None and self.source != label.source:
            return 0
        m = self._regex.match(label.key)
        return m.end() if m else 0


DEFAULT_INCLUDES: tuple[str, ...] = (
    "reserved:.*",
    "io.kubernetes.pod.namespace",
    "io.cilium.k8s.namespace.labels",
    "app.kubernetes.io",
    "io.cilium.k8s.policy.cluster",
)
"""Upstream default include expressions (they do not turn on whitelist mode)."""

DEFAULT_EXCLUDES: tuple[str, ...] = (
    r"io\.kubernetes",
    r"kubernetes\.io",
    r"statefulset\.kubernetes\.io/pod-name",
    r"apps\.kubernetes\.io/pod-index",
    r"batch\.kubernetes\.io/job-completion-index",
    r".*beta\.kubernetes\.io",
    r"k8s\.io",
    r"pod-template-generation",
    r"pod-template-hash",
    r"controller-revision-hash",
    r"annotation.*",
    r"etcd_node",
)
"""Upstream default ignore expressions (written without the leading ``!``)."""


@dataclass(frozen=True)
class LabelFilter:
    """Decides which labels are identity-relevant.

    A label is kept when (no user include exists and no ignore expression matches it)
    or (its longest include match is longer than its shortest ignore match).
    Source: upstream ``pkg/labelsfilter`` ``filterLabels``.
    """

    prefixes: tuple[LabelPrefix, ...]
    whitelist: bool = False

    @classmethod
    def default(cls, user_expressions: Sequence[str] = ()) -> LabelFilter:
        """The upstream defaults plus ``user_expressions`` (``[source:][!]regex``).

        Any user include expression (without ``!``) turns on whitelist mode: labels no
        include matches are then dropped (upstream ``--labels``).

        Raises:
            LabelError: a user expression is malformed.
        """
        prefixes = [LabelPrefix.parse(e) for e in DEFAULT_INCLUDES]
        prefixes += [LabelPrefix(pattern=e, ignore=True) for e in DEFAULT_EXCLUDES]
        user = [LabelPrefix.parse(e) for e in user_expressions]
        return cls(tuple(prefixes + user), whitelist=any(not p.ignore for p in user))

    def keep(self, label: Label) -> bool:
        """True when ``label`` is identity-relevant."""
        included = 0
        ignored = 0
        for prefix in self.prefixes:
            length = prefix.match_length(label)
            if length == 0:
                continue
            if prefix.ignore:
                if ignored == 0 or length < ignored:
                    ignored = length
            elif length > included:
                included = length
        return (not self.whitelist and ignored == 0) or included > ignored

    def filter(self, labels: Iterable[Label]) -> tuple[LabelSet, LabelSet]:
        """Split into (identity labels, informational labels)."""
        kept: list[Label] = []
        dropped: list[Label] = []
        for label in labels:
            (kept if self.keep(label) else dropped).append(label)
        return LabelSet(frozenset(kept)), LabelSet(frozenset(dropped))


DEFAULT_FILTER = LabelFilter.default()


def pod_identity_labels(
    namespace: str,
    pod_labels: Mapping[str, str],
    label_filter: LabelFilter = DEFAULT_FILTER,
) -> LabelSet:
    """Identity labels of a pod: ``k8s:<key>=<value>`` per pod label plus
    ``k8s:io.kubernetes.pod.namespace=<namespace>``, passed through ``label_filter``.

    ``pod_labels`` are plain Kubernetes labels (``{"app": "web"}``); keys must be
    non-empty. The canonical allocation form is ``result.strings()``.

    Raises:
        LabelError: empty namespace or an empty label key.
    """
    if not namespace:
        raise LabelError("pod namespace must not be empty")
    labels = []
    for key, value in pod_labels.items():
        if not key:
            raise LabelError(f"pod label with empty key (value {value!r})")
        labels.append(Label(SOURCE_K8S, key, value))
    labels.append(Label(SOURCE_K8S, POD_NAMESPACE_KEY, namespace))
    kept, _ = label_filter.filter(labels)
    return kept


# --------------------------------------------------------------------------- reserved


@dataclass(frozen=True)
class ReservedIdentity:
    """A reserved identity: number, name and its ``reserved:`` labels."""

    id: int
    name: str
    labels: LabelSet


def _reserved(id_: int, name: str, *extra: str) -> ReservedIdentity:
    return ReservedIdentity(
        id_, name, LabelSet.of([f"reserved:{name}", *(f"reserved:{e}" for e in extra)])
    )


# Names kept for the modules that import them from here; the numbers live in ``reserved``.
IDENTITY_UNKNOWN = reserved.UNKNOWN
IDENTITY_HOST = reserved.HOST
IDENTITY_WORLD = reserved.WORLD
IDENTITY_UNMANAGED = reserved.UNMANAGED
IDENTITY_HEALTH = reserved.HEALTH
IDENTITY_INIT = reserved.INIT
IDENTITY_REMOTE_NODE = reserved.REMOTE_NODE
IDENTITY_KUBE_APISERVER = reserved.KUBE_APISERVER
IDENTITY_INGRESS = reserved.INGRESS

# upstream labels kube-apiserver also as remote-node (numericidentity.go)
_EXTRA_LABELS: Mapping[int, tuple[str, ...]] = {
    reserved.KUBE_APISERVER: (reserved.NAMES[reserved.REMOTE_NODE],)
}

RESERVED_IDENTITIES: Mapping[int, ReservedIdentity] = {
    id_: _reserved(id_, reserved.NAMES[id_], *_EXTRA_LABELS.get(id_, ()))
    for id_ in reserved.LABELLED
}
"""Reserved identities 1..8 (upstream ``pkg/identity/numericidentity.go``)."""

RESERVED_BY_NAME: Mapping[str, ReservedIdentity] = {r.name: r for r in RESERVED_IDENTITIES.values()}


def is_cluster_identity(identity: int) -> bool:
    """True for operator-allocated identities (256 … 65535 in cluster 0)."""
    return MINIMAL_CLUSTER_IDENTITY <= identity < (1 << 16)
