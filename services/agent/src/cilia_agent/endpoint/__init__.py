"""Endpoint lifecycle (create, delete, restore) and its state files."""

from cilia_agent.endpoint.manager import (
    AddParams,
    AgentNotReady,
    EndpointConflict,
    EndpointManager,
    InvalidRequest,
    RestoreReport,
)
from cilia_agent.endpoint.state import EndpointRecord, NodeState, StateError, StateStore

__all__ = [
    "AddParams",
    "AgentNotReady",
    "EndpointConflict",
    "EndpointManager",
    "EndpointRecord",
    "InvalidRequest",
    "NodeState",
    "RestoreReport",
    "StateError",
    "StateStore",
]
