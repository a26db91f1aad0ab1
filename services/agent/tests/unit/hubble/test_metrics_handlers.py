"""Hubble metric handlers over constructed flows: the ``--hubble-metrics`` grammar, what each
handler counts, label names and values as upstream, and the exposition a Prometheus parser
reads."""

from __future__ import annotations

import pytest
from google.protobuf import wrappers_pb2
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cilia.hubble.flow import flow_pb2
from cilia_agent.__main__ import main
from cilia_agent.config import Config
from cilia_agent.hubble.metrics import HubbleMetrics, MetricsConfigError, parse_metrics
from cilia_agent.hubble.metrics.api import HandlerSpec

from . import helpers as h

WORLD = ["reserved:world"]
FRONTEND = ["k8s:app=frontend", "k8s:io.kubernetes.pod.namespace=demo"]
BACKEND = ["k8s:app.kubernetes.io/name=api", "k8s:app=backend", "k8s:io.kubernetes.pod.namespace=demo"]  # fmt: skip


def endpoint(
    pod: str = "", namespace: str = "", labels: list[str] | None = None, workload: str = ""
) -> flow_pb2.Endpoint:
    ep = flow_pb2.Endpoint(pod_name=pod, namespace=namespace, labels=labels or [])
    if workload:
        ep.workloads.add(name=workload, kind="Deployment")
    return ep


def tcp(dport: int = 8080, **flags: bool) -> flow_pb2.Layer4:
    return flow_pb2.Layer4(
        TCP=flow_pb2.TCP(
            source_port=40000, destination_port=dport, flags=flow_pb2.TCPFlags(**flags)
        )
    )


def udp(dport: int = 53) -> flow_pb2.Layer4:
    return flow_pb2.Layer4(UDP=flow_pb2.UDP(source_port=40000, destination_port=dport))


def icmp(icmp_type: int = 8, code: int = 0) -> flow_pb2.Layer4:
    return flow_pb2.Layer4(ICMPv4=flow_pb2.ICMPv4(type=icmp_type, code=code))


def make_flow(
    *,
    verdict: int = flow_pb2.FORWARDED,
    l4: flow_pb2.Layer4 | None = None,
    src: flow_pb2.Endpoint | None = None,
    dst: flow_pb2.Endpoint | None = None,
    is_reply: bool | None = False,
    drop_reason: int = 0,
    event_type: int | None = None,
    sub_type: int = 5,
    direction: int = flow_pb2.EGRESS,
) -> flow_pb2.Flow:
    """A flow as the parser builds it: a from-endpoint trace unless DROPPED (then a drop)."""
    dropped = verdict == flow_pb2.DROPPED
    f = flow_pb2.Flow(
        verdict=verdict,  # type: ignore[arg-type]
        IP=flow_pb2.IP(source="10.0.0.1", destination="10.0.0.2", ipVersion=flow_pb2.IPv4),
        source=src or endpoint("frontend-7d9f8b-x2x4z", "demo", FRONTEND, "frontend"),
        destination=dst or endpoint("backend-0", "demo", BACKEND),
        traffic_direction=direction,  # type: ignore[arg-type]
    )
    f.l4.CopyFrom(l4 if l4 is not None else tcp(SYN=True))
    if is_reply is not None:
        f.is_reply.CopyFrom(wrappers_pb2.BoolValue(value=is_reply))
    f.event_type.type = event_type if event_type is not None else (1 if dropped else 4)
    f.event_type.sub_type = drop_reason if dropped else sub_type
    if dropped:
        f.drop_reason_desc = drop_reason  # type: ignore[assignment]
    return f


def metrics(text: str) -> HubbleMetrics:
    return HubbleMetrics(CollectorRegistry(), handlers=parse_metrics(text))


