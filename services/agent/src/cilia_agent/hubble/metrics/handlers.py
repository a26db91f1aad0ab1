"""The Hubble metric handlers: each turns decoded flows into one ``hubble_*`` counter.

What each counts and its labels (upstream ``pkg/hubble/metrics/<handler>/handler.go``; the
handler's context labels, :mod:`.api`, come after these unless said otherwise):

``flow`` → ``hubble_flows_processed_total{protocol,type,subtype,verdict}``
    every flow. ``protocol`` as :func:`flow_protocol`; ``type`` "Drop", "Trace",
    "PolicyVerdict", "Capture", "L7" or "Unknown"; ``subtype`` the trace observation point
    ("to-endpoint", "from-endpoint", …; "" for drops), for "Unknown" the event type number;
    ``verdict`` the ``flow.Verdict`` name.
``drop`` → ``hubble_drop_total{reason,protocol}`` (context labels FIRST)
    flows with verdict DROPPED; ``reason`` the ``flow.DropReason`` name (``POLICY_DENIED``,
    ``POLICY_DENY``; the number for a reason without a name).
``tcp`` → ``hubble_tcp_flags_total{flag,family}``
    FORWARDED or REDIRECTED TCP flows with flags and an IP header: one count for each of
    FIN, SYN (without ACK), SYN-ACK and RST the packet carries; ``family`` the
    ``flow.IPVersion`` name ("IPv4").
``port-distribution`` → ``hubble_port_distribution_total{protocol,port}``
    FORWARDED or REDIRECTED flows known not to be replies (``is_reply`` set and false):
    ``protocol`` TCP/UDP/SCTP with the destination port, or ICMPv4/ICMPv6 with port "0".
``icmp`` → ``hubble_icmp_total{family,type}``
    every ICMP flow, any verdict: ``family`` "IPv4"/"IPv6" (upstream writes "IPv4" for
    ICMPv6 too, a slip not copied; this agent's flows carry no ICMPv6 yet), ``type`` the
    message name as
    gopacket spells it ("EchoRequest", "EchoReply", "DestinationUnreachable(Port)";
    unknown type "T(C)").
``flows-to-world`` → ``hubble_flows_to_world_total{protocol,verdict[,port]}``
    flows with L4 whose destination carries ``reserved:world``; not replies (a dropped
    reply still counts); a drop counts only when its reason is POLICY_DENIED unless the
    ``any-drop`` option is given. Options: ``port`` adds the destination port label (""
    for ICMP); ``syn-only`` counts only TCP SYN packets that are not replies.

Cost per flow: each handler reads a few fields of the decoded Flow, builds its label tuple
and adds one to a plain dict keyed by that tuple; the dict becomes a counter family only
when scraped. No ``prometheus_client.Counter`` child (label validation, a lock per
increment) is on the flow path, and no ``*_created`` series is exported (upstream's Go
client has none either). The dict holds one entry per label set, as the metric does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from cilia.hubble.flow import flow_pb2
from cilia_agent.hubble.metrics.api import ContextOptions, HandlerSpec

# Upstream monitor message types (pkg/monitor/api/types.go).
MSG_DROP = 1
MSG_CAPTURE = 3
MSG_TRACE = 4
MSG_POLICY_VERDICT = 5
MSG_ACCESS_LOG = 129

#: Trace observation points by number (upstream monitor/api ``TraceObservationPoints``).
TRACE_POINTS: dict[int, str] = {
    0: "to-endpoint",
    1: "to-proxy",
    2: "to-host",
    3: "to-stack",
    4: "to-overlay",
    5: "from-endpoint",
    6: "from-proxy",
    7: "from-host",
    8: "from-stack",
    9: "from-overlay",
    10: "from-network",
    11: "to-network",
    12: "from-crypto",
    13: "to-crypto",
}

_L4_PROTOCOLS = frozenset({"TCP", "UDP", "ICMPv4", "ICMPv6", "SCTP"})
_WORLD_LABEL = "reserved:world"

# ICMP message names as gopacket's ICMPv4TypeCode/ICMPv6TypeCode print them; a type listed
# with codes prints "Type(Code)", one without codes prints "Type" (code 0) or
# "Type(Code: N)".
_ICMP4_TYPES: dict[int, tuple[str, dict[int, str] | None]] = {
    0: ("EchoReply", None),
    3: (
        "DestinationUnreachable",
        {
            0: "Net",
            1: "Host",
            2: "Protocol",
            3: "Port",
            4: "FragmentationNeeded",
            5: "SourceRoutingFailed",
            6: "NetUnknown",
            7: "HostUnknown",
            8: "SourceIsolated",
            9: "NetAdminProhibited",
            10: "HostAdminProhibited",
            11: "NetTOS",
            12: "HostTOS",
            13: "CommAdminProhibited",
            14: "HostPrecedence",
            15: "PrecedenceCutoff",
        },
    ),
    4: ("SourceQuench", None),
    5: ("Redirect", {0: "Net", 1: "Host", 2: "TOS+Net", 3: "TOS+Host"}),
    8: ("EchoRequest", None),
    9: ("RouterAdvertisement", None),
    10: ("RouterSolicitation", None),
    11: ("TimeExceeded", {0: "TTLExceeded", 1: "FragmentReassemblyTimeExceeded"}),
    12: ("ParameterProblem", {0: "PointerIndicatesError", 1: "MissingOption", 2: "BadLength"}),
    13: ("TimestampRequest", None),
    14: ("TimestampReply", None),
    15: ("InfoRequest", None),
    16: ("InfoReply", None),
    17: ("AddressMaskRequest", None),
    18: ("AddressMaskReply", None),
}
_ICMP6_TYPES: dict[int, tuple[str, dict[int, str] | None]] = {
    1: (
        "DestinationUnreachable",
        {
            0: "NoRouteToDst",
            1: "AdminProhibited",
            2: "BeyondScopeOfSrc",
            3: "AddressUnreachable",
            4: "PortUnreachable",
            5: "SrcAddressFailedPolicy",
            6: "RejectRouteToDst",
        },
    ),
    2: ("PacketTooBig", None),
    3: ("TimeExceeded", {0: "HopLimitExceeded", 1: "FragmentReassemblyTimeExceeded"}),
    4: (
        "ParameterProblem",
        {0: "ErroneousHeaderField", 1: "UnrecognizedNextHeader", 2: "UnrecognizedIPv6Option"},
    ),
    128: ("EchoRequest", None),
    129: ("EchoReply", None),
    133: ("RouterSolicitation", None),
    134: ("RouterAdvertisement", None),
    135: ("NeighborSolicitation", None),
    136: ("NeighborAdvertisement", None),
    137: ("Redirect", None),
}


def icmp_type_name(icmp_type: int, code: int, v6: bool = False) -> str:
    """An ICMP type/code as the ``type`` label of ``hubble_icmp_total`` (gopacket's
    spelling): ``(8, 0)`` → "EchoRequest", ``(3, 3)`` → "DestinationUnreachable(Port)",
    ``(8, 1)`` → "EchoRequest(Code: 1)", ``(42, 0)`` → "42(0)"."""
    known = (_ICMP6_TYPES if v6 else _ICMP4_TYPES).get(icmp_type)
    if known is None:
        return f"{icmp_type}({code})"
    name, codes = known
    if codes is None:
        return name if code == 0 else f"{name}(Code: {code})"
    code_name = codes.get(code)
    return f"{name}({code_name})" if code_name is not None else f"{name}(Code: {code})"


def protocol_label(etype: int, l4: str | None) -> str:
    """The ``protocol`` label (upstream ``v1.FlowProtocol``) of a flow with monitor event
    type ``etype`` whose ``l4`` oneof holds ``l4`` (its field name, None when unset): for
    drop, trace, policy verdict and capture events the L4 protocol ("TCP", "UDP", "ICMPv4",
    "ICMPv6", "SCTP", else "Unknown L4"); "Unknown L7" for L7 events (this agent has no L7
    records); else "Unknown flow"."""
    if etype in _L4_EVENTS:
        return l4 if l4 in _L4_PROTOCOLS else "Unknown L4"
    if etype == MSG_ACCESS_LOG:
        return "Unknown L7"
    return "Unknown flow"


def flow_protocol(flow: flow_pb2.Flow) -> str:
    """:func:`protocol_label` of a whole flow."""
    return protocol_label(flow.event_type.type, flow.l4.WhichOneof("protocol"))


def _name(names: dict[int, str], value: int) -> str:
    return names.get(value) or str(value)


_L4_EVENTS = frozenset({MSG_DROP, MSG_TRACE, MSG_POLICY_VERDICT, MSG_CAPTURE})
_VERDICT_NAMES: dict[int, str] = {v: flow_pb2.Verdict.Name(v) for v in flow_pb2.Verdict.values()}
_DROP_REASON_NAMES: dict[int, str] = {
    v: flow_pb2.DropReason.Name(v) for v in flow_pb2.DropReason.values()
}
_IP_VERSION_NAMES: dict[int, str] = {
    v: flow_pb2.IPVersion.Name(v) for v in flow_pb2.IPVersion.values()
}
_FORWARDED = flow_pb2.FORWARDED
_REDIRECTED = flow_pb2.REDIRECTED
_DROPPED = flow_pb2.DROPPED
_POLICY_DENIED = flow_pb2.POLICY_DENIED
# Cluster-scope identities (pods, 256 .. 2^24-1) come from pod labels and never carry a
# reserved label: only reserved (< 256) and node-local (>= 2^24, CIDR) ones can be world.
_CLUSTER_IDENTITY_MIN, _LOCAL_IDENTITY_MIN = 256, 1 << 24


class _LastFlowMemo:
    """Wraps a context extractor; returns the last result again for the same flow object."""

    __slots__ = ("_extract", "_flow", "_value")

    def __init__(self, extract: Callable[[flow_pb2.Flow], tuple[str, ...]]) -> None:
        self._extract = extract
        self._flow: flow_pb2.Flow | None = None
        self._value: tuple[str, ...] = ()

    def __call__(self, flow: flow_pb2.Flow) -> tuple[str, ...]:
        if flow is not self._flow:
            self._value = self._extract(flow)
            self._flow = flow
        return self._value


class Handler(Collector):
    """Base of the handlers: one counter family, its context, the counts by label tuple.

    Args:
        spec: the handler and its options (checked by :func:`.api.parse_metrics`).
        registry: where the handler registers itself as a collector (the Hubble metrics
            registry); it exports :attr:`counts` as one counter family at each scrape.
        contexts: context options → extractor, shared by the handlers of one
            :class:`~cilia_agent.hubble.metrics.HubbleMetrics` (filled here).

    Subclasses set :attr:`metric`, :attr:`help`, :attr:`own_labels` and implement
    :meth:`process`. Counting runs on the event loop's thread only; a scrape (another
    thread) exports a copy of :attr:`counts` taken in one step.
    """

    metric = ""
    help = ""
    own_labels: tuple[str, ...] = ()
    context_first = False

    def __init__(
        self,
        spec: HandlerSpec,
        registry: CollectorRegistry,
        contexts: dict[ContextOptions, Callable[[flow_pb2.Flow], tuple[str, ...]]] | None = None,
    ) -> None:
        self.spec = spec
        self.context = ContextOptions.parse(spec.options)
        # handlers with equal context options share one extractor, which remembers its
        # last flow: the labels are read once per flow however many handlers use them
        shared = contexts if contexts is not None else {}
        if self.context not in shared:
            shared[self.context] = _LastFlowMemo(self.context.extractor())
        self.context_values = shared[self.context]
        ctx = self.context.label_names()
        names = (*ctx, *self.own_labels) if self.context_first else (*self.own_labels, *ctx)
        self.label_names: tuple[str, ...] = names
        #: label values (in :attr:`label_names` order) -> flows counted
        self.counts: dict[tuple[str, ...], int] = {}
        self.registry = registry
        registry.register(self)

    def _family(self) -> CounterMetricFamily:
        # CounterMetricFamily adds the "_total" suffix to the samples itself.
        return CounterMetricFamily(
            self.metric.removesuffix("_total"), self.help, labels=self.label_names
        )

    def describe(self) -> Iterator[Metric]:
        yield self._family()

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for labels, value in sorted(dict(self.counts).items()):
            family.add_metric(labels, value)
        yield family

    def close(self) -> None:
        """Unregister from the registry."""
        self.registry.unregister(self)

    def _inc(self, labels: tuple[str, ...]) -> None:
        counts = self.counts
        counts[labels] = counts.get(labels, 0) + 1

    def process(self, flow: flow_pb2.Flow, etype: int, verdict: int, l4: str | None) -> None:
        """Count ``flow`` (or not) in this handler's counter.

        Args:
            flow: the decoded flow.
            etype, verdict, l4: ``flow.event_type.type``, ``flow.verdict`` and the name of
                the field set in ``flow.l4`` (None: no L4), read once per flow by the caller
                for all handlers.
        """
        raise NotImplementedError


class FlowHandler(Handler):
    """``flow``: ``hubble_flows_processed_total`` (module docstring)."""

    metric = "hubble_flows_processed_total"
    help = "Total number of flows processed"
    own_labels = ("protocol", "type", "subtype", "verdict")

    def process(self, flow: flow_pb2.Flow, etype: int, verdict: int, l4: str | None) -> None:
        if etype == MSG_TRACE:
            kind, subtype = "Trace", TRACE_POINTS.get(flow.event_type.sub_type, "")
        elif etype == MSG_DROP:
            kind, subtype = "Drop", ""
        elif etype == MSG_POLICY_VERDICT:
            kind, subtype = "PolicyVerdict", ""
        elif etype == MSG_CAPTURE:
            kind, subtype = "Capture", ""
        elif etype == MSG_ACCESS_LOG:
            kind, subtype = "L7", ""
        else:
            kind, subtype = "Unknown", str(etype)
        own = (protocol_label(etype, l4), kind, subtype, _name(_VERDICT_NAMES, verdict))
        self._inc(own + self.context_values(flow))


class DropHandler(Handler):
    """``drop``: ``hubble_drop_total`` (module docstring)."""

    metric = "hubble_drop_total"
    help = "Number of drops"
    own_labels = ("reason", "protocol")
    context_first = True

    def process(self, flow: flow_pb2.Flow, etype: int, verdict: int, l4: str | None) -> None:
        if verdict != _DROPPED:
            return
        own = (_name(_DROP_REASON_NAMES, flow.drop_reason_desc), protocol_label(etype, l4))
        self._inc(self.context_values(flow) + own)


class TCPHandler(Handler):
    """``tcp``: ``hubble_tcp_flags_total`` (module docstring)."""

    metric = "hubble_tcp_flags_total"
    help = "TCP flag occurrences"
    own_labels = ("flag", "family")

    def process(self, flow: flow_pb2.Flow, etype: int, verdict: int, l4: str | None) -> None:
        if l4 != "TCP" or (verdict != _FORWARDED and verdict != _REDIRECTED):
            return
        # unset flags read as all false: nothing is counted, as upstream skips them
        flags = flow.l4.TCP.flags
        fin, syn, rst = flags.FIN, flags.SYN, flags.RST
        if not (fin or syn or rst):
            return
        version = flow.IP.ipVersion
        if version == 0 and not flow.HasField("IP"):
            return
        family = _name(_IP_VERSION_NAMES, version)
        ctx = self.context_values(flow)
        if fin:
            self._inc(("FIN", family, *ctx))
        if syn:
            self._inc(("SYN-ACK" if flags.ACK else "SYN", family, *ctx))
        if rst:
            self._inc(("RST", family, *ctx))


class PortDistributionHandler(Handler):
    """``port-distribution``: ``hubble_port_distribution_total`` (module docstring)."""

    metric = "hubble_port_distribution_total"
    help = "Numbers of packets distributed by destination port"
    own_labels = ("protocol", "port")

    def process(self, flow: flow_pb2.Flow, etype: int, verdict: int, l4: str | None) -> None:
        if l4 is None or (verdict != _FORWARDED and verdict != _REDIRECTED):
            return
        # a flow not known to be a request (is_reply unset) is skipped, as upstream
        if not flow.HasField("is_reply") or flow.is_reply.value:
            return
        if l4 == "ICMPv4" or l4 == "ICMPv6":
            port = "0"
        elif l4 in ("TCP", "UDP", "SCTP"):
            port = str(getattr(flow.l4, l4).destination_port)
        else:
            return
        self._inc((l4, port, *self.context_values(flow)))


class ICMPHandler(Handler):
    """``icmp``: ``hubble_icmp_total`` (module docstring)."""

    metric = "hubble_icmp_total"
    help = "Number of ICMP messages"
    own_labels = ("family", "type")

    def process(self, flow: flow_pb2.Flow, etype: int, verdict: int, l4: str | None) -> None:
        if l4 == "ICMPv4":
            icmp = flow.l4.ICMPv4
            own = ("IPv4", icmp_type_name(icmp.type, icmp.code))
        elif l4 == "ICMPv6":  # absent from this agent's flow.proto today
            icmp = getattr(flow.l4, l4)
            own = ("IPv6", icmp_type_name(icmp.type, icmp.code, v6=True))
        else:
            return
        self._inc(own + self.context_values(flow))


class FlowsToWorldHandler(Handler):
    """``flows-to-world``: ``hubble_flows_to_world_total`` (module docstring)."""

    metric = "hubble_flows_to_world_total"
    help = "Total number of flows to reserved:world"

    def __init__(
        self,
        spec: HandlerSpec,
        registry: CollectorRegistry,
        contexts: dict[ContextOptions, Callable[[flow_pb2.Flow], tuple[str, ...]]] | None = None,
    ) -> None:
        keys = {key.lower() for key, _ in spec.options}
        self.any_drop = "any-drop" in keys
        self.port = "port" in keys
        self.syn_only = "syn-only" in keys
        self.own_labels = ("protocol", "verdict", "port") if self.port else ("protocol", "verdict")
        super().__init__(spec, registry, contexts)

    def process(self, flow: flow_pb2.Flow, etype: int, verdict: int, l4: str | None) -> None:
        if l4 is None:
            return
        dst = flow.destination
        identity = dst.identity
        if _CLUSTER_IDENTITY_MIN <= identity < _LOCAL_IDENTITY_MIN:
            return  # a pod: no reserved label (saves reading its labels)
        if _WORLD_LABEL not in dst.labels:
            return
        dropped = verdict == _DROPPED
        if dropped and not self.any_drop and flow.drop_reason_desc != _POLICY_DENIED:
            return
        is_reply = flow.HasField("is_reply") and flow.is_reply.value
        if is_reply and not dropped:
            return
        if self.syn_only and (l4 != "TCP" or not flow.l4.TCP.flags.SYN or is_reply):
            return
        own: tuple[str, ...] = (protocol_label(etype, l4), _name(_VERDICT_NAMES, verdict))
        if self.port:
            port = ""
            if l4 in ("TCP", "UDP", "SCTP"):
                port = str(getattr(flow.l4, l4).destination_port)
            own = (*own, port)
        self._inc(own + self.context_values(flow))


HANDLERS: dict[str, type[Handler]] = {
    "flow": FlowHandler,
    "drop": DropHandler,
    "tcp": TCPHandler,
    "port-distribution": PortDistributionHandler,
    "icmp": ICMPHandler,
    "flows-to-world": FlowsToWorldHandler,
}
