"""``cilia-agent service list`` reads the pinned maps as upstream's ``cilium service list``
shows them."""

from __future__ import annotations

import json

import pytest

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent.__main__ import main
from cilia_agent.loadbalancer.maps import ServiceMapWriter


def test_service_list_shows_frontends_backends_and_states(
    writer: ServiceMapWriter, capsys: pytest.CaptureFixture[str]
) -> None:
    writer.upsert_service(
        cp.Service(
            namespace="m",
            name="dns",
            cluster_ips=["198.18.81.10"],
            ports=[
                cp.ServicePort(
                    protocol="UDP",
                    port=53,
                    backends=[
                        cp.ServiceBackend(ip="10.0.9.1", port=5353, ready=True),
                        cp.ServiceBackend(ip="10.0.9.2", port=5353, terminating=True),
                    ],
                )
            ],
        )
    )
    pin = str(writer.maps.pin_dir)

    assert main(["service", "list", "--bpf-pin-dir", pin]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["ID", "FRONTEND", "SERVICE", "TYPE", "BACKEND"]
    assert table[1].split() == [
        "1",
        "198.18.81.10:53/UDP",
        "ClusterIP",
        "1)",
        "10.0.9.1:5353/UDP",
        "(active)",
    ]
    assert table[2].split() == ["-", "-", "-", "1)", "10.0.9.2:5353/UDP", "(terminating)"]

    assert main(["service", "list", "--bpf-pin-dir", pin, "-o", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["frontend"] == "198.18.81.10:53/UDP"
    assert [b["state"] for b in rows[0]["backends"]] == ["active"]


def test_service_list_without_maps_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["service", "list", "--bpf-pin-dir", "/sys/fs/bpf/cilia-tlb-none"]) == 1
    assert "cannot open pinned map /sys/fs/bpf/cilia-tlb-none/cilium_lb4_services_v2" in (
        capsys.readouterr().err
    )