def samples(m: HubbleMetrics, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """``{sorted label items: value}`` of metric ``name`` as a Prometheus parser reads the
    exposition (``*_created`` samples left out)."""
    text = generate_latest(m.flow_registry).decode()
    out: dict[tuple[tuple[str, str], ...], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def key(**labels: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))


# -- the grammar ---------------------------------------------------------------------------


def test_upstream_example_parses_with_options_in_order() -> None:
    specs = parse_metrics(
        "drop:sourceContext=pod;destinationContext=pod tcp flow port-distribution icmp "
        "flows-to-world:any-drop;port"
    )
    assert specs == [
        HandlerSpec("drop", (("sourceContext", "pod"), ("destinationContext", "pod"))),
        HandlerSpec("tcp"),
        HandlerSpec("flow"),
        HandlerSpec("port-distribution"),
        HandlerSpec("icmp"),
        HandlerSpec("flows-to-world", (("any-drop", ""), ("port", ""))),
    ]
    assert parse_metrics("") == [] and parse_metrics("  ") == []


def test_commas_separate_handlers_but_stay_inside_a_labels_context_list() -> None:
    specs = parse_metrics("flow,drop:labelsContext=source_pod,destination_pod,tcp")
    assert specs == [
        HandlerSpec("flow"),
        HandlerSpec("drop", (("labelsContext", "source_pod,destination_pod"),)),
        HandlerSpec("tcp"),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("bogus", "unknown handler 'bogus' (one of flow, drop, tcp"),
        ("dns:query", "handler 'dns' exists upstream but not in this agent"),
        ("drop:sourceContext=pods", "drop: sourceContext: unknown context 'pods'"),
        ("tcp:destinationContext=pod|nope", "tcp: destinationContext: unknown context 'nope'"),
        ("flow:sourcecontex=pod", "flow: unknown option 'sourcecontex'"),
        ("drop:labelsContext=source_pod,bogus", "drop: labelsContext: invalid label 'bogus'"),
        ("flows-to-world:port=80", "flows-to-world: option 'port' takes no value"),
        ("icmp:any-drop", "icmp: unknown option 'any-drop'"),
        ("drop tcp drop", "handler 'drop' is given twice"),
        (":sourceContext=pod", "empty handler name"),
    ],
)
def test_bad_handler_or_option_is_refused_with_the_reason(text: str, message: str) -> None:
    with pytest.raises(MetricsConfigError) as err:
        parse_metrics(text)
    assert message in str(err.value)


def test_serve_exits_2_with_one_line_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--hubble-metrics", "drop:sourceContext=pods"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cilia-agent: --hubble-metrics: drop: sourceContext: unknown context")
    assert err.count("\n") == 1


def test_flags_default_to_no_handlers_on_upstream_port_9965(
    capsys: pytest.CaptureFixture[str],
) -> None:
    c = Config(node_name="n1")
    assert (c.hubble_metrics, c.hubble_metrics_server) == ("", ":9965")
    assert main(["serve", "--hubble-metrics-server", "9965"]) == 2
    assert "--hubble-metrics-server" in capsys.readouterr().err


def test_nothing_is_registered_or_counted_without_handlers() -> None:
    m = metrics("")
    m.flow_processed(make_flow())
    assert not m.enabled
    assert list(m.flow_registry.collect()) == []


# -- each handler ----------------------------------------------------------------------------


def test_flow_counts_every_flow_by_protocol_type_subtype_and_verdict() -> None:
    m = metrics("flow")
    m.flow_processed(make_flow(sub_type=5))
    m.flow_processed(make_flow(sub_type=5, l4=udp()))
    m.flow_processed(make_flow(sub_type=0, l4=icmp()))
    m.flow_processed(make_flow(verdict=flow_pb2.DROPPED, drop_reason=133))
    m.flow_processed(make_flow(sub_type=99))
    m.flow_processed(make_flow(event_type=7, l4=flow_pb2.Layer4()))
    assert samples(m, "hubble_flows_processed_total") == {
        key(protocol="TCP", type="Trace", subtype="from-endpoint", verdict="FORWARDED"): 1,
        key(protocol="UDP", type="Trace", subtype="from-endpoint", verdict="FORWARDED"): 1,
        key(protocol="ICMPv4", type="Trace", subtype="to-endpoint", verdict="FORWARDED"): 1,
        key(protocol="TCP", type="Drop", subtype="", verdict="DROPPED"): 1,
        key(protocol="TCP", type="Trace", subtype="", verdict="FORWARDED"): 1,
        key(protocol="Unknown flow", type="Unknown", subtype="7", verdict="FORWARDED"): 1,
    }


