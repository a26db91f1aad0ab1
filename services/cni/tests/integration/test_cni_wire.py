"""cilia_cni.wire (the plugin's protobuf-free messages) against the contract: every schema
field for field against the generated descriptors, values round-tripped through the
protobuf runtime both ways, the method paths, and malformed input refused."""

from __future__ import annotations

import random
from typing import Any

import pytest
from google.protobuf.descriptor import FieldDescriptor

from cilia.agent.v1 import agent_pb2
from cilia_cni import wire

MESSAGES = [
    wire.AddRequest,
    wire.Interface,
    wire.IPConfig,
    wire.Route,
    wire.AddResponse,
    wire.DelRequest,
    wire.DelResponse,
    wire.QueuedDel,
    wire.CheckRequest,
    wire.CheckResponse,
    wire.Attachment,
    wire.GCRequest,
    wire.GCResponse,
    wire.StatusRequest,
    wire.PoolStatus,
    wire.StatusResponse,
]
#: Fields of the contract the plugin's schema leaves out (read as unknown fields, skipped).
SKIPPED = {"cilia.agent.v1.StatusResponse": {"datapath", "hubble"}}
KINDS = {
    FieldDescriptor.TYPE_STRING: wire.STRING,
    FieldDescriptor.TYPE_UINT32: wire.UINT32,
    FieldDescriptor.TYPE_UINT64: wire.UINT64,
    FieldDescriptor.TYPE_INT64: wire.INT64,
    FieldDescriptor.TYPE_BOOL: wire.BOOL,
    FieldDescriptor.TYPE_MESSAGE: wire.MESSAGE,
}


def _pb2(cls: type[wire.Message]) -> Any:
    return getattr(agent_pb2, cls.__name__)


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.__name__)
def test_schema_matches_the_contract_field_for_field(cls: type[wire.Message]) -> None:
    descriptor = _pb2(cls).DESCRIPTOR
    assert descriptor.full_name == cls.FULL_NAME
    ours = {f.name: f for f in cls.FIELDS}
    theirs = {f.name: f for f in descriptor.fields}
    assert set(theirs) - set(ours) == SKIPPED.get(cls.FULL_NAME, set())
    assert set(ours) <= set(theirs)
    for name, field in ours.items():
        pb = theirs[name]
        assert field.number == pb.number, name
        is_map = pb.message_type is not None and pb.message_type.GetOptions().map_entry
        if is_map:
            key, value = pb.message_type.fields
            assert (key.type, value.type) == (FieldDescriptor.TYPE_STRING,) * 2
            assert field.kind == wire.MAP and not field.repeated, name
            continue
        assert field.kind == KINDS[pb.type], name
        assert field.repeated == pb.is_repeated, name
        if field.kind == wire.MESSAGE:
            assert field.message is not None
            assert pb.message_type.full_name == field.message.FULL_NAME, name


def test_method_paths_are_the_contracts() -> None:
    attach = agent_pb2.DESCRIPTOR.services_by_name["AttachmentService"]
    debug = agent_pb2.DESCRIPTOR.services_by_name["DebugService"]
    paths = {f"/{s.full_name}/{m.name}" for s in (attach, debug) for m in s.methods}
    ours = {wire.ADD_METHOD, wire.DEL_METHOD, wire.CHECK_METHOD, wire.GC_METHOD}
    assert ours | {wire.STATUS_METHOD} <= paths
    assert wire.STATUS_METHOD.startswith(f"/{debug.full_name}/")


TEXTS = ["", "a", "eth0", "ünïcode ✓ 🐙", "x" * 300, "\x00nul", "/var/run/netns/pod-1"]
NUMBERS = {
    wire.UINT32: [0, 1, 127, 128, 300, 65535, 2**32 - 1],
    wire.UINT64: [0, 1, 2**32, 2**63, 2**64 - 1],
    wire.INT64: [0, 1, -1, 1_733_000_000_000, -(2**63), 2**63 - 1],
}


