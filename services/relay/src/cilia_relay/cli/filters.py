"""Build ``flow.FlowFilter`` whitelists from ``observe`` flags exactly as ``hubble observe`` does.

Hubble keeps two filters, *left* and *right*, and the result is ``left OR right``:

* either-side flags (``--pod``, ``--port``, ``--label``) add the source field to
  *left* and the destination field to *right*;
* one-sided or symmetric flags (``--from-pod``, ``--to-pod``, ``--verdict``,
  ``--protocol``) add the same field to both;
* when *left* equals *right* a single filter is sent.

Values are passed unchanged (pods as ``namespace/name`` or ``name``, ports as strings,
protocols as typed); they are only validated. ``--pod`` cannot be combined with
``--from-pod`` or ``--to-pod`` (hubble's conflict groups).

Source: hubble ``cmd/observe/flows_filter.go`` behaviour (re-implemented).
"""

from __future__ import annotations

from collections.abc import Sequence

from cilia.hubble.flow import flow_pb2

FILTER_FLAGS = ("pod", "from-pod", "to-pod", "verdict", "port", "protocol", "label")
"""Filter flags of ``observe``, in the spelling of ``hubble observe``."""

CONFLICTS: tuple[tuple[str, ...], ...] = (("from-pod", "pod"), ("to-pod", "pod"))

PROTOCOLS = frozenset({"tcp", "udp", "icmp", "icmpv4", "icmpv6", "sctp", "http", "dns", "kafka"})
"""Protocol names hubble's server-side filter understands (case-insensitive)."""

VERDICTS = tuple(n for n in flow_pb2.Verdict.keys() if n != "VERDICT_UNKNOWN")  # noqa: SIM118


class FilterError(ValueError):
    """A filter flag has a bad value or conflicts with another flag (message names both)."""


def _validate(flag: str, value: str) -> str:
    if flag == "verdict":
        upper = value.upper()
        if upper not in VERDICTS:
            raise FilterError(f"invalid --verdict value: {value!r} (one of {', '.join(VERDICTS)})")
        return upper
    if flag == "port":
        if not value.isdigit() or int(value) > 65535:
            raise FilterError(f"invalid --port value: {value!r} (a number 0-65535)")
        return value
    if flag == "protocol":
        if value.lower() not in PROTOCOLS:
            raise FilterError(
                f"invalid --protocol value: {value!r} (one of {', '.join(sorted(PROTOCOLS))})"
            )
        return value
    if not value or value.strip() != value:
        raise FilterError(f"invalid --{flag} value: {value!r} (must be non-empty)")
    if flag in ("pod", "from-pod", "to-pod") and value.count("/") > 1:
        raise FilterError(f"invalid --{flag} value: {value!r} (use namespace/name or name)")
    return value


def build_whitelist(flags: Sequence[tuple[str, str]]) -> list[flow_pb2.FlowFilter]:
    """Turn ``[(flag, value), ...]`` (command-line order) into the GetFlows whitelist.

    Args:
        flags: pairs such as ``("pod", "default/frontend")``, ``("verdict", "DROPPED")``;
            flag names are those of :data:`FILTER_FLAGS`.

    Returns:
        ``[]`` without filter flags, ``[f]`` when left and right are equal, else
        ``[left, right]``.

    Raises:
        FilterError: a bad value (unknown verdict, port not 0-65535, unknown protocol,
            empty pod/label) or conflicting flags (``--pod`` with ``--from-pod``/``--to-pod``).
    """
    seen: list[str] = []
    left: flow_pb2.FlowFilter | None = None
    right: flow_pb2.FlowFilter | None = None
    for flag, raw in flags:
        if flag not in FILTER_FLAGS:
            raise FilterError(f"unknown filter flag --{flag}")
        if flag not in seen:
            seen.append(flag)
        for group in CONFLICTS:
            used = [name for name in group if name in seen]
            if len(used) > 1:
                raise FilterError(f"filters --{used[0]} and --{used[1]} cannot be combined")
        value = _validate(flag, raw)
        if left is None:
            left = flow_pb2.FlowFilter()
        if right is None:
            right = flow_pb2.FlowFilter()
        if flag == "pod":
            left.source_pod.append(value)
            right.destination_pod.append(value)
        elif flag == "port":
            left.source_port.append(value)
            right.destination_port.append(value)
        elif flag == "label":
            left.source_label.append(value)
            right.destination_label.append(value)
        else:
            for side in (left, right):
                if flag == "from-pod":
                    side.source_pod.append(value)
                elif flag == "to-pod":
                    side.destination_pod.append(value)
                elif flag == "verdict":
                    side.verdict.append(flow_pb2.Verdict.Value(value))  # type: ignore[arg-type]
                elif flag == "protocol":
                    side.protocol.append(value)
    if left is None or right is None:
        return []
    if left == right:
        return [left]
    return [left, right]
