"""The agent's periodic alias-use report goes by ``NodeService.ReportAliasUse`` (no IPAM
reconcile of the node at the operator); an older operator without that RPC gets a
``Register`` carrying the uses, as before. Over a real gRPC channel."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia.controlplane.v1 import controlplane_pb2_grpc as cp_grpc
from cilia_agent.controlplane import NodeNetworks, OperatorClient

USES = [cp.AliasUse(ip="10.96.0.10", used=True, idle_ms=1500)]


class OldOperator(cp_grpc.NodeServiceServicer):  # type: ignore[misc]
    """An operator from before ReportAliasUse: only Register (UNIMPLEMENTED otherwise)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    async def Register(self, request: cp.RegisterRequest, context: Any) -> cp.RegisterResponse:  # noqa: N802
        self.calls.append(("Register", request))
        return cp.RegisterResponse()


class NewOperator(OldOperator):
    async def ReportAliasUse(  # noqa: N802
        self, request: cp.ReportAliasUseRequest, context: Any
    ) -> cp.ReportAliasUseResponse:
        self.calls.append(("ReportAliasUse", request))
        return cp.ReportAliasUseResponse()


async def _two_reports(servicer: OldOperator) -> list[tuple[str, Any]]:
    server = grpc.aio.server()
    cp_grpc.add_NodeServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")

    async def nothing(*_args: Any) -> None:
        return None

    client = OperatorClient(
        address=f"127.0.0.1:{port}", node_name="n1", version="t", timeout=5.0,
        min_backoff=0.1, max_backoff=1.0, exclude_devices=(), demand=nothing,
        on_registered=nothing, on_allocation=nothing, channel=channel,
        alias_uses=lambda: list(USES),
    )  # fmt: skip
    try:
        await client.report_alias_use()  # before the first Register: nothing
        await client.register_again(NodeNetworks(["192.0.2.1"], []))
        servicer.calls.clear()
        await client.report_alias_use()
        await client.report_alias_use()
    finally:
        await channel.close()
        await server.stop(None)
    return servicer.calls


def test_reports_go_by_report_alias_use_and_not_register() -> None:
    calls = asyncio.run(_two_reports(NewOperator()))
    assert [name for name, _ in calls] == ["ReportAliasUse", "ReportAliasUse"]
    for _, request in calls:
        assert request.node_name == "n1" and list(request.alias_uses) == USES


def test_an_older_operator_gets_the_reports_with_register() -> None:
    calls = asyncio.run(_two_reports(OldOperator()))
    assert [name for name, _ in calls] == ["Register", "Register"]
    for _, request in calls:
        assert request.reports_alias_use and list(request.alias_uses) == USES
        assert list(request.addresses) == ["192.0.2.1"]