def test_drop_counts_only_drops_by_reason_protocol_and_pod_context() -> None:
    m = metrics("drop:sourceContext=pod;destinationContext=pod")
    m.flow_processed(make_flow())  # forwarded: not a drop
    for _ in range(3):
        m.flow_processed(make_flow(verdict=flow_pb2.DROPPED, drop_reason=133))
    m.flow_processed(make_flow(verdict=flow_pb2.DROPPED, drop_reason=181, l4=udp()))
    m.flow_processed(make_flow(verdict=flow_pb2.DROPPED, drop_reason=250))  # no name
    src, dst = "demo/frontend-7d9f8b-x2x4z", "demo/backend-0"
    assert samples(m, "hubble_drop_total") == {
        key(reason="POLICY_DENIED", protocol="TCP", source=src, destination=dst): 3,
        key(reason="POLICY_DENY", protocol="UDP", source=src, destination=dst): 1,
        key(reason="250", protocol="TCP", source=src, destination=dst): 1,
    }
    # as upstream, the context labels come first in the drop metric's label list
    assert m.handlers[0].label_names == ("source", "destination", "reason", "protocol")


def test_tcp_counts_syn_syn_ack_fin_and_rst_of_forwarded_packets() -> None:
    m = metrics("tcp")
    m.flow_processed(make_flow(l4=tcp(SYN=True)))
    m.flow_processed(make_flow(l4=tcp(SYN=True, ACK=True), is_reply=True))
    m.flow_processed(make_flow(l4=tcp(FIN=True, ACK=True)))
    m.flow_processed(make_flow(l4=tcp(RST=True, FIN=True)))
    m.flow_processed(make_flow(l4=tcp(ACK=True, PSH=True)))  # no counted flag
    m.flow_processed(make_flow(verdict=flow_pb2.DROPPED, drop_reason=133, l4=tcp(SYN=True)))
    m.flow_processed(make_flow(l4=udp()))
    assert samples(m, "hubble_tcp_flags_total") == {
        key(flag="SYN", family="IPv4"): 1,
        key(flag="SYN-ACK", family="IPv4"): 1,
        key(flag="FIN", family="IPv4"): 2,
        key(flag="RST", family="IPv4"): 1,
    }


def test_port_distribution_counts_destination_ports_of_requests_only() -> None:
    m = metrics("port-distribution")
    m.flow_processed(make_flow(l4=tcp(8080, SYN=True)))
    m.flow_processed(make_flow(l4=tcp(8080, ACK=True)))
    m.flow_processed(make_flow(l4=tcp(40000, SYN=True, ACK=True), is_reply=True))  # reply
    m.flow_processed(make_flow(l4=tcp(9090, SYN=True), is_reply=None))  # not known: skipped
    m.flow_processed(make_flow(verdict=flow_pb2.DROPPED, drop_reason=133, l4=tcp(9090)))
    m.flow_processed(make_flow(l4=udp(53)))
    m.flow_processed(make_flow(l4=icmp(8)))
    assert samples(m, "hubble_port_distribution_total") == {
        key(protocol="TCP", port="8080"): 2,
        key(protocol="UDP", port="53"): 1,
        key(protocol="ICMPv4", port="0"): 1,
    }


def test_icmp_counts_every_icmp_flow_by_family_and_gopacket_type_name() -> None:
    m = metrics("icmp")
    m.flow_processed(make_flow(l4=icmp(8)))
    m.flow_processed(make_flow(l4=icmp(0), is_reply=True))
    m.flow_processed(make_flow(verdict=flow_pb2.DROPPED, drop_reason=133, l4=icmp(8)))
    m.flow_processed(make_flow(l4=icmp(3, 3)))
    m.flow_processed(make_flow(l4=icmp(3, 99)))
    m.flow_processed(make_flow(l4=icmp(8, 1)))
    m.flow_processed(make_flow(l4=icmp(42, 7)))
    m.flow_processed(make_flow(l4=tcp()))
    assert samples(m, "hubble_icmp_total") == {
        key(family="IPv4", type="EchoRequest"): 2,
        key(family="IPv4", type="EchoReply"): 1,
        key(family="IPv4", type="DestinationUnreachable(Port)"): 1,
        key(family="IPv4", type="DestinationUnreachable(Code: 99)"): 1,
        key(family="IPv4", type="EchoRequest(Code: 1)"): 1,
        key(family="IPv4", type="42(7)"): 1,
    }


