"""A compiled policy written by PolicyMapWriter into the real cilia_policy map of
bpf/bpf_lxc.c gives the expected verdicts through BPF_PROG_TEST_RUN.

Uses cilia_agent.testing.bpf (bpf_lxc.o loaded with libbpf, maps pinned under
/sys/fs/bpf/cilia-test-<rand>, removed afterwards). Under test run the program sees
ifindex 1, so the endpoint is registered for ifindex 1.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Iterator
from typing import Any

import pytest

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia_agent.policy.compiler import EndpointPolicy, PolicyEntry, Verdict
from cilia_agent.policy.engine import PolicyEngine
from cilia_agent.policy.maps import PolicyMapWriter, encode_key
from cilia_agent.testing import bpf as bpf_harness
from cilia_testkit import skips

pytestmark = pytest.mark.privileged

BACKEND_IP, FRONTEND_IP, OTHER_IP, BANNED_IP = (
    "10.251.0.10",
    "10.251.0.20",
    "10.251.0.30",
    "10.251.0.40",
)
EP_ID, BACKEND, FRONTEND, OTHER, BANNED = 42, 1001, 1000, 1002, 1005
NS = "k8s:io.kubernetes.pod.namespace=prod"


@pytest.fixture
def harness() -> Any:
    """:mod:`cilia_agent.testing.bpf`, once root, bpffs and libbpf are there."""
    skips.require_bpf("BPF_PROG_TEST_RUN")
    return bpf_harness


@pytest.fixture
def dp(harness: Any) -> Iterator[Any]:
    datapath = harness.load()
    try:
        yield datapath
    finally:
        harness.unload(datapath)


def identity_event(id_: int, app: str) -> pb.IdentityEvent:
    return pb.IdentityEvent(
        type=pb.EVENT_TYPE_UPSERT, identity=pb.Identity(id=id_, labels=[f"k8s:app={app}", NS])
    )


def policy_event(name: str, spec: dict[str, Any]) -> pb.PolicyEvent:
    doc = {
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumNetworkPolicy",
        "metadata": {"name": name, "namespace": "prod"},
        "spec": {"endpointSelector": {"matchLabels": {"app": "backend"}}, **spec},
    }
    return pb.PolicyEvent(
        type=pb.EVENT_TYPE_UPSERT,
        kind="CiliumNetworkPolicy",
        namespace="prod",
        name=name,
        json=json.dumps(doc),
    )


def tcp8080(*apps: str) -> dict[str, Any]:
    return {
        "fromEndpoints": [{"matchLabels": {"app": a}} for a in apps],
        "toPorts": [{"ports": [{"port": "8080", "protocol": "TCP"}]}],
    }


def test_compiled_policy_in_real_map_forwards_allowed_and_drops_the_rest(
    harness: Any, dp: Any
) -> None:
    for ip, ident in ((BACKEND_IP, BACKEND), (FRONTEND_IP, FRONTEND), (OTHER_IP, OTHER)):
        dp.agent.ipcache_map[harness.IpcacheKey(32, harness.ip_to_map(ip))] = harness.IpcacheValue(
            ident, 0
        )
    dp.agent.ipcache_map[harness.IpcacheKey(32, harness.ip_to_map(BANNED_IP))] = (
        harness.IpcacheValue(BANNED, 0)
    )
    endpoints = dp.agent.endpoint_map

    def enforce(ep_id: int, policy: EndpointPolicy) -> None:
        endpoints[ctypes.c_uint32(1)] = harness.EndpointInfo(
            ep_id=ep_id,
            sec_identity=BACKEND,
            ipv4=harness.ip_to_map(BACKEND_IP),
            enforce_ingress=int(policy.enforce_ingress),
            enforce_egress=int(policy.enforce_egress),
        )

    engine = PolicyEngine(PolicyMapWriter(dp.agent.policy_map), on_enforce=enforce)
    engine.on_identities(
        pb.WatchIdentitiesResponse(
            events=[
                identity_event(FRONTEND, "frontend"),
                identity_event(BACKEND, "backend"),
                identity_event(OTHER, "other"),
                identity_event(BANNED, "banned"),
            ],
            synced=True,
        )
    )
    engine.on_policies(
        pb.WatchPoliciesResponse(
            events=[
                policy_event(
                    "backend",
                    {
                        "ingress": [tcp8080("frontend", "banned")],
                        "ingressDeny": [{"fromEndpoints": [{"matchLabels": {"app": "banned"}}]}],
                    },
                )
            ],
            synced=True,
        )
    )
    engine.set_endpoint(EP_ID, ["k8s:app=backend", NS], "prod")

    to = "cil_to_container"
    run = dp.run
    pkt = harness.packet
    assert run(to, pkt(FRONTEND_IP, BACKEND_IP, sport=1, dport=8080)) == harness.TC_ACT_OK
    assert run(to, pkt(FRONTEND_IP, BACKEND_IP, sport=2, dport=9090)) == harness.TC_ACT_SHOT
    assert run(to, pkt(OTHER_IP, BACKEND_IP, sport=3, dport=8080)) == harness.TC_ACT_SHOT
    # banned's allow on 8080 was converted to deny by the broader L3 deny
    assert run(to, pkt(BANNED_IP, BACKEND_IP, sport=4, dport=8080)) == harness.TC_ACT_SHOT
    assert [(e.verdict, e.drop_reason) for e in dp.events] == [(1, 0), (2, 133), (2, 133), (2, 181)]
    # egress is not enforced by an ingress-only policy
    assert run("cil_from_container", pkt(BACKEND_IP, OTHER_IP, dport=5432)) == harness.TC_ACT_OK

    # Policy update on the running endpoint: "other" may now reach 8080 too.
    frontend_key = encode_key(EP_ID, PolicyEntry(FRONTEND, 0, 6, 8080))
    assert dp.agent.policy_map[frontend_key].packets == 1
    _, affected = engine.on_policies(
        pb.WatchPoliciesResponse(events=[policy_event("other", {"ingress": [tcp8080("other")]})])
    )
    assert affected == {EP_ID}
    assert run(to, pkt(OTHER_IP, BACKEND_IP, sport=5, dport=8080)) == harness.TC_ACT_OK
    # the unchanged frontend entry was not rewritten: its counter survived
    assert dp.agent.policy_map[frontend_key].packets == 1

    # A restarted agent reads back exactly what it wrote.
    reread = PolicyMapWriter(dp.agent.policy_map).read()
    assert reread == {EP_ID: dict(engine.compiled[EP_ID].entries)}

    engine.remove_endpoint(EP_ID)
    assert len(list(dp.agent.policy_map.items())) == 0


def test_port_ranges_sctp_and_icmp_types_give_their_verdicts_in_the_real_map(
    harness: Any, dp: Any
) -> None:
    """``endPort`` ranges (written as aligned port blocks), SCTP ports and ICMP types
    (``icmps``) are enforced by bpf_lxc.c: inside the range / the allowed type passes,
    everything next to it is dropped; a deny block inside an allowed range wins."""
    for ip, ident in ((BACKEND_IP, BACKEND), (FRONTEND_IP, FRONTEND)):
        dp.agent.ipcache_map[harness.IpcacheKey(32, harness.ip_to_map(ip))] = harness.IpcacheValue(
            ident, 0
        )

    def enforce(ep_id: int, policy: EndpointPolicy) -> None:
        dp.agent.endpoint_map[ctypes.c_uint32(1)] = harness.EndpointInfo(
            ep_id=ep_id,
            sec_identity=BACKEND,
            ipv4=harness.ip_to_map(BACKEND_IP),
            enforce_ingress=int(policy.enforce_ingress),
            enforce_egress=int(policy.enforce_egress),
        )

    engine = PolicyEngine(PolicyMapWriter(dp.agent.policy_map), on_enforce=enforce)
    engine.on_identities(
        pb.WatchIdentitiesResponse(
            events=[identity_event(FRONTEND, "frontend"), identity_event(BACKEND, "backend")],
            synced=True,
        )
    )
    frontend = [{"matchLabels": {"app": "frontend"}}]
    engine.on_policies(
        pb.WatchPoliciesResponse(
            events=[
                policy_event(
                    "ranges",
                    {
                        "ingress": [
                            {
                                "fromEndpoints": frontend,
                                "toPorts": [
                                    {
                                        "ports": [
                                            {"port": "8080", "endPort": 8090, "protocol": "TCP"},
                                            {"port": "9000", "protocol": "SCTP"},
                                        ]
                                    }
                                ],
                            },
                            {"fromEndpoints": frontend, "icmps": [{"fields": [{"type": 8}]}]},
                        ],
                        "ingressDeny": [
                            {
                                "fromEndpoints": frontend,
                                "toPorts": [
                                    {
                                        "ports": [
                                            {"port": "8084", "endPort": 8085, "protocol": "TCP"}
                                        ]
                                    }
                                ],
                            }
                        ],
                    },
                )
            ],
            synced=True,
        )
    )
    engine.set_endpoint(EP_ID, ["k8s:app=backend", NS], "prod")

    def verdict(frame: bytes) -> str:
        rc = dp.run("cil_to_container", frame)
        return {harness.TC_ACT_OK: "pass", harness.TC_ACT_SHOT: "drop"}[rc]

    pkt = harness.packet
    tcp = {p: verdict(pkt(FRONTEND_IP, BACKEND_IP, sport=p, dport=p)) for p in range(8078, 8093)}
    assert tcp == {
        8078: "drop", 8079: "drop",
        8080: "pass", 8081: "pass", 8082: "pass", 8083: "pass",
        8084: "drop", 8085: "drop",  # the deny block inside the allowed range wins
        8086: "pass", 8087: "pass", 8088: "pass", 8089: "pass", 8090: "pass",
        8091: "drop", 8092: "drop",
    }  # fmt: skip
    assert verdict(pkt(FRONTEND_IP, BACKEND_IP, "sctp", sport=1, dport=9000)) == "pass"
    assert verdict(pkt(FRONTEND_IP, BACKEND_IP, "sctp", sport=2, dport=9001)) == "drop"
    assert verdict(pkt(FRONTEND_IP, BACKEND_IP, "tcp", sport=3, dport=9000)) == "drop"
    assert verdict(pkt(FRONTEND_IP, BACKEND_IP, "icmp", icmp_type=8, icmp_id=11)) == "pass"
    assert verdict(pkt(FRONTEND_IP, BACKEND_IP, "icmp", icmp_type=13, icmp_id=12)) == "drop"
    assert verdict(pkt(FRONTEND_IP, BACKEND_IP, "udp", sport=4, dport=8080)) == "drop"
    drops = [e.drop_reason for e in dp.events if e.verdict == 2]
    assert drops.count(181) == 2, "the two ports of the deny block: policy deny"

    # what the agent wrote reads back exactly (a restarted agent adopts the blocks)
    reread = PolicyMapWriter(dp.agent.policy_map).read()
    assert reread == {EP_ID: dict(engine.compiled[EP_ID].entries)}


def test_a_named_port_resolves_on_the_selected_pods_container_ports(harness: Any, dp: Any) -> None:
    """A NetworkPolicy allowing ingress on the named port ``serve-80``: on a pod whose
    container port of that name is 8080, TCP 8080 passes and every other port is dropped;
    resolved per pod (upstream), so a pod without that name gets nothing from the rule."""
    for ip, ident in ((BACKEND_IP, BACKEND), (FRONTEND_IP, FRONTEND)):
        dp.agent.ipcache_map[harness.IpcacheKey(32, harness.ip_to_map(ip))] = harness.IpcacheValue(
            ident, 0
        )

    def enforce(ep_id: int, policy: EndpointPolicy) -> None:
        dp.agent.endpoint_map[ctypes.c_uint32(1)] = harness.EndpointInfo(
            ep_id=ep_id,
            sec_identity=BACKEND,
            ipv4=harness.ip_to_map(BACKEND_IP),
            enforce_ingress=int(policy.enforce_ingress),
            enforce_egress=int(policy.enforce_egress),
        )

    ports = {("prod", "backend-1"): {("serve-80", "TCP"): 8080, ("dns", "UDP"): 5353}}
    engine = PolicyEngine(PolicyMapWriter(dp.agent.policy_map), on_enforce=enforce)
    engine.named_ports = lambda namespace, pod: ports.get((namespace, pod), {})
    engine.on_identities(
        pb.WatchIdentitiesResponse(
            events=[identity_event(FRONTEND, "frontend"), identity_event(BACKEND, "backend")],
            synced=True,
        )
    )
    np_doc = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "named", "namespace": "prod"},
        "spec": {
            "podSelector": {"matchLabels": {"app": "backend"}},
            "ingress": [{"ports": [{"protocol": "TCP", "port": "serve-80"}]}],
        },
    }
    event = pb.PolicyEvent(
        type=pb.EVENT_TYPE_UPSERT, kind="NetworkPolicy", namespace="prod", name="named",
        json=json.dumps(np_doc),
    )  # fmt: skip
    engine.on_policies(pb.WatchPoliciesResponse(events=[event], synced=True))
    engine.set_endpoint(EP_ID, ["k8s:app=backend", NS], "prod", pod_name="backend-1")

    def verdict(frame: bytes) -> str:
        rc = dp.run("cil_to_container", frame)
        return {harness.TC_ACT_OK: "pass", harness.TC_ACT_SHOT: "drop"}[rc]

    pkt = harness.packet
    assert verdict(pkt(FRONTEND_IP, BACKEND_IP, sport=1, dport=8080)) == "pass"
    assert verdict(pkt(FRONTEND_IP, BACKEND_IP, sport=2, dport=80)) == "drop"
    assert verdict(pkt(FRONTEND_IP, BACKEND_IP, "udp", sport=3, dport=8080)) == "drop"
    assert dict(engine.compiled[EP_ID].entries) == {PolicyEntry(0, 0, 6, 8080): Verdict.ALLOW}, (
        "the name resolved to this pod's 8080 for any peer"
    )

    # the same endpoint as a pod without that port name: the rule allows nothing
    engine.set_endpoint(EP_ID, ["k8s:app=backend", NS], "prod", pod_name="backend-2")
    assert engine.compiled[EP_ID].entries == {} and engine.compiled[EP_ID].enforce_ingress
    assert verdict(pkt(FRONTEND_IP, BACKEND_IP, sport=4, dport=8080)) == "drop"


def test_a_forged_source_is_dropped_with_upstreams_reason_and_reported(
    harness: Any, dp: Any
) -> None:
    """Source address verification: a packet leaving a pod with another source than the
    pod's address is dropped (even with no policy at all), reported as a DROPPED event with
    reason 132 (Hubble's INVALID_SOURCE_IP) and counted; the pod's own address passes."""
    from cilia.hubble.flow import flow_pb2
    from cilia_agent.hubble.metrics import read_counters

    harness.endpoint(dp, EP_ID, BACKEND, BACKEND_IP)
    out = "cil_from_container"
    assert dp.run(out, harness.packet(BACKEND_IP, OTHER_IP, sport=1)) == harness.TC_ACT_OK
    assert dp.run(out, harness.packet(FRONTEND_IP, OTHER_IP, sport=2)) == harness.TC_ACT_SHOT
    assert dp.run(out, harness.packet(FRONTEND_IP, OTHER_IP, "udp")) == harness.TC_ACT_SHOT
    drops = [e for e in dp.events if e.verdict == 2]
    assert [e.drop_reason for e in drops] == [132, 132]
    assert flow_pb2.DropReason.Name(drops[0].drop_reason) == "INVALID_SOURCE_IP"
    counted = {
        (c.reason, c.direction): sum(c.packets)
        for c in read_counters(dp.agent.metrics_map)
        if c.reason
    }
    assert counted[(132, 1)] == 2
