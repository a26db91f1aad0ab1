"""JSON for ``-o json`` command output: a protobuf message as a plain dict that scripts can
use without knowing the protobuf JSON mapping.

protobuf's canonical JSON mapping (``json_format.MessageToDict``) prints 64-bit integers
as strings (``"blocksTotal": "16"``) and omits every field equal to its default (``0``,
``""``, ``false``, empty lists), so a script reading ``nodesMigrated`` gets a KeyError
exactly when the value is 0. :func:`message_to_dict` keeps the mapping's key names and
shapes but always prints fields without presence and prints 64-bit integers as JSON
numbers (Python's ``json`` has no 2^53 limit; jq and Go read them as numbers too).

Upstream: ``google.protobuf.json_format`` (protobuf >= 5.26 names the option
``always_print_fields_with_no_presence``; the older ``including_default_value_fields`` is
gone, and ``proto/pyproject.toml`` requires protobuf >= 6.31).
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

_INT64 = frozenset(
    {
        FieldDescriptor.CPPTYPE_INT64,
        FieldDescriptor.CPPTYPE_UINT64,
    }
)


def message_to_dict(
    message: Message, *, preserving_proto_field_name: bool = False
) -> dict[str, Any]:
    """``message`` as a JSON-ready dict: every field present (defaults included), 64-bit
    integers as ``int``.

    Args:
        message: any generated protobuf message.
        preserving_proto_field_name: keys as in the .proto (``blocks_total``) instead of
            the JSON mapping's lowerCamelCase (``blocksTotal``).

    Returns:
        ``{key: value}`` with str/int/float/bool/list/dict values; enums as names, bytes as
        base64 (as protobuf's JSON mapping); well-known types (``google.protobuf.*``) as
        their JSON mapping.
    """
    data = json_format.MessageToDict(
        message,
        always_print_fields_with_no_presence=True,
        preserving_proto_field_name=preserving_proto_field_name,
    )
    _unquote_int64(message.DESCRIPTOR, data, preserving_proto_field_name)
    return data


def _unquote_int64(descriptor: Any, data: dict[str, Any], proto_names: bool) -> None:
    """Rewrite, in place, the 64-bit integer strings of ``data`` (the dict of one message
    of type ``descriptor``) as ints, recursing into sub-messages, lists and maps."""
    if descriptor.full_name.startswith("google.protobuf."):
        return  # well-known types have their own JSON forms (Duration "1s", Int64Value...)
    for field in descriptor.fields:
        key = field.name if proto_names else field.json_name
        if key not in data:
            continue
        value = data[key]
        message_type = field.message_type
        if message_type is not None and message_type.GetOptions().map_entry:
            value_field = message_type.fields_by_name["value"]
            for map_key, item in value.items():
                value[map_key] = _convert(value_field, item, proto_names)
        elif field.is_repeated:
            data[key] = [_convert(field, item, proto_names) for item in value]
        else:
            data[key] = _convert(field, value, proto_names)


def _convert(field: FieldDescriptor, value: Any, proto_names: bool) -> Any:
    if field.cpp_type in _INT64 and isinstance(value, str):
        return int(value)
    if field.message_type is not None and isinstance(value, dict):
        _unquote_int64(field.message_type, value, proto_names)
    return value