def _values(cls: type[wire.Message], rng: random.Random, depth: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in cls.FIELDS:
        if rng.random() < 0.2:
            continue  # left at its default
        if f.kind == wire.MAP:
            out[f.name] = {rng.choice(TEXTS): rng.choice(TEXTS) for _ in range(rng.randrange(4))}
        elif f.kind == wire.MESSAGE:
            assert f.message is not None
            sub = f.message
            count = rng.randrange(4) if f.repeated else 1
            items = [_values(sub, rng, depth + 1) for _ in range(count)]
            out[f.name] = items if f.repeated else items[0]
        else:
            pick = {
                wire.STRING: lambda: rng.choice(TEXTS),
                wire.BOOL: lambda: rng.random() < 0.5,
            }.get(f.kind, lambda kind=f.kind: rng.choice(NUMBERS[kind]))
            out[f.name] = [pick() for _ in range(rng.randrange(4))] if f.repeated else pick()
    return out


def _build(cls: type[wire.Message], values: dict[str, Any], pb: bool) -> Any:
    kwargs: dict[str, Any] = {}
    for f in cls.FIELDS:
        if f.name not in values:
            continue
        value = values[f.name]
        if f.kind == wire.MESSAGE:
            assert f.message is not None
            if f.repeated:
                value = [_build(f.message, v, pb) for v in value]
            else:
                value = _build(f.message, value, pb)
        kwargs[f.name] = value
    return (_pb2(cls) if pb else cls)(**kwargs)


def _same(ours: wire.Message, theirs: Any) -> None:
    for f in type(ours).FIELDS:
        mine, other = getattr(ours, f.name), getattr(theirs, f.name)
        if f.kind == wire.MAP:
            assert mine == dict(other), f.name
        elif f.kind == wire.MESSAGE and f.repeated:
            assert len(mine) == len(other), f.name
            for a, b in zip(mine, other, strict=True):
                _same(a, b)
        elif f.kind == wire.MESSAGE:
            assert (mine is not None) == theirs.HasField(f.name), f.name
            if mine is not None:
                _same(mine, other)
        elif f.repeated:
            assert mine == list(other), f.name
        else:
            assert mine == other, f.name


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.__name__)
def test_values_round_trip_through_protobuf_both_ways(cls: type[wire.Message]) -> None:
    rng = random.Random(cls.FULL_NAME)
    for _ in range(60):
        values = _values(cls, rng)
        ours, theirs = _build(cls, values, pb=False), _build(cls, values, pb=True)
        # ours encoded → protobuf decodes the same message
        assert _pb2(cls).FromString(ours.SerializeToString()) == theirs
        # protobuf encoded → ours decodes the same values
        decoded = cls.FromString(theirs.SerializeToString())
        _same(decoded, theirs)
        assert decoded == ours


def test_unknown_fields_and_other_wire_types_are_skipped() -> None:
    status = agent_pb2.StatusResponse(
        ready=True,
        pools=[agent_pb2.PoolStatus(pool="default", capacity=254, used=3)],
        datapath=agent_pb2.DatapathStatus(pin_dir="/sys/fs/bpf/x", policies=4),
        hubble=agent_pb2.HubbleStatus(num_flows=9),
    )
    extra = bytes([0x98, 0x06, 0x05])  # field 99 varint 5
    extra += bytes([0xA1, 0x06]) + b"\x01" * 8  # field 100, 64-bit
    extra += bytes([0xAD, 0x06]) + b"\x02" * 4  # field 101, 32-bit
    extra += bytes([0x08 | 2, 0x01, 0x00])  # field 1 (bool) as a length-delimited field
    decoded = wire.StatusResponse.FromString(status.SerializeToString() + extra)
    assert decoded.ready is True
    assert [(p.pool, p.used, p.capacity) for p in decoded.pools] == [("default", 3, 254)]


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"\x08", "truncated varint"),
        (b"\x08" + b"\xff" * 10 + b"\x01", "longer than 10 bytes"),
        (b"\x0a\x05abc", "overruns"),
        (b"\x0a\x02\xff\xfe", "not valid UTF-8"),
        (b"\x0b", "wire type 3"),
        (b"\x09\x00\x00", "truncated fixed-size"),
        (b"\x00\x00", "field number 0"),
    ],
    ids=["varint", "long-varint", "overrun", "utf8", "group", "fixed", "zero"],
)
def test_malformed_input_is_a_decode_error(data: bytes, needle: str) -> None:
    with pytest.raises(wire.DecodeError, match=needle):
        wire.DelRequest.FromString(data)
    with pytest.raises(Exception):  # noqa: B017 - protobuf refuses it too
        agent_pb2.DelRequest.FromString(data)


def test_nested_malformed_input_is_a_decode_error() -> None:
    with pytest.raises(wire.DecodeError, match=r"Interface\.name: string is not valid UTF-8"):
        wire.AddResponse.FromString(b"\x0a\x04\x0a\x02\xc3\x28")


def test_out_of_range_values_and_unknown_names_are_refused() -> None:
    with pytest.raises(ValueError, match="uint32"):
        wire.AddRequest(mtu=2**32).SerializeToString()
    with pytest.raises(ValueError, match="uint32"):
        wire.AddRequest(mtu=-1).SerializeToString()
    with pytest.raises(ValueError, match="int64"):
        wire.QueuedDel(queued_at_unix_ms=2**63).SerializeToString()
    with pytest.raises(TypeError, match="no field 'nope'"):
        wire.DelRequest(nope="x")
