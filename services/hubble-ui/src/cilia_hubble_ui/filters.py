"""Page filters (the URL's query) → the ``flow.FlowFilter`` whitelist sent to the relay.

The filters are those of ``hubble observe`` and are combined the same way: Hubble keeps two
filters, *left* and *right*, and asks for ``left OR right``.

* either-side filters (``namespace``, ``pod``, ``label``, ``port``) add the source field to
  *left* and the destination field to *right*;
* one-sided or symmetric filters (``from-pod``, ``to-pod``, ``from-label``, ``to-label``,
  ``verdict``, ``protocol``) add the same field to both;
* when *left* equals *right* one filter is sent.

``namespace=NS`` is a pod prefix ``NS/`` (every pod of the namespace); with a ``pod`` given,
a pod name without a namespace is taken in that namespace instead. Repeating a parameter
ORs its values (``verdict=DROPPED&verdict=ERROR``); empty values are ignored (what an empty
form field sends). ``pod`` cannot be combined with ``from-pod``/``to-pod``, nor ``label``
with ``from-label``/``to-label`` (hubble's conflict groups).

Every value is validated here, so a malformed URL is refused with a clear message before
the relay is asked (HTTP 400 at the boundary); what the relay still refuses comes back as
its ``INVALID_ARGUMENT`` message.

Source: hubble ``cmd/observe`` filter flags and their left/right combination (behaviour
re-implemented).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from cilia.hubble.flow import flow_pb2

FILTER_NAMES = (
    "namespace",
    "pod",
    "from-pod",
    "to-pod",
    "label",
    "from-label",
    "to-label",
    "verdict",
    "port",
    "protocol",
)
"""Query parameters the page and its API take, in hubble's spelling."""

CONFLICTS: tuple[tuple[str, str], ...] = (
    ("pod", "from-pod"),
    ("pod", "to-pod"),
    ("label", "from-label"),
    ("label", "to-label"),
)

PROTOCOLS = ("tcp", "udp", "icmp", "icmpv4", "icmpv6", "sctp", "http", "dns", "kafka")
"""Protocol names Hubble's server-side filter understands (case-insensitive)."""

VERDICTS = tuple(n for n in flow_pb2.Verdict.keys() if n != "VERDICT_UNKNOWN")  # noqa: SIM118

MAX_VALUES = 16
"""Values of one parameter at most (a URL is not a way to send the relay a huge filter)."""
MAX_VALUE_LENGTH = 253
"""Characters of one value at most (a DNS name's limit; namespaces and pods are shorter)."""

_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
# A Kubernetes label selector with Cilium's optional source prefix (k8s:, reserved:, ...):
# requirements `key`, `!key`, `key=v`, `key==v`, `key!=v`, `key in (a,b)`, `key notin (a)`.
_KEY = r"(?:[A-Za-z0-9_-]+:)?[A-Za-z0-9](?:[A-Za-z0-9_./-]*[A-Za-z0-9])?"
_VALUE = r"(?:[A-Za-z0-9](?:[A-Za-z0-9_.-]*[A-Za-z0-9])?)?"
_REQUIREMENT = (
    rf"(?:!\s*{_KEY}|{_KEY}\s*(?:==?|!=)\s*{_VALUE}"
    rf"|{_KEY}\s+(?:in|notin)\s*\(\s*{_VALUE}(?:\s*,\s*{_VALUE})*\s*\)|{_KEY})"
)
_SELECTOR = re.compile(rf"\s*{_REQUIREMENT}(?:\s*,\s*{_REQUIREMENT})*\s*")


class FilterError(ValueError):
    """A filter parameter is unknown, malformed or conflicts with another (message names
    the parameter and the value)."""


@dataclass(frozen=True)
class PageFilter:
    """The validated filters of one page.

    Attributes:
        params: parameter → normalised values, in :data:`FILTER_NAMES` order (only those
            given); what the page shows in its form.
        whitelist: the ``GetFlowsRequest.whitelist`` (``[]``: every flow).
    """

    params: dict[str, tuple[str, ...]]
    whitelist: tuple[flow_pb2.FlowFilter, ...]

    def query(self) -> list[tuple[str, str]]:
        """``params`` flattened to query pairs."""
        return [(name, value) for name, values in self.params.items() for value in values]