def test_flows_to_world_counts_requests_to_world_and_policy_denied_drops() -> None:
    world = endpoint(labels=WORLD)
    m = metrics("flows-to-world")
    m.flow_processed(make_flow(dst=world))
    m.flow_processed(make_flow(dst=world, l4=udp()))
    m.flow_processed(make_flow(dst=world, is_reply=True))  # forwarded reply: not counted
    m.flow_processed(make_flow())  # destination not world
    m.flow_processed(make_flow(dst=world, l4=flow_pb2.Layer4()))  # no L4
    m.flow_processed(make_flow(dst=world, verdict=flow_pb2.DROPPED, drop_reason=133))
    m.flow_processed(make_flow(dst=world, verdict=flow_pb2.DROPPED, drop_reason=133, is_reply=True))
    m.flow_processed(make_flow(dst=world, verdict=flow_pb2.DROPPED, drop_reason=181))  # deny rule
    assert samples(m, "hubble_flows_to_world_total") == {
        key(protocol="TCP", verdict="FORWARDED"): 1,
        key(protocol="UDP", verdict="FORWARDED"): 1,
        key(protocol="TCP", verdict="DROPPED"): 2,
    }


def test_flows_to_world_options_any_drop_port_and_syn_only() -> None:
    world = endpoint(labels=WORLD)
    m = metrics("flows-to-world:any-drop;port;syn-only;sourceContext=namespace")
    m.flow_processed(make_flow(dst=world, l4=tcp(443, SYN=True)))
    m.flow_processed(make_flow(dst=world, l4=tcp(443, ACK=True)))  # not a SYN
    m.flow_processed(make_flow(dst=world, l4=udp(53)))  # not TCP
    m.flow_processed(
        make_flow(dst=world, verdict=flow_pb2.DROPPED, drop_reason=181, l4=tcp(80, SYN=True))
    )
    assert samples(m, "hubble_flows_to_world_total") == {
        key(protocol="TCP", verdict="FORWARDED", port="443", source="demo"): 1,
        key(protocol="TCP", verdict="DROPPED", port="80", source="demo"): 1,
    }


# -- context labels ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("context", "source", "destination"),
    [
        ("namespace", "demo", "demo"),
        ("pod", "demo/frontend-7d9f8b-x2x4z", "demo/backend-0"),
        ("pod-short", "demo/frontend", "demo/backend"),
        ("pod-name", "frontend-7d9f8b-x2x4z", "backend-0"),
        ("identity", ",".join(FRONTEND), ",".join(BACKEND)),
        ("ip", "10.0.0.1", "10.0.0.2"),
        ("workload-name", "frontend", ""),
        ("app", "frontend", "api"),  # app.kubernetes.io/name is the first app label there
        ("dns", "", ""),
        ("reserved-identity", "", ""),
    ],
)
def test_each_context_identifier_gives_upstream_values(
    context: str, source: str, destination: str
) -> None:
    m = metrics(f"flow:sourceContext={context};destinationContext={context}")
    m.flow_processed(make_flow())
    ((labels, value),) = samples(m, "hubble_flows_processed_total").items()
    assert (dict(labels)["source"], dict(labels)["destination"], value) == (
        source,
        destination,
        1,
    )


def test_context_falls_back_to_the_next_identifier_and_prefers_kube_apiserver() -> None:
    api = endpoint(labels=["reserved:world", "reserved:kube-apiserver"])
    m = metrics("drop:destinationContext=pod|reserved-identity")
    m.flow_processed(make_flow(verdict=flow_pb2.DROPPED, drop_reason=133))
    m.flow_processed(make_flow(verdict=flow_pb2.DROPPED, drop_reason=133, dst=api))
    m.flow_processed(
        make_flow(verdict=flow_pb2.DROPPED, drop_reason=133, dst=endpoint(labels=WORLD))
    )
    got = {dict(k)["destination"]: v for k, v in samples(m, "hubble_drop_total").items()}
    assert got == {"demo/backend-0": 1, "reserved:kube-apiserver": 1, "reserved:world": 1}


