"""Datapath failures a caller can act on."""

from __future__ import annotations


class DatapathError(Exception):
    """Kernel plumbing failed (operation, interface and reason in the message)."""


class NetnsNotFound(DatapathError):
    """The network namespace path does not exist or is not a network namespace."""

    def __init__(self, netns: str, reason: str = "does not exist") -> None:
        self.netns = netns
        super().__init__(f"network namespace {netns!r} {reason}")


class InterfaceExists(DatapathError):
    """An interface named ``ifname`` already exists in ``netns``."""

    def __init__(self, ifname: str, netns: str) -> None:
        self.ifname = ifname
        self.netns = netns
        super().__init__(f"interface {ifname!r} already exists in network namespace {netns!r}")


class DefaultRouteExists(DatapathError):
    """``netns`` already has an IPv4 default route (via ``via``, an interface name).

    A second Cilia interface in one netns (``CNI_IFNAME=net1`` next to our ``eth0``) is
    refused up front: its default route would collide. gRPC INVALID_ARGUMENT.
    """

    def __init__(self, netns: str, via: str) -> None:
        self.netns = netns
        self.via = via
        super().__init__(
            f"network namespace {netns!r} already has a default route via {via}; "
            "a second Cilia interface is not supported"
        )


class HostNetns(DatapathError):
    """``netns`` is the agent's own network namespace (the host's, e.g. ``/proc/1/ns/net``
    or ``/proc/<agent pid>/ns/net``): the pod end, its address and a default route would be
    put on the host. Refused before anything is created. gRPC INVALID_ARGUMENT."""

    def __init__(self, netns: str) -> None:
        self.netns = netns
        super().__init__(
            f"network namespace {netns!r} is the agent's own (the host's), not a pod's"
        )


class IptablesError(DatapathError):
    """An iptables command failed (command line and stderr in the message)."""


class BpfUnavailable(RuntimeError):
    """A compiled BPF object cannot be found or loaded: missing or stale ``.o`` (the message
    names ``make bpf``), bpffs not usable, or libbpf/the verifier refused it (libbpf's
    message and the verifier log's tail in the message)."""

    def __init__(self, message: str, *, kernel: bool = False) -> None:
        """``kernel``: the host's side failed (bpffs not usable, the kernel or its verifier
        refused the load), where ``--enable-bpf=false`` is a way to run at all; False for
        what a build or a flag fixes (a missing or stale object, a pinned map's size)."""
        super().__init__(message)
        self.kernel = kernel
