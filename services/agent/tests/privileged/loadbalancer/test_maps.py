"""The map writer on real pinned maps (created by loading bpf_sock.o, not attached):
the layout the programs read, id sharing and reuse, cleanup, and restore after a crash."""

from __future__ import annotations

import dataclasses
import logging
import socket

import pytest

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent.datapath.layout import ip_from_map
from cilia_agent.loadbalancer import socklb
from cilia_agent.loadbalancer.layout import (
    BE_STATE_ACTIVE,
    BE_STATE_TERMINATING,
    SERVICES_MAP,
    SVC_FLAG_AFFINITY,
    SVC_FLAG_ROUTABLE,
    AffinityMatch,
    Lb4Service,
)
from cilia_agent.loadbalancer.maps import LBMaps, ServiceMapWriter, frontend_key
from cilia_agent.loadbalancer.model import Frontend
from cilia_agent.loadbalancer.sizing import map_info

TCP = 6


def svc(
    name: str,
    vip: str,
    ready: list[str],
    terminating: tuple[str, ...] = (),
    *,
    affinity: int = 0,
    port: int = 80,
) -> cp.Service:
    backends = [cp.ServiceBackend(ip=ip, port=8080, ready=True) for ip in ready] + [
        cp.ServiceBackend(ip=ip, port=8080, terminating=True) for ip in terminating
    ]
    return cp.Service(
        namespace="m",
        name=name,
        cluster_ips=[vip],
        session_affinity="ClientIP" if affinity else "None",
        session_affinity_timeout_seconds=affinity,
        ports=[cp.ServicePort(protocol="TCP", port=port, backends=backends)],
    )


def slots(writer: ServiceMapWriter, vip: str, port: int = 80) -> dict[int, Lb4Service]:
    """Every slot of ``vip:port/TCP`` in the pinned services map."""
    want = frontend_key(Frontend(vip, port, TCP))
    return {
        k.backend_slot: v
        for k, v in writer.maps.services.items()
        if (k.address, k.dport, k.proto) == (want.address, want.dport, want.proto)
    }


def test_master_entry_and_slots_hold_the_active_backends(writer: ServiceMapWriter) -> None:
    writer.upsert_service(svc("a", "198.18.79.1", ["10.0.9.1", "10.0.9.2"], ("10.0.9.3",)))

    entries = slots(writer, "198.18.79.1")
    master = entries.pop(0)
    assert (master.count, master.flags, master.backend_id) == (2, SVC_FLAG_ROUTABLE, 0)
    assert master.rev_nat_index == writer.frontends[Frontend("198.18.79.1", 80, TCP)].rev_nat
    ids = {v.backend_id for v in entries.values()}
    assert set(entries) == {1, 2} and len(ids) == 2
    backends = {k.value: v for k, v in writer.maps.backends.items()}
    assert {ip_from_map(backends[i].address) for i in ids} == {"10.0.9.1", "10.0.9.2"}
    assert all(backends[i].flags == BE_STATE_ACTIVE for i in ids)
    assert all(socket.ntohs(backends[i].port) == 8080 for i in ids)
    (kept,) = set(backends) - ids
    assert (ip_from_map(backends[kept].address), backends[kept].flags) == (
        "10.0.9.3",
        BE_STATE_TERMINATING,
    )
    revnat = {k.value: v for k, v in writer.maps.revnat.items()}
    entry = revnat[master.rev_nat_index]
    assert (ip_from_map(entry.address), socket.ntohs(entry.port)) == ("198.18.79.1", 80)


def test_fewer_backends_shrink_the_slots_and_free_the_ids(writer: ServiceMapWriter) -> None:
    writer.upsert_service(svc("a", "198.18.79.2", ["10.0.9.1", "10.0.9.2", "10.0.9.3"]))
    writer.upsert_service(svc("a", "198.18.79.2", ["10.0.9.2"]))

    entries = slots(writer, "198.18.79.2")
    assert set(entries) == {0, 1} and entries[0].count == 1
    assert [b.address for b in writer.backends.values()] == ["10.0.9.2"]
    assert len(list(writer.maps.backends.items())) == 1


def test_a_backend_shared_by_two_services_has_one_id_and_stays_while_used(
    writer: ServiceMapWriter,
) -> None:
    writer.upsert_service(svc("a", "198.18.79.3", ["10.0.9.1"]))
    writer.upsert_service(svc("b", "198.18.79.4", ["10.0.9.1"]))
    a, b = slots(writer, "198.18.79.3")[1], slots(writer, "198.18.79.4")[1]
    assert a.backend_id == b.backend_id

    assert writer.delete_service("m", "a") == 1

    assert slots(writer, "198.18.79.3") == {}
    assert [k.value for k, _ in writer.maps.backends.items()] == [b.backend_id]
    writer.delete_service("m", "b")
    assert list(writer.maps.backends.items()) == []
    assert list(writer.maps.revnat.items()) == []
    assert list(writer.maps.services.items()) == []


def test_a_terminating_backend_of_one_service_stays_active_for_another(
    writer: ServiceMapWriter,
) -> None:
    writer.upsert_service(svc("a", "198.18.79.5", ["10.0.9.1"]))
    writer.upsert_service(svc("b", "198.18.79.6", [], ("10.0.9.1",)))

    ((_, value),) = list(writer.maps.backends.items())
    assert value.flags == BE_STATE_ACTIVE
    writer.delete_service("m", "a")
    ((_, value),) = list(writer.maps.backends.items())
    assert value.flags == BE_STATE_TERMINATING


