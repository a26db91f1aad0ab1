"""The page's HTTP API against a fake relay (a real gRPC Observer server on port 0).

Shows: the page's filters reach the relay as the GetFlows whitelist; the live stream sends
the graph and follows new flows; malformed filters are a 400 naming the parameter and the
service keeps serving; --max-clients is enforced with 503; a filter the relay refuses ends
the stream with a ``refused`` event; an unreachable relay is a 502 for a snapshot; mutual TLS
to the relay with upstream's server name.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp.test_utils import TestClient, TestServer
from fake_relay import FakeRelay
from flows import endpoint, tcp_flow

from cilia.hubble.flow import flow_pb2
from cilia_common.tls import ClientTLS, ServerTLS, generate_bundle
from cilia_hubble_ui.live import LiveOptions
from cilia_hubble_ui.metrics import Metrics
from cilia_hubble_ui.relay import RelayClient
from cilia_hubble_ui.web import make_app

NS = "shop"
FRONT, BACK, OTHER = (endpoint(NS, n) for n in ("frontend", "backend", "other"))
OPTIONS = LiveOptions(flows_buffer=50, table_rows=20, update_interval=0.05, retry_timeout=0.2)
EVENT_TIMEOUT = 10.0

Body = Callable[[TestClient[Any, Any], FakeRelay], Awaitable[None]]


def _run(
    body: Body,
    *,
    max_clients: int = 5,
    relay_address: str = "",
    server_tls: ServerTLS | None = None,
    client_tls: ClientTLS | None = None,
) -> None:
    async def main() -> None:
        relay = FakeRelay([tcp_flow(FRONT, BACK), tcp_flow(OTHER, BACK, verdict=flow_pb2.DROPPED)])
        await relay.start(server_tls)
        client = RelayClient(relay_address or relay.address, client_tls)
        app = make_app(client, OPTIONS, max_clients=max_clients, metrics=Metrics())
        async with TestClient(TestServer(app)) as http:
            try:
                await body(http, relay)
            finally:
                await client.close()
                await relay.stop()

    asyncio.run(main())


async def _events(resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    event, data = "", ""
    while True:
        line = (await asyncio.wait_for(resp.content.readline(), EVENT_TIMEOUT)).decode()
        if not line:
            return
        if line.startswith("event: "):
            event = line[7:].strip()
        elif line.startswith("data: "):
            data = line[6:].strip()
        elif line == "\n" and event:
            yield event, json.loads(data)
            event, data = "", ""


async def _next(events: AsyncIterator[tuple[str, dict[str, Any]]], kind: str) -> dict[str, Any]:
    async for event, data in events:
        if event == kind:
            return data
    raise AssertionError(f"stream ended before a {kind!r} event")


async def _graph(events: AsyncIterator[tuple[str, dict[str, Any]]], seen: int) -> dict[str, Any]:
    """The first ``graph`` event built from at least ``seen`` flows (the very first event of
    a stream is sent at once, before the relay answered)."""
    while True:
        graph = await _next(events, "graph")
        if graph["seen"] >= seen:
            return graph


def test_live_stream_sends_the_graph_and_follows_new_flows() -> None:
    async def body(http: TestClient[Any, Any], relay: FakeRelay) -> None:
        resp = await http.get("/api/events?namespace=shop")
        assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
        events = _events(resp)
        first = await _graph(events, 2)
        assert {e["verdict"] for e in first["edges"]} == {"FORWARDED", "DROPPED"}
        assert len(first["nodes"]) == 3 and first["namespaces"] == [NS]
        assert first["filters"] == {"namespace": ["shop"]}
        await relay.push(tcp_flow(FRONT, OTHER, 9090))
        graph = await _graph(events, 3)
        assert "pod:shop/frontend->pod:shop/other:FORWARDED" in {e["id"] for e in graph["edges"]}
        assert graph["flows"][0]["destination_label"] == "other"
        resp.close()
        (request,) = relay.requests
        assert request.follow and request.number == OPTIONS.flows_buffer
        assert [list(f.source_pod) for f in request.whitelist] == [["shop/"], []]
        assert [list(f.destination_pod) for f in request.whitelist] == [[], ["shop/"]]

    _run(body)


def test_the_verdict_filter_goes_to_the_relay_and_hides_the_dropped_edge() -> None:
    async def body(http: TestClient[Any, Any], relay: FakeRelay) -> None:
        resp = await http.get("/api/events?verdict=FORWARDED")
        graph = await _graph(_events(resp), 1)
        resp.close()
        assert [e["verdict"] for e in graph["edges"]] == ["FORWARDED"]
        (only,) = relay.requests[0].whitelist
        assert list(only.verdict) == [flow_pb2.FORWARDED]

    _run(body)


def test_malformed_filters_are_a_400_and_the_service_keeps_serving() -> None:
    async def body(http: TestClient[Any, Any], relay: FakeRelay) -> None:
        page = await http.get("/?verdict=MAYBE")
        assert page.status == 400
        assert "verdict: &#x27;MAYBE&#x27; is not one of" in await page.text()
        api = await http.get("/api/events?port=99999")
        assert api.status == 400
        assert (await api.json())["error"] == "port: '99999' is not a number 0-65535"
        snap = await http.get("/api/graph?colour=red")
        assert snap.status == 400 and "unknown filter 'colour'" in (await snap.json())["error"]
        assert relay.requests == [], "a malformed filter must not reach the relay"
        good = await http.get("/?verdict=DROPPED&namespace=shop")
        assert good.status == 200 and "Service map" in await good.text()
        snap = await http.get("/api/graph?verdict=DROPPED")
        assert snap.status == 200
        assert [e["verdict"] for e in (await snap.json())["edges"]] == ["DROPPED"]
        assert (await http.get("/healthz")).status == 200

    _run(body)


def test_pages_beyond_max_clients_get_503_and_a_closed_page_frees_its_slot() -> None:
    async def body(http: TestClient[Any, Any], relay: FakeRelay) -> None:
        first = await http.get("/api/events")
        await _next(_events(first), "graph")
        second = await http.get("/api/events")
        assert second.status == 503 and "--max-clients" in (await second.json())["error"]
        first.close()
        for _ in range(100):
            third = await http.get("/api/events")
            if third.status == 200:
                break
            await asyncio.sleep(0.05)
        assert third.status == 200
        third.close()

    _run(body, max_clients=1)


def test_a_filter_the_relay_refuses_ends_the_stream_with_its_reason() -> None:
    async def body(http: TestClient[Any, Any], relay: FakeRelay) -> None:
        resp = await http.get("/api/events?label=refuse")
        refused = await _next(_events(resp), "refused")
        assert refused["code"] == "INVALID_ARGUMENT"
        assert "cannot use 'refuse'" in refused["message"]
        snap = await http.get("/api/graph?label=refuse")
        assert snap.status == 400 and "INVALID_ARGUMENT" in (await snap.json())["error"]

    _run(body)


def test_an_unreachable_relay_is_reported_not_fatal() -> None:
    async def body(http: TestClient[Any, Any], relay: FakeRelay) -> None:
        snap = await http.get("/api/graph")
        assert snap.status == 502 and "UNAVAILABLE" in (await snap.json())["error"]
        resp = await http.get("/api/events")
        status = await _next(_events(resp), "status")
        while status["state"] == "connecting":
            status = await _next(_events(resp), "status")
        assert status["state"] == "unavailable" and "retrying in 0.2s" in status["message"]
        resp.close()
        assert (await http.get("/healthz")).status == 200

    _run(body, relay_address="127.0.0.1:1")


def test_mutual_tls_to_the_relay_with_its_upstream_server_name(tmp_path: pathlib.Path) -> None:
    """The relay serves *.hubble-relay.cilium.io and asks for a client certificate: the UI
    dials it with the CA, its client pair and the name ui.hubble-relay.cilium.io; without a
    client certificate the handshake is refused and the snapshot says the relay is
    unavailable (502)."""
    bundle = generate_bundle(tmp_path, server_hosts=["127.0.0.1"], hubble_cluster="default")
    cert, key = bundle.hubble["hubble-relay-server"]
    server = ServerTLS(cert, key, (bundle.ca_cert,))
    client_cert, client_key = bundle.hubble["hubble-relay-client"]
    name = "ui.hubble-relay.cilium.io"

    async def works(http: TestClient[Any, Any], relay: FakeRelay) -> None:
        snap = await http.get("/api/graph")
        assert snap.status == 200, await snap.text()
        assert {e["verdict"] for e in (await snap.json())["edges"]} == {"FORWARDED", "DROPPED"}

    _run(
        works,
        server_tls=server,
        client_tls=ClientTLS((bundle.ca_cert,), client_cert, client_key, name),
    )

    async def refused(http: TestClient[Any, Any], relay: FakeRelay) -> None:
        snap = await http.get("/api/graph")
        assert snap.status == 502 and "UNAVAILABLE" in (await snap.json())["error"]
        assert relay.requests == []

    _run(refused, server_tls=server, client_tls=ClientTLS((bundle.ca_cert,), "", "", name))