def _validate(name: str, value: str) -> str:
    if len(value) > MAX_VALUE_LENGTH:
        raise FilterError(f"{name}: value longer than {MAX_VALUE_LENGTH} characters")
    if value.strip() != value:
        raise FilterError(f"{name}: {value!r} has leading or trailing blanks")
    if name == "verdict":
        upper = value.upper()
        if upper not in VERDICTS:
            raise FilterError(f"verdict: {value!r} is not one of {', '.join(VERDICTS)}")
        return upper
    if name == "port":
        if not value.isdigit() or int(value) > 65535:
            raise FilterError(f"port: {value!r} is not a number 0-65535")
        return str(int(value))
    if name == "protocol":
        if value.lower() not in PROTOCOLS:
            raise FilterError(f"protocol: {value!r} is not one of {', '.join(PROTOCOLS)}")
        return value.lower()
    if name == "namespace":
        if not _NAME.fullmatch(value):
            raise FilterError(f"namespace: {value!r} is not a Kubernetes namespace name")
        return value
    if name in ("pod", "from-pod", "to-pod"):
        parts = value.split("/")
        if len(parts) > 2 or not all(_NAME.fullmatch(p) for p in parts if p) or not parts[-1]:
            raise FilterError(f"{name}: {value!r} is not [namespace/]pod-name")
        return value
    if not _SELECTOR.fullmatch(value):  # label, from-label, to-label
        raise FilterError(
            f"{name}: {value!r} is not a label selector (key=value, [source:]key, "
            "key!=value, key in (a,b), !key; comma-separated)"
        )
    return value


def parse_filters(pairs: Iterable[tuple[str, str]]) -> PageFilter:
    """Validate query pairs (URL order) and build the relay's whitelist.

    Args:
        pairs: e.g. ``[("namespace", "shop"), ("verdict", "dropped")]``; names from
            :data:`FILTER_NAMES`, empty values ignored.

    Returns:
        the :class:`PageFilter`.

    Raises:
        FilterError: an unknown parameter, a malformed value, more than
            :data:`MAX_VALUES` values of one parameter, or conflicting parameters.
    """
    given: dict[str, list[str]] = {}
    for name, raw in pairs:
        if name not in FILTER_NAMES:
            raise FilterError(f"unknown filter {name!r} (one of {', '.join(FILTER_NAMES)})")
        if raw == "":
            continue
        values = given.setdefault(name, [])
        value = _validate(name, raw)
        if value not in values:
            values.append(value)
        if len(values) > MAX_VALUES:
            raise FilterError(f"{name}: more than {MAX_VALUES} values")
    for a, b in CONFLICTS:
        if a in given and b in given:
            raise FilterError(f"filters {a!r} and {b!r} cannot be combined")
    params = {name: tuple(given[name]) for name in FILTER_NAMES if name in given}
    return PageFilter(params=params, whitelist=tuple(_whitelist(params)))


def _in_namespace(pod: str, namespaces: tuple[str, ...]) -> list[str]:
    if "/" in pod or not namespaces:
        return [pod]
    return [f"{ns}/{pod}" for ns in namespaces]


def _whitelist(params: dict[str, tuple[str, ...]]) -> list[flow_pb2.FlowFilter]:
    if not params:
        return []
    left, right = flow_pb2.FlowFilter(), flow_pb2.FlowFilter()
    namespaces = params.get("namespace", ())
    pods = [p for v in params.get("pod", ()) for p in _in_namespace(v, namespaces)]
    if pods:
        left.source_pod.extend(pods)
        right.destination_pod.extend(pods)
    elif namespaces and not ("from-pod" in params or "to-pod" in params):
        left.source_pod.extend(f"{ns}/" for ns in namespaces)
        right.destination_pod.extend(f"{ns}/" for ns in namespaces)
    left.source_label.extend(params.get("label", ()))
    right.destination_label.extend(params.get("label", ()))
    left.source_port.extend(params.get("port", ()))
    right.destination_port.extend(params.get("port", ()))
    for side in (left, right):
        side.source_pod.extend(
            p for v in params.get("from-pod", ()) for p in _in_namespace(v, namespaces)
        )
        side.destination_pod.extend(
            p for v in params.get("to-pod", ()) for p in _in_namespace(v, namespaces)
        )
        side.source_label.extend(params.get("from-label", ()))
        side.destination_label.extend(params.get("to-label", ()))
        side.verdict.extend(
            flow_pb2.Verdict.Value(v)  # type: ignore[misc]
            for v in params.get("verdict", ())
        )
        side.protocol.extend(params.get("protocol", ()))
    if left == right:
        return [left]
    return [left, right]
