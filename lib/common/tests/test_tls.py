"""cilia_common.tls over real TLS on loopback: an asyncio gRPC server with the dynamic
credentials, clients with certificates from :func:`generate_bundle`."""

from __future__ import annotations

import asyncio
import os
import pathlib
import shutil
from typing import Any

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cilia_common.tls import (
    ADMIN_GROUP,
    ClientTLS,
    GeneratedBundle,
    PeerIdentity,
    RotatingChannel,
    ServerTLS,
    TLSFileError,
    channel_credentials,
    generate_bundle,
    is_loopback,
    peer_identity,
    read_key_pair,
    server_credentials,
)


class WhoAmI(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    """Health.Check that records the caller's identity."""

    def __init__(self) -> None:
        self.seen: list[PeerIdentity | None] = []

    async def Check(self, request: Any, context: Any) -> Any:  # noqa: N802
        self.seen.append(peer_identity(context))
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def _bundle(directory: pathlib.Path, **kwargs: Any) -> GeneratedBundle:
    return generate_bundle(
        directory, server_hosts=["127.0.0.1"], nodes=["n1"], admins=["admin"], days=1, **kwargs
    )


def _serial(path: str) -> int:
    return x509.load_pem_x509_certificate(pathlib.Path(path).read_bytes()).serial_number


async def _serve(bundle: GeneratedBundle) -> tuple[grpc.aio.Server, str, WhoAmI, Any]:
    server = grpc.aio.server()
    servicer = WhoAmI()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    creds, reloader = server_credentials(
        ServerTLS(bundle.server_cert, bundle.server_key, (bundle.ca_cert,))
    )
    port = server.add_secure_port("127.0.0.1:0", creds)
    await server.start()
    return server, f"127.0.0.1:{port}", servicer, reloader


def _client(bundle: GeneratedBundle, name: str) -> ClientTLS:
    cert, key = bundle.clients[name]
    return ClientTLS((bundle.ca_cert,), cert, key)


async def _check(channel: Any) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
    return int(reply.status)


def test_generated_files_name_the_node_and_admin_groups(tmp_path: pathlib.Path) -> None:
    bundle = _bundle(tmp_path)
    node = x509.load_pem_x509_certificate(pathlib.Path(bundle.clients["node-n1"][0]).read_bytes())
    assert node.subject.rfc4514_string() == "CN=system:node:n1,O=system:nodes"
    admin = x509.load_pem_x509_certificate(pathlib.Path(bundle.clients["admin"][0]).read_bytes())
    assert admin.subject.rfc4514_string() == f"CN=admin,O={ADMIN_GROUP}"
    assert os.stat(bundle.server_key).st_mode & 0o777 == 0o600
    assert os.stat(bundle.ca_key).st_mode & 0o777 == 0o600
    # a second run keeps the CA, so certificates issued before stay valid
    ca, server = pathlib.Path(bundle.ca_cert).read_bytes(), _serial(bundle.server_cert)
    again = _bundle(tmp_path)
    assert pathlib.Path(again.ca_cert).read_bytes() == ca
    assert _serial(again.server_cert) != server


def test_a_key_of_another_certificate_is_refused(tmp_path: pathlib.Path) -> None:
    bundle = _bundle(tmp_path)
    with pytest.raises(TLSFileError, match="is not the private key of"):
        read_key_pair(bundle.server_cert, bundle.clients["admin"][1])
    with pytest.raises(TLSFileError, match="No such file"):
        read_key_pair(str(tmp_path / "absent.crt"), bundle.server_key)


def test_peer_identity_is_read_from_the_verified_client_certificate(tmp_path: pathlib.Path) -> None:
    asyncio.run(_test_peer_identity_is_read_from_the_verified_client_certificate(tmp_path))


async def _test_peer_identity_is_read_from_the_verified_client_certificate(
    tmp_path: pathlib.Path,
) -> None:
    bundle = _bundle(tmp_path)
    server, address, servicer, _ = await _serve(bundle)
    try:
        for name in ("node-n1", "admin"):
            async with grpc.aio.secure_channel(
                address, channel_credentials(_client(bundle, name))
            ) as ch:
                assert await _check(ch) == health_pb2.HealthCheckResponse.SERVING
        node, admin = servicer.seen
        assert node is not None and node.node == "n1" and not node.is_admin
        assert admin is not None and admin.is_admin and admin.node == ""
        assert node.serial == _serial(bundle.clients["node-n1"][0])
    finally:
        await server.stop(None)


def test_server_serves_renewed_files_and_keeps_the_old_pair_when_they_do_not_match(
    tmp_path: pathlib.Path,
) -> None:
    asyncio.run(
        _test_server_serves_renewed_files_and_keeps_the_old_pair_when_they_do_not_match(tmp_path)
    )


async def _test_server_serves_renewed_files_and_keeps_the_old_pair_when_they_do_not_match(
    tmp_path: pathlib.Path,
) -> None:
    bundle = _bundle(tmp_path)
    first = _serial(bundle.server_cert)
    server, address, _, reloader = await _serve(bundle)
    client = _client(bundle, "admin")
    try:
        # half a rotation: a new certificate beside the old key is not taken
        other = _bundle(tmp_path / "other")
        shutil.copy(other.server_cert, bundle.server_cert)
        async with grpc.aio.secure_channel(address, channel_credentials(client)) as ch:
            assert await _check(ch) == health_pb2.HealthCheckResponse.SERVING
        assert reloader.serial == first and reloader.reloads == 0
        # the full rotation (same CA): taken at the next handshake
        renewed = _bundle(tmp_path)
        async with grpc.aio.secure_channel(address, channel_credentials(client)) as ch:
            assert await _check(ch) == health_pb2.HealthCheckResponse.SERVING
        assert reloader.serial == _serial(renewed.server_cert) != first
        assert reloader.reloads == 1
    finally:
        await server.stop(None)


def test_rotating_channel_dials_with_the_renewed_client_files(tmp_path: pathlib.Path) -> None:
    asyncio.run(_test_rotating_channel_dials_with_the_renewed_client_files(tmp_path))


async def _test_rotating_channel_dials_with_the_renewed_client_files(
    tmp_path: pathlib.Path,
) -> None:
    bundle = _bundle(tmp_path)
    server, address, servicer, _ = await _serve(bundle)
    channel = RotatingChannel(address, _client(bundle, "node-n1"))
    try:
        stub = health_pb2_grpc.HealthStub(channel)  # made once, follows rotations
        await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        _bundle(tmp_path)  # renews node-n1.crt/.key
        renewed = _serial(bundle.clients["node-n1"][0])
        await asyncio.sleep(0)
        await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert channel.generation == 1
        serials = [who.serial for who in servicer.seen if who is not None]
        assert serials[-1] == renewed and serials[0] != renewed
    finally:
        await channel.close()
        await server.stop(None)


@pytest.mark.parametrize(
    ("address", "loopback"),
    [("127.0.0.1:4250", True), ("localhost:1", True), ("[::1]:4250", True),
     ("unix:/run/x.sock", True), ("0.0.0.0:4250", False), (":4250", False),
     ("10.0.0.1:4250", False), ("operator.example:4250", False)],
)  # fmt: skip
def test_is_loopback(address: str, loopback: bool) -> None:
    assert is_loopback(address) is loopback
