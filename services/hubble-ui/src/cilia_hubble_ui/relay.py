"""The UI's one link to the relay: ``observer.Observer/GetFlows`` over gRPC.

Only the versioned Hubble contract (``proto/``, package ``observer``) is used; the relay is
dialled in plaintext or with TLS (:attr:`cilia_hubble_ui.config.Config.relay_tls`: CA files,
optional client certificate for mutual TLS, the relay's server name), through
:class:`cilia_common.tls.RotatingChannel` so renewed certificate files are picked up for new
streams without a restart. One channel serves every page; each page holds its own stream.

Errors are mapped once, here: :class:`RelayRefused` (the relay refused the request, e.g. a
filter it cannot use: ``INVALID_ARGUMENT``; retrying the same request cannot help) and
:class:`RelayUnavailable` (anything else: not reachable, stream lost; worth retrying).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence

import grpc

from cilia.hubble.flow import flow_pb2
from cilia.hubble.observer import observer_pb2, observer_pb2_grpc
from cilia_common.addresses import dial_target
from cilia_common.tls import ClientTLS, RotatingChannel

log = logging.getLogger("cilia_hubble_ui")

#: Status codes that mean "this request is wrong", not "the relay is away".
_REFUSED = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
    }
)


class RelayError(RuntimeError):
    """A GetFlows call failed.

    Attributes:
        code: the gRPC status code name (``UNAVAILABLE``, ``INVALID_ARGUMENT``, ...).
        details: the relay's message.
    """

    def __init__(self, address: str, code: str, details: str) -> None:
        self.code = code
        self.details = details
        super().__init__(f"relay {address}: {code}: {details}")


class RelayRefused(RelayError):
    """The relay refused the request itself (retrying it unchanged cannot succeed)."""


class RelayUnavailable(RelayError):
    """The relay could not be reached or the stream was lost (retry later)."""


class RelayClient:
    """Streams flows from the relay at ``address``.

    Args:
        address: ``host:port``, ``:port`` or ``unix:/path``.
        tls: TLS files, or None for plaintext.

    Raises (constructor):
        cilia_common.tls.TLSFileError: a TLS file is unusable at start.
    """

    def __init__(self, address: str, tls: ClientTLS | None) -> None:
        self.address = address
        target = dial_target(address)
        self._channel: grpc.aio.Channel = (
            RotatingChannel(target, tls) if tls is not None else grpc.aio.insecure_channel(target)
        )
        self._stub = observer_pb2_grpc.ObserverStub(self._channel)  # type: ignore[no-untyped-call]

    async def flows(
        self,
        whitelist: Sequence[flow_pb2.FlowFilter],
        *,
        number: int,
        follow: bool,
        timeout: float | None = None,
    ) -> AsyncIterator[observer_pb2.GetFlowsResponse]:
        """Yield the GetFlows responses (flows, node status and lost events) of one call.

        Args:
            whitelist: the request's whitelist (``[]``: every flow).
            number: past flows asked for (the last ``number``).
            follow: keep streaming new flows.
            timeout: deadline of the whole call in seconds (None: none; a follow stream).

        Raises:
            RelayRefused: the relay refused the request (e.g. ``INVALID_ARGUMENT``).
            RelayUnavailable: the relay is not reachable or the stream broke.
        """
        request = observer_pb2.GetFlowsRequest(number=number, follow=follow, whitelist=whitelist)
        call = self._stub.GetFlows(request, timeout=timeout)
        try:
            async for response in call:
                yield response
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            error = RelayRefused if code in _REFUSED else RelayUnavailable
            raise error(self.address, code.name, exc.details() or "") from None
        finally:
            call.cancel()

    async def close(self) -> None:
        """Close the channel (streams still open end)."""
        await self._channel.close(None)
