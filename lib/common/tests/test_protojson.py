"""``-o json`` output of protobuf messages: every field printed, 64-bit integers as numbers."""

from __future__ import annotations

import json

from google.protobuf import json_format

from cilia.agent.v1 import agent_pb2
from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia_common.protojson import message_to_dict


def test_int64_fields_are_numbers_and_zero_fields_are_present() -> None:
    status = pb.IPAMServiceGetStatusResponse(
        mode="multi-pool",
        pools=[
            pb.PoolStatus(name="default", cidrs=["10.0.0.0/16"], mask_size=24,
                          blocks_total=256, blocks_allocated=0),
        ],
        nodes=[pb.NodeIPAMStatus(node_name="n1")],
    )  # fmt: skip
    # protobuf's own mapping is what scripts tripped over: "256" and no blocksAllocated
    plain = json_format.MessageToDict(status)
    assert plain["pools"][0]["blocksTotal"] == "256" and "blocksAllocated" not in plain["pools"][0]

    data = json.loads(json.dumps(message_to_dict(status)))
    assert data["pools"][0]["blocksTotal"] == 256
    assert data["pools"][0]["blocksAllocated"] == 0
    assert data["pools"][0]["drainingCidrs"] == []
    assert data["migration"] == "" and data["nodesMigrated"] == 0 and data["leader"] is False
    assert data["nodes"][0]["error"] == "" and data["nodes"][0]["allocated"] == []


def test_proto_field_names_maps_and_large_values() -> None:
    endpoint = agent_pb2.Endpoint(id=2**63 + 5, labels={"app": "web"}, pod_name="p")
    data = message_to_dict(endpoint, preserving_proto_field_name=True)
    assert data["id"] == 2**63 + 5  # beyond 2^53: still an exact JSON number
    assert data["labels"] == {"app": "web"}
    assert data["pod_name"] == "p" and data["identity"] == 0 and data["chained"] is False
    assert json.loads(json.dumps(data))["id"] == 2**63 + 5
