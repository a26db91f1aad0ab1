"""Errors of the endpoint layer (mapped to gRPC status codes in ``cilia_agent.api``)."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request field is invalid; ``field`` names it (INVALID_ARGUMENT)."""

    def __init__(self, field_name: str, reason: str) -> None:
        self.field = field_name
        super().__init__(f"{field_name}: {reason}")


class AgentNotReady(Exception):
    """The agent (or the endpoint) cannot serve the request yet; retry later (UNAVAILABLE)."""


class EndpointConflict(Exception):
    """The attachment key already exists with a different netns (ALREADY_EXISTS)."""

    def __init__(self, container_id: str, ifname: str, netns: str) -> None:
        self.container_id = container_id
        self.ifname = ifname
        super().__init__(
            f"attachment ({container_id}, {ifname}) already exists in network namespace {netns!r}"
        )


class UnknownAttachment(LookupError):
    """No endpoint for ``(container_id, ifname)`` (NOT_FOUND; CNI code 3 in CHECK)."""

    def __init__(self, container_id: str, ifname: str) -> None:
        self.container_id = container_id
        self.ifname = ifname
        super().__init__(
            f"unknown attachment ({container_id}, {ifname}): the agent holds no endpoint for it"
        )


class CheckFailed(Exception):
    """CHECK found differences (FAILED_PRECONDITION); ``differences`` lists every one."""

    def __init__(self, container_id: str, ifname: str, differences: list[str]) -> None:
        self.differences = differences
        super().__init__(
            f"attachment ({container_id}, {ifname}) does not match: " + "; ".join(differences)
        )
