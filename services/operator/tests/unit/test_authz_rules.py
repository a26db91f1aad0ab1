"""The authorisation table and the TLS flags of ``cilia-operator serve``."""

from __future__ import annotations

import pathlib
from typing import Any

import pydantic
import pytest

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia_common.tls import PeerIdentity
from cilia_operator.config import Config
from cilia_operator.controlplane.authz import (
    RULES,
    foreign_record_refusal,
    kubernetes_mode_refusal,
    refusal,
    rule_for,
)

NODE_N1 = PeerIdentity("system:node:n1", ("system:nodes",))
ADMIN = PeerIdentity("admin", ("system:masters",))
OTHER = PeerIdentity("system:node:n1", ())  # the CN without the group is no node


def test_every_control_plane_method_has_an_explicit_rule() -> None:
    methods = {
        f"{service.name}/{method.name}"
        for service in pb.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    }
    assert methods == set(RULES)


def test_unknown_control_plane_methods_are_admin_only_and_others_are_reads() -> None:
    assert rule_for("/cilia.controlplane.v1.NodeService/Unheard").kind == "admin"
    assert rule_for("/grpc.health.v1.Health/Check").kind == "read"


@pytest.mark.parametrize(
    ("method", "request_", "who", "allowed"),
    [
        ("NodeService/Register", pb.RegisterRequest(node_name="n1"), NODE_N1, True),
        ("NodeService/Register", pb.RegisterRequest(node_name="n2"), NODE_N1, False),
        ("NodeService/Register", pb.RegisterRequest(node_name="n1"), OTHER, False),
        ("NodeService/Register", pb.RegisterRequest(node_name="n2"), ADMIN, True),
        ("EndpointService/UpsertEndpoint",
         pb.UpsertEndpointRequest(endpoint=pb.EndpointRecord(node_name="n1")), NODE_N1, True),
        ("EndpointService/UpsertEndpoint",
         pb.UpsertEndpointRequest(endpoint=pb.EndpointRecord(node_name="n2")), NODE_N1, False),
        ("EndpointService/DeleteEndpoint", pb.DeleteEndpointRequest(name="p"), NODE_N1, False),
        ("ResourceService/Apply", pb.ApplyRequest(), NODE_N1, False),
        ("ResourceService/Apply", pb.ApplyRequest(), ADMIN, True),
        ("ResourceService/List", pb.ListRequest(), OTHER, True),
        ("IdentityService/Release", pb.ReleaseRequest(node_name="n1"), NODE_N1, True),
    ],
)  # fmt: skip
def test_refusal(method: str, request_: object, who: PeerIdentity, allowed: bool) -> None:
    why, _ = refusal(RULES[method], who, request_)
    assert (why == "") is allowed, why


@pytest.mark.parametrize(
    ("who", "owner", "node", "allowed"),
    [
        (NODE_N1, "n2", "n1", False),  # another node's record
        (NODE_N1, "n1", "n1", True),
        (NODE_N1, "", "n1", True),  # no owner recorded
        (ADMIN, "n2", "n1", True),
        (None, "n2", "n1", True),  # plaintext listener: nothing is authenticated
    ],
)
def test_foreign_record_refusal(
    who: PeerIdentity | None, owner: str, node: str, allowed: bool
) -> None:
    why = foreign_record_refusal(who, owner, node)
    assert (why == "") is allowed, why
    if not allowed:
        assert f"belongs to node {owner!r}" in why


def test_kubernetes_mode_refuses_exactly_the_resource_writes() -> None:
    refused = {name for name in RULES if kubernetes_mode_refusal(f"/cilia.controlplane.v1.{name}")}
    assert refused == {"ResourceService/Apply", "ResourceService/Delete",
                       "ResourceService/ApplyOutcome"}  # fmt: skip
    assert "kubectl" in kubernetes_mode_refusal("/cilia.controlplane.v1.ResourceService/Apply")
    assert kubernetes_mode_refusal("/grpc.health.v1.Health/Check") == ""


def test_no_certificate_is_refused_even_for_reads() -> None:
    assert refusal(RULES["ResourceService/List"], None, pb.ListRequest())[0]


