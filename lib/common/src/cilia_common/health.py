"""The one gRPC health client: ask a server ``grpc.health.v1.Health/Check`` once
(:func:`check`) or until it answers SERVING (:func:`wait_serving`, polled with tenacity).

Every Cilia server registers the standard health service (:mod:`cilia_common.grpcserver`), so
an image's HEALTHCHECK, the safe-agent-updater's wait for a new agent and the tests ask the
same question the same way. Plaintext only (what the probes reach: the agent's unix socket,
the servers' local health ports).

Source: the gRPC health checking protocol (``grpc.health.v1``): the empty service name asks
for the server's overall status.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import tenacity
from grpc_health.v1 import health_pb2, health_pb2_grpc

__all__ = ["HealthAnswer", "check", "wait_serving"]


@dataclass(frozen=True)
class HealthAnswer:
    """One Check's outcome.

    Attributes:
        status: the serving status name (``SERVING``, ``NOT_SERVING``, ``SERVICE_UNKNOWN``,
            ``UNKNOWN``), "" when the call failed.
        error: ``"CODE: details"`` of the failed call ("" when it answered).
    """

    status: str
    error: str = ""

    @property
    def serving(self) -> bool:
        """The server answered SERVING."""
        return self.status == "SERVING"


def check(address: str, *, service: str = "", timeout: float = 3.0) -> HealthAnswer:
    """One ``Health/Check`` of ``service`` at ``address`` within ``timeout`` seconds.

    Args:
        address: gRPC target, ``host:port`` or ``unix:/path``.
        service: the service asked about; "" = the server's overall status.
        timeout: the call's deadline, seconds.

    Returns:
        the answer; nothing is raised for a failed call (nothing listening, deadline,
        UNIMPLEMENTED: :attr:`HealthAnswer.error` says which).
    """
    with grpc.insecure_channel(address) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as exc:
            return HealthAnswer("", f"{exc.code().name}: {exc.details()}")
    return HealthAnswer(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))


def wait_serving(
    address: str,
    *,
    attempts: int,
    interval: float,
    timeout: float,
    service: str = "",
) -> HealthAnswer:
    """Ask :func:`check` up to ``attempts`` times (at least once), ``interval`` seconds apart,
    until it answers SERVING; returns the last answer (worst case about
    ``attempts * (interval + timeout)`` seconds)."""
    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(max(1, attempts)),
        wait=tenacity.wait_fixed(interval),
        retry=tenacity.retry_if_result(lambda answer: not answer.serving),
        retry_error_callback=lambda state: state.outcome.result() if state.outcome else None,
    )
    answer: HealthAnswer = retrying(check, address, service=service, timeout=timeout)
    return answer
