"""A ``grpc.aio.Channel`` whose calls go to whichever channel is current when each call starts:
:class:`SwappableChannel`, the base of a client channel that changes under its stubs (renewed
TLS files: :class:`cilia_common.tls.RotatingChannel`; newly discovered server addresses: the
agent's operator discovery)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Self

import grpc


class SwappableChannel(grpc.aio.Channel):  # type: ignore[misc]  # grpc has no stubs
    """A ``grpc.aio.Channel`` that forwards every call to :meth:`current`, asked at each call.

    Multi-callables (what stubs hold) resolve the channel at each call, so a stub made once
    follows every swap; calls already running keep the channel they started on. A subclass
    supplies :meth:`current` and puts a new channel in place with :meth:`swap`; the channels
    it replaced are kept until :meth:`close` closes them with the current one (swaps are rare:
    a file renewal, an address change; so they are few).

    Attributes:
        generation: how many times :meth:`swap` replaced a channel.
    """

    def __init__(self) -> None:
        self._current: grpc.aio.Channel | None = None
        self._retired: list[grpc.aio.Channel] = []
        self.generation = 0

    def current(self) -> grpc.aio.Channel:
        """The channel for a new call (the subclass decides; it may :meth:`swap` first)."""
        raise NotImplementedError

    def swap(self, fresh: grpc.aio.Channel) -> None:
        """Send new calls to ``fresh``; the channel it replaces is closed by :meth:`close`."""
        if self._current is not None:
            self._retired.append(self._current)
            self.generation += 1
        self._current = fresh

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Bound(self, "unary_unary", method, args, kwargs)

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Bound(self, "unary_stream", method, args, kwargs)

    def stream_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Bound(self, "stream_unary", method, args, kwargs)

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Bound(self, "stream_stream", method, args, kwargs)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self.current().get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self.current().wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self.current().channel_ready()

    async def close(self, grace: float | None = None) -> None:
        """Close the current channel and every replaced one (a call after this raises
        ``grpc.aio.UsageError`` in :class:`cilia_common.tls.RotatingChannel`; a subclass may
        open anew)."""
        channels = [c for c in (self._current, *self._retired) if c is not None]
        self._current, self._retired = None, []
        await asyncio.gather(*(c.close(grace) for c in channels))

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        await self.close(None)


@dataclass
class _Bound:
    """A multi-callable that binds to :meth:`SwappableChannel.current` at each call."""

    owner: SwappableChannel
    kind: str
    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        channel = self.owner.current()
        return getattr(channel, self.kind)(self.method, *self.args, **self.kwargs)(*args, **kwargs)