BASE: dict[str, Any] = {"store": "redis://127.0.0.1:1/0"}


def test_network_listener_needs_tls_or_disable_tls() -> None:
    with pytest.raises(pydantic.ValidationError, match="needs mutual TLS"):
        Config(**BASE, listen="0.0.0.0:4250")
    assert Config(**BASE, listen="0.0.0.0:4250", disable_tls=True).server_tls is None
    assert Config(**BASE, listen="127.0.0.1:4250").server_tls is None


def test_tls_files_come_together() -> None:
    with pytest.raises(pydantic.ValidationError, match="give all three"):
        Config(**BASE, tls_cert_file="a.crt", tls_key_file="a.key")
    config = Config(**BASE, listen="0.0.0.0:4250", tls_cert_file="a.crt", tls_key_file="a.key",
                    tls_client_ca_files=["ca1.crt,ca2.crt"])  # fmt: skip
    assert config.server_tls is not None
    assert config.server_tls.client_ca_files == ("ca1.crt", "ca2.crt")
    with pytest.raises(pydantic.ValidationError, match="conflicts"):
        Config(**BASE, tls_cert_file="a", tls_key_file="b", tls_client_ca_files=["c"],
               disable_tls=True)  # fmt: skip


def test_certs_generate_writes_the_bundle_and_refuses_bad_node_names(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cilia_operator.__main__ import main

    out = tmp_path / "tls"
    assert main(["certs", "generate", "--dir", str(out), "--nodes", "a,b", "--days", "2"]) == 0
    written = sorted(p.name for p in out.iterdir())
    assert written == ["admin.crt", "admin.key", "ca.crt", "ca.key", "node-a.crt", "node-a.key",
                       "node-b.crt", "node-b.key", "server.crt", "server.key"]  # fmt: skip
    assert "--tls-cert-file" in capsys.readouterr().out
    assert main(["certs", "generate", "--dir", str(out), "--nodes", "Bad_Name"]) == 2
    assert "--nodes: 'Bad_Name'" in capsys.readouterr().err


def test_certs_generate_refuses_bad_input_in_one_line_and_writes_nothing(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--days past a century overflowed datetime (a traceback); its message said seconds;
    a bad node name printed pydantic's several lines; a bad --hubble-cluster was written into
    every node's certificate name."""
    from cilia_operator.__main__ import main

    out = tmp_path / "tls"
    for days in ("1e9", "36501", "0", "nan"):
        with pytest.raises(SystemExit) as exit_:
            main(["certs", "generate", "--dir", str(out), "--days", days])
        assert exit_.value.code == 2
        err = capsys.readouterr().err.splitlines()[-1]
        assert err.endswith(f"--days: {days!r} must be a number of days > 0 and <= 36500"), err
    for argv, want in (
        (["--nodes", "bad name"], "--nodes: 'bad name': Value error, 'bad name' is not a valid"),
        (["--nodes", "a", "--hubble-cluster", "Bad_Cluster"], "--hubble-cluster: 'Bad_Cluster'"),
        (["--hosts", "127.0.0.1,not an addr!"], "--hosts: 'not an addr!': not an IP address"),
        (["--hosts=-bad.example"], "--hosts: '-bad.example': not an IP address"),
    ):
        assert main(["certs", "generate", "--dir", str(out), *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and want in err, err
    assert not out.exists()
    a_file = tmp_path / "a-file"
    a_file.write_text("kept")
    assert main(["certs", "generate", "--dir", str(a_file)]) == 2  # said "File exists"
    assert capsys.readouterr().err == f"error: --dir: {a_file}: exists and is not a directory\n"
    assert a_file.read_text() == "kept" and sorted(tmp_path.iterdir()) == [a_file]
    assert main(["certs", "generate", "--dir", str(out), "--days", "36500"]) == 0


def test_client_tls_flags_come_together(capsys: pytest.CaptureFixture[str]) -> None:
    from cilia_operator.__main__ import main

    assert main(["get", "cn", "--tls-operator-client-cert-file", "x.crt"]) == 2
    assert "give all three or none" in capsys.readouterr().err
