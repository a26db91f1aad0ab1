"""PolicyService: every CiliumNetworkPolicy, CiliumClusterwideNetworkPolicy and
NetworkPolicy, then changes (a cluster-wide policy's events carry an empty namespace)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from cilia.controlplane.v1 import controlplane_pb2 as pb

from ..kinds import CCNP, CNP, NETWORK_POLICY
from ..store import Resource, Store, resource_version
from .errors import streaming
from .streams import WATCH_MESSAGE_MAX_BYTES, Changed, Listed, Sent, watch_stream

log = logging.getLogger(__name__)

PolicyKey = tuple[str, str, str]  # kind, namespace, name


def _key(kind: str, obj: Resource) -> PolicyKey:
    meta = obj.get("metadata") or {}
    namespace = "" if kind == CCNP.kind else str(meta.get("namespace") or "default")
    return kind, namespace, str(meta.get("name") or "")


def policy_event(kind: str, obj: Resource) -> pb.PolicyEvent:
    """An upsert ``PolicyEvent`` carrying the record as JSON (``metadata.namespace`` set)."""
    _, namespace, name = _key(kind, obj)
    return pb.PolicyEvent(
        type=pb.EVENT_TYPE_UPSERT,
        kind=kind,
        namespace=namespace,
        name=name,
        json=json.dumps(obj, sort_keys=True),
        resource_version=resource_version(obj),
    )


class PolicyServicer:
    """``cilia.controlplane.v1.PolicyService``.

    Args:
        store: the Store; chunk_size / queue_size: ``--watch-list-chunk-size`` /
        ``--watch-buffer-size``; max_bytes: ``--watch-max-message-bytes`` (bytes of one
        stream message at most).
    """

    def __init__(
        self,
        store: Store,
        *,
        chunk_size: int,
        queue_size: int,
        max_bytes: int = WATCH_MESSAGE_MAX_BYTES,
    ) -> None:
        self.store = store
        self.chunk_size = chunk_size
        self.queue_size = queue_size
        self.max_bytes = max_bytes

    @streaming
    async def WatchPolicies(  # noqa: N802 (gRPC method name)
        self, request: pb.WatchPoliciesRequest, context: Any
    ) -> AsyncIterator[pb.WatchPoliciesResponse]:
        """Every policy of the three kinds (``synced`` on the last message of the listing), then
        each create/update (UPSERT with JSON) and delete (DELETE, empty JSON).

        Errors: UNAVAILABLE.
        """
        sent: Sent[PolicyKey, pb.PolicyEvent] = Sent()

        def delete(key: PolicyKey) -> pb.PolicyEvent:
            kind, namespace, name = key
            return pb.PolicyEvent(
                type=pb.EVENT_TYPE_DELETE, kind=kind, namespace=namespace, name=name
            )

        def apply(item: Listed | Changed) -> list[pb.PolicyEvent]:
            if isinstance(item, Listed):
                current = {_key(item.kind, o): policy_event(item.kind, o) for o in item.items}
                changes = sent.replace(current, scope=lambda k: k[0] == item.kind)
            else:
                key = _key(item.kind, item.event.object)
                if item.event.type == "DELETED":
                    changes = sent.set(key, None)
                else:
                    changes = sent.set(key, policy_event(item.kind, item.event.object))
            return [message or delete(key) for key, message in changes]

        def respond(events: Sequence[pb.PolicyEvent], synced: bool) -> pb.WatchPoliciesResponse:
            return pb.WatchPoliciesResponse(events=events, synced=synced)

        async for response in watch_stream(
            self.store,
            [CNP.kind, CCNP.kind, NETWORK_POLICY.kind],
            apply,
            respond,
            key=lambda e: (e.kind, e.namespace, e.name),
            chunk_size=self.chunk_size,
            queue_size=self.queue_size,
            max_bytes=self.max_bytes,
        ):
            yield response
