"""`cilia-operator ipam status`: what each draining CIDR still waits for, and when none is left."""

from __future__ import annotations

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia_operator.cli import draining_lines


def _status(draining: list[str]) -> pb.IPAMServiceGetStatusResponse:
    return pb.IPAMServiceGetStatusResponse(
        pools=[pb.PoolStatus(name="default", cidrs=["10.9.0.0/16"], draining_cidrs=draining)],
        nodes=[
            pb.NodeIPAMStatus(
                node_name="a",
                allocated=[pb.PoolCIDRs(pool="default", cidrs=["10.8.0.0/24", "10.9.0.0/24"])],
            ),
            pb.NodeIPAMStatus(
                node_name="b",
                allocated=[pb.PoolCIDRs(pool="default", cidrs=["10.8.1.0/24", "10.8.2.0/24"])],
            ),
            pb.NodeIPAMStatus(node_name="c", pod_cidrs=["10.9.1.0/24"]),
        ],
    )


def test_each_draining_cidr_names_the_nodes_and_blocks_it_waits_for() -> None:
    assert draining_lines(_status(["10.8.0.0/16"])) == [
        "draining: pool default 10.8.0.0/16: 3 blocks still held by a (1), b (2); "
        "handed back as their pods leave"
    ]


def test_no_draining_cidr_says_the_drain_is_complete() -> None:
    assert draining_lines(_status([])) == [
        "draining: none in progress (every CIDR removed from a pool is handed back)"
    ]
