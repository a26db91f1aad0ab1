"""gRPC health (``grpc.health.v1.Health/Check``) of the agent, as booleans: the one health
client, :mod:`cilia_common.health`."""

from __future__ import annotations

import logging

from cilia_common import health

log = logging.getLogger("cilia_safe_agent_updater.health")


def check(address: str, rpc_timeout: float) -> bool:
    """Return True when ``address`` answers overall status SERVING within ``rpc_timeout`` s.

    Args:
        address: gRPC target, ``host:port`` or ``unix:/path`` (the agent's ``--socket``).
        rpc_timeout: deadline of the one Check call, seconds.

    Any RPC error (nothing listening, NOT_SERVING, deadline) gives False; nothing is raised.
    """
    answer = health.check(address, timeout=rpc_timeout)
    if not answer.serving:
        log.debug(
            "health check failed",
            extra={"address": address, "error": answer.error or answer.status},
        )
    return answer.serving


def wait_serving(address: str, *, attempts: int, interval: float, rpc_timeout: float) -> bool:
    """Poll :func:`check` up to ``attempts`` times, ``interval`` s apart; True once SERVING.

    Worst case about ``attempts * (interval + rpc_timeout)`` seconds.
    """
    answer = health.wait_serving(address, attempts=attempts, interval=interval, timeout=rpc_timeout)
    return answer.serving
