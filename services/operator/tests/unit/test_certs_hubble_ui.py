"""``certs generate --hubble-cluster`` also writes hubble-ui's client pair (Secret
``hubble-ui-client-certs`` of deploy/helm/cilia/templates/hubble-ui), and the relay's mutual TLS
accepts it under the name the UI checks (a real gRPC handshake on loopback)."""

from __future__ import annotations

import asyncio
import pathlib

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cilia_common.tls import ClientTLS, ServerTLS, channel_credentials, server_credentials

UI_SERVER_NAME = (
    "ui.hubble-relay.cilium.io"  # deploy/helm/cilia/templates/hubble-ui --tls-relay-server-name
)


async def _health_over_tls(server_tls: ServerTLS, client_tls: ClientTLS) -> int:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    credentials, _ = server_credentials(server_tls)
    port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    try:
        async with grpc.aio.secure_channel(
            f"127.0.0.1:{port}", channel_credentials(client_tls),
            options=[("grpc.ssl_target_name_override", client_tls.server_name)],
        ) as channel:  # fmt: skip
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
            return int(reply.status)
    finally:
        await server.stop(None)


def test_certs_generate_writes_hubble_uis_client_pair_that_the_relay_accepts(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cilia_operator.__main__ import main

    out = tmp_path / "tls"
    assert main(["certs", "generate", "--dir", str(out), "--hubble-cluster", "default"]) == 0
    printed = capsys.readouterr().out
    [line] = [x for x in printed.splitlines() if x.startswith("hubble-ui-client:")]
    assert f"--tls-relay-client-cert-file {out / 'hubble-ui-client.crt'}" in line
    assert f"--tls-relay-server-name {UI_SERVER_NAME}" in line
    assert "hubble-ui-client-certs" in line
    cert = x509.load_pem_x509_certificate((out / "hubble-ui-client.crt").read_bytes())
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "hubble-ui"
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.CLIENT_AUTH in usage
    relay = ServerTLS(str(out / "hubble-relay-server.crt"), str(out / "hubble-relay-server.key"),
                      (str(out / "ca.crt"),))  # fmt: skip
    ui = ClientTLS((str(out / "ca.crt"),), str(out / "hubble-ui-client.crt"),
                   str(out / "hubble-ui-client.key"), UI_SERVER_NAME)  # fmt: skip
    assert asyncio.run(_health_over_tls(relay, ui)) == health_pb2.HealthCheckResponse.SERVING
