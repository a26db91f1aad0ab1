"""Bad input for every method of a gRPC service, built from its protobuf descriptors.

Used by the operator's and the agent API's fuzz tests ("bad input on every gRPC method: a
clear status, nothing changed, no crash"):

- :func:`methods`: every method of the services of a generated ``*_pb2`` module
  (full name, request descriptor, streaming or not);
- :func:`messages`: a hypothesis strategy of request messages whose fields are drawn from
  their types: strings (short, plausible names and addresses, control characters, lone
  surrogates are impossible in protobuf so they are left out), integers over the whole range
  of their type, enum fields with values the schema does not define, nested messages and
  repeated fields (a few elements), maps;
- :func:`huge`: a request whose every string and bytes field (nested ones too) holds
  ``size`` bytes;
- :func:`call`: one call with raw request bytes through a channel's generic multi-callables
  (no stub), returning the status code and details; a server stream is read up to its first
  message.

Statuses a server may answer bad input with are :data:`CLEAR_CODES`; UNKNOWN (an exception
escaped a handler or the request's bytes did not parse) and INTERNAL are never clear.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import grpc
from google.protobuf import descriptor as _d
from google.protobuf import message_factory
from hypothesis import strategies as st

CLEAR_CODES = frozenset(
    {
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
    }
)
"""Status codes that answer bad input clearly (OK: the input happened to be valid)."""

_INT_RANGES = {
    _d.FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    _d.FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    _d.FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    _d.FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    _d.FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    _d.FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    _d.FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    _d.FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    _d.FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    _d.FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
_PLAUSIBLE = [
    "", "default", "n1", "kube-system", "web", "a" * 64, "a" * 300, "10.0.0.1", "10.0.0.0/8",
    "0.0.0.0/0", "::1", "k8s:app=web", "CiliumPodIPPool", "ciliumnodes", "cnp", "-", "..",
    "a/b", "UPPER", "\x00", "\n", "é", "{}", "- [", "*", "0", "-1", "9" * 30,
]  # fmt: skip
_TEXT = st.sampled_from(_PLAUSIBLE) | st.text(
    alphabet=st.characters(exclude_categories=["Cs"]), max_size=40
)


@dataclass(frozen=True)
class Method:
    """One RPC: ``name`` ``/pkg.Service/Method``, its request descriptor, and whether the
    server streams its responses."""

    name: str
    request: _d.Descriptor
    server_streaming: bool

    def request_class(self) -> Any:
        """The generated class of the request message."""
        return message_factory.GetMessageClass(self.request)


def methods(*modules: ModuleType) -> list[Method]:
    """Every method of every service the ``*_pb2`` modules define, sorted by name."""
    out = []
    for module in modules:
        for service in module.DESCRIPTOR.services_by_name.values():
            for m in service.methods:
                name = f"/{service.full_name}/{m.name}"
                out.append(Method(name, m.input_type, bool(m.server_streaming)))
    return sorted(out, key=lambda m: m.name)


def _fields(desc: _d.Descriptor) -> list[Any]:
    """The descriptor's fields (typed loosely: protobuf's stubs make message_type Optional)."""
    return list(desc.fields)


def _scalar(field: Any) -> st.SearchStrategy[Any]:
    t = field.type
    if t == _d.FieldDescriptor.TYPE_STRING:
        return _TEXT
    if t == _d.FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=40)
    if t == _d.FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t in (_d.FieldDescriptor.TYPE_DOUBLE, _d.FieldDescriptor.TYPE_FLOAT):
        return st.floats(width=32 if t == _d.FieldDescriptor.TYPE_FLOAT else 64)
    if t == _d.FieldDescriptor.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        # open enums keep numbers the schema does not name
        return st.sampled_from(known) | st.integers(-(2**31), 2**31 - 1)
    lo, hi = _INT_RANGES[t]
    return st.sampled_from([0, 1, -1 if lo < 0 else 2, lo, hi]) | st.integers(lo, hi)


def messages(desc: _d.Descriptor, depth: int = 3) -> st.SearchStrategy[Any]:
    """Messages of type ``desc`` with every field present or not and drawn from its type;
    nesting stops at ``depth``."""
    cls = message_factory.GetMessageClass(desc)

    @st.composite
    def build(draw: Any) -> Any:
        msg = cls()
        for field in _fields(desc):
            if not draw(st.booleans()):
                continue
            _fill(draw, msg, field, depth)
        return msg

    return build()


def _fill(draw: Any, msg: Any, field: Any, depth: int) -> None:
    is_message = field.type == _d.FieldDescriptor.TYPE_MESSAGE
    if is_message and field.message_type.GetOptions().map_entry:
        key_f, value_f = (
            field.message_type.fields_by_name["key"],
            field.message_type.fields_by_name["value"],
        )
        target = getattr(msg, field.name)
        for _ in range(draw(st.integers(0, 3))):
            key = draw(_scalar(key_f))
            if value_f.type == _d.FieldDescriptor.TYPE_MESSAGE:
                if depth > 0:
                    target[key].CopyFrom(draw(messages(value_f.message_type, depth - 1)))
            else:
                target[key] = draw(_scalar(value_f))
        return
    if is_message and depth <= 0:
        return
    repeated = field.is_repeated
    count = draw(st.integers(0, 3)) if repeated else 1
    values = [
        draw(messages(field.message_type, depth - 1)) if is_message else draw(_scalar(field))
        for _ in range(count)
    ]
    if repeated:
        container = getattr(msg, field.name)
        if is_message:
            for v in values:
                container.add().CopyFrom(v)
        else:
            container.extend(values)
    elif is_message:
        getattr(msg, field.name).CopyFrom(values[0])
    else:
        setattr(msg, field.name, values[0])


def huge(desc: _d.Descriptor, size: int, depth: int = 3) -> Any:
    """A message of type ``desc`` whose every string/bytes field holds ``size`` bytes
    (``"a"``), and every message field (to ``depth``) is filled the same way; repeated
    fields get one such element."""
    msg = message_factory.GetMessageClass(desc)()
    for field in _fields(desc):
        repeated = field.is_repeated
        if field.type == _d.FieldDescriptor.TYPE_MESSAGE:
            if depth <= 0 or field.message_type.GetOptions().map_entry:
                continue
            inner = huge(field.message_type, size, depth - 1)
            if repeated:
                getattr(msg, field.name).add().CopyFrom(inner)
            else:
                getattr(msg, field.name).CopyFrom(inner)
        elif field.type in (_d.FieldDescriptor.TYPE_STRING, _d.FieldDescriptor.TYPE_BYTES):
            value: Any = "a" * size
            if field.type == _d.FieldDescriptor.TYPE_BYTES:
                value = value.encode()
            if repeated:
                getattr(msg, field.name).append(value)
            else:
                setattr(msg, field.name, value)
    return msg


def extreme(desc: _d.Descriptor, depth: int = 3) -> Any:
    """A message of type ``desc`` whose every enum field holds a number the schema does not
    define (2**31 - 1) and every integer field the largest value of its type, nested
    messages (to ``depth``) and one element of repeated fields likewise."""
    msg = message_factory.GetMessageClass(desc)()
    for field in _fields(desc):
        repeated = field.is_repeated
        value: Any
        if field.type == _d.FieldDescriptor.TYPE_MESSAGE:
            if depth <= 0 or field.message_type.GetOptions().map_entry:
                continue
            inner = extreme(field.message_type, depth - 1)
            target = getattr(msg, field.name)
            (target.add() if repeated else target).CopyFrom(inner)
            continue
        if field.type == _d.FieldDescriptor.TYPE_ENUM:
            value = 2**31 - 1
        elif field.type in _INT_RANGES:
            value = _INT_RANGES[field.type][1]
        else:
            continue
        if repeated:
            getattr(msg, field.name).append(value)
        else:
            setattr(msg, field.name, value)
    return msg


async def call(
    channel: Any, method: Method, payload: bytes, timeout: float
) -> tuple[grpc.StatusCode, str]:
    """Call ``method`` with the raw ``payload`` bytes: ``(code, details)``; a server stream
    counts as OK once its first message arrives (then it is cancelled)."""
    identity: Any = None
    try:
        if method.server_streaming:
            stream = channel.unary_stream(
                method.name, request_serializer=identity, response_deserializer=identity
            )(payload, timeout=timeout)
            try:
                await asyncio.wait_for(stream.read(), timeout)
            except TimeoutError:
                return grpc.StatusCode.OK, "stream open, nothing sent yet"
            finally:
                stream.cancel()
            return grpc.StatusCode.OK, ""
        await channel.unary_unary(
            method.name, request_serializer=identity, response_deserializer=identity
        )(payload, timeout=timeout)
        return grpc.StatusCode.OK, ""
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""


def is_clear(code: grpc.StatusCode) -> bool:
    """Whether ``code`` answers bad input clearly (:data:`CLEAR_CODES`)."""
    return code in CLEAR_CODES