def test_labels_context_adds_labels_in_upstream_order_whatever_the_given_order() -> None:
    m = metrics(
        "tcp:labelsContext=traffic_direction,destination_pod,source_namespace,source_app,"
        "destination_workload;sourceContext=pod-name"
    )
    m.flow_processed(make_flow(direction=flow_pb2.INGRESS))
    m.flow_processed(make_flow(direction=flow_pb2.TRAFFIC_DIRECTION_UNKNOWN))
    assert m.handlers[0].label_names == (
        "flag",
        "family",
        "source_namespace",
        "source_app",
        "destination_pod",
        "destination_workload",
        "traffic_direction",
        "source",
    )
    common = {"flag": "SYN", "family": "IPv4", "source_namespace": "demo",
              "source_app": "frontend", "destination_pod": "backend-0",
              "destination_workload": "", "source": "frontend-7d9f8b-x2x4z"}  # fmt: skip
    assert samples(m, "hubble_tcp_flags_total") == {
        key(**common, traffic_direction="ingress"): 1,
        key(**common, traffic_direction="unknown"): 1,
    }


def test_direction_specific_context_overrides_the_plain_one() -> None:
    m = metrics("flow:sourceContext=namespace;sourceIngressContext=pod-name")
    m.flow_processed(make_flow(direction=flow_pb2.INGRESS))
    m.flow_processed(make_flow(direction=flow_pb2.EGRESS))
    got = {dict(k)["source"]: v for k, v in samples(m, "hubble_flows_processed_total").items()}
    assert got == {"frontend-7d9f8b-x2x4z": 1, "demo": 1}


# -- together ------------------------------------------------------------------------------


def test_all_handlers_on_parsed_flows_and_the_exposition_a_scraper_reads() -> None:
    """Flows from the real parser (``helpers``), every handler on, the text parsed back."""
    p = h.parser()
    m = metrics(
        "flow drop:sourceContext=pod;destinationContext=pod tcp port-distribution icmp "
        "flows-to-world"
    )
    for ev in (
        h.event(),  # frontend -> backend:8080 SYN, forwarded
        h.event(verdict=2, event_type=1, drop_reason=133, direction=0, ep_id=h.BACKEND_EP),
    ):
        m.flow_processed(p.parse(ev))
    families = {
        f.name: f for f in text_string_to_metric_families(generate_latest(m.flow_registry).decode())
    }
    assert {n: f.type for n, f in families.items()} == {
        "hubble_flows_processed": "counter",
        "hubble_drop": "counter",
        "hubble_tcp_flags": "counter",
        "hubble_port_distribution": "counter",
        "hubble_icmp": "counter",
        "hubble_flows_to_world": "counter",
    }  # and no *_created series: upstream's Go client exports none
    assert samples(m, "hubble_drop_total") == {
        key(reason="POLICY_DENIED", protocol="TCP", source="demo/frontend-7d9f",
            destination="demo/backend-5c4b"): 1,
    }  # fmt: skip
    assert samples(m, "hubble_tcp_flags_total") == {key(flag="SYN", family="IPv4"): 1}
    assert samples(m, "hubble_port_distribution_total") == {key(protocol="TCP", port="8080"): 1}
    assert sum(samples(m, "hubble_flows_processed_total").values()) == 2


def test_counts_are_exact_under_many_flows_and_one_label_set_is_one_series() -> None:
    m = metrics("drop:sourceContext=pod;destinationContext=pod")
    for _ in range(1000):
        m.flow_processed(make_flow(verdict=flow_pb2.DROPPED, drop_reason=133))
    assert list(samples(m, "hubble_drop_total").values()) == [1000]
    text = generate_latest(m.flow_registry).decode()
    assert text.count("hubble_drop_total{") == 1 and "_created" not in text


def test_a_failing_handler_is_logged_once_and_the_others_still_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    m = metrics("tcp flow")

    def broken(flow: flow_pb2.Flow, etype: int, verdict: int, l4: str | None) -> None:
        raise RuntimeError("bug")

    m._process = (broken, *m._process[1:])  # the tcp handler's slot
    m.flow_processed(make_flow())
    m.flow_processed(make_flow())
    assert list(samples(m, "hubble_flows_processed_total").values()) == [2]
    assert sum("metric handler" in r.getMessage() for r in caplog.records) == 1


def test_close_unregisters_so_the_same_registry_can_be_reused() -> None:
    m = metrics("flow drop")
    registry = m.flow_registry
    m.close()
    assert list(registry.collect()) == []
    HubbleMetrics(CollectorRegistry(), handlers=parse_metrics("flow drop"), flow_registry=registry)
