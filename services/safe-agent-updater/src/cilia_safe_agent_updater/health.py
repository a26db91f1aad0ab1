"""gRPC health (``grpc.health.v1.Health/Check``) of the agent, polled with tenacity."""

from __future__ import annotations

import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tenacity import RetryError, Retrying, retry_if_result, stop_after_attempt, wait_fixed

log = logging.getLogger("cilia_safe_agent_updater.health")


def check(address: str, rpc_timeout: float) -> bool:
    """Return True when ``address`` answers overall status SERVING within ``rpc_timeout`` s.

    Args:
        address: gRPC target, ``host:port`` or ``unix:/path`` (the agent's ``--socket``).
        rpc_timeout: deadline of the one Check call, seconds.

    Any RPC error (nothing listening, NOT_SERVING, deadline) gives False; nothing is raised.
    """
    try:
        with grpc.insecure_channel(address) as channel:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=rpc_timeout
            )
    except grpc.RpcError as exc:
        log.debug("health check failed", extra={"address": address, "error": str(exc)})
        return False
    return bool(response.status == health_pb2.HealthCheckResponse.SERVING)


def wait_serving(address: str, *, attempts: int, interval: float, rpc_timeout: float) -> bool:
    """Poll :func:`check` up to ``attempts`` times, ``interval`` s apart; True once SERVING.

    Worst case about ``attempts * (interval + rpc_timeout)`` seconds.
    """
    retrying = Retrying(
        stop=stop_after_attempt(max(1, attempts)),
        wait=wait_fixed(interval),
        retry=retry_if_result(lambda ok: not ok),
    )
    try:
        return bool(retrying(check, address, rpc_timeout))
    except RetryError:
        return False
