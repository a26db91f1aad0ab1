"""The ``--hubble-metrics`` grammar and the context labels every handler can add.

Grammar (upstream ``pkg/hubble/metrics/api``: ``ParseMetricList``, ``ParseOptions``,
``ParseContextOptions``), restated::

    metrics  ::= handler { (" " | ",") handler }
    handler  ::= name [ ":" option { ";" option } ]
    option   ::= key [ "=" value ]
    context  ::= identifier { "|" identifier }      (the first non-empty value wins)

Upstream separates handlers with whitespace (its configuration file) or commas (its
command line). A comma inside a value list (``labelsContext=source_pod,destination_pod``)
stays with that value: a comma piece joins the piece before it when that piece has an
``=`` and the new piece is neither a handler name nor ``name:options``.

Context options (keys case-insensitive, values as upstream):

- ``sourceContext`` / ``destinationContext``: add a ``source`` / ``destination`` label whose
  value is the first non-empty of the ``|``-separated identifiers: ``identity`` (the
  endpoint's labels joined by ","), ``namespace``, ``pod`` ("namespace/pod"), ``pod-short``
  ("namespace/" + the pod name without its one or two generated suffixes), ``pod-name``,
  ``dns`` (the flow's source/destination names joined by ","), ``ip``,
  ``reserved-identity`` ("reserved:kube-apiserver" when present, else the first
  "reserved:" label), ``workload-name`` (the first workload's name), ``app`` (the value of
  the first ``k8s:app.kubernetes.io/name``, ``k8s:k8s-app`` or ``k8s:app`` label).
- ``sourceIngressContext`` / ``sourceEgressContext`` / ``destinationIngressContext`` /
  ``destinationEgressContext``: replace the plain context for flows of that traffic
  direction. As upstream, the label itself exists only when the plain context is given.
- ``labelsContext``: a comma list of extra labels, always in this order: ``source_ip``,
  ``source_pod``, ``source_namespace``, ``source_workload``, ``source_app``,
  ``destination_ip``, ``destination_pod``, ``destination_namespace``,
  ``destination_workload``, ``destination_app``, ``traffic_direction`` ("ingress",
  "egress", "unknown").

Label order of a handler's context: the ``labelsContext`` labels, then ``source``, then
``destination`` (upstream ``ContextOptions.GetLabelNames``).

Stricter than upstream, on purpose: an option key a handler does not know, a handler
named twice, or an empty handler name is an error (upstream ignores the first and lets
the last of a repeated handler win), so a typo fails at start-up instead of silently
producing a metric without its labels.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from cilia.hubble.flow import flow_pb2

#: Handlers this agent implements (upstream plugin names).
HANDLER_NAMES = ("flow", "drop", "tcp", "port-distribution", "icmp", "flows-to-world")
#: Upstream handlers this agent does not implement (L7, policy verdict, SCTP).
UPSTREAM_ONLY = frozenset({"dns", "http", "httpV2", "kafka", "policy", "sctp", "flows-per-pod"})

CONTEXT_IDENTIFIERS = (
    "identity",
    "namespace",
    "pod",
    "pod-short",
    "pod-name",
    "dns",
    "ip",
    "reserved-identity",
    "workload-name",
    "app",
)
#: Labels ``labelsContext`` may name, in the order they are added.
CONTEXT_LABELS = (
    "source_ip",
    "source_pod",
    "source_namespace",
    "source_workload",
    "source_app",
    "destination_ip",
    "destination_pod",
    "destination_namespace",
    "destination_workload",
    "destination_app",
    "traffic_direction",
)
#: Option keys (lower case) every handler understands.
CONTEXT_KEYS = (
    "sourcecontext",
    "sourceingresscontext",
    "sourceegresscontext",
    "destinationcontext",
    "destinationingresscontext",
    "destinationegresscontext",
    "labelscontext",
)

KUBE_APISERVER_LABEL = "reserved:kube-apiserver"
_RESERVED_PREFIX = "reserved:"
_APP_PREFIXES = ("k8s:app.kubernetes.io/name=", "k8s:k8s-app=", "k8s:app=")
# A generated pod name: a base, then one or two "-suffix" parts of [a-z0-9] (a Deployment's
# pod "web-7d9f8b-x2x4z" -> "web"); the base keeps at least one character.
_POD_SUFFIXES = re.compile(r"^(?P<base>.+?)(?:-[a-z0-9]+){1,2}$")


class MetricsConfigError(ValueError):
    """``--hubble-metrics`` is malformed: unknown handler, unknown option, bad value.

    The message names the handler and the offending text, e.g.
    ``drop: sourceContext: unknown context 'pods' (one of identity, namespace, ...)``.
    """


@dataclass(frozen=True, slots=True)
class HandlerSpec:
    """One handler of ``--hubble-metrics``.

    Attributes:
        name: the handler (one of :data:`HANDLER_NAMES`).
        options: option key (as written) → value ("" when written without ``=``), in the
            order given.
    """

    name: str
    options: tuple[tuple[str, str], ...] = ()


def _split_handlers(text: str) -> list[str]:
    items: list[str] = []
    for token in text.split():
        pieces = token.split(",")
        current = pieces[0]
        for piece in pieces[1:]:
            if "=" in current and ":" not in piece and piece not in HANDLER_NAMES:
                current += "," + piece  # a comma inside a value list
            else:
                items.append(current)
                current = piece
        items.append(current)
    return items


def parse_metrics(text: str) -> list[HandlerSpec]:
    """Parse ``--hubble-metrics`` into handler specs and check every name and option.

    ``"drop:sourceContext=pod;destinationContext=pod tcp"`` →
    ``[HandlerSpec("drop", (("sourceContext", "pod"), ("destinationContext", "pod"))),
    HandlerSpec("tcp")]``; ``""`` → ``[]``.

    Raises:
        MetricsConfigError: an empty or unknown handler name, a handler given twice, an
            option the handler does not take, or a bad option value.
    """
    specs: list[HandlerSpec] = []
    seen: set[str] = set()
    for item in _split_handlers(text):
        name, _, rest = item.partition(":")
        if not name:
            raise MetricsConfigError(f"{item!r}: empty handler name")
        if name in UPSTREAM_ONLY:
            raise MetricsConfigError(
                f"handler {name!r} exists upstream but not in this agent (implemented: "
                f"{', '.join(HANDLER_NAMES)})"
            )
        if name not in HANDLER_NAMES:
            raise MetricsConfigError(
                f"unknown handler {name!r} (one of {', '.join(HANDLER_NAMES)})"
            )
        if name in seen:
            raise MetricsConfigError(f"handler {name!r} is given twice")
        seen.add(name)
        options: list[tuple[str, str]] = []
        for option in rest.split(";"):
            if option:
                key, _, value = option.partition("=")
                options.append((key, value))
        spec = HandlerSpec(name, tuple(options))
        extra = _EXTRA_KEYS.get(name, ())
        for key, value in spec.options:
            low = key.lower()
            if low in extra:
                if value:
                    raise MetricsConfigError(f"{name}: option {key!r} takes no value")
            elif low not in CONTEXT_KEYS:
                known = ", ".join((*_CONTEXT_KEY_NAMES, *extra))
                raise MetricsConfigError(f"{name}: unknown option {key!r} (one of {known})")
        try:
            ContextOptions.parse(spec.options)
        except MetricsConfigError as exc:
            raise MetricsConfigError(f"{name}: {exc}") from None
        specs.append(spec)
    return specs


_CONTEXT_KEY_NAMES = (
    "sourceContext",
    "sourceIngressContext",
    "sourceEgressContext",
    "destinationContext",
    "destinationIngressContext",
    "destinationEgressContext",
    "labelsContext",
)
#: Flag-like options (no value) of handlers beyond the context keys.
_EXTRA_KEYS: Mapping[str, tuple[str, ...]] = {"flows-to-world": ("any-drop", "port", "syn-only")}


def _parse_context(key: str, value: str) -> tuple[str, ...]:
    out = []
    for ident in value.split("|"):
        low = ident.lower()
        if low not in CONTEXT_IDENTIFIERS:
            raise MetricsConfigError(
                f"{key}: unknown context {ident!r} (one of {', '.join(CONTEXT_IDENTIFIERS)})"
            )
        out.append(low)
    return tuple(out)


# -- label values ---------------------------------------------------------------------------

Extractor = Callable[[flow_pb2.Flow], str]


def _shorten_pod(name: str) -> str:
    m = _POD_SUFFIXES.match(name)
    return m.group("base") if m else name


def _reserved_label(labels: list[str]) -> str:
    if KUBE_APISERVER_LABEL in labels:
        return KUBE_APISERVER_LABEL
    return next((lbl for lbl in labels if lbl.startswith(_RESERVED_PREFIX)), "")


def app_from_labels(labels: list[str]) -> str:
    """The app name of an endpoint: the value of its first label that is
    ``k8s:app.kubernetes.io/name=V``, ``k8s:k8s-app=V`` or ``k8s:app=V`` with V non-empty;
    "" when none (upstream ``getK8sAppFromLabels``)."""
    for label in labels:
        for prefix in _APP_PREFIXES:
            if label.startswith(prefix) and len(label) > len(prefix):
                return label[len(prefix) :]
    return ""


def _endpoint_value(ident: str, source: bool) -> Extractor:
    """The extractor of one context identifier for the source (or destination) side."""

    def ep(flow: flow_pb2.Flow) -> flow_pb2.Endpoint:
        return flow.source if source else flow.destination

    if ident == "namespace":
        return lambda f: ep(f).namespace
    if ident == "identity":
        return lambda f: ",".join(ep(f).labels)
    if ident == "pod":

        def pod(f: flow_pb2.Flow) -> str:
            e = ep(f)
            return f"{e.namespace}/{e.pod_name}" if e.namespace else e.pod_name

        return pod
    if ident == "pod-short":

        def pod_short(f: flow_pb2.Flow) -> str:
            e = ep(f)
            short = _shorten_pod(e.pod_name)
            return f"{e.namespace}/{short}" if e.namespace else short

        return pod_short
    if ident == "pod-name":
        return lambda f: ep(f).pod_name
    if ident == "dns":
        if source:
            return lambda f: ",".join(f.source_names)
        return lambda f: ",".join(f.destination_names)
    if ident == "ip":
        if source:
            return lambda f: f.IP.source
        return lambda f: f.IP.destination
    if ident == "reserved-identity":
        return lambda f: _reserved_label(list(ep(f).labels))
    if ident == "workload-name":

        def workload(f: flow_pb2.Flow) -> str:
            w = ep(f).workloads
            return w[0].name if w else ""

        return workload
    if ident == "app":
        return lambda f: app_from_labels(list(ep(f).labels))
    raise MetricsConfigError(f"unknown context {ident!r}")  # parse_metrics stops it earlier


def _first_non_empty(extractors: tuple[Extractor, ...]) -> Extractor:
    if len(extractors) == 1:
        return extractors[0]

    def first(flow: flow_pb2.Flow) -> str:
        value = ""
        for extract in extractors:
            value = extract(flow)
            if value:
                break
        return value

    return first


def _traffic_direction(flow: flow_pb2.Flow) -> str:
    direction = flow.traffic_direction
    if direction == flow_pb2.INGRESS:
        return "ingress"
    if direction == flow_pb2.EGRESS:
        return "egress"
    return "unknown"


_LABEL_EXTRACTORS: Mapping[str, Extractor] = {
    "source_ip": lambda f: f.IP.source,
    "source_pod": lambda f: f.source.pod_name,
    "source_namespace": lambda f: f.source.namespace,
    "source_workload": _endpoint_value("workload-name", True),
    "source_app": _endpoint_value("app", True),
    "destination_ip": lambda f: f.IP.destination,
    "destination_pod": lambda f: f.destination.pod_name,
    "destination_namespace": lambda f: f.destination.namespace,
    "destination_workload": _endpoint_value("workload-name", False),
    "destination_app": _endpoint_value("app", False),
    "traffic_direction": _traffic_direction,
}


def _side(
    plain: tuple[str, ...], ingress: tuple[str, ...], egress: tuple[str, ...], source: bool
) -> Extractor:
    default = _first_non_empty(tuple(_endpoint_value(i, source) for i in plain))
    if not ingress and not egress:
        return default
    on_ingress = _first_non_empty(tuple(_endpoint_value(i, source) for i in ingress))
    on_egress = _first_non_empty(tuple(_endpoint_value(i, source) for i in egress))

    def by_direction(flow: flow_pb2.Flow) -> str:
        direction = flow.traffic_direction
        if ingress and direction == flow_pb2.INGRESS:
            return on_ingress(flow)
        if egress and direction == flow_pb2.EGRESS:
            return on_egress(flow)
        return default(flow)

    return by_direction


@dataclass(frozen=True)
class ContextOptions:
    """A handler's context options (module docstring), parsed.

    Attributes:
        source, source_ingress, source_egress, destination, destination_ingress,
            destination_egress: context identifiers, in fallback order.
        labels: ``labelsContext`` labels, in :data:`CONTEXT_LABELS` order.
    """

    source: tuple[str, ...] = ()
    source_ingress: tuple[str, ...] = ()
    source_egress: tuple[str, ...] = ()
    destination: tuple[str, ...] = ()
    destination_ingress: tuple[str, ...] = ()
    destination_egress: tuple[str, ...] = ()
    labels: tuple[str, ...] = ()

    @classmethod
    def parse(cls, options: tuple[tuple[str, str], ...]) -> ContextOptions:
        """The context part of a handler's options (other keys are ignored here).

        Raises:
            MetricsConfigError: an unknown identifier or ``labelsContext`` label.
        """
        values: dict[str, tuple[str, ...]] = {}
        for key, value in options:
            low = key.lower()
            if low == "labelscontext":
                wanted = value.split(",")
                bad = [w for w in wanted if w not in CONTEXT_LABELS]
                if bad:
                    raise MetricsConfigError(
                        f"{key}: invalid label {bad[0]!r} (one of {', '.join(CONTEXT_LABELS)})"
                    )
                values["labels"] = tuple(lbl for lbl in CONTEXT_LABELS if lbl in wanted)
            elif low in CONTEXT_KEYS:
                field = {
                    "sourcecontext": "source",
                    "sourceingresscontext": "source_ingress",
                    "sourceegresscontext": "source_egress",
                    "destinationcontext": "destination",
                    "destinationingresscontext": "destination_ingress",
                    "destinationegresscontext": "destination_egress",
                }[low]
                values[field] = _parse_context(key, value)
        return cls(**values)

    def label_names(self) -> tuple[str, ...]:
        """Label names this context adds, in order (``labels``…, ``source``, ``destination``)."""
        names = list(self.labels)
        if self.source:
            names.append("source")
        if self.destination:
            names.append("destination")
        return tuple(names)

    def extractor(self) -> Callable[[flow_pb2.Flow], tuple[str, ...]]:
        """A function giving a flow's context label values, in :meth:`label_names` order."""
        parts: list[Extractor] = [_LABEL_EXTRACTORS[lbl] for lbl in self.labels]
        if self.source:
            parts.append(_side(self.source, self.source_ingress, self.source_egress, True))
        if self.destination:
            parts.append(
                _side(self.destination, self.destination_ingress, self.destination_egress, False)
            )
        if not parts:
            return lambda _flow: ()
        if len(parts) == 1:
            only = parts[0]
            return lambda flow: (only(flow),)
        frozen = tuple(parts)
        return lambda flow: tuple(part(flow) for part in frozen)
