"""A client channel that follows renewed TLS files: :class:`RotatingChannel`, a
:class:`cilia_common.channels.SwappableChannel` whose new calls go to a channel dialled from the
files as they are when the call starts."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import grpc

from ..channels import SwappableChannel
from .files import ClientTLS, TLSFileError, channel_credentials, channel_options, file_stamp

log = logging.getLogger(__name__)


class RotatingChannel(SwappableChannel):
    """A ``grpc.aio.Channel`` whose calls go to a secure channel built from ``tls``'s
    files as they were when the call started: when a file changed (mtime, size, inode) and
    the new files are usable, new calls go to a new channel built from them. Calls already
    running keep their channel; superseded channels are closed by :meth:`close`
    (rotations are rare, so they are few).

    Multi-callables (what stubs hold) resolve the channel at each call, so a stub made once
    follows rotations.

    Raises (constructor):
        TLSFileError: the files are unusable at start.
    """

    def __init__(
        self, target: str, tls: ClientTLS, options: Sequence[tuple[str, Any]] = ()
    ) -> None:
        super().__init__()
        self._target = target
        self._tls = tls
        self._options = [*options, *channel_options(tls)]
        self._stamp = file_stamp(tls.paths())
        self.swap(self._dial())

    def _dial(self) -> grpc.aio.Channel:
        return grpc.aio.secure_channel(
            self._target, channel_credentials(self._tls), options=self._options
        )

    def current(self) -> grpc.aio.Channel:
        """The channel for a new call (a new one when the files changed and are usable).

        Raises:
            grpc.aio.UsageError: the channel was closed.
        """
        if self._current is None:
            raise grpc.aio.UsageError("Channel is closed.")
        stamp = file_stamp(self._tls.paths())
        if stamp != self._stamp:
            try:
                fresh = self._dial()
            except TLSFileError as exc:
                log.warning(
                    "TLS client files changed but cannot be used", extra={"error": str(exc)}
                )
            else:
                self.swap(fresh)
                self._stamp = stamp
                log.info("TLS client files reloaded", extra={"target": self._target})
        return self._current
