"""Hubble TLS on the agent: flags checked, Peer announcements carry upstream's TLS names,
and the generated certificates are named as the relay checks them."""

from __future__ import annotations

import pathlib

import pytest
from cryptography import x509
from pydantic import ValidationError

from cilia.hubble.peer import peer_pb2
from cilia_agent.config import Config
from cilia_agent.hubble.peer import PeerInfo, PeerRegistry
from cilia_common.tls import generate_bundle, hubble_server_name


def test_hubble_tls_flags_must_be_consistent() -> None:
    with pytest.raises(ValidationError, match="give both or none"):
        Config(node_name="n1", hubble_tls_cert_file="c.crt")
    with pytest.raises(ValidationError, match="needs --hubble-tls-cert-file"):
        Config(node_name="n1", hubble_tls_client_ca_files=["ca.crt"])
    with pytest.raises(ValidationError, match="contradicts"):
        Config(node_name="n1", hubble_disable_tls=True, hubble_tls_cert_file="c.crt",
               hubble_tls_key_file="c.key")  # fmt: skip
    cfg = Config(node_name="n1", hubble_tls_cert_file="c.crt", hubble_tls_key_file="c.key",
                 hubble_tls_client_ca_files=["a.crt,b.crt"])  # fmt: skip
    assert cfg.hubble_tls is not None and cfg.hubble_tls.client_ca_files == ("a.crt", "b.crt")
    assert Config(node_name="n1").hubble_tls is None


def test_peers_are_announced_with_their_tls_names_when_tls_is_on() -> None:
    tls = PeerRegistry(PeerInfo("node-a", "10.0.0.1:4244"), tls_cluster="prod")
    tls.upsert(PeerInfo("node-b", "10.0.0.2:4244"))
    names = {p.name: p.tls_server_name for p in tls.peers()}
    assert names == {"node-a": "node-a.prod.hubble-grpc.cilium.io",
                     "node-b": "node-b.prod.hubble-grpc.cilium.io"}  # fmt: skip
    note = tls.peers()[1].notification(peer_pb2.PEER_ADDED)
    assert note.HasField("tls") and note.tls.server_name == "node-b.prod.hubble-grpc.cilium.io"
    plain = PeerRegistry(PeerInfo("node-a", "10.0.0.1:4244"))
    assert not plain.peers()[0].notification(peer_pb2.PEER_ADDED).HasField("tls")


def test_generated_hubble_certificates_carry_the_names_the_relay_checks(
    tmp_path: pathlib.Path,
) -> None:
    bundle = generate_bundle(tmp_path, server_hosts=["127.0.0.1"], nodes=["node-a"],
                             admins=(), hubble_cluster="default")  # fmt: skip

    def sans(stem: str) -> list[str]:
        cert = x509.load_pem_x509_certificate(pathlib.Path(bundle.hubble[stem][0]).read_bytes())
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
        return [str(v) for v in ext.value.get_values_for_type(x509.DNSName)]

    assert sans("hubble-node-a") == [hubble_server_name("node-a")]
    assert sans("hubble-server") == ["*.default.hubble-grpc.cilium.io"]
    assert "*.hubble-relay.cilium.io" in sans("hubble-relay-server")
    assert set(bundle.hubble) == {"hubble-node-a", "hubble-server", "hubble-relay-client",
                                  "hubble-relay-server", "hubble-ui-client"}  # fmt: skip


def test_serve_refuses_unusable_hubble_tls_files_before_touching_anything(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A key that is not the certificate's: exit 1 naming both, before the datapath or any
    cgroup link exists (the pin dir is never created)."""
    from cilia_agent.__main__ import main

    generate_bundle(tmp_path, server_hosts=["127.0.0.1"], nodes=["n1"], hubble_cluster="default")
    pins = tmp_path / "pins"
    code = main(["serve", "--node-name", "n1", "--operator", "127.0.0.1:1",
                 "--socket", str(tmp_path / "a.sock"), "--state-dir", str(tmp_path / "st"),
                 "--bpf-pin-dir", str(pins),
                 "--hubble-tls-cert-file", str(tmp_path / "hubble-n1.crt"),
                 "--hubble-tls-key-file", str(tmp_path / "admin.key")])  # fmt: skip
    assert code == 1
    assert "is not the private key of" in capsys.readouterr().err
    assert not pins.exists()
