"""Endpoint lifecycle (create, delete, check, GC, restore) and its state files."""

from cilia_agent.endpoint.errors import (
    AgentNotReady,
    CheckFailed,
    EndpointConflict,
    InvalidRequest,
    UnknownAttachment,
)
from cilia_agent.endpoint.manager import EndpointManager
from cilia_agent.endpoint.params import AddParams, CheckParams
from cilia_agent.endpoint.restore import RestoreReport
from cilia_agent.endpoint.state import EndpointRecord, StateError, StateStore

__all__ = [
    "AddParams",
    "AgentNotReady",
    "CheckFailed",
    "CheckParams",
    "EndpointConflict",
    "EndpointManager",
    "EndpointRecord",
    "InvalidRequest",
    "RestoreReport",
    "StateError",
    "StateStore",
    "UnknownAttachment",
]
