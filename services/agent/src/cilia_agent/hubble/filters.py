"""``flow.FlowFilter`` matching with upstream Hubble semantics.

- A request's result is whitelist minus blacklist: a flow passes when the whitelist
  is empty or any whitelist filter matches, and no blacklist filter matches.
- Filters in a list are ORed; the fields set inside one filter are ANDed; the
  values inside one repeated field are ORed.
- An empty filter (no field set) matches every flow.
- Lost events are never filtered (the observer does not pass them here).

Supported fields (every field of Cilia's ``flow.FlowFilter``): source/destination_ip
(address or CIDR), source/destination_pod (``ns/name-prefix``, ``ns/``, or
``name-prefix`` meaning namespace ``default``), verdict, event_type, source/
destination_label (Kubernetes label selectors with Cilium source prefixes),
protocol, source/destination_port, reply, source/destination_identity, tcp_flags,
node_name (``[cluster/]node`` patterns with ``*``), ip_version, traffic_direction.
An upstream field Cilia does not implement (fqdn, http, service, workload, uuid …)
arrives as an unknown protobuf field and is refused with :class:`InvalidFilter`,
never silently ignored.

Upstream: ``pkg/hubble/filters/*.go`` (behaviour re-implemented, not copied).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from google.protobuf import unknown_fields

from cilia.hubble.flow import flow_pb2
from cilia_agent.hubble.errors import InvalidFilter

FlowPredicate = Callable[[flow_pb2.Flow], bool]

DEFAULT_NAMESPACE = "default"
DEFAULT_CLUSTER = "default"

# Upstream FlowFilter fields Cilia's proto does not declare (for error messages).
_UPSTREAM_ONLY_FIELDS = {
    7: "source_fqdn",
    8: "destination_fqdn",
    9: "http_status_code",
    16: "source_service",
    17: "destination_service",
    18: "dns_query",
    21: "http_method",
    22: "http_path",
    26: "source_workload",
    27: "destination_workload",
    28: "trace_id",
    29: "uuid",
}


# -- individual field predicates ----------------------------------------------


def _ip_filter(values: Sequence[str], side: str) -> FlowPredicate:
    addresses: set[ipaddress.IPv4Address | ipaddress.IPv6Address] = set()
    networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
    for value in values:
        try:
            if "/" in value:
                networks.append(ipaddress.ip_network(value, strict=False))
            else:
                addresses.add(ipaddress.ip_address(value))
        except ValueError:
            raise InvalidFilter(f"{side}_ip: invalid IP address or CIDR {value!r}") from None

    def match(flow: flow_pb2.Flow) -> bool:
        text = getattr(flow.IP, side)
        if not text:
            return False
        try:
            addr = ipaddress.ip_address(text)
        except ValueError:
            return False
        return addr in addresses or any(addr in net for net in networks)

    return match


def parse_namespaced_name(value: str) -> tuple[str, str]:
    """``"ns/name"`` → (ns, name); ``"name"`` → ("default", name); ``""`` → ("", "").

    Upstream: ``pkg/hubble/k8s.ParseNamespaceName``.
    """
    parts = value.split("/")
    if len(parts) > 1:
        return parts[0], parts[1]
    if not parts[0]:
        return "", ""
    return DEFAULT_NAMESPACE, parts[0]


def _pod_filter(values: Sequence[str], side: str) -> FlowPredicate:
    wanted: list[tuple[str, str]] = []
    for value in values:
        namespace, prefix = parse_namespaced_name(value)
        if not namespace and not prefix:
            raise InvalidFilter(
                f"{side}_pod: invalid filter, must be [namespace/][<name>], got {value!r}"
            )
        wanted.append((namespace, prefix))

    def match(flow: flow_pb2.Flow) -> bool:
        ep = getattr(flow, side)
        if not ep.namespace and not ep.pod_name:
            return False
        return any(ns == ep.namespace and ep.pod_name.startswith(prefix) for ns, prefix in wanted)

    return match


def _event_type_filter(values: Sequence[flow_pb2.EventTypeFilter]) -> FlowPredicate:
    wanted = [(v.type, v.match_sub_type, v.sub_type) for v in values]

    def match(flow: flow_pb2.Flow) -> bool:
        if not flow.HasField("event_type"):
            return False
        et = flow.event_type
        for type_, match_sub, sub in wanted:
            if type_ != 0 and et.type != type_:
                continue
            if match_sub and et.sub_type != sub:
                continue
            return True
        return False

    return match


_L4_PROTOCOLS = {"icmp", "icmpv4", "icmpv6", "tcp", "udp", "sctp"}
_L7_PROTOCOLS = {"dns", "http", "kafka"}


def _protocol_filter(values: Sequence[str]) -> FlowPredicate:
    wanted: set[str] = set()
    for value in values:
        proto = value.lower()
        if proto in _L4_PROTOCOLS:
            wanted.add(proto)
        elif proto in _L7_PROTOCOLS:
            pass  # valid upstream; Cilia has no L7 flows, so these never match
        else:
            raise InvalidFilter(f"protocol: unknown protocol {value!r}")

    def match(flow: flow_pb2.Flow) -> bool:
        kind = flow.l4.WhichOneof("protocol")
        if kind is None:
            return False
        if kind == "ICMPv4":
            return bool(wanted & {"icmp", "icmpv4"})
        return kind.lower() in wanted

    return match


def _port_filter(values: Sequence[str], side: str) -> FlowPredicate:
    ports: set[int] = set()
    for value in values:
        if not value.isdigit() or int(value) > 65535:
            raise InvalidFilter(f"{side}_port: invalid port {value!r}")
        ports.add(int(value))
    field = f"{side}_port"

    def match(flow: flow_pb2.Flow) -> bool:
        kind = flow.l4.WhichOneof("protocol")
        if kind not in ("TCP", "UDP"):
            return False
        return int(getattr(getattr(flow.l4, kind), field)) in ports

    return match


def _reply_filter(values: Sequence[bool]) -> FlowPredicate:
    wanted = set(values)

    def match(flow: flow_pb2.Flow) -> bool:
        return flow.HasField("is_reply") and flow.is_reply.value in wanted

    return match


def _identity_filter(values: Sequence[int], side: str) -> FlowPredicate:
    wanted = set(values)
    return lambda flow: int(getattr(flow, side).identity) in wanted


_TCP_FLAG_NAMES = ("FIN", "SYN", "RST", "PSH", "ACK", "URG", "ECE", "CWR", "NS")


def _tcp_flags_filter(values: Sequence[flow_pb2.TCPFlags]) -> FlowPredicate:
    wanted = [tuple(name for name in _TCP_FLAG_NAMES if getattr(f, name)) for f in values]

    def match(flow: flow_pb2.Flow) -> bool:
        if flow.l4.WhichOneof("protocol") != "TCP" or not flow.l4.TCP.HasField("flags"):
            return False
        flags = flow.l4.TCP.flags
        return any(all(getattr(flags, name) for name in names) for names in wanted)

    return match


_FQDN_CHARS = re.compile(r"[-0-9_a-z.*]*")
_FQDN_ANY = r"(?:[-0-9_a-z]+(?:\.[-0-9_a-z]+)*)"


def _fqdn_pattern(pattern: str) -> str:
    pattern = pattern.strip().removesuffix(".").lower()
    if not pattern:
        raise InvalidFilter("node_name: empty pattern")
    if pattern.endswith("."):
        raise InvalidFilter("node_name: multiple trailing dots in pattern")
    if not _FQDN_CHARS.fullmatch(pattern):
        raise InvalidFilter(f"node_name: invalid character in pattern {pattern!r}")
    return "".join(r"[-.0-9a-z]*" if c == "*" else re.escape(c) for c in pattern)


def _node_name_filter(values: Sequence[str]) -> FlowPredicate:
    parts: list[str] = []
    for value in values:
        if not value:
            raise InvalidFilter("node_name: empty pattern")
        elems = value.split("/")
        if len(elems) > 2:
            raise InvalidFilter(f"node_name: too many slashes in pattern {value!r}")
        cluster, node = ("", elems[0]) if len(elems) == 1 else (elems[0], elems[1])
        parts.append(
            (_fqdn_pattern(cluster) if cluster else _FQDN_ANY)
            + "/"
            + (_fqdn_pattern(node) if node else _FQDN_ANY)
        )
    regex = re.compile(r"\A(?:" + "|".join(parts) + r")\Z")

    def match(flow: flow_pb2.Flow) -> bool:
        name = flow.node_name
        if not name:
            return False
        if "/" not in name:
            name = f"{DEFAULT_CLUSTER}/{name}"
        return regex.match(name) is not None

    return match


def _enum_filter(values: Iterable[int], getter: Callable[[flow_pb2.Flow], int]) -> FlowPredicate:
    wanted = set(values)
    return lambda flow: getter(flow) in wanted


# -- label selectors ------------------------------------------------------------

_KEY = r"[A-Za-z0-9_./:-]+"
_VALUE = r"[A-Za-z0-9_.-]*"
_RE_EXISTS = re.compile(rf"\s*(!?)\s*({_KEY})\s*")
_RE_EQUALS = re.compile(rf"\s*({_KEY})\s*(==|=|!=)\s*({_VALUE})\s*")
_RE_SET = re.compile(rf"\s*({_KEY})\s+(in|notin)\s*\(([^()]*)\)\s*")
_RE_CMP = re.compile(rf"\s*({_KEY})\s*(<|>)\s*(-?\d+)\s*")
_RE_SET_VALUE = re.compile(_VALUE)


@dataclass(frozen=True, slots=True)
class _LabelKey:
    source: str  # "any" = any source
    key: str


def _label_key(text: str) -> _LabelKey:
    source, sep, key = text.partition(":")
    if not sep:
        return _LabelKey("any", text)
    if not source or not key:
        raise InvalidFilter(f"label: invalid key {text!r}")
    return _LabelKey(source, key)


Labels = list[tuple[str, str, str]]  # (source, key, value)


def parse_labels(labels: Iterable[str]) -> Labels:
    """ "source:key=value" strings → (source, key, value); no source → "unspec"."""
    out: Labels = []
    for label in labels:
        name, _, value = label.partition("=")
        source, sep, key = name.partition(":")
        if not sep:
            source, key = "unspec", name
        out.append((source, key, value))
    return out


def _values_of(labels: Labels, k: _LabelKey) -> list[str]:
    return [v for s, key, v in labels if key == k.key and (k.source in ("any", s))]


Requirement = Callable[[Labels], bool]


def _requirement(text: str) -> Requirement:
    if m := _RE_SET.fullmatch(text):
        key = _label_key(m.group(1))
        items = [v.strip() for v in m.group(3).split(",")] if m.group(3).strip() else []
        if not all(_RE_SET_VALUE.fullmatch(v) for v in items):
            raise InvalidFilter(f"label: invalid value list in {text.strip()!r}")
        values = set(items)
        if m.group(2) == "in":
            return lambda labels: any(v in values for v in _values_of(labels, key))
        return lambda labels: not any(v in values for v in _values_of(labels, key))
    if m := _RE_EQUALS.fullmatch(text):
        key, op, value = _label_key(m.group(1)), m.group(2), m.group(3)
        if op == "!=":
            return lambda labels: value not in _values_of(labels, key)
        return lambda labels: value in _values_of(labels, key)
    if m := _RE_CMP.fullmatch(text):
        key, op, bound = _label_key(m.group(1)), m.group(2), int(m.group(3))

        def compare(labels: Labels) -> bool:
            for v in _values_of(labels, key):
                try:
                    number = int(v)
                except ValueError:
                    continue
                if (number > bound) if op == ">" else (number < bound):
                    return True
            return False

        return compare
    if m := _RE_EXISTS.fullmatch(text):
        key = _label_key(m.group(2))
        if m.group(1):
            return lambda labels: not _values_of(labels, key)
        return lambda labels: bool(_values_of(labels, key))
    raise InvalidFilter(f"label: cannot parse selector requirement {text.strip()!r}")


def _split_top_level(selector: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, c in enumerate(selector):
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth < 0:
                raise InvalidFilter(f"label: unbalanced parenthesis in {selector!r}")
        elif c == "," and depth == 0:
            parts.append(selector[start:i])
            start = i + 1
    if depth:
        raise InvalidFilter(f"label: unbalanced parenthesis in {selector!r}")
    parts.append(selector[start:])
    return parts


def compile_label_selector(selector: str) -> Callable[[Labels], bool]:
    """Compile a Kubernetes label selector with Cilium source prefixes.

    Requirements are comma-separated and ANDed: ``key``, ``!key``, ``key=value``,
    ``key==value``, ``key!=value``, ``key in (a,b)``, ``key notin (a,b)``,
    ``key>N``, ``key<N``. A key may carry a source (``k8s:app``,
    ``reserved:world``); without one it matches labels of any source.

    Raises:
        InvalidFilter: the selector does not parse.
    """
    if not selector.strip():
        raise InvalidFilter("label: empty selector")
    requirements = [_requirement(part) for part in _split_top_level(selector)]
    return lambda labels: all(req(labels) for req in requirements)


def _label_filter(values: Sequence[str], side: str) -> FlowPredicate:
    selectors = [compile_label_selector(v) for v in values]

    def match(flow: flow_pb2.Flow) -> bool:
        labels = parse_labels(getattr(flow, side).labels)
        return any(sel(labels) for sel in selectors)

    return match


# -- filters and filter sets ----------------------------------------------------


def _unknown_field_numbers(ff: flow_pb2.FlowFilter) -> list[int]:
    fields = unknown_fields.UnknownFieldSet(ff)
    numbers = sorted({fields[i].field_number for i in range(len(fields))})
    for sub in ff.event_type:
        if len(unknown_fields.UnknownFieldSet(sub)):
            numbers.append(6)
    return numbers


def compile_filter(ff: flow_pb2.FlowFilter) -> FlowPredicate:
    """Compile one FlowFilter into a predicate (fields ANDed, values ORed).

    Raises:
        InvalidFilter: a value is malformed, or the filter sets a field Cilia does not
            implement (upstream-only fields reach us as unknown protobuf fields).
    """
    unknown = _unknown_field_numbers(ff)
    if unknown:
        names = ", ".join(f"{n} ({_UPSTREAM_ONLY_FIELDS.get(n, 'unknown')})" for n in unknown)
        raise InvalidFilter(f"unsupported FlowFilter field(s): {names}")
    preds: list[FlowPredicate] = []
    if ff.source_ip:
        preds.append(_ip_filter(ff.source_ip, "source"))
    if ff.destination_ip:
        preds.append(_ip_filter(ff.destination_ip, "destination"))
    if ff.source_pod:
        preds.append(_pod_filter(ff.source_pod, "source"))
    if ff.destination_pod:
        preds.append(_pod_filter(ff.destination_pod, "destination"))
    if ff.verdict:
        preds.append(_enum_filter(ff.verdict, lambda f: int(f.verdict)))
    if ff.event_type:
        preds.append(_event_type_filter(ff.event_type))
    if ff.source_label:
        preds.append(_label_filter(ff.source_label, "source"))
    if ff.destination_label:
        preds.append(_label_filter(ff.destination_label, "destination"))
    if ff.protocol:
        preds.append(_protocol_filter(ff.protocol))
    if ff.source_port:
        preds.append(_port_filter(ff.source_port, "source"))
    if ff.destination_port:
        preds.append(_port_filter(ff.destination_port, "destination"))
    if ff.reply:
        preds.append(_reply_filter(ff.reply))
    if ff.source_identity:
        preds.append(_identity_filter(ff.source_identity, "source"))
    if ff.destination_identity:
        preds.append(_identity_filter(ff.destination_identity, "destination"))
    if ff.tcp_flags:
        preds.append(_tcp_flags_filter(ff.tcp_flags))
    if ff.node_name:
        preds.append(_node_name_filter(ff.node_name))
    if ff.ip_version:
        preds.append(_enum_filter(ff.ip_version, lambda f: int(f.IP.ipVersion)))
    if ff.traffic_direction:
        preds.append(_enum_filter(ff.traffic_direction, lambda f: int(f.traffic_direction)))
    if not preds:
        return lambda flow: True
    if len(preds) == 1:
        return preds[0]
    return lambda flow: all(p(flow) for p in preds)


class FilterSet:
    """Whitelist/blacklist pair of a GetFlows request.

    Args:
        whitelist: filters of which at least one must match (empty = all flows).
        blacklist: filters of which none may match.

    Raises:
        InvalidFilter: any filter is invalid (see :func:`compile_filter`).
    """

    def __init__(
        self,
        whitelist: Iterable[flow_pb2.FlowFilter] = (),
        blacklist: Iterable[flow_pb2.FlowFilter] = (),
    ) -> None:
        whitelist, blacklist = list(whitelist), list(blacklist)
        self._whitelist = [compile_filter(f) for f in whitelist]
        self._blacklist = [compile_filter(f) for f in blacklist]
        self.empty = not self._whitelist and not self._blacklist
        """True when every flow passes (no filter at all)."""
        self.reads_ports = any(f.source_port or f.destination_port for f in whitelist + blacklist)
        """True when a filter reads the L4 ports: the only fields a flow does not share with
        the other flows of its shape (the time and uuid are never filtered on here)."""

    def matches(self, flow: flow_pb2.Flow) -> bool:
        """True when the flow is in the whitelist (or it is empty) and not in the blacklist."""
        if self._whitelist and not any(p(flow) for p in self._whitelist):
            return False
        return not any(p(flow) for p in self._blacklist)
