"""The node's own state kept across restarts (``node.json`` under ``--state-dir``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["NodeState"]


class NodeState(BaseModel):
    """Node-level state kept across restarts.

    Attributes:
        router_ip: the node's router IP (first usable address of its first CIDR), or "".
        default_pool: default pool name the operator announced.
        allocation: last allocation seen, ``pool -> [cidr, ...]``.
        registered: the operator accepted this node at least once.
    """

    model_config = ConfigDict(extra="ignore")

    router_ip: str = ""
    default_pool: str = ""
    allocation: dict[str, list[str]] = Field(default_factory=dict)
    registered: bool = False
