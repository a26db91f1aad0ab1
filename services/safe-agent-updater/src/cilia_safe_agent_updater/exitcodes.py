"""Exit codes of ``cilia-safe-agent-updater`` (one per failure) and the error that carries one.

The table (also in README.md) is the contract with whoever runs the updater: the kubelet
(init container: any non-zero status makes it retry with back-off and stops the
DaemonSet rollout at ``maxUnavailable: 1``), a systemd unit or a CI script.
"""

from __future__ import annotations

import enum


class Exit(enum.IntEnum):
    """Process exit status of ``cilia-safe-agent-updater`` (see README.md, "Exit codes")."""

    OK = 0
    """Up to date, or the agent was replaced and is healthy."""
    USAGE = 2
    """Bad flags or missing input (``--node-name``/``NODE_NAME``, ``--image``, a bad file)."""
    API_UNAVAILABLE = 3
    """The Kubernetes API server / Docker engine / Redis kept failing after the retries."""
    DAEMONSET_NOT_FOUND = 10
    """The agent DaemonSet does not exist."""
    ANNOTATION_MISSING = 11
    """The agent DaemonSet's pod template has no (or an empty) generation annotation."""
    NO_AGENT_POD = 12
    """No agent pod is scheduled on this node."""
    MULTIPLE_AGENT_PODS = 13
    """More than one agent pod is on this node (the updater refuses to pick one)."""
    IMAGES_MISSING = 14
    """A desired agent image is not on the node (prepull did not run or failed)."""
    REPLACEMENT_MISSING = 15
    """Exactly one replacement pod did not appear within the attempts."""
    REPLACEMENT_NOT_READY = 16
    """The replacement pod did not become Ready within the attempts."""
    AGENT_UNHEALTHY = 17
    """The agent's gRPC health did not report SERVING within the attempts/timeout."""
    LOCK_TIMEOUT = 18
    """No update slot (Lease or Redis lock) could be taken within the wait timeout."""
    GENERATION_SKEW = 19
    """``--expected-generation`` differs from the agent DaemonSet's (apply still in progress)."""
    CONTAINER_NOT_FOUND = 20
    """Docker mode: no agent container of that name."""
    IMAGE_UNAVAILABLE = 21
    """Docker mode: the desired image is neither present nor pullable."""
    ROLLED_BACK = 22
    """Docker mode: the new image never became healthy; the previous one runs again."""
    ROLLBACK_FAILED = 23
    """Docker mode: the new image failed and the previous one did not come back healthy."""


class UpdaterError(Exception):
    """A failure that ends the run with ``code``; ``str()`` is the human-readable reason."""

    def __init__(self, code: Exit, message: str) -> None:
        super().__init__(message)
        self.code = code
