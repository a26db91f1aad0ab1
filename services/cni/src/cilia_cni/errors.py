"""CNI errors: one exception type per failure a runtime or operator can act on.

Every error becomes the spec's error JSON on stdout
(``{"cniVersion", "code", "msg", "details"}``) with a non-zero exit status.

Codes 0-99 are reserved by the CNI spec (anchors.md §2; libcni ``pkg/types/types.go``);
100 and up are plugin-specific and documented in services/cni/README.md.
"""

from __future__ import annotations

# CNI spec / libcni codes.
INCOMPATIBLE_VERSION = 1
UNKNOWN_CONTAINER = 3
INVALID_ENVIRONMENT = 4
IO_FAILURE = 5
DECODING_FAILURE = 6
INVALID_NETWORK_CONFIG = 7
INVALID_NETNS = 8
TRY_AGAIN_LATER = 11
PLUGIN_NOT_AVAILABLE = 50
INTERNAL = 999
# Plugin-specific codes (>= 100).
ATTACHMENT_EXISTS = 100
POOL_EXHAUSTED = 101
CHECK_MISMATCH = 102


class CniError(Exception):
    """Base of every error the plugin reports to the runtime.

    Attributes:
        code: CNI error code (class attribute of each subclass).
        msg: one-line human-readable message naming the offending input.
        details: optional longer text (e.g. the agent's gRPC status and message).
    """

    code = INTERNAL

    def __init__(self, msg: str, details: str = "") -> None:
        super().__init__(msg)
        self.msg = msg
        self.details = details


class IncompatibleVersion(CniError):
    """The netconf's ``cniVersion`` is not one this plugin speaks (code 1)."""

    code = INCOMPATIBLE_VERSION


class UnknownContainer(CniError):
    """CHECK: the agent holds no attachment (CNI_CONTAINERID, CNI_IFNAME) (code 3)."""

    code = UNKNOWN_CONTAINER


class InvalidEnvironment(CniError):
    """A required CNI_* environment variable is missing or malformed (code 4)."""

    code = INVALID_ENVIRONMENT


class IOFailure(CniError):
    """stdin could not be read (code 5)."""

    code = IO_FAILURE


class DecodingFailure(CniError):
    """stdin is not a UTF-8 JSON object (code 6)."""

    code = DECODING_FAILURE


class InvalidNetworkConfig(CniError):
    """A netconf field is missing or has a bad value; the field is named (code 7).

    Also used when the agent rejects a request field (gRPC INVALID_ARGUMENT).
    """

    code = INVALID_NETWORK_CONFIG


class InvalidNetNS(CniError):
    """The agent cannot find the network namespace CNI_NETNS (code 8, libcni ErrInvalidNetNS)."""

    code = INVALID_NETNS


class AgentUnavailable(CniError):
    """cilia-agent is not reachable, not ready, or did not answer in time (code 11).

    The runtime retries later (kubelet retries pod sandbox creation).
    """

    code = TRY_AGAIN_LATER


class AgentUnreachable(AgentUnavailable):
    """cilia-agent's socket is absent or refuses connections: nobody answered (code 11).

    DEL queues itself on disk in this case (the agent replays the queue at start).
    """


class PluginNotAvailable(CniError):
    """STATUS: the agent is unreachable, not ready, or has no free address (code 50)."""

    code = PLUGIN_NOT_AVAILABLE


class AgentTimeout(AgentUnavailable):
    """cilia-agent did not answer within the netconf timeout (code 11).

    After an ADD timeout the plugin asks the agent to Del the attachment, since the agent
    may still complete the ADD.
    """


class AttachmentExists(CniError):
    """CNI_IFNAME already exists in the netns (code 100, gRPC ALREADY_EXISTS)."""

    code = ATTACHMENT_EXISTS


class PoolExhausted(CniError):
    """The node's IPAM pool has no free address (code 101, gRPC RESOURCE_EXHAUSTED)."""

    code = POOL_EXHAUSTED


class CheckMismatch(CniError):
    """CHECK: the netns or the endpoint differs from prevResult (code 102, gRPC
    FAILED_PRECONDITION); the message lists every difference the agent found."""

    code = CHECK_MISMATCH


class InternalError(CniError):
    """Anything else: an unexpected agent status or a plugin bug (code 999, libcni ErrInternal)."""

    code = INTERNAL