def test_client_ip_affinity_sets_the_timeout_flag_and_match_entries(
    writer: ServiceMapWriter,
) -> None:
    writer.upsert_service(svc("s", "198.18.79.7", ["10.0.9.1", "10.0.9.2"], affinity=300))
    master = slots(writer, "198.18.79.7")[0]
    assert master.flags == SVC_FLAG_ROUTABLE | SVC_FLAG_AFFINITY and master.backend_id == 300
    ids = {v.backend_id for s, v in slots(writer, "198.18.79.7").items() if s}
    matches = {(m.backend_id, m.rev_nat_id) for m, _ in writer.maps.affinity_match.items()}
    assert matches == {(i, master.rev_nat_index) for i in ids}

    writer.upsert_service(svc("s", "198.18.79.7", ["10.0.9.1", "10.0.9.2"]))  # affinity off

    assert list(writer.maps.affinity_match.items()) == []
    assert writer.maps.affinity_match.lookup(AffinityMatch(backend_id=min(ids))) is None


def test_a_service_moving_its_port_drops_the_old_frontend(writer: ServiceMapWriter) -> None:
    writer.upsert_service(svc("a", "198.18.79.8", ["10.0.9.1"], port=80))
    writer.upsert_service(svc("a", "198.18.79.8", ["10.0.9.1"], port=8000))

    assert slots(writer, "198.18.79.8", 80) == {}
    assert set(slots(writer, "198.18.79.8", 8000)) == {0, 1}


def test_restore_reads_ids_back_and_drops_what_a_crash_left(writer: ServiceMapWriter) -> None:
    writer.upsert_service(svc("a", "198.18.79.9", ["10.0.9.1", "10.0.9.2"]))
    writer.upsert_service(svc("b", "198.18.79.10", ["10.0.9.3"], affinity=60))
    # a crash between writing slot 3 and the master entry
    writer.maps.services.update(
        frontend_key(Frontend("198.18.79.9", 80, TCP), 3), Lb4Service(backend_id=99)
    )

    again = ServiceMapWriter(LBMaps(writer.maps.pin_dir), writer.capacity)
    try:
        assert again.restore() == 2
        assert {
            f: (p.rev_nat, p.active, p.affinity_timeout) for f, p in again.frontends.items()
        } == {f: (p.rev_nat, p.active, p.affinity_timeout) for f, p in writer.frontends.items()}
        assert again.backends == writer.backends
        assert set(slots(again, "198.18.79.9")) == {0, 1, 2}
        # new ids continue after the restored ones
        again.upsert_service(svc("c", "198.18.79.11", ["10.0.9.4"]))
        new = again.frontends[Frontend("198.18.79.11", 80, TCP)]
        assert new.rev_nat not in {p.rev_nat for p in writer.frontends.values()}
        assert new.active[0] not in writer.backends
    finally:
        again.maps.close()


def test_bad_entries_are_reported_and_the_rest_programmed(writer: ServiceMapWriter) -> None:
    bad = cp.Service(
        namespace="m",
        name="bad",
        cluster_ips=["198.18.79.12", "not-an-ip", "fd00::1"],
        ports=[
            cp.ServicePort(protocol="SCTP", port=80),
            cp.ServicePort(protocol="TCP", port=70000),
            cp.ServicePort(
                protocol="TCP",
                port=81,
                backends=[
                    cp.ServiceBackend(ip="10.0.9.1", port=8080, ready=True),
                    cp.ServiceBackend(ip="10.0.9.x", port=8080, ready=True),
                    cp.ServiceBackend(ip="10.0.9.2", port=0, ready=True),
                ],
            ),
        ],
    )

    problems = writer.upsert_service(bad)

    assert len(problems) == 5, problems
    assert set(writer.frontends) == {Frontend("198.18.79.12", 81, TCP)}
    assert slots(writer, "198.18.79.12", 81)[0].count == 1


def test_a_pinned_map_keeps_its_size_when_the_flag_changes(
    writer: ServiceMapWriter, sock_config: socklb.SockConfig, caplog: pytest.LogCaptureFixture
) -> None:
    """An agent restarted with another --bpf-lb-map-max reuses the pinned maps (entries
    kept) at their size, with a warning; libbpf alone would refuse the load."""
    writer.upsert_service(svc("keep", "198.18.77.40", ["10.252.77.11"]))
    bigger = dataclasses.replace(sock_config, lb_map_max=sock_config.lb_map_max * 2)
    with caplog.at_level(logging.WARNING, logger="cilia_agent.loadbalancer.sizing"):
        socklb.create_maps(bigger)
    info = map_info(sock_config.pin_dir / SERVICES_MAP)
    assert info is not None and info.max_entries == sock_config.lb_map_max
    warned = [r for r in caplog.records if getattr(r, "map", None) == SERVICES_MAP]
    assert warned and getattr(warned[0], "flag", None) == bigger.lb_map_max
    again = LBMaps(sock_config.pin_dir)
    try:
        key = frontend_key(Frontend("198.18.77.40", 80, TCP))
        master = again.services.lookup(key)
        assert master is not None and master.count == 1
    finally:
        again.close()
