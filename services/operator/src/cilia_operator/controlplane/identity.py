"""IdentityService: Allocate / Release / WatchIdentities (CiliumIdentity records)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from cilia.controlplane.v1 import controlplane_pb2 as pb

from ..identity import records
from ..identity.allocator import IdentityAllocator
from ..identity.labels import LabelSet
from ..metrics import Metrics
from ..store import Store
from .errors import streaming, unary
from .streams import WATCH_MESSAGE_MAX_BYTES, Changed, Listed, Sent, watch_stream

log = logging.getLogger(__name__)


def identity_message(record: dict[str, Any]) -> pb.Identity | None:
    """A CiliumIdentity record as ``Identity`` (None when malformed)."""
    identity = records.identity_id(record)
    labels = records.record_labels(record)
    if identity == 0 or labels is None:
        return None
    return pb.Identity(id=identity, labels=labels.strings())


class IdentityServicer:
    """``cilia.controlplane.v1.IdentityService``.

    Args:
        store: the Store; allocator: allocates and releases;
        chunk_size / queue_size: ``--watch-list-chunk-size`` / ``--watch-buffer-size``;
        max_bytes: ``--watch-max-message-bytes`` (bytes of one stream message at most).
    """

    def __init__(
        self,
        store: Store,
        allocator: IdentityAllocator,
        *,
        chunk_size: int,
        queue_size: int,
        max_bytes: int = WATCH_MESSAGE_MAX_BYTES,
        metrics: Metrics | None = None,
    ) -> None:
        self.store = store
        self.allocator = allocator
        self.chunk_size = chunk_size
        self.queue_size = queue_size
        self.max_bytes = max_bytes
        self.metrics = metrics

    @unary
    async def Allocate(  # noqa: N802 (gRPC method name)
        self, request: pb.AllocateRequest, context: Any
    ) -> pb.AllocateResponse:
        """The identity of the label set, created if needed; references ``node_name``.

        Errors: INVALID_ARGUMENT (empty/malformed labels), RESOURCE_EXHAUSTED (no free
        id), ABORTED (contention; retry), UNAVAILABLE (store down).
        """
        labels = LabelSet.parse(request.labels)
        identity, created = await self.allocator.allocate(request.node_name, labels)
        if created and self.metrics is not None:
            self.metrics.identities_allocated.inc()
        return pb.AllocateResponse(
            identity=pb.Identity(id=identity, labels=labels.strings()), created=created
        )

    @unary
    async def Release(  # noqa: N802 (gRPC method name)
        self, request: pb.ReleaseRequest, context: Any
    ) -> pb.ReleaseResponse:
        """Drop ``node_name``'s reference to identity ``id`` (absent: no-op).

        Errors: INVALID_ARGUMENT (no node_name), ABORTED, UNAVAILABLE.
        """
        if not request.node_name:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "node_name: empty")
        await self.allocator.release(request.node_name, request.id)
        return pb.ReleaseResponse()

    @streaming
    async def WatchIdentities(  # noqa: N802 (gRPC method name)
        self, request: pb.WatchIdentitiesRequest, context: Any
    ) -> AsyncIterator[pb.WatchIdentitiesResponse]:
        """Every identity (``synced`` on the last message of the listing), then changes.

        Only changes of the id or labels are sent (not of references or GC marks).
        Errors: UNAVAILABLE.
        """
        sent: Sent[int, pb.Identity] = Sent()

        def apply(item: Listed | Changed) -> list[pb.IdentityEvent]:
            if isinstance(item, Listed):
                previous = dict(sent.sent)
                current = {}
                for record in item.items:
                    message = identity_message(record)
                    if message is not None:
                        current[message.id] = message
                changes = sent.replace(current)
            else:
                identity = records.identity_id(item.event.object)
                if not identity:
                    return []
                previous = {identity: sent.sent[identity]} if identity in sent.sent else {}
                deleted = item.event.type == "DELETED"
                changes = sent.set(
                    identity, None if deleted else identity_message(item.event.object)
                )
            return [
                pb.IdentityEvent(type=pb.EVENT_TYPE_UPSERT, identity=message)
                if message is not None
                else pb.IdentityEvent(type=pb.EVENT_TYPE_DELETE, identity=previous[key])
                for key, message in changes
            ]

        def respond(events: Sequence[pb.IdentityEvent], synced: bool) -> pb.WatchIdentitiesResponse:
            return pb.WatchIdentitiesResponse(events=events, synced=synced)

        async for response in watch_stream(
            self.store,
            [records.KIND],
            apply,
            respond,
            key=lambda e: e.identity.id,
            chunk_size=self.chunk_size,
            queue_size=self.queue_size,
            max_bytes=self.max_bytes,
        ):
            yield response
