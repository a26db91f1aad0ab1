"""Endpoint lifecycle (create, delete, check, GC, restore) and its state files."""

from cilia_agent.endpoint.errors import (
    AgentNotReady,
    CheckFailed,
    EndpointConflict,
    InvalidRequest,
    UnknownAttachment,
)
from cilia_agent.endpoint.manager import (
    AddParams,
    CheckParams,
    EndpointManager,
    RestoreReport,
)
from cilia_agent.endpoint.state import EndpointRecord, NodeState, StateError, StateStore

__all__ = [
    "AddParams",
    "AgentNotReady",
    "CheckFailed",
    "CheckParams",
    "EndpointConflict",
    "EndpointManager",
    "EndpointRecord",
    "InvalidRequest",
    "NodeState",
    "RestoreReport",
    "StateError",
    "StateStore",
    "UnknownAttachment",
]
