"""peer.Peer Notify: every known peer first as PEER_ADDED, then changes in order."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia.hubble.peer import peer_pb2, peer_pb2_grpc
from cilia_agent.hubble.peer import PeerInfo, PeerRegistry, PeerServicer, peer_from_node
from cilia_common import grpcserver

from .helpers import run

LOCAL = PeerInfo("node-b", "10.0.0.2:4244")


@pytest.fixture
def sock() -> Iterator[str]:
    path = Path(tempfile.mkdtemp(prefix="hbp-", dir="/tmp"))
    yield f"unix:{path}/hubble.sock"
    shutil.rmtree(path, ignore_errors=True)


def summary(notes: list[peer_pb2.ChangeNotification]) -> list[tuple[str, str, str]]:
    return [(peer_pb2.ChangeNotificationType.Name(n.type), n.name, n.address) for n in notes]


def node_event(
    name: str, ip: str, kind: int = cp.EVENT_TYPE_UPSERT, hubble: str = ""
) -> cp.NodeEvent:
    return cp.NodeEvent(type=kind, node=cp.Node(name=name, addresses=[ip], hubble_address=hubble))  # type: ignore[arg-type]


def test_notify_sends_known_peers_then_changes_in_order(sock: str) -> None:
    async def main() -> list[peer_pb2.ChangeNotification]:
        registry = PeerRegistry(LOCAL)
        registry.upsert(PeerInfo("node-c", "10.0.0.3:4244"))
        registry.upsert(PeerInfo("node-a", "10.0.0.1:4244"))
        service = grpcserver.Service(
            peer_pb2_grpc.add_PeerServicer_to_server, PeerServicer(registry), "peer.Peer"
        )
        server, _ = await grpcserver.start_server([service], [sock])
        try:
            async with grpc.aio.insecure_channel(sock) as channel:
                call = peer_pb2_grpc.PeerStub(channel).Notify(peer_pb2.NotifyRequest())
                got = [await call.read() for _ in range(3)]
                registry.upsert(PeerInfo("node-d", "10.0.0.4:4244"))
                registry.upsert(PeerInfo("node-a", "10.0.0.11:4244"))
                registry.upsert(PeerInfo("node-a", "10.0.0.11:4244"))  # unchanged: nothing sent
                registry.delete("node-c")
                registry.delete(LOCAL.name)  # the local node always stays
                registry.delete("unknown")
                registry.upsert(PeerInfo("node-e", "10.0.0.5:4244"))
                got += [await asyncio.wait_for(call.read(), 2) for _ in range(4)]
                call.cancel()
                return got
        finally:
            await server.stop(None)

    assert summary(run(main())) == [
        ("PEER_ADDED", "node-a", "10.0.0.1:4244"),
        ("PEER_ADDED", "node-b", "10.0.0.2:4244"),
        ("PEER_ADDED", "node-c", "10.0.0.3:4244"),
        ("PEER_ADDED", "node-d", "10.0.0.4:4244"),
        ("PEER_UPDATED", "node-a", "10.0.0.11:4244"),
        ("PEER_DELETED", "node-c", "10.0.0.3:4244"),
        ("PEER_ADDED", "node-e", "10.0.0.5:4244"),
    ]


def test_local_node_alone_is_announced_without_tls() -> None:
    async def main() -> peer_pb2.ChangeNotification:
        stream = PeerRegistry(LOCAL).subscribe()
        note = await stream.__anext__()
        await stream.aclose()  # type: ignore[attr-defined]
        return note

    note = run(main())
    assert summary([note]) == [("PEER_ADDED", "node-b", "10.0.0.2:4244")]
    assert not note.HasField("tls")


async def _stream(responses: list[cp.WatchNodesResponse]) -> AsyncIterator[cp.WatchNodesResponse]:
    for r in responses:
        yield r
        await asyncio.sleep(0)


def test_watch_nodes_stream_resyncs_then_applies_changes() -> None:
    async def main() -> tuple[list[str], list[tuple[str, str, str]]]:
        registry = PeerRegistry(LOCAL)
        registry.upsert(PeerInfo("stale", "10.0.0.9:4244"))  # gone while we were not watching
        stream = registry.subscribe()
        initial = [await stream.__anext__() for _ in range(2)]
        await registry.consume_watch(
            _stream(
                [
                    cp.WatchNodesResponse(events=[node_event("node-a", "10.0.0.1")]),
                    cp.WatchNodesResponse(
                        events=[
                            node_event("node-b", "10.9.9.9"),  # ourselves: ignored
                            node_event("node-c", "10.0.0.3", hubble="10.0.0.3:5555"),
                        ],
                        synced=True,
                    ),
                    cp.WatchNodesResponse(events=[node_event("node-a", "", cp.EVENT_TYPE_DELETE)]),
                ]
            )
        )
        changes = [await asyncio.wait_for(stream.__anext__(), 1) for _ in range(4)]
        await stream.aclose()  # type: ignore[attr-defined]
        return [p.name for p in registry.peers()], summary(initial + changes)

    names, notes = run(main())
    assert names == ["node-b", "node-c"]
    assert notes == [
        ("PEER_ADDED", "node-b", "10.0.0.2:4244"),
        ("PEER_ADDED", "stale", "10.0.0.9:4244"),
        ("PEER_DELETED", "stale", "10.0.0.9:4244"),
        ("PEER_ADDED", "node-a", "10.0.0.1:4244"),
        ("PEER_ADDED", "node-c", "10.0.0.3:5555"),
        ("PEER_DELETED", "node-a", "10.0.0.1:4244"),
    ]


def test_subscriber_that_falls_behind_is_disconnected_with_resource_exhausted(sock: str) -> None:
    async def main() -> grpc.StatusCode:
        registry = PeerRegistry(LOCAL, max_buffer=3)
        service = grpcserver.Service(
            peer_pb2_grpc.add_PeerServicer_to_server, PeerServicer(registry), "peer.Peer"
        )
        server, _ = await grpcserver.start_server([service], [sock])
        try:
            async with grpc.aio.insecure_channel(sock) as channel:
                call = peer_pb2_grpc.PeerStub(channel).Notify(peer_pb2.NotifyRequest())
                await call.read()  # local node; the server-side subscriber exists now
                for i in range(10):  # no await: the handler cannot drain in between
                    registry.upsert(PeerInfo(f"n{i}", f"10.0.1.{i}:4244"))
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    while True:
                        await asyncio.wait_for(call.read(), 2)
                return err.value.code()
        finally:
            await server.stop(None)

    assert run(main()) == grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.parametrize(
    ("hubble_address", "addresses", "expected"),
    [
        ("192.0.2.1:4244", ["10.0.0.1"], "192.0.2.1:4244"),
        (":4300", ["10.0.0.1"], "10.0.0.1:4300"),
        ("", ["10.0.0.1"], "10.0.0.1:4244"),
        ("", ["fd00::1"], "[fd00::1]:4244"),
        ("", [], None),
    ],
)
def test_peer_address_from_a_controlplane_node(
    hubble_address: str, addresses: list[str], expected: str | None
) -> None:
    peer = peer_from_node(cp.Node(name="n", addresses=addresses, hubble_address=hubble_address))
    assert (peer.address if peer else None) == expected
